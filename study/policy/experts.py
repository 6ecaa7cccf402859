"""The policy's experts: megatron's SequentialMLP, its forward and backward run as one autograd Function, one expert
after another (`ExpertsFunction`) or as grouped GEMMs (`GroupedExpertsFunction`).

SequentialMLP runs each expert as its own MLP module: two linear autograd Functions, a chunk, SiLU and two
multiplies per expert, forward and backward, each a module call or an autograd node with its own kernels. On the tiny
preset's 64-wide experts that plumbing is a quarter of the experts' time at an 8-sequence minibatch
(docs/performance.md); Qwen3-30B-A3B on one GPU makes 48 x 128 such expert calls per micro-batch.
1. `ExpertsFunction` computes the same matmuls and elementwise ops in the same order in one Function with a
   written-out backward, a Python loop over the experts, so the output and every gradient (the input's, the
   weights', the routing probs') equal SequentialMLP's bit for bit (tests/study/policy/test_model.py). It takes
   routing probs of the experts' dtype (fp32 runs); elsewhere SequentialMLP runs.
2. `GroupedExpertsFunction` computes each projection of all of a layer's experts as one grouped GEMM
   (`torch._grouped_mm` over each expert's rows), forward and backward, and the elementwise ops once over all rows,
   with megatron's casts where the probs are fp32 and the experts bf16. On the CPU torch's grouped GEMM is a loop of
   the same matmuls: it equals SequentialMLP bit for bit at one thread in fp32 and bf16
   (tests/study/policy/test_grouped_experts.py; at more threads a split of an elementwise op over all rows can move
   a last bit, docs/performance.md). On a CUDA GPU in bf16 it is one grouped kernel per projection, equal to
   rounding. The per-expert weights are views of one stacked buffer per projection
   (`GroupedSequentialMLP.stack_weights`), which the grouped GEMM reads in place; where something has moved them
   (megatron's distributed optimizer puts them in its own buffer, in another order) they are stacked per call.
Which one runs (build_policy's `experts`, RunConfig.experts): "grouped" (2), "sequential" (1), or "auto"
(`device_experts`): grouped on CUDA, sequential on the CPU, where the grouped GEMM's loop is no faster
(benchmarks/bench_experts.py --policy, docs/performance.md). The module, its parameters, their names and its place in
the layer spec stay megatron's either way, so the HF weight map, the weight sync and the checkpoints read the same
tensors; `SequentialMLP.forward` runs wherever neither Function is exact (hooks, such as emulated precision's
rounding; tensor or expert-tensor parallelism; fp8; biases; another activation; one local expert), and the grouped
path also steps aside where its GEMM cannot take the operands (no rows at all; row widths not whole 16-byte units).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def device_experts(cuda: bool) -> str:
    """The experts' path "auto" takes: grouped GEMMs on CUDA (one kernel per projection instead of a launch per
    expert and op), the per-expert Function on the CPU (torch's grouped GEMM loops there over the same matmuls and
    is no faster: docs/performance.md)."""
    return "grouped" if cuda else "sequential"


class ExpertsFunction(torch.autograd.Function):
    """Per expert e over its rows of `x` (consecutive, `counts[e]` of them): fc2_e(silu(gate) * up * probs), where
    [gate | up] = fc1_e(x). Weights: the experts' fc1 weights (2F, H), then their fc2 weights (H, F)."""

    @staticmethod
    def forward(ctx, x, probs, counts, *weights):  # type: ignore[no-untyped-def]
        fc1, fc2 = weights[: len(counts)], weights[len(counts) :]
        out = x.new_empty(x.shape[0], fc2[0].shape[0])
        saved, start = [], 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            h = torch.matmul(x[rows], fc1[e].t())
            gate, up = torch.chunk(h, 2, dim=-1)
            silu = F.silu(gate)
            act = silu * up * probs[rows, None]
            torch.matmul(act, fc2[e].t(), out=out[rows])
            saved += [h, silu, act]  # silu(gate) kept: the backward needs it, and recomputing it cost ~2% of an update
            start += n
        ctx.counts = counts
        ctx.save_for_backward(x, probs, *saved, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        counts = ctx.counts
        x, probs, *rest = ctx.saved_tensors
        k = len(counts)
        saved, fc1, fc2 = rest[: 3 * k], rest[3 * k : 4 * k], rest[4 * k :]
        dx, dprobs, dfc1, dfc2, start = torch.empty_like(x), torch.empty_like(probs), [], [], 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            h, silu, act = saved[3 * e : 3 * e + 3]
            dfc2.append(grad[rows].t().matmul(act))
            dact = grad[rows].matmul(fc2[e])
            gate, up = torch.chunk(h, 2, dim=-1)
            torch.sum(dact * (silu * up), dim=-1, out=dprobs[rows])  # as autograd reduces the broadcast probs
            dact = dact * probs[rows, None]
            dh = torch.cat((torch.ops.aten.silu_backward(dact * up, gate), dact * silu), dim=-1)
            dfc1.append(dh.t().matmul(x[rows]))
            torch.matmul(dh, fc1[e], out=dx[rows])
            start += n
        return dx, dprobs, None, *dfc1, *dfc2


_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts' weights of one projection as one (E, *shape) tensor, without autograd: a view where they lie
    evenly one after another in one storage (`GroupedSequentialMLP.stack_weights` puts them there), else a copy."""
    first = weights[0].detach()
    size, base, offset = first.numel(), first.untyped_storage().data_ptr(), first.storage_offset()
    in_place = first.is_contiguous() and all(
        w.shape == first.shape
        and w.is_contiguous()
        and w.untyped_storage().data_ptr() == base
        and w.storage_offset() == offset + e * size
        for e, w in enumerate(weights)
    )
    if in_place:
        return first.as_strided((len(weights), *first.shape), (size, *first.stride()), offset)
    return torch.stack([w.detach() for w in weights])


class GroupedExpertsFunction(torch.autograd.Function):
    """`ExpertsFunction`'s computation with each projection of every expert as one grouped GEMM over the rows of
    `x` (the experts' rows consecutive, `tokens_per_expert[e]` of them), and megatron's casts for routing probs of
    another dtype than the experts' (fp32 probs with bf16 experts): the scaled activations are cast back to the
    experts' dtype and their gradient computed in the probs' dtype, as autograd does through SequentialMLP. Weights:
    the experts' fc1 weights (2F, H), then their fc2 weights (H, F); they are read stacked (`stacked`)."""

    @staticmethod
    def forward(ctx, x, probs, tokens_per_expert, *weights):  # type: ignore[no-untyped-def]
        k = len(weights) // 2
        fc1, fc2 = stacked(weights[:k]), stacked(weights[k:])  # (E, 2F, H), (E, H, F)
        counts = tokens_per_expert.to(device=x.device)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) end row of each expert
        h = _grouped_mm(x, fc1.transpose(1, 2), offs=offs)  # (N, 2F)
        gate, up = torch.chunk(h, 2, dim=-1)
        silu = F.silu(gate)
        act = (silu * up * probs[:, None]).to(x.dtype)  # (N, F); megatron's cast back from fp32 probs
        out = _grouped_mm(act, fc2.transpose(1, 2), offs=offs)  # (N, H)
        ctx.save_for_backward(x, probs, counts, offs, h, silu, act, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, probs, counts, offs, h, silu, act, *weights = ctx.saved_tensors
        k = len(weights) // 2
        fc1, fc2 = stacked(weights[:k]), stacked(weights[k:])
        grad = grad.contiguous()  # (N, H); the grouped GEMM takes no broadcast strides
        dfc2 = _grouped_mm(grad.t(), act, offs=offs)  # (E, H, F)
        dact = _grouped_mm(grad, fc2, offs=offs).to(probs.dtype)  # (N, F)
        gate, up = torch.chunk(h, 2, dim=-1)
        dprobs = torch.sum(dact * (silu * up), dim=-1)  # (N,) as autograd reduces the broadcast probs
        dact = (dact * probs[:, None]).to(x.dtype)
        dh = torch.cat((torch.ops.aten.silu_backward(dact * up, gate), dact * silu), dim=-1)  # (N, 2F)
        dfc1 = _grouped_mm(dh.t(), x, offs=offs)  # (E, 2F, H)
        dx = _grouped_mm(dh, fc1, offs=offs)  # (N, H)
        if dfc1.is_cuda:  # an expert without rows gets a zero gradient, as from its empty matmul (the CPU loop's)
            empty = (counts == 0)[:, None, None]  # which not every GPU's kernel writes
            dfc1.masked_fill_(empty, 0)
            dfc2.masked_fill_(empty, 0)
        return dx, dprobs, None, *dfc1.unbind(0), *dfc2.unbind(0)


@functools.cache
def fused_sequential_mlp() -> type:
    """megatron's SequentialMLP whose forward runs `ExpertsFunction` where that is exact (see the module doc)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    class FusedSequentialMLP(SequentialMLP):
        def _fusable(self) -> bool:
            c = self.config
            return (
                self.num_local_experts > 1
                and c.activation_func is F.silu
                and c.gated_linear_unit
                and not c.add_bias_linear
                and not (c.use_te_activation_func or c.bias_activation_fusion or c.moe_apply_probs_on_input)
                and getattr(c, "activation_func_clamp_value", None) is None
                and getattr(c, "glu_linear_offset", 0.0) == 0.0
                and not (c.fp8 or getattr(c, "fp4", None))
                and parallel_state.get_tensor_model_parallel_world_size() == 1
                and parallel_state.get_expert_tensor_parallel_world_size() == 1
                and not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules())
            )

        def _weights(self) -> list[torch.nn.Parameter]:
            """The experts' fc1 weights, then their fc2 weights (the Functions' order)."""
            return [e.linear_fc1.weight for e in self.local_experts] + [e.linear_fc2.weight for e in self.local_experts]

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):  # type: ignore[no-untyped-def]
            # fp32 routing probs with bf16/fp16 experts: megatron casts the scaled activations back; not fused
            if permuted_probs.dtype != permuted_local_hidden_states.dtype or not self._fusable():
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            out = ExpertsFunction.apply(
                permuted_local_hidden_states, permuted_probs, tokens_per_expert.tolist(), *self._weights()
            )
            return out, None

    return FusedSequentialMLP


@functools.cache
def grouped_sequential_mlp() -> type:
    """megatron's SequentialMLP whose forward runs `GroupedExpertsFunction` where its GEMM takes the operands (else
    `fused_sequential_mlp`'s forward), its per-expert weights views of one buffer per projection (module doc, 2)."""

    class GroupedSequentialMLP(fused_sequential_mlp()):  # type: ignore[misc]
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            self.stack_weights()

        def stack_weights(self) -> None:
            """Make each projection's per-expert weights views of one (E, *shape) buffer holding their values (the
            same Parameters, names and attributes)."""
            if self.num_local_experts < 2:
                return
            with torch.no_grad():
                for name in ("linear_fc1", "linear_fc2"):
                    params = [getattr(e, name).weight for e in self.local_experts]
                    buffer = torch.stack([p.detach() for p in params])
                    for p, view in zip(params, buffer.unbind(0), strict=True):
                        p.data = view

        def _groupable(self, x: torch.Tensor) -> bool:
            """Whether torch's grouped GEMM takes this call's operands: rows to compute, row widths (hidden, 2F, F)
            of whole 16-byte units and the input at a 16-byte address."""
            fc2 = self.local_experts[0].linear_fc2.weight  # (H, F)
            unit = 16 // x.element_size()
            return (
                x.shape[0] > 0
                and x.dtype == fc2.dtype
                and fc2.shape[0] % unit == 0
                and fc2.shape[1] % unit == 0
                and x.is_contiguous()
                and x.data_ptr() % 16 == 0
            )

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):  # type: ignore[no-untyped-def]
            x = permuted_local_hidden_states
            if not (self._fusable() and self._groupable(x)):
                return super().forward(x, tokens_per_expert, permuted_probs)
            return GroupedExpertsFunction.apply(x, permuted_probs, tokens_per_expert, *self._weights()), None

    return GroupedSequentialMLP
