"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv 2503.14476).

Differences from grpo:
1. clip-higher: eps_low 0.2, eps_high 0.28;
2. token-mean aggregation over the whole batch (long responses weigh more), not seq-mean-token-mean;
3. dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped and refilled by the loop;
4. soft overlong punishment added to the reward: 0 if L <= Lmax - Lcache, ((Lmax - Lcache) - L) / Lcache inside
   the cache, -1 beyond Lmax; Lcache = 0.2 Lmax (the paper's 4096 of 20480).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from algorithms.common import to_floats, token_mean
from algorithms.grpo import clipped_token_objective
from algorithms.registry import Range, register

if TYPE_CHECKING:
    import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_frac: float = 0.2) -> torch.Tensor:
    """DAPO's soft overlong punishment R_length(L) for response lengths (B,)."""
    import torch

    cache = cache_frac * max_len
    length = lengths.float()
    soft = ((max_len - cache) - length) / cache  # inside the cache: linear from 0 down to -1
    return torch.where(length <= max_len - cache, 0.0, torch.where(length <= max_len, soft, -1.0))


def shape_rewards(rewards: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Task reward plus the overlong penalty."""
    return rewards.float() + overlong_penalty(lengths, max_len)


@register("dapo", label="DAPO", color="#000000", dynamic_sampling=True, reward_shaping=shape_rewards)
def dapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Annotated[float, Range(ge=0.0, lt=1.0)] = 0.2,
    eps_high: Annotated[float, Range(ge=0.0)] = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    obj, metrics = clipped_token_objective(logp, old_logp, advantages, mask, eps_low, eps_high)  # (B, T)
    # J = sum_{i,t} obj_{i,t} / sum_i |y_i|
    return -token_mean(obj, mask), to_floats(metrics)
