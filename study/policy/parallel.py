"""The policy across ranks: full weights in and out of a sharded model, and its training through megatron's DDP and
distributed optimizer.

Under a `ParallelLayout` (study/core/model_config.py) each rank's GPTModel holds a shard (study/policy/model.py
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
   distributed optimizer (Adam, fp32 main parameters for bf16, its global-norm clip over every rank's shard), on
   the CPU too (study/policy/compat.py point 6).
   Gradients are summed, not averaged, over the data-parallel ranks (`calculate_per_token_loss`): the loop gives
   each rank the share of the global loss its rows carry (study/rl.py), so the sum is the one-process gradient.

`data_rows` / `gather_rows` split a global batch's rows over the data-parallel ranks. Every rank of one
tensor-parallel group computes the same rows; megatron's sequence parallelism splits each sequence between them
(contiguous chunks of S in rank order; S must divide: the RL loop pads its batch to a multiple of `parallel.tensor`),
so a rank's routers see its slice of each sequence: study/policy/routing.py records and replays routes per slice and
gathers them over the tensor-parallel group, and `model.token_logp` takes its kept positions from the gathered
sequence, each rank its share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
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
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def _is_expert(name: str) -> bool:
    # megatron marks expert weights `allreduce = False` only when expert parallelism is on; the name says it always
    return ".mlp.experts." in name


def _gated(name: str, model: torch.nn.Module) -> bool:
    return name.endswith("linear_fc1.weight") and bool(model.config.gated_linear_unit)


def _experts_per_rank(model: torch.nn.Module) -> int:
    from megatron.core import parallel_state as ps

    return model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's `t` over `group`, on `t`'s device; through the communication device (`_to_comm`: the GPU under
    NCCL, which gathers CUDA tensors only: CPU ones, such as megatron's CPU Adam states, travel through it)."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [t]
    sent = _to_comm(t.contiguous())
    out = [torch.empty_like(sent) for _ in range(size)]
    torch.distributed.all_gather(out, sent, group=group)
    return [o.to(t.device) for o in out]


def full_weights(
    model: torch.nn.Module,
    *,
    grads: bool = False,
    values: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the policy as the one-process model holds it: (megatron name, full tensor), in the model's
    parameter order, experts in global order. Collective: every rank of the run must iterate it to the end (each
    tensor is gathered over the tensor- and expert-parallel groups); each rank gets the same full tensors. At one
    process it yields the parameters themselves (detached). This is the one source of full weights for the rollout
    engine's weight sync (`full_hf_weights`), HF export and layout-free checkpoints. `grads`: the reduced
    gradients instead (megatron's `main_grad` after `finalize_model_grads` with an all-reduce, else `.grad`), to
    compare a layout's gradients with one process's. `values`: per parameter, a tensor of its shape to gather in its
    place (an optimizer state: `ShardedTrainer.full_optimizer_state`)."""
    tp, _, etp, _, _ = _sizes()
    groups = _groups() if (tp > 1 or etp > 1 or _ep_size() > 1) else {}
    per_rank = _experts_per_rank(model) if groups else 0
    pending: dict[str, list[torch.Tensor]] = {}  # expert name -> this rank's local experts' tensors, in order
    for name, param in model.named_parameters():
        t = param.detach() if values is None else values(param)
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


