"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071, Eq. 5-7).

Differences from grpo:
1. one importance ratio per sequence, length-normalised: s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|)
   = exp(mean_t l_{i,t});
2. clipping of s_i, so a clipped response drops all its tokens; the range is therefore tiny: 3e-4 / 4e-4 (paper).
   ScaleRL (arXiv 2510.13786) found about 3e-3 / 5e-3 better at 8B: set eps_low / eps_high;
3. aggregation over sequences only: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), whose gradient (Eq. 10) weights
   every token of a response equally: (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_{i,t}).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import check_inputs, clipped_objective, log_ratio, per_sequence, seq_mean, to_floats
from algorithms.registry import Range, ratio_level, register

if TYPE_CHECKING:
    import torch


@register("gspo", label="GSPO", color="#009E73")
@ratio_level("sequence")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0, lt=1.0)] = 3e-4,
    eps_high: Annotated[float, Range(ge=0.0)] = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    check_inputs(logp, old_logp, advantages, mask)
    adv = per_sequence(advantages, "gspo")  # (B,)  A_i
    s = seq_mean(log_ratio(logp, old_logp, mask), mask).exp()  # (B,)  s_i = exp(mean_t l_{i,t})
    # J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); a clipped sequence counts all its tokens
    obj, metrics = clipped_objective(s, adv, mask, eps_low, eps_high)  # (B,)
    return -obj.mean(), to_floats(metrics)
