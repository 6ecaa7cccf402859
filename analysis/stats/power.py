"""Power: the smallest difference a study's seeds can detect (from the measured seed noise), and the power of a
declared comparison's test (from the SD its sizing assumes). Both read a contrast of group means at n seeds per group
through the same pieces: the t test's critical value (`_critical`) and the search for the fewest seeds
(`_fewest_seeds`).

The smallest detectable difference. A claim's quantity is a contrast of group means, d = sum_i w_i * mean_i (C5:
(GRPO recompute - GRPO rollout) - (GSPO recompute - GSPO rollout), weights +1 -1 -1 +1; the length part of C6: longest
minus shortest budget, +1 -1).
With s the pooled seed standard deviation of the groups' per-run values (df = runs - groups), the standard error of d
is SE = s * sqrt(sum_i w_i^2 / n_i), and the smallest difference detected with probability `power` by a two-sided test
at level `alpha` is

    MDD = (t_{1 - alpha/2, df} + t_{power, df}) * SE

(the textbook normal-approximation formula with Student t quantiles for few seeds). It answers "how large would the
effect have to be for these seeds to see it", which is what an inconclusive verdict must say; more seeds shrink it as
1 / sqrt(n). The verdicts themselves come from the t intervals (analysis.claims), not from this formula.

The power of a declared test (analysis.claims.declared sizes a confirmation sweep with it). Paired, a one-sample t test
on the n per-seed differences of SD sd: the noncentral t with n - 1 df and noncentrality gap sqrt(n) / sd; unpaired,
the two-sample test of n runs per arm: 2 (n - 1) df, noncentrality gap / (sd sqrt(2 / n)) (`t_power`;
`power_paired`, `power_unpaired`, and `seeds_for_power`, the fewest seeds reaching a target power; a one-sided test
of a declared size is the same with the gap measured from that size; an equivalence test's two one-sided tests,
`tost_power`). Not the same
calculation as the smallest detectable difference: that is the normal-approximation formula with t quantiles, this
the exact noncentral t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    mdd = float(_quantiles(df, alpha, power) * se)
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
    return _fewest_seeds(
        lambda n: _quantiles(len(weights) * (n - 1), alpha, power) * d.sd * np.sqrt(w2 / n) <= target, 9_999
    )


def _critical(df: float, alpha: float, alternative: str = "two-sided") -> float:
    """The t test's critical value at level `alpha`: t_{1 - alpha/2, df} two-sided, t_{1 - alpha, df} one-sided."""
    return sps.t.ppf(1 - (alpha / 2 if alternative == "two-sided" else alpha), df)


def _quantiles(df: float, alpha: float, power: float) -> float:
    """t_{1 - alpha/2, df} + t_{power, df}: the smallest detectable difference in standard errors."""
    return _critical(df, alpha) + sps.t.ppf(power, df)


def _fewest_seeds(reaches: Callable[[int], bool], max_seeds: int) -> int | None:
    """The fewest seeds n in 2..max_seeds for which `reaches(n)`; None when none does."""
    return next((n for n in range(2, max_seeds + 1) if reaches(n)), None)


def sentence(name: str, d: Detectable, needed: int | None = None) -> str:
    """The Evidence name of a detectable difference: what it is of, at which power, from which seed SD, and (when
    known) the seeds per group that would detect TARGET."""
    tail = f"; {TARGET:g} needs {needed} seeds" if needed is not None else ""
    return f"{PREFIX} |{name}| ({POWER:.0%} power, {ALPHA:g} two-sided; seed SD {d.sd:.3g}, df {d.df}{tail})"


# --- the power of a declared test -------------------------------------------------------------------------------------
def power_paired(sd: float, gap: float, seeds: int, *, alpha: float = ALPHA, alternative: str = "two-sided") -> float:
    """Power of the paired t test (n = `seeds` pairs, differences of SD `sd`) to detect a mean difference `gap`: the
    noncentral t distribution with n - 1 df and noncentrality gap sqrt(n) / sd."""
    if seeds < 2 or not sd > 0:
        return float("nan")
    return t_power(seeds - 1, gap * np.sqrt(seeds) / sd, alpha, alternative)


