"""Power of a claim's comparison from the measured seed noise: the smallest difference the study's seeds can detect.

A claim's quantity is a contrast of group means, d = sum_i w_i * mean_i (C5: (GRPO recompute - GRPO rollout) -
(GSPO recompute - GSPO rollout), weights +1 -1 -1 +1; the length part of C6: longest minus shortest budget, +1 -1).
With s the pooled seed standard deviation of the groups' per-run values (df = runs - groups), the standard error of d
is SE = s * sqrt(sum_i w_i^2 / n_i), and the smallest difference detected with probability `power` by a two-sided test
at level `alpha` is

    MDD = (t_{1 - alpha/2, df} + t_{power, df}) * SE

(the textbook normal-approximation formula with Student t quantiles for few seeds). It answers "how large would the
effect have to be for these seeds to see it", which is what an inconclusive verdict must say; more seeds shrink it as
1 / sqrt(n). The verdicts themselves come from the t intervals (scorecard.py), not from this formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

ALPHA = 0.05
"""Two-sided test level of the power calculation (the verdicts' 95% intervals)."""
POWER = 0.8
"""Probability of detecting a difference of the stated size."""
TARGET = 0.03
"""A reward difference worth detecting at laptop scale (the precision study's target): the Power table says how many
seeds per group would detect it at the measured seed noise."""
PREFIX = "smallest detectable"
"""Name prefix of the Evidence lines carrying a detectable difference (scorecard, report)."""


@dataclass(frozen=True)
class Detectable:
    """The smallest detectable |d| of a contrast and what it is computed from."""

    mdd: float
    """Smallest detectable |d| at POWER and ALPHA (NaN: too few runs for a seed SD)."""
    sd: float
    """Pooled seed standard deviation of the groups' per-run values."""
    se: float
    """Standard error of d."""
    df: int
    """Degrees of freedom of the pooled SD (runs - groups)."""


def detectable(
    groups: Sequence[np.ndarray], weights: Sequence[float], *, alpha: float = ALPHA, power: float = POWER
) -> Detectable:
    """The smallest detectable |sum_i w_i mean_i| from the groups' per-run values (NaNs dropped)."""
    gs = [np.asarray(g, np.float64)[np.isfinite(np.asarray(g, np.float64))] for g in groups]
    if len(gs) != len(weights):
        raise ValueError(f"{len(gs)} groups but {len(weights)} weights")
    if any(g.size == 0 for g in gs):
        return Detectable(np.nan, np.nan, np.nan, 0)
    df = int(sum(g.size - 1 for g in gs))
    if df < 1:
        return Detectable(np.nan, np.nan, np.nan, df)
    sd = float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in gs) / df))
    se = sd * float(np.sqrt(sum(w * w / g.size for w, g in zip(weights, gs, strict=True))))
    mdd = float((sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(power, df)) * se)
    return Detectable(mdd, sd, se, df)


def seeds_needed(
    groups: Sequence[np.ndarray], weights: Sequence[float], target: float, *, alpha: float = ALPHA, power: float = POWER
) -> int | None:
    """Seeds per group (equal groups) that bring the detectable |d| to `target` at the measured pooled seed SD;
    None when there is no SD (fewer than two runs in a group) or the target is not positive."""
    d = detectable(groups, weights, alpha=alpha, power=power)
    if not (np.isfinite(d.sd) and d.sd > 0 and target > 0):
        return None
    w2 = float(sum(w * w for w in weights))
    for n in range(2, 10_000):
        df = len(weights) * (n - 1)
        if (sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(power, df)) * d.sd * np.sqrt(w2 / n) <= target:
            return n
    return None


def sentence(name: str, d: Detectable, needed: int | None = None) -> str:
    """The Evidence name of a detectable difference: what it is of, at which power, from which seed SD, and (when
    known) the seeds per group that would detect TARGET."""
    tail = f"; {TARGET:g} needs {needed} seeds" if needed is not None else ""
    return f"{PREFIX} |{name}| ({POWER:.0%} power, {ALPHA:g} two-sided; seed SD {d.sd:.3g}, df {d.df}{tail})"


__all__ = ["ALPHA", "POWER", "PREFIX", "TARGET", "Detectable", "detectable", "seeds_needed", "sentence"]