def full_hf_weights(model: torch.nn.Module, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights in the rollout engine's (HF Qwen3-MoE) names, full tensors, on global rank `dst` (the
    rank that hosts the engine); every other rank yields nothing. Collective: every rank must iterate it to the end.
    Streamed (`stream_full_weights`): one full megatron weight at a time exists on `dst`, gathered from the shards
    only through the groups that hold `dst` (the sync's extra memory is the largest full tensor, plus the engine's
    bucket; a rank outside those groups sends nothing and holds nothing). On `dst` each name and shape is checked
    against the HF model of the policy's shape (study.core.weights.hf_param_shapes), and every HF weight comes
    exactly once (checked at the end)."""
    from study.core.weights import hf_param_shapes, iter_hf_weights

    cfg = model.study_config
    shapes, seen = hf_param_shapes(cfg), set()
    is_dst = not torch.distributed.is_initialized() or torch.distributed.get_rank() == dst
    for hf_name, tensor in iter_hf_weights(
        ((n, t) for n, t in stream_full_weights(model, dst=dst) if t is not None), cfg
    ):
        if not is_dst:
            continue
        want = shapes.get(hf_name)
        if want is None or tuple(tensor.shape) != tuple(want):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, the HF model of this shape has {want}")
        seen.add(hf_name)
        yield hf_name, tensor
        del tensor  # the full tensor goes before the next is gathered
    missing = set(shapes) - seen
    if is_dst and missing:
        raise KeyError(f"the policy's export misses HF weights {sorted(missing)[:4]} ({len(missing)} in all)")


def stream_full_weights(model: torch.nn.Module, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(megatron name, full tensor) of every weight in the one-process model's order, experts in global order, on
    global rank `dst`; elsewhere (name, None) after this rank's part in gathering it. Collective over every rank.

    Each full tensor is gathered straight into one buffer on `dst` (no copy besides: a column-parallel weight's
    shards are its row blocks; a row-parallel weight's are gathered transposed and yielded as the transpose's view;
    the gated fc1's [gate_r; up_r] shards go to the gate and up halves), only through the tensor- or
    expert-tensor-parallel group that holds `dst`. Under expert parallelism each expert goes from its owner to `dst`
    point to point, one at a time. The tensors yielded are read-only views (weights or gather buffers): consume
    them before the next."""
    from megatron.core import parallel_state as ps

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    me = torch.distributed.get_rank()
    tp, _, etp, _, _ = _sizes()
    ep = _ep_size()
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    with_dst = {
        "tp": dst in torch.distributed.get_process_group_ranks(tp_group),
        "etp": dst in torch.distributed.get_process_group_ranks(etp_group),
    }
    if ep > 1:  # the ranks whose expert shards make up dst's experts: dst's expert-data replica (module doc)
        ep_group = ps.get_expert_model_parallel_group()
        ep_ranks = torch.distributed.get_process_group_ranks(ep_group)
        replica = _object_from(dst, ps.get_expert_data_parallel_rank())  # dst's expert-data-parallel rank
        feeds = ps.get_expert_data_parallel_rank() == replica
        owners = _object_from(dst, ep_ranks)  # dst's expert-parallel group, in expert-parallel rank order
        etp_root = torch.distributed.get_process_group_ranks(etp_group)[0]
        per_rank = _experts_per_rank(model)
    pending: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        expert = _is_expert(name)
        m = _LOCAL_EXPERT.fullmatch(name)
        if not (expert and m and ep > 1):
            kind = "etp" if expert else "tp"
            size = etp if expert else tp
            sharded = getattr(param, "tensor_model_parallel", False) and size > 1
            if not sharded:
                yield name, (param.detach() if me == dst else None)
            elif with_dst[kind]:
                yield name, _gather_to(param, name, model, tp_group if kind == "tp" else etp_group, dst)
            else:
                yield name, None
            continue
        head, local, tail = m.group(1), int(m.group(2)), m.group(3)
        pending.setdefault(head + tail, []).append((name, param))
        if local < per_rank - 1:
            continue
        mine = pending.pop(head + tail)  # this rank's local experts of the layer's weight, in order
        for r, owner in enumerate(owners):
            for e in range(per_rank):
                g = f"{head}{r * per_rank + e}{tail}"
                full = None
                local_name, local_param = mine[e]
                if feeds and _sizes()[4] == r:  # this rank holds a shard of expert g (or all of it)
                    sharded = getattr(local_param, "tensor_model_parallel", False) and etp > 1
                    full = (
                        _gather_to(local_param, local_name, model, etp_group, etp_root)
                        if sharded
                        else local_param.detach()
                    )
                    if me == etp_root and owner != dst:
                        torch.distributed.send(full.contiguous(), dst=dst)
                        full = None
                if me == dst and owner != dst:
                    full = torch.empty(
                        local_param.shape
                        if not (getattr(local_param, "tensor_model_parallel", False) and etp > 1)
                        else _full_shape(local_param, etp),
                        dtype=local_param.dtype,
                        device=local_param.device,
                    )
                    torch.distributed.recv(full, src=owner)
                yield g, (full if me == dst else None)


