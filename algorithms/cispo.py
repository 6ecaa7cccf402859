"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585).

Differences from grpo:
1. the importance weight is clipped and *detached*, never the update: loss = -mean_tokens sg(min(w_{i,t}, eps_max))
   A_i log pi_theta(y_{i,t}), so every token keeps a gradient (rare high-ratio "fork" tokens are not dropped);
2. no lower bound on the weight; eps_max 4..8 in the literature, 5 here;
3. token-mean aggregation over the batch (as DAPO).
No gradient is ever zeroed, so clip_frac is 0 by the metric's definition; `is_trunc_frac` is the fraction of tokens
whose weight was truncated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import no_clip_metrics, to_floats, token_mean, token_ratio
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


@register("cispo", label="CISPO", color="#56B4E9")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_max: Annotated[float, Range(gt=0.0)] = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    import torch

    w, adv = token_ratio(logp, old_logp, advantages, mask)  # (B, T)  w_{i,t}, A_{i,t}
    # J = mean_tokens sg(min(w, eps_max)) A log pi_theta
    obj = w.clamp(max=eps_max).detach() * adv * torch.where(mask.bool(), logp.float(), 0.0)
    with torch.no_grad():
        trunc = token_mean((w > eps_max).float(), mask)
    return -token_mean(obj, mask), to_floats({**no_clip_metrics(w, mask), "is_trunc_frac": trunc})
