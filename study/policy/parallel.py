"""The policy across ranks: full weights in and out of a sharded model, and its training through megatron's DDP and
distributed optimizer.

Under a `ParallelLayout` (study/model_config.py) each rank's GPTModel holds a shard (study/policy/model.py
`build_policy(parallel=...)`): megatron marks a tensor-parallel weight with `tensor_model_parallel`,
`partition_dim`; an expert's weights have the local name `local_experts.{e}` of global expert
`expert_rank x experts_per_rank + e` (split over the expert-tensor group, not the tensor group).
Three things follow from those marks and nothing else:
1. `full_weights(model)` yields every weight of the one-process model, by its one-process name and shape
   (tensor-parallel pieces concatenated on their partition dimension, the SwiGLU fc1's gate and up halves
   concatenated separately, the experts gathered over the expert-parallel ranks); the rollout engines' weight sync
   and HF export read it (`full_hf_weights`).
2. `load_full_state(model, state)`: the inverse, a one-process state dict (a cold start, a checkpoint) sliced into
   this rank's shard; `load_streamed(model, tensors)` the same from tensors read one at a time (an HF checkpoint).
3. `ShardedTrainer`: megatron's DistributedDataParallel around the model, `finalize_model_grads` and megatron's
   distributed optimizer (Adam, fp32 main parameters for bf16, its global-norm clip over every rank's shard).
   Gradients are summed, not averaged, over the data-parallel ranks (`calculate_per_token_loss`): the loop gives
   each rank the share of the global loss its rows carry (study/rl.py), so the sum is the one-process gradient.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def _groups() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
    }


def _sizes() -> tuple[int, int, int, int, int]:
    """(tp, tp rank, etp, etp rank, ep rank) of this process, (1, 0, 1, 0, 0) before megatron is initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, 1, 0, 0
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_model_parallel_rank())  # fmt: skip


def _is_expert(name: str) -> bool:
    # megatron marks expert weights `allreduce = False` only when expert parallelism is on; the name says it always
    return ".mlp.experts." in name


def _gated(name: str, model: torch.nn.Module) -> bool:
    return name.endswith("linear_fc1.weight") and bool(model.config.gated_linear_unit)


def _experts_per_rank(model: torch.nn.Module) -> int:
    from megatron.core import parallel_state as ps

    return model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(out, t.contiguous(), group=group)
    return out


