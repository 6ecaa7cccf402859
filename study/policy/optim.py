"""The policy's optimiser and fp16 loss scaling.

Torch's fused AdamW over every trainable parameter (one kernel over all of them): one process's optimizer; a run at a
parallel layout steps megatron's (study/policy/parallel.py ShardedTrainer). fp16 training needs loss scaling:
`DynamicLossScaler` (megatron's DynamicGradScaler needs CUDA).

Low-precision training is megatron's mixed precision: the forward and backward compute in bf16 (or fp16) over
parameters stored in that dtype, while AdamW steps fp32 master copies of them and writes each update back rounded
(`MasterWeightAdamW`; megatron's Float16OptimizerWithFloat16Params at a parallel layout). An update far below the
weight's bf16 spacing (lr 1e-6 on a weight of 0.02, whose spacing is 1.2e-4) accumulates in the master copy instead
of rounding away. Emulated precision (study/core/precision.py) is the same scheme over fp32 parameters that hold
rounded values: apply_precision marks them, and the update written back is rounded to the target dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from study.core.precision import ROUND_ATTR


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    router_lr_scale: float = 1.0,
) -> torch.optim.AdamW:
    """Torch AdamW over every trainable parameter, its fused kernel where torch has one (CPU and CUDA, fp32 / fp16 /
    bf16): over the parameters themselves when they are fp32, over fp32 master copies (`MasterWeightAdamW`, module
    doc) when any is bf16 / fp16 or stored rounded (emulated precision). `eps` defaults to 1e-8, or 1e-6 for fp16
    parameters (1e-8 is below fp16's smallest subnormal).
    `router_lr_scale` != 1 puts the MoE routers' weights (`*.mlp.router.weight`) in a parameter group of their own at
    lr x scale: a knob that moves the routing (the study's routing-volatility axis) while the rest trains at `lr`.

    Fused: one kernel over all parameters instead of ~9 ops per parameter tensor. On this CPU a step takes 0.4-0.6
    ms instead of 2.2-2.8 on `tiny` (33 tensors) and 4.2 instead of 14 on `default` (docs/performance.md). It
    computes the same update to rounding (~1e-8 after 60 steps), not bit for bit.
    """
    if not (router_lr_scale > 0 and router_lr_scale < float("inf")):
        raise ValueError(f"router_lr_scale = {router_lr_scale}: must be a finite number > 0")
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list | list[dict] = params
    if router_lr_scale != 1.0:
        routers = {id(p) for n, p in model.named_parameters() if n.endswith(".mlp.router.weight") and p.requires_grad}
        if not routers:
            raise ValueError("router_lr_scale != 1 but the model has no MoE router weights (*.mlp.router.weight)")
        groups = [
            {"params": [p for p in params if id(p) not in routers]},
            {"params": [p for p in params if id(p) in routers], "lr": lr * router_lr_scale},
        ]
    if eps is None:
        eps = 1e-6 if any(p.dtype == torch.float16 for p in params) else 1e-8
    fused = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
    )
    kwargs = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused or None)
    if any(p.dtype != torch.float32 or getattr(p, ROUND_ATTR, None) is not None for p in params):
        return MasterWeightAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ bit for bit (the gradients' global 2-norm, returned; every gradient scaled by
    min(1, max_norm / (norm + 1e-6))), without its scaling pass where the factor is 1: multiplying by 1.0 changes no
    bit, and on the CPU that pass over every gradient is ~4% of an update at the routing study's shape (clip_grad_norm_
    scales unconditionally to spare an accelerator the host sync this test makes). A NaN factor still scales."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of the model's parameters (module doc): `step` steps the masters with the
    model's gradients upcast and writes them back in the parameters' dtype (rounded to `ROUND_ATTR`'s dtype where a
    parameter carries one). Its param_groups, states and state dict are torch AdamW's over the masters, in the model
    parameters' order, plus "master_params" (the fp32 weights, restored by `load_state_dict`). `zero_grad` clears the
    model's gradients, which the caller clips and unscales as usual."""

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], **kwargs: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], Mapping):
            groups = [{"params": groups}]
        self.model_params: list[torch.nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                m = p.detach().float().clone()
                self.model_params.append(p)
                self.masters.append(m)
                masters.append(m)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for p, m in zip(self.model_params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters, strict=True):
            if m.grad is None:
                continue
            dtype = getattr(p, ROUND_ATTR, None)
            p.copy_(m if dtype is None else m.to(dtype).float())  # the cast rounds to the parameter's dtype
            m.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["master_params"] = [m.clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch AdamW's states; the masters from "master_params", or (a state dict without them) from the model's
        current weights (load those first)."""
        state = dict(state_dict)
        masters = state.pop("master_params", None)
        super().load_state_dict(state)
        with torch.no_grad():
            if masters is None:
                masters = [p.detach() for p in self.model_params]
            if len(masters) != len(self.masters):
                raise ValueError(f"the state has {len(masters)} master weights, the optimizer {len(self.masters)}")
            for m, saved in zip(self.masters, masters, strict=True):
                m.copy_(saved.float())


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training (the usual scheme; megatron's DynamicGradScaler needs CUDA).

    Usage: `scaler.scale(loss).backward(); stepped = scaler.step(optimizer, model.parameters())`. `step` unscales
    the gradients in place, skips the optimizer step and backs the scale off when any gradient is inf/NaN, and
    grows the scale after `growth_interval` clean steps.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x scale, in fp32."""
        return loss.float() * self.scale_value

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; True when all of them are finite."""
        finite = True
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is None:
                continue
            if not bool(torch.isfinite(p.grad).all()):
                finite = False
            p.grad.mul_(inv)
        return finite

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, step unless a gradient overflowed, update the scale. Returns whether the step was taken."""
        finite = self.unscale_(params)
        if finite:
            optimizer.step()
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale_value = min(self.scale_value * self.growth_factor, self.max_scale)
        else:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
        return finite

    def state_dict(self) -> dict[str, float]:
        """Scale and step counters, for checkpoints."""
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Inverse of `state_dict`."""
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
