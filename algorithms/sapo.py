"""SAPO: Soft Adaptive Policy Optimization (Qwen team, arXiv 2511.20347).

Differences from grpo:
1. no hard clip: each token's ratio goes through a smooth gate f(w) = sigmoid(tau (w - 1)) * 4 / tau, whose
   slope is 1 on-policy (w = 1) and decays smoothly off-policy instead of dropping to zero;
2. asymmetric temperatures: tau_pos = 1.0 for A > 0, tau_neg = 1.05 for A <= 0 (negative tokens damped faster).
Aggregation is grpo's seq-mean-token-mean. clip_frac is 0 (no hard clipping); `soft_gate_mean` is the mean gate
slope df/dw = 4 sigmoid (1 - sigmoid) over response tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import no_clip_metrics, seq_mean, to_floats, token_mean, token_ratio
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


@register("sapo", label="SAPO", color="#E69F00")
def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: Annotated[float, Range(gt=0.0)] = 1.0,
    tau_neg: Annotated[float, Range(gt=0.0)] = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    import torch

    w, adv = token_ratio(logp, old_logp, advantages, mask)  # (B, T)  w_{i,t}, A_{i,t}
    tau = torch.where(adv > 0, tau_pos, tau_neg)  # (B, T)
    gate = torch.sigmoid(tau * (w - 1.0))
    # f(w) = sigmoid(tau (w - 1)) * 4 / tau;  J = (1/G) sum_i (1/|y_i|) sum_t f(w_{i,t}) A_{i,t}
    loss = -seq_mean(gate * 4.0 / tau * adv, mask).mean()
    with torch.no_grad():
        slope = token_mean(4.0 * gate * (1.0 - gate), mask)
    return loss, to_floats({**no_clip_metrics(w, mask), "soft_gate_mean": slope})
