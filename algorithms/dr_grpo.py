"""Dr. GRPO: GRPO Done Right (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

Differences from grpo:
1. advantage A_i = r_i - mean r, without division by the group's std (question-difficulty bias);
2. per-response token sums divided by one constant, the maximum generation length, instead of by |y_i|
   (response-length bias): J = (1/G) sum_i (1/L_max) sum_t obj_{i,t}. L_max = `norm_len`; 0 means the padded
   width T of the batch, which the loop sets to the maximum response length;
3. symmetric clip range 0.2 / 0.2 (the paper keeps PPO's default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import group_centered_advantages, to_floats
from algorithms.grpo import clipped_token_objective
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


@register("dr_grpo", label="Dr. GRPO", color="#332288", advantages=group_centered_advantages)
def dr_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0, lt=1.0)] = 0.2,
    eps_high: Annotated[float, Range(ge=0.0)] = 0.2,
    norm_len: Annotated[int, Range(ge=0)] = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    import torch

    obj, metrics = clipped_token_objective(logp, old_logp, advantages, mask, eps_low, eps_high)  # (B, T)
    const = float(norm_len or mask.shape[-1])
    loss = -(torch.where(mask.bool(), obj, 0.0).sum(-1) / const).mean()
    return loss, to_floats(metrics)