def power_unpaired(sd: float, gap: float, seeds: int, *, alpha: float = ALPHA, alternative: str = "two-sided") -> float:
    """Power of the two-sample t test (`seeds` runs per arm, each of SD `sd`): 2 (n - 1) df, noncentrality
    gap / (sd sqrt(2 / n))."""
    if seeds < 2 or not sd > 0:
        return float("nan")
    return t_power(2 * (seeds - 1), gap / (sd * np.sqrt(2.0 / seeds)), alpha, alternative)


def t_power(df: int, nc: float, alpha: float, alternative: str) -> float:
    """P(reject) of a t test with `df` degrees of freedom at level `alpha` under the noncentral t of noncentrality
    `nc`; where scipy's noncentral t returns NaN (large noncentrality, power ~ 1), the normal approximation with the
    same critical value."""
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative = {alternative!r}; valid: two-sided, greater, less")
    crit = _critical(df, alpha, alternative)
    upper = 0.0 if alternative == "less" else sps.nct.sf(crit, df, nc)
    lower = 0.0 if alternative == "greater" else sps.nct.cdf(-crit, df, nc)
    if not np.isfinite(upper):
        upper = sps.norm.sf(crit - nc)
    if not np.isfinite(lower):
        lower = sps.norm.cdf(-crit - nc)
    return float(min(1.0, upper + lower))


def tost_power(sd: float, margin: float, gap: float, seeds: int, *, alpha: float = ALPHA, paired: bool = True) -> float:
    """Power of the two one-sided tests (TOST, each at `alpha`) to show |mean difference| < `margin` when the true
    difference is `gap`: paired, n = `seeds` differences of SD `sd` (n - 1 df); unpaired, `seeds` runs per arm
    (2 (n - 1) df, SE sd sqrt(2 / n)). Exact: given the sample SD s, the test passes when the mean lies within
    margin - t_{1 - alpha} SE(s) of 0, a normal probability, integrated over s's chi distribution."""
    from scipy import integrate

    if seeds < 2 or not sd > 0 or not margin > 0:
        return float("nan")
    df = seeds - 1 if paired else 2 * (seeds - 1)
    se = sd * (np.sqrt(1.0 / seeds) if paired else np.sqrt(2.0 / seeds))
    crit = _critical(df, alpha, "greater")

    def given(u: float) -> float:  # u ~ chi2(df): the sample SE is se sqrt(u / df)
        half = margin - crit * se * np.sqrt(u / df)
        if half <= 0:
            return 0.0
        inside = sps.norm.cdf((half - gap) / se) - sps.norm.cdf((-half - gap) / se)
        return float(inside * sps.chi2.pdf(u, df))

    top = df * (margin / (crit * se)) ** 2  # beyond it the interval is wider than the margins
    return float(min(1.0, integrate.quad(given, 0.0, top, limit=200)[0]))


def seeds_for_power(
    sd: float,
    gap: float,
    *,
    power: float = POWER,
    alpha: float = ALPHA,
    alternative: str = "two-sided",
    paired: bool = True,
    max_seeds: int = 1000,
) -> int | None:
    """The fewest seeds (pairs, or runs per arm unpaired) whose test reaches `power` at `gap`; None beyond max_seeds."""
    fn = power_paired if paired else power_unpaired
    return _fewest_seeds(lambda n: fn(sd, gap, n, alpha=alpha, alternative=alternative) >= power, max_seeds)


__all__ = [
    "ALPHA",
    "POWER",
    "PREFIX",
    "TARGET",
    "Detectable",
    "detectable",
    "power_paired",
    "power_unpaired",
    "seeds_for_power",
    "seeds_needed",
    "sentence",
    "t_power",
    "tost_power",
]
