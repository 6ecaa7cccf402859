"""GSPO-token (Zheng et al. 2025, arXiv 2507.18071, Eq. 13-14): GSPO with per-token advantages.

Differences from gspo:
1. per-token ratio s_{i,t} = sg[s_i] * pi_theta(y_{i,t}) / sg[pi_theta(y_{i,t})]: numerically s_i, but each token
   carries its own gradient path, so per-token advantages A_{i,t} (e.g. multi-turn credit) can be used;
2. token-level clipping and seq-mean-token-mean aggregation of min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t}).
With A_{i,t} = A_i it equals gspo in value, clipping decision and gradient (tested).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import check_inputs, clipped_objective, log_ratio, per_token, seq_mean, to_floats
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


@register("gspo_token", label="GSPO-token", color="#44AA99")
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0, lt=1.0)] = 3e-4,
    eps_high: Annotated[float, Range(ge=0.0)] = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    import torch

    check_inputs(logp, old_logp, advantages, mask)
    adv = per_token(advantages, mask)  # (B, T)
    log_s = seq_mean(log_ratio(logp, old_logp, mask), mask)  # (B,)  log s_i
    lp = logp.float()
    # log s_{i,t} = sg[log s_i] + log pi_theta(y_{i,t}) - sg[log pi_theta(y_{i,t})]
    s_t = (log_s.detach()[:, None] + torch.where(mask.bool(), lp - lp.detach(), 0.0)).exp()  # (B, T)
    obj, metrics = clipped_objective(s_t, adv, mask, eps_low, eps_high)  # (B, T)
    return -seq_mean(obj, mask).mean(), to_floats(metrics)
