"""Tensor pieces shared by the variants: input checks, masked reductions, advantages and the metric vocabulary.

Shapes: B sequences (prompts x group size, laid out group by group), T response positions (padded; `mask` is 1 on
response tokens). Everything is computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a tensor is computed: the registry's metadata is read without loading torch
    import torch

# The metrics every loss returns (the fixed vocabulary; variants may add extras).
LOSS_METRICS: dict[str, str] = {
    "clip_frac": "fraction of response tokens whose clipped branch was active (zero gradient); a clipped "
    "sequence counts all its tokens; 0 for variants without hard clipping",
    "clip_frac_low": "the part of clip_frac with ratio < 1 - eps_low and A < 0",
    "clip_frac_high": "the part of clip_frac with ratio > 1 + eps_high and A > 0",
    "ratio_mean": "mean importance ratio the variant uses: per token (token-level variants) or per sequence "
    "(sequence-level variants)",
    "ratio_max": "max of that ratio",
    "ratio_min": "min of that ratio",
}


def check_inputs(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> None:
    """Shape checks with messages that name the argument."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be (B,) or (B, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}")


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """l_{i,t} = log pi_theta - log pi_old on response tokens, 0 on padding (B, T), fp32.

    `where` (not multiply) so that padding holding -inf or NaN cannot leak into values or gradients.
    """
    import torch

    return torch.where(mask.bool(), logp.float() - old_logp.float(), 0.0)


def token_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs checked, then (w_{i,t}, A_{i,t}), both (B, T) fp32: the token ratio pi_theta / pi_old and the
    advantages broadcast to the tokens."""
    check_inputs(logp, old_logp, advantages, mask)
    return log_ratio(logp, old_logp, mask).exp(), per_token(advantages, mask)


def lengths(mask: torch.Tensor) -> torch.Tensor:
    """|y_i| (B,), at least 1 so that empty responses contribute 0 instead of NaN."""
    return mask.float().sum(-1).clamp_min(1.0)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(1/|y_i|) sum_t x_{i,t} over response tokens (B,)."""
    import torch

    return torch.where(mask.bool(), x, 0.0).sum(-1) / lengths(mask)


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every response token of the batch (scalar)."""
    import torch

    return torch.where(mask.bool(), x, 0.0).sum() / mask.float().sum().clamp_min(1.0)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Advantages broadcast to (B, T), fp32."""
    adv = advantages.float()
    return adv if adv.dim() == 2 else adv[:, None].expand(mask.shape)


def per_sequence(advantages: torch.Tensor, name: str) -> torch.Tensor:
    """Advantages as (B,), for sequence-level variants; (B, T) is refused rather than silently averaged."""
    if advantages.dim() != 1:
        raise ValueError(
            f"{name} uses a sequence-level ratio and needs per-sequence advantages (B,), got "
            f"{tuple(advantages.shape)}; use a token-level variant (e.g. gspo_token) for per-token advantages"
        )
    return advantages.float()


def clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's term min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) of a per-token (B, T) or per-sequence (B,) ratio r,
    and its clip and ratio metrics."""
    import torch

    obj = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    with torch.no_grad():  # the clipped branch is active (zero gradient) exactly in these two cases
        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
    return obj, {**clip_metrics(low, high, mask), **ratio_metrics(ratio, mask)}


def clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-weighted active-clip fractions from boolean masks of clipped tokens (B, T) or sequences (B,): a clipped
    sequence counts all its tokens."""
    import torch

    with torch.no_grad():
        if low.dim() == 1:
            low, high = low[:, None].expand(mask.shape), high[:, None].expand(mask.shape)
        m = mask.bool()
        n = m.sum().clamp_min(1)
        lo = (low & m).sum() / n
        hi = (high & m).sum() / n
        return {"clip_frac": lo + hi, "clip_frac_low": lo, "clip_frac_high": hi}


def no_clip_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Clip fractions (0) and ratio metrics of a variant that never zeroes a gradient by clipping."""
    import torch

    with torch.no_grad():
        zero = torch.zeros((), device=mask.device)
        return {"clip_frac": zero, "clip_frac_low": zero, "clip_frac_high": zero, **ratio_metrics(ratio, mask)}


def ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean / max / min of a per-token ratio (B, T) over response tokens, or of a per-sequence ratio (B,) over the
    sequences with a token; 1.0 when there is none."""
    import torch

    with torch.no_grad():
        r = ratio.detach().float()[mask.bool() if ratio.dim() == 2 else mask.bool().any(-1)]
        if r.numel() == 0:
            one = torch.ones((), device=ratio.device)
            return {"ratio_mean": one, "ratio_max": one, "ratio_min": one}
        return {"ratio_mean": r.mean(), "ratio_max": r.max(), "ratio_min": r.min()}


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device sync for all metrics."""
    import torch

    keys = list(metrics)
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist()
    return dict(zip(keys, values, strict=True))


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_normalized_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_group r) / (std_group r + eps) (GRPO / GSPO), std with Bessel's correction as in TRL
    and verl; a zero-variance group gets all-zero advantages."""
    r = _groups(rewards, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).reshape(-1)


def group_centered_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean_group r (Dr. GRPO: no division by the group's std)."""
    r = _groups(rewards, group_size)
    return (r - r.mean(1, keepdim=True)).reshape(-1)