def full_weights(model: torch.nn.Module, *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the policy as the one-process model holds it: (megatron name, full tensor), in the model's
    parameter order, experts in global order. Collective: every rank of the run must iterate it to the end (each
    tensor is gathered over the tensor- and expert-parallel groups); each rank gets the same full tensors. At one
    process it yields the parameters themselves (detached). This is the one source of full weights for the rollout
    engine's weight sync (`full_hf_weights`), HF export and layout-free checkpoints. `grads`: the reduced
    gradients instead (megatron's `main_grad` after `finalize_model_grads` with an all-reduce, else `.grad`), to
    compare a layout's gradients with one process's."""
    tp, _, etp, _, _ = _sizes()
    groups = _groups() if (tp > 1 or etp > 1 or _ep_size() > 1) else {}
    per_rank = _experts_per_rank(model) if groups else 0
    pending: dict[str, list[torch.Tensor]] = {}  # expert name -> this rank's local experts' tensors, in order
    for name, param in model.named_parameters():
        t = param.detach()
        if grads:
            t = getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad
            t = torch.zeros_like(param) if t is None else t.detach().clone()  # not the buffer the clip scales
        expert = _is_expert(name)
        parts = 1
        if getattr(param, "tensor_model_parallel", False):
            group = groups.get("etp" if expert else "tp")
            parts = torch.distributed.get_world_size(group) if group is not None else 1
        if parts > 1:
            pieces = _all_gather(t, groups["etp" if expert else "tp"])
            dim = param.partition_dim
            if _gated(name, model):  # [gate_r; up_r] per rank -> [gate; up]
                halves = [p.chunk(2, dim=dim) for p in pieces]
                t = torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
            else:
                t = torch.cat(pieces, dim)
        m = _LOCAL_EXPERT.fullmatch(name)
        if not (expert and m and groups and _ep_size() > 1):
            yield name, t
            continue
        head, local, tail = m.group(1), int(m.group(2)), m.group(3)
        pending.setdefault(head + tail, []).append(t)
        if local == per_rank - 1:  # this rank's last local expert of the layer: gather all ranks' experts
            mine = torch.stack(pending.pop(head + tail))
            for rank, block in enumerate(_all_gather(mine, groups["ep"])):
                for e in range(per_rank):
                    yield f"{head}{rank * per_rank + e}{tail}", block[e]


def _ep_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`full_weights` as a dict (collective)."""
    return dict(full_weights(model))


def full_hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights in the rollout engine's (HF Qwen3-MoE) names, full tensors: the generator a weight sync
    and HF export take from a sharded model (collective, like `full_weights`: every rank must iterate it to the
    end). Each name and shape is checked against the HF model of the policy's shape (study.weights.hf_param_shapes),
    and every HF weight comes exactly once (checked at the end). The full megatron weights are gathered once at the
    start (one copy of the model; study.weights.iter_hf_weights then yields views of them)."""
    from study.weights import hf_param_shapes, iter_hf_weights

    cfg = model.study_config
    shapes, seen = hf_param_shapes(cfg), set()
    for hf_name, tensor in iter_hf_weights(full_state_dict(model), cfg):
        want = shapes.get(hf_name)
        if want is None or tuple(tensor.shape) != tuple(want):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, the HF model of this shape has {want}")
        seen.add(hf_name)
        yield hf_name, tensor
    missing = set(shapes) - seen
    if missing:
        raise KeyError(f"the policy's export misses HF weights {sorted(missing)[:4]} ({len(missing)} in all)")


def _shard_params(model: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """This rank's parameters by their one-process name: {full name: (local name, parameter)}."""
    _, _, _, _, ep_rank = _sizes()
    per_rank = _experts_per_rank(model) if _ep_size() > 1 else 0
    out = {}
    for name, param in model.named_parameters():
        m = _LOCAL_EXPERT.fullmatch(name)
        key = f"{m.group(1)}{ep_rank * per_rank + int(m.group(2))}{m.group(3)}" if m is not None and per_rank else name
        out[key] = (name, param)
    return out


def _this_rank(model: torch.nn.Module, key: str, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the one-process tensor `full` (the inverse of `full_weights`' concatenation)."""
    tp, tp_rank, etp, etp_rank, _ = _sizes()
    parts, rank = (etp, etp_rank) if _is_expert(name) else (tp, tp_rank)
    t = full
    if getattr(param, "tensor_model_parallel", False) and parts > 1:
        dim = param.partition_dim
        if _gated(name, model):
            gate, up = full.chunk(2, dim=dim)
            t = torch.cat([gate.chunk(parts, dim)[rank], up.chunk(parts, dim)[rank]], dim)
        else:
            t = full.chunk(parts, dim)[rank]
    if t.shape != param.shape:
        raise ValueError(f"{key}: shape {tuple(full.shape)} does not shard to this rank's {tuple(param.shape)}")
    return t


def load_full_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a one-process (full) megatron state dict into this rank's shard: each tensor sliced as `full_weights`
    concatenates it. Names the model lacks are ignored (like `load_state_dict(strict=False)` on the cold start's
    extra state); with `strict` every parameter of the shard must be in `state`, with the full shape."""
    with torch.no_grad():
        for key, (name, param) in _shard_params(model).items():
            if key not in state:
                if strict:
                    raise KeyError(f"state has no {key!r} (the one-process name of this rank's {name!r})")
                continue
            param.copy_(_this_rank(model, key, name, param, state[key]))


def load_streamed(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load (one-process megatron name, full tensor) pairs, read one at a time (an HF checkpoint's
    `HFCheckpoint.tensors()`), into this rank's shard: each sliced as `load_full_state` slices it, tensors of other
    ranks' experts skipped, so a rank never holds more than one full tensor besides its shard. Every parameter of the
    shard must be written once; returns the number of elements this rank copied."""
    params = _shard_params(model)
    written: set[str] = set()
    copied = 0
    with torch.no_grad():
        for key, full in tensors:
            if key not in params:
                if _LOCAL_EXPERT.fullmatch(key) is not None and _ep_size() > 1:
                    continue  # another expert-parallel rank's expert
                raise ValueError(f"the policy has no weight {key!r} (at this layout or any)")
            name, param = params[key]
            t = _this_rank(model, key, name, param, full)
            param.copy_(t)
            written.add(key)
            copied += t.numel()
    missing = sorted(set(params) - written)
    if missing:
        raise ValueError(f"{len(missing)} weights of this rank's shard were not in the checkpoint, e.g. {missing[:3]}")
    return copied


def data_rows(n: int) -> torch.Tensor:
    """The rows of an n-row global batch this rank computes: its data-parallel rank's contiguous share
    (torch.tensor_split order, so shares differ by at most one row; every row at one data-parallel rank)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_data_parallel_rank() if dp > 1 else 0
    return torch.tensor_split(torch.arange(n), dp)[rank]


def gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """The global (n, ...) tensor from each data-parallel rank's `data_rows(n)` share, differentiable in this rank's
    rows only (the other ranks' rows arrive detached). A loss computed from it is the one-process loss on every
    rank, whatever its form (sequence-level ratios, global token means), and its gradient through this rank's rows
    is the one-process gradient's share: summed over the ranks by `ShardedTrainer`, the one-process gradient."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if dp == 1:
        return local
    sizes = [len(r) for r in torch.tensor_split(torch.arange(n), dp)]
    width = max(sizes)
    device = _comm_device(local.device)  # NCCL gathers CUDA tensors only: CPU ones (routes) travel through the GPU
    padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]] = local.detach().to(device)
    pieces = [torch.empty_like(padded) for _ in range(dp)]
    torch.distributed.all_gather(pieces, padded, group=ps.get_data_parallel_group())
    rank = ps.get_data_parallel_rank()
    return torch.cat([local if r == rank else pieces[r][: sizes[r]].to(local.device) for r in range(dp)])


def _comm_device(device: torch.device) -> torch.device:
    """Where a collective's tensors must be: the current GPU under NCCL, else where they are."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ShardedTrainer:
    """megatron's DistributedDataParallel and `finalize_model_grads` around a policy built with
    `build_policy(parallel=...)`, then Adam with a global-norm clip: the training step of a run whose layout is not
    one process.

    Usage per update: `zero_grad()`, the loss's backward through the model (called directly: DDP's hooks sit on the
    parameters), then `step()` -> (stepped, global grad norm). The gradients are reduced by megatron (summed over
    data-parallel ranks, `calculate_per_token_loss`; sequence-parallel norms and routers summed over the
    tensor-parallel ranks; experts over the expert-data-parallel ranks). The optimizer:
    - on CUDA, megatron's (`get_megatron_optimizer`): the distributed optimizer (Adam states sharded over the
      data-parallel ranks), fp32 main parameters and gradients for bf16, its global-norm clip;
    - on the CPU, megatron's optimizer cannot run (it allocates its scalars on "cuda" and refuses CPU parameter
      types), so each rank steps torch's fused AdamW over its own shard, with the gradients all-reduced and clipped
      by the global norm over every rank's shard (each weight counted once: `global_grad_norm`), as megatron
      clips. The optimizer state is then replicated over the data-parallel ranks.
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None, grad_clip: float = 0.0,
                 distributed_optimizer: bool | None = None) -> None:  # fmt: skip
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = model.config
        if config.fp16:
            raise ValueError("train_dtype = 'fp16' with a parallel layout: megatron's loss scaler is not wired here; "
                             "valid: fp32 or bf16")  # fmt: skip
        eps = 1e-8 if eps is None else eps  # build_optimizer's default (fp16, its 1e-6, is refused above)
        self.megatron_optimizer = torch.cuda.is_available()
        if distributed_optimizer is None:
            distributed_optimizer = self.megatron_optimizer
        if distributed_optimizer and not self.megatron_optimizer:
            raise ValueError("distributed_optimizer = True needs CUDA (megatron's optimizer); on the CPU: False")
        self.model, self.grad_clip = model, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed_optimizer)  # fmt: skip
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        if self.megatron_optimizer:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            opt_config = OptimizerConfig(
                optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
                adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip, bf16=config.bf16, fp16=False,
                params_dtype=config.params_dtype, use_distributed_optimizer=distributed_optimizer,
            )  # fmt: skip
            self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
            for group in self.optimizer.param_groups:  # no scheduler: the run's constant lr
                group["lr"] = lr
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                               fused=True)  # fmt: skip

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def reduce(self) -> None:
        """megatron's gradient reduction over the ranks (`finalize_model_grads`); `step` calls it."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])

    def step(self) -> tuple[bool, float]:
        """Reduce the gradients over the ranks, clip by the global norm and step. Returns (whether the step was
        taken, the global gradient norm before clipping); a non-finite norm skips the step."""
        self.reduce()
        if self.megatron_optimizer:
            stepped, grad_norm, _ = self.optimizer.step()
            return bool(stepped), float(grad_norm) if grad_norm is not None else float("nan")
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        norm = global_grad_norm(self.model, [p.grad for p in self.params])
        if not math.isfinite(norm):
            return False, norm
        if self.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_: coefficient max / (norm + 1e-6), at most 1
            coef = min(self.grad_clip / (norm + 1e-6), 1.0)
            torch._foreach_mul_([p.grad for p in self.params], coef)
        self.optimizer.step()
        return True, norm

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def global_grad_norm(model: torch.nn.Module, grads: list[torch.Tensor]) -> float:
    """The 2-norm of the one-process model's gradient from this rank's shard's `grads` (same order as the model's
    trainable parameters): every weight counted once (a tensor-parallel piece on each rank, a replicated weight on
    tensor-parallel rank 0 only, experts on their own ranks), the squares summed over the tensor-parallel group
    (dense) and the expert-tensor-and-expert-parallel group (experts), as megatron's clip counts them."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for (name, p), g in zip(params, grads, strict=True):
        sq = g.detach().double().square().sum()
        sharded = getattr(p, "tensor_model_parallel", False)
        if _is_expert(name):
            if sharded or etp_rank == 0:
                expert += sq
        elif sharded or tp_rank == 0:
            dense += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
    return float((dense + expert).sqrt())
