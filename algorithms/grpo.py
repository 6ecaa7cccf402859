"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, arXiv 2402.03300), as run by the GSPO paper
(Zheng et al. 2025, arXiv 2507.18071, Eq. 2-3) for its MoE baseline.

The reference every other variant states its difference from:
1. token-level importance ratio w_{i,t} = pi_theta(y_{i,t}) / pi_old(y_{i,t});
2. PPO clipping per token, asymmetric range tuned by the paper for the MoE: eps_low 0.2, eps_high 0.27;
3. group-normalised advantage A_i = (r_i - mean r) / (std r + eps), shared by the tokens of y_i;
4. "seq-mean-token-mean" aggregation: mean over each response's tokens, then over responses;
5. free routing (no Routing Replay; see grpo_rr), no KL term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import clipped_objective, seq_mean, to_floats, token_ratio
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


def clipped_token_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO term min(w A, clip(w, 1-eps_low, 1+eps_high) A) (B, T) and its clip/ratio metrics."""
    w, adv = token_ratio(logp, old_logp, advantages, mask)  # (B, T)  w_{i,t}, A_{i,t}
    return clipped_objective(w, adv, mask, eps_low, eps_high)


@register("grpo", label="GRPO", color="#D55E00")
def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0, lt=1.0)] = 0.2,
    eps_high: Annotated[float, Range(ge=0.0)] = 0.27,
) -> tuple[torch.Tensor, dict[str, float]]:
    obj, metrics = clipped_token_objective(logp, old_logp, advantages, mask, eps_low, eps_high)  # (B, T)
    # J = (1/G) sum_i (1/|y_i|) sum_t obj_{i,t}
    loss = -seq_mean(obj, mask).mean()
    return loss, to_floats(metrics)
