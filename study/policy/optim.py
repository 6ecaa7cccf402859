"""The policy's optimiser and fp16 loss scaling.

Torch's fused AdamW over every trainable parameter (one kernel over all of them): one process's optimizer; a run at a
parallel layout steps megatron's (study/policy/parallel.py ShardedTrainer). fp16 training needs loss scaling:
`DynamicLossScaler` (megatron's DynamicGradScaler needs CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
    bf16). `eps` defaults to 1e-8, or 1e-6 for fp16 parameters (1e-8 is below fp16's smallest subnormal).
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
        groups = [{"params": [p for p in params if id(p) not in routers]},
                  {"params": [p for p in params if id(p) in routers], "lr": lr * router_lr_scale}]  # fmt: skip
    if eps is None:
        eps = 1e-6 if any(p.dtype == torch.float16 for p in params) else 1e-8
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
                for p in params)  # fmt: skip
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused or None)


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