def _object_from(src: int, obj: Any) -> Any:
    """`obj` as global rank `src` has it, on every rank."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _full_shape(param: torch.nn.Parameter, parts: int) -> tuple[int, ...]:
    shape = list(param.shape)
    shape[param.partition_dim] *= parts
    return tuple(shape)


def _gather_to(
    param: torch.nn.Parameter, name: str, model: torch.nn.Module, group: Any, dst: int
) -> torch.Tensor | None:
    """`param`'s full tensor gathered over `group` into one buffer on global rank `dst` (a member of `group`); None
    elsewhere (stream_full_weights' doc). Point to point, each shard received straight into its block of the buffer
    (a collective gather may stage the blocks in a buffer of its own: gloo's does)."""
    ranks = torch.distributed.get_process_group_ranks(group)
    parts = len(ranks)
    t = param.detach()
    root = dst == torch.distributed.get_rank()
    dim = param.partition_dim
    if dim == 0 and _gated(name, model):  # [gate_r; up_r] per rank -> [gate; up]
        sends = t.chunk(2, 0)
        full = torch.empty(_full_shape(param, parts), dtype=t.dtype, device=t.device) if root else None
        blocks = [b for half in full.chunk(2, 0) for b in half.chunk(parts, 0)] if root else []
    elif dim == 0:
        sends = (t,)
        full = torch.empty(_full_shape(param, parts), dtype=t.dtype, device=t.device) if root else None
        blocks = list(full.chunk(parts, 0)) if root else []
    elif t.dim() == 2 and dim == 1:  # gathered transposed: the shards are row blocks of the transpose
        sends = (t.t(),)
        full_t = torch.empty(t.shape[1] * parts, t.shape[0], dtype=t.dtype, device=t.device) if root else None
        blocks = list(full_t.chunk(parts, 0)) if root else []
        full = full_t.t() if root else None
    else:
        raise ValueError(f"{name}: partition_dim {dim} of a {t.dim()}-d weight is not streamed")
    for k, piece in enumerate(sends):  # blocks: piece k of every rank in group order, piece after piece
        if not root:
            torch.distributed.send(piece.contiguous(), dst=dst)
            continue
        for i, rank in enumerate(ranks):
            block = blocks[k * parts + i]
            if rank == dst:
                block.copy_(piece)
            else:
                torch.distributed.recv(block, src=rank)
    return full


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


def _shards(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True
) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(local name, parameter, this rank's slice of `state`'s full tensor) for each parameter of the shard whose
    one-process name `state` holds (all of them with `strict`)."""
    for key, (name, param) in _shard_params(model).items():
        if key not in state:
            if strict:
                raise KeyError(f"state has no {key!r} (the one-process name of this rank's {name!r})")
            continue
        yield name, param, _this_rank(model, key, name, param, state[key])


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
    # NCCL gathers CUDA tensors only: CPU ones (routes) travel through the GPU
    padded = _to_comm(local.new_zeros((width, *local.shape[1:])))
    padded[: local.shape[0]] = _to_comm(local.detach())
    pieces = [torch.empty_like(padded) for _ in range(dp)]
    torch.distributed.all_gather(pieces, padded, group=ps.get_data_parallel_group())
    rank = ps.get_data_parallel_rank()
    return torch.cat([local if r == rank else pieces[r][: sizes[r]].to(local.device) for r in range(dp)])


def _comm_device(device: torch.device) -> torch.device:
    """Where a collective's tensors must be: the current GPU under NCCL, else where they are."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _to_comm(t: torch.Tensor) -> torch.Tensor:
    """`t` on the communication device (`_comm_device`): every tensor a collective here sends or fills."""
    return t.to(_comm_device(t.device))


ADAM_STATES = ("exp_avg", "exp_avg_sq")
# megatron's distributed optimizer in a distributed checkpoint: per weight (reshardable to any layout), gathered over
# gloo to data-parallel rank 0 (its all-gather alternative moves the states through CUDA)
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}


class ShardedTrainer:
    """megatron's DistributedDataParallel, `finalize_model_grads` and megatron's optimizer around a policy built with
    `build_policy(parallel=...)`: the training step of a run whose layout is not one process.

    Usage per update: `zero_grad()`, the loss's backward through the model (called directly: DDP's hooks sit on the
    parameters), then `step()` -> (stepped, global grad norm). The gradients are reduced by megatron (summed over
    data-parallel ranks, `calculate_per_token_loss`; sequence-parallel norms and routers summed over the
    tensor-parallel ranks; experts over the expert-data-parallel ranks). The optimizer is megatron's
    (`get_megatron_optimizer`, on the CPU through study/policy/compat.py point 6): Adam with decoupled weight decay
    on every weight (as `build_optimizer`: no per-parameter exemptions), one optimizer for the dense weights and one
    for the experts, chained, with megatron's global-norm clip over every rank's shard; fp32 main parameters and
    gradients when the model is bf16; with `distributed_optimizer` (the default) the Adam states and main
    parameters sharded over the data-parallel ranks (ZeRO-1), else replicated. On the CPU the inner Adam is torch's
    AdamW (megatron's fallback without TransformerEngine or apex), which steps like the one-process
    `build_optimizer` (torch's fused AdamW) up to rounding.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float | None = None,
        grad_clip: float = 0.0,
        distributed_optimizer: bool = True,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = model.config
        if config.fp16:
            raise ValueError(
                "train_dtype = 'fp16' with a parallel layout: megatron's loss scaler is not wired here; "
                "valid: fp32 or bf16"
            )
        from study.core.precision import ROUND_ATTR

        if any(getattr(p, ROUND_ATTR, None) is not None for p in model.parameters()):
            raise ValueError(
                "train_precision = an emulated low precision with a parallel layout: megatron's optimizer keeps no "
                "fp32 master copy of fp32 weights stored rounded, so its updates would round away; valid: fp32, bf16 "
                "or bf16_fp32head (real, megatron's fp32 main parameters)"
            )
        eps = 1e-8 if eps is None else eps  # build_optimizer's default (fp16, its 1e-6, is refused above)
        self.model, self.grad_clip = model, grad_clip
        self.hparams = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        self.distributed_optimizer = distributed_optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            clip_grad=grad_clip,
            bf16=config.bf16,
            fp16=False,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
        )
        # config_overrides={}: weight decay on every weight, as build_optimizer (megatron's default exempts biases
        # and 1-d weights)
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp], config_overrides={})
        for group in self.optimizer.param_groups:  # no scheduler: the run's constant lr
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def reduce(self) -> None:
        """megatron's gradient reduction over the ranks (`finalize_model_grads`); `step` calls it."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])

    def step(self) -> tuple[bool, float]:
        """Reduce the gradients over the ranks, clip by the global norm and step (megatron's `step`). Returns
        (whether the step was taken, the global gradient norm before clipping). megatron checks for inf/NaN only
        under a loss scaler (fp16, refused here): a non-finite norm is returned as it is, after a step that moved
        the weights to non-finite values, and the loop ends the run on it (study/rl.py, Collapse)."""
        self.reduce()
        stepped, grad_norm, _ = self.optimizer.step()
        return bool(stepped), float(grad_norm) if grad_norm is not None else float("nan")

    # -- checkpoints -------------------------------------------------------------------------------------------------
    # Two forms. megatron's distributed checkpoint (`sharded_state_dict`, saved and loaded with
    # megatron.core.dist_checkpointing, which reshards it to the loading layout): the model's sharded state and the
    # optimizer's in megatron's "fully_reshardable" form (Adam states and fp32 main parameters per weight, gathered
    # over the data-parallel ranks over gloo and written by data-parallel rank 0). And the one-process form
    # (`full_optimizer_state` / `load_full_optimizer_state`): each Adam state as the one-process model's full tensor
    # by its one-process name, what a one-process run's torch AdamW holds.
    def init_states(self) -> None:
        """Allocate Adam's states before a load: megatron's distributed optimizer reads the step from them (with
        torch's Adam, its fallback without TransformerEngine or apex) and loads into them in place. Megatron's own
        initialisation, a step with zero gradients on the fp32 main parameters (the load overwrites both)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for o in self.optimizer.chained_optimizers:
            if isinstance(o, DistributedOptimizer) and not o.is_stub_optimizer and not o.optimizer.state:
                o._init_optimizer_states_with_dummy_values()

    def sharded_state_dict(self, *, loading: bool) -> dict[str, Any]:
        """{"model", "optimizer"}: the sharded state megatron's dist_checkpointing saves, or (`loading`) the
        template it loads into (then `load_sharded`)."""
        if loading:
            self.init_states()
        model_state = self.model.sharded_state_dict()
        optimizer_state = self.optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=SHARDING)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_sharded(self, loaded: dict[str, Any]) -> None:
        """Apply what dist_checkpointing loaded into `sharded_state_dict(loading=True)`."""
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])

    def _states(self) -> tuple[dict[torch.nn.Parameter, dict[str, torch.Tensor]], int]:
        """Each parameter of this rank's shard -> its Adam states ("exp_avg", "exp_avg_sq") shaped like it (whole
        over the data-parallel ranks: the distributed optimizer's are gathered, a collective over them), and the
        step."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        states: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        step = 0
        for o in self.optimizer.chained_optimizers:
            if o.is_stub_optimizer:
                continue
            for s in o.optimizer.state.values():
                step = int(s["step"])
            if isinstance(o, DistributedOptimizer):  # its flat buffers' state over the data-parallel ranks
                world = o.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True)
                for index, buffer in enumerate(o.buffers):
                    (tensors,) = world[index].values()  # one dtype per buffer
                    for param, (start, end, _) in buffer.param_index_map.items():
                        states[param] = {k: tensors[k][start:end].view(param.shape) for k in ADAM_STATES}
            else:  # FP32Optimizer: the parameters themselves; Float16Optimizer: their fp32 main parameters
                for param in self.params:
                    main = getattr(param, "main_param", None)
                    main = param if main is None else main
                    if main in o.optimizer.state:
                        states[param] = {k: o.optimizer.state[main][k] for k in ADAM_STATES}
        return states, step

    def full_optimizer_state(self) -> dict[str, Any]:
        """The Adam states as one process holds them (collective over every rank): {"step", "exp_avg": {name: full
        tensor}, "exp_avg_sq": {...}} by the one-process model's names, fp32."""
        states, step = self._states()
        out: dict[str, Any] = {"step": step}
        for key in ADAM_STATES:
            out[key] = {n: t.float().clone() for n, t in full_weights(self.model, values=lambda p, k=key: states[p][k])}
        return out

    def load_full_optimizer_state(self, full: Mapping[str, Any]) -> None:
        """Set the Adam states from their one-process form (`full_optimizer_state`'s, or a one-process run's torch
        AdamW states by name): each full tensor sliced into this rank's shard; the fp32 main parameters from the
        model's current weights (load those first)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.init_states()
        local = {id(p): {} for p in self.params}
        for key in ADAM_STATES:
            for _, param, t in _shards(self.model, full[key]):
                local[id(param)][key] = t.float()
        step = torch.tensor(float(full["step"]))
        with torch.no_grad():
            for o in self.optimizer.chained_optimizers:
                if o.is_stub_optimizer:
                    continue
                if isinstance(o, DistributedOptimizer):  # megatron slices each weight's states to its own range
                    by_index, index = {}, 0
                    for buffer in o.buffers:
                        for param in buffer.param_index_map:
                            by_index[index] = {"param": param.detach().float(), **local[id(param)]}
                            index += 1
                    o.load_parameter_state_from_fully_reshardable(by_index)
                else:
                    for param in self.params:
                        main = getattr(param, "main_param", None)
                        main = param if main is None else main
                        if any(main is q for g in o.optimizer.param_groups for q in g["params"]):
                            if main is not param:
                                main.copy_(param.float())
                            o.optimizer.state[main] = {
                                "step": step.clone(),
                                **{k: v.clone() for k, v in local[id(param)].items()},
                            }
                for s in o.optimizer.state.values():
                    s["step"] = step.clone()


def one_process_adam_state(
    full: Mapping[str, Any], weights: Mapping[str, torch.Tensor], hparams: Mapping[str, Any]
) -> dict[str, Any]:
    """`ShardedTrainer.full_optimizer_state`'s Adam states as the state dict of the torch AdamW a one-process run
    builds (study.policy.optim.build_optimizer over the one-process model's weights, `weights` in their order): what
    a one-process resume loads. Each state in its weight's dtype (a one-process bf16 run's AdamW holds bf16 states)."""
    from study.policy.optim import build_optimizer

    holder = torch.nn.Module()
    holder.weights = torch.nn.ParameterList(
        [torch.nn.Parameter(w.detach(), requires_grad=True) for w in weights.values()]
    )
    optimizer = build_optimizer(
        holder, lr=hparams["lr"], weight_decay=hparams["weight_decay"], betas=hparams["betas"], eps=hparams["eps"]
    )
    step = torch.tensor(float(full["step"]))
    for name, p in zip(weights, holder.weights, strict=True):
        optimizer.state[p] = {"step": step.clone(), **{k: full[k][name].to(p.dtype) for k in ADAM_STATES}}
    return optimizer.state_dict()


def adam_state_by_name(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """Inverse of `one_process_adam_state`: a one-process run's torch AdamW state dict (its weights named `names`, in
    their order) as {"step", "exp_avg": {name: tensor}, "exp_avg_sq": {...}}."""
    if len(state["param_groups"]) != 1:
        raise ValueError(
            f"the optimizer state has {len(state['param_groups'])} parameter groups, one expected (router_lr_scale = 1)"
        )
    indices = state["param_groups"][0]["params"]
    if len(indices) != len(names):
        raise ValueError(f"the optimizer state covers {len(indices)} weights, the model has {len(names)}")
    per = state["state"]
    if set(per) != set(indices):
        raise ValueError("the optimizer state lacks Adam states of some weights (it has never stepped?)")
    steps = {float(per[i]["step"]) for i in indices}
    if len(steps) != 1:
        raise ValueError(f"the optimizer state's weights are at different steps {sorted(steps)}")
    out: dict[str, Any] = {"step": int(steps.pop())}
    for key in ADAM_STATES:
        out[key] = {name: per[i][key] for name, i in zip(names, indices, strict=True)}
    return out


def save_distributed(trainer: ShardedTrainer, directory: str | Path, *, rng: Any = None) -> None:
    """Save the policy and its optimizer with megatron's distributed checkpointing into `directory` (made empty
    first; collective over every rank: each writes its shards, data-parallel rank 0 the gathered optimizer states).
    `rng`: this rank's RNG states, kept under its global rank (`load_distributed`)."""
    import shutil

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    directory = Path(directory)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    torch.distributed.barrier()
    state = trainer.sharded_state_dict(loading=False)
    if rng is not None:
        state["rng"] = ShardedObject(f"rng.rank{torch.distributed.get_rank()}", rng, (1,), (0,), replica_id=0)
    dist_checkpointing.save(state, str(directory))


