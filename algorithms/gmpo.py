"""GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673).

Differences from grpo:
1. the sequence objective is the geometric mean of the token terms instead of their arithmetic mean:
   R_i = exp(mean_t clip_sgn(A_i)(l_{i,t})), J = (1/G) sum_i A_i R_i;
2. clipping in log space, sign-aware and per token: l clipped above at +eps_high when A > 0, below at -eps_low when
   A < 0 (the min/max PPO would pick), with eps = 0.4 on both sides (ratio range [e^-0.4, e^0.4]);
3. sequence-level advantages; a clipped token drops out of the gradient while the rest keep weight R_i / |y_i|.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import check_inputs, clip_metrics, log_ratio, per_sequence, ratio_metrics, seq_mean, to_floats
from algorithms.registry import Range, ratio_level, register

if TYPE_CHECKING:
    import torch


@register("gmpo", label="GMPO", color="#999933")
@ratio_level("sequence")
def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0)] = 0.4,
    eps_high: Annotated[float, Range(ge=0.0)] = 0.4,
) -> tuple[torch.Tensor, dict[str, float]]:
    import torch

    check_inputs(logp, old_logp, advantages, mask)
    adv = per_sequence(advantages, "gmpo")  # (B,)
    lr = log_ratio(logp, old_logp, mask)  # (B, T)
    pos = (adv > 0)[:, None]  # (B, 1)
    # clip_sgn(A)(l): min(l, eps_high) where A > 0, max(l, -eps_low) where A <= 0
    lr_clipped = torch.where(pos, lr.clamp(max=eps_high), lr.clamp(min=-eps_low))  # (B, T)
    big_r = seq_mean(lr_clipped, mask).exp()  # (B,)  R_i
    loss = -(adv * big_r).mean()
    with torch.no_grad():
        low = (lr < -eps_low) & (adv < 0)[:, None]
        high = (lr > eps_high) & pos
    geo_ratio = seq_mean(lr, mask).exp()  # unclipped geometric-mean ratio, for the ratio stats
    return loss, to_floats({**clip_metrics(low, high, mask), **ratio_metrics(geo_ratio, mask)})
