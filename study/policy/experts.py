"""The policy's experts: megatron's SequentialMLP, its forward and backward run as one autograd Function.

SequentialMLP runs each expert as its own MLP module: two linear autograd Functions, a chunk, SiLU and two
multiplies per expert, forward and backward, each a module call or an autograd node. On the tiny preset's 64-wide
experts that plumbing is a quarter of the experts' time at an 8-sequence minibatch (docs/performance.md).
`ExpertsFunction` computes the same matmuls and elementwise ops in the same order in one Function with a written-out
backward, so the output and every gradient (the input's, the weights', the routing probs') equal SequentialMLP's
bit for bit (tests/study/policy/test_model.py). The module, its parameters, their names and its place in
the layer spec stay megatron's; `SequentialMLP.forward` runs wherever the Function would not be exact (hooks, such
as emulated precision's rounding; tensor or expert-tensor parallelism; fp8; biases; another activation).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):  # type: ignore[no-untyped-def]
            # fp32 routing probs with bf16/fp16 experts: megatron casts the scaled activations back; not fused
            if permuted_probs.dtype != permuted_local_hidden_states.dtype or not self._fusable():
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            weights = [e.linear_fc1.weight for e in self.local_experts] + [
                e.linear_fc2.weight for e in self.local_experts
            ]
            out = ExpertsFunction.apply(
                permuted_local_hidden_states, permuted_probs, tokens_per_expert.tolist(), *weights
            )
            return out, None

    return FusedSequentialMLP