def load_distributed(trainer: ShardedTrainer, directory: str | Path, *, rng: bool = False) -> Any:
    """Load `save_distributed`'s checkpoint into this layout's policy and optimizer (megatron reshards it from the
    layout that saved it; collective). `rng`: also return this rank's saved RNG states (the saving world must have
    had this rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    check_checkpoint_metadata(directory)
    template = trainer.sharded_state_dict(loading=True)
    if rng:
        template["rng"] = ShardedObject(f"rng.rank{torch.distributed.get_rank()}", None, (1,), (0,), replica_id=0)
    loaded = dist_checkpointing.load(template, str(directory))
    trainer.load_sharded(loaded)
    return loaded.get("rng")


def one_process_names(model: torch.nn.Module) -> list[str]:
    """The one-process model's parameter names in its own order (a one-process run's optimizer indexes its states in
    that order): this shard's names with each layer's local experts replaced by every global expert, expert by
    expert (`full_weights` yields them grouped by weight instead). No communication."""
    per_rank = _experts_per_rank(model) if _ep_size() > 1 else 0
    out: list[str | tuple[str]] = []
    tails: dict[str, list[str]] = {}  # a layer's expert prefix -> its weights' suffixes, in order
    for name, _ in model.named_parameters():
        m = _LOCAL_EXPERT.fullmatch(name)
        if m is None or not per_rank:
            out.append(name)
            continue
        head, local, tail = m.group(1), int(m.group(2)), m.group(3)
        if head not in tails:
            tails[head] = []
            out.append((head,))  # the layer's experts go here
        if local == 0:
            tails[head].append(tail)
    experts = per_rank * _ep_size()
    return [
        n
        for item in out
        for n in (
            [item] if isinstance(item, str) else [f"{item[0]}{e}{t}" for e in range(experts) for t in tails[item[0]]]
        )
    ]


# What torch DCP's `.metadata` pickle of a megatron torch_dist checkpoint names: DCP's own metadata classes, torch.Size,
# dtypes and layouts. Anything else (a hostile or foreign file) is refused before torch reads it with pickle.load.
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)


def check_checkpoint_metadata(directory: str | Path) -> None:
    """Refuse a distributed checkpoint whose `.metadata` (torch DCP's pickle, which torch reads with `pickle.load`)
    names anything but DCP's metadata classes, torch.Size, dtypes and layouts: read here with an unpickler that
    constructs nothing else (the check runs no code of the file), as state.pt is read with weights_only."""
    import importlib
    import io
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in _DCP_MODULES and isinstance(getattr(importlib.import_module(module), name, None), type):
                return super().find_class(module, name)
            if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            if (module, name) == ("torch.serialization", "_get_layout"):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata class")

    path = Path(directory) / ".metadata"
    try:
        Restricted(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise ValueError(f"{path}: not a distributed checkpoint's metadata ({type(err).__name__}: {err})") from None
