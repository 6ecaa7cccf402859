"""The confirmatory design's statistics: paired intervals by unit of replication, a family's multiplicity control,
the one "last 10% of compute" window, per-update vs cumulative routing volatility, and claims read in the paper's
units (C2's ratio beside the paper's, C6's length gain split into RL's part and truncation's).

Pairing. The arms of one seed share its prompts, cold start and evaluation sampling, so a seed's arms are not
independent samples: the difference of arm means over independent seeds (Welch) carries the seed-to-seed spread that
pairing removes. `paired_difference` takes one value per arm per unit (seed), the differences within each unit, and a
Student t interval over units (n - 1 df); the unit is named in the result. A unit that lacks an arm is dropped and
listed, never imputed.

A family. A study that reads m comparisons at 95% each excludes 0 somewhere by chance far more often than 5% of the
time. `holm` adjusts the family's p-values (Holm's step-down: the family-wise error at alpha, uniformly more
powerful than Bonferroni; statsmodels' multipletests), `simultaneous` widens each interval to 1 - alpha / m
(Bonferroni), so all m cover together with probability >= 1 - alpha. The confirmatory comparison a sweep declares
(analysis.claims.declared) is a family of one; everything else is exploratory and is read with these.

Libraries: rliable (Agarwal et al., NeurIPS 2021) for the interquartile mean and the probability of improvement, with
its stratified bootstrap run by scipy; scipy for the t quantiles and tests; statsmodels for Holm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from analysis.runs import vocab
from analysis.runs.columns import SEED
from analysis.stats import regime
from analysis.stats.intervals import CI, mean_band, mean_ci, mean_difference

UNIT = SEED
"""The unit of replication: the arms of one seed share prompts, cold start and evaluation sampling."""


# --- paired intervals -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Paired:
    """mean over units of (treatment - control) within each unit, with its t interval over units."""

    ci: CI
    unit: str
    """What a pair is (seed)."""
    units: tuple
    """The units paired, in order."""
    differences: tuple[float, ...]
    """treatment - control per unit."""
    sd: float
    """Standard deviation of the differences (NaN with fewer than two units)."""
    p_value: float
    """Two-sided paired t test of mean difference 0 (NaN with fewer than two units)."""
    unpaired: tuple = ()
    """Units that had one arm only: dropped, never imputed."""

    def __str__(self) -> str:
        return f"{self.ci} paired by {self.unit}"


def paired_difference(treatment: Mapping, control: Mapping, *, unit: str = UNIT, confidence: float = 0.95) -> Paired:
    """treatment[u] - control[u] for every unit u in both (NaN values dropped), with the Student t interval over units
    and the paired t test's p-value."""
    both = sorted(set(treatment) & set(control), key=str)
    pairs = [(u, float(treatment[u]) - float(control[u])) for u in both]
    pairs = [(u, d) for u, d in pairs if np.isfinite(d)]
    unpaired = tuple(sorted(set(treatment) ^ set(control), key=str))
    d = np.array([x for _, x in pairs], dtype=np.float64)
    ci = mean_ci(d, confidence=confidence)
    sd = float(d.std(ddof=1)) if d.size > 1 else np.nan
    p = float(sps.ttest_1samp(d, 0.0).pvalue) if d.size > 1 and sd > 0 else (np.nan if d.size < 2 else float(d[0] == 0))
    return Paired(ci, unit, tuple(u for u, _ in pairs), tuple(d.tolist()), sd, p, unpaired)


def paired_arms(
    per_run: pd.DataFrame,
    arm: str,
    treatment: object,
    control: object,
    *,
    unit: str = UNIT,
    value: str = "value",
    confidence: float = 0.95,
) -> Paired:
    """`paired_difference` of a per-run table (one row per run: `arm`, `unit`, `value`, e.g. stats.final_window's or
    gain.per_run's) between the rows whose `arm` is `treatment` and those whose `arm` is `control`. Raises when an arm
    has two runs of one unit (then the unit does not identify a pair)."""
    arms = [
        per_unit(per_run[per_run[arm].astype(object) == name], f"{arm} = {name!r}", unit=unit, value=value)
        for name in (treatment, control)
    ]
    return paired_difference(*arms, unit=unit, confidence=confidence)


def per_unit(rows: pd.DataFrame, what: str, *, unit: str = UNIT, value: str = "value") -> dict:
    """One arm's rows (`what` names the arm) as {unit: value}; raises when a unit has two runs (then the unit does
    not identify a pair)."""
    dup = rows[unit][rows[unit].duplicated()].tolist()
    if dup:
        raise ValueError(f"{what} has several runs of {unit} {dup}; pair within one stratum at a time")
    return dict(zip(rows[unit].tolist(), rows[value].astype(float).tolist(), strict=True))


# --- a family of comparisons ------------------------------------------------------------------------------------------
def holm(p_values: Sequence[float], *, alpha: float = 0.05) -> np.ndarray:
    """Holm-adjusted p-values of a family (statsmodels' multipletests, method "holm"); NaN stays NaN and is not
    counted in the family's size."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(p_values, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], alpha=alpha, method="holm")[1]
    return out


def simultaneous(
    samples: Sequence[Sequence[float] | np.ndarray], *, confidence: float = 0.95, family: int | None = None
) -> list[CI]:
    """Simultaneous intervals of a family of means (each family member: its paired differences over units): each a t
    interval at 1 - (1 - confidence) / m (Bonferroni), so all m cover their means together with probability at
    least `confidence`. m is `family` when given (the whole family's size, when `samples` are only some of its
    members: the paired rows of a family that also holds Welch rows), else the members of `samples` with two or more
    units. `CI.confidence` holds the per-interval level."""
    if not samples:
        return []
    width = max(len(np.asarray(x)) for x in samples)
    mat = np.full((width, len(samples)), np.nan)  # (units, family members)
    for j, x in enumerate(samples):
        mat[: len(np.asarray(x)), j] = np.asarray(x, dtype=np.float64)
    m = int((np.isfinite(mat).sum(axis=0) >= 2).sum()) if family is None else family
    level = 1 - (1 - confidence) / max(m, 1)
    mean, low, high, n = mean_band(mat, confidence=level)
    return [CI(float(e), float(lo), float(hi), int(k), level) for e, lo, hi, k in zip(mean, low, high, n, strict=True)]


def arm_gap(x: np.ndarray, y: np.ndarray, x_by_seed: Mapping | None, y_by_seed: Mapping | None) -> dict[str, Any]:
    """One gap of a family, arm x minus arm y: paired by seed (`paired_difference`) when both arms ran the same seeds
    (two or more, one run each: `x_by_seed` / `y_by_seed` not None), else Welch over their runs (`x`, `y`).

    Keys: estimate, low, high, n ("N seeds, paired" or "N vs M"), pairing, p (the paired or Welch t test), and the
    private `_diffs` (the paired differences) and `_xy` that `read_as_family` consumes."""
    paired = None
    if x_by_seed is not None and y_by_seed is not None and set(x_by_seed) == set(y_by_seed) and len(x_by_seed) >= 2:
        paired = paired_difference(x_by_seed, y_by_seed)
    if paired is not None and paired.ci.n >= 2:
        d, p, diffs = paired.ci, paired.p_value, paired.differences
        how, n = f"paired by {UNIT}", f"{paired.ci.n} seeds, paired"
    else:
        d, how = mean_difference(x, y), "unpaired (Welch)"
        xf, yf = x[np.isfinite(x)], y[np.isfinite(y)]
        p = float(sps.ttest_ind(xf, yf, equal_var=False).pvalue) if min(xf.size, yf.size) > 1 else np.nan
        diffs, n = (), f"{np.isfinite(x).sum()} vs {np.isfinite(y).sum()}"
    return {
        "estimate": d.estimate,
        "low": d.low,
        "high": d.high,
        "n": n,
        "pairing": how,
        "p": p,
        "_diffs": diffs,
        "_xy": (x, y),
    }


GAP_COLUMNS = (
    "estimate",
    "low",
    "high",
    "n",
    "pairing",
    "p",
    "p_holm",
    "simultaneous_low",
    "simultaneous_high",
    "family",
)
"""The columns an `arm_gap` row has after `read_as_family`, in a table's order."""
FAMILY = (
    "exploratory, family of {n}, Holm-adjusted (simultaneous intervals: Bonferroni, each at {level:.4g}%); unit of "
    "replication: {unit}"
)
"""The `family` column of a table of gaps read as one family (Figures 8 and 9): how the table is to be read."""


def read_as_family(rows: list[dict[str, Any]]) -> None:
    """`arm_gap` rows read together as one exploratory family: `p_holm` (`holm` over the rows with a p-value) and
    the simultaneous intervals (Bonferroni over the whole family of m rows with a p-value: `simultaneous` of the
    paired rows' differences and Welch's interval of the others, each at 1 - 0.05 / m); each row's `family` says so.
    In place; the private keys are dropped."""
    m = int(sum(np.isfinite(r["p"]) for r in rows))
    for r, adj in zip(rows, holm([r["p"] for r in rows]), strict=True):
        r["p_holm"] = float(adj)
    level = 1 - 0.05 / max(m, 1)
    paired = [r for r in rows if len(r["_diffs"]) >= 2]
    for r, ci in zip(paired, simultaneous([r["_diffs"] for r in paired], family=m), strict=True):
        r["simultaneous_low"], r["simultaneous_high"] = ci.low, ci.high
    for r in rows:
        x, y = r.pop("_xy")
        if "simultaneous_low" not in r:  # unpaired: Welch's interval at the family's per-interval level
            ci = mean_difference(x, y, confidence=level)
            r["simultaneous_low"], r["simultaneous_high"] = ci.low, ci.high
        r.pop("_diffs")
        r["family"] = FAMILY.format(
            n=m,
            level=100 * level,
            unit=f"{UNIT} (the arms of a seed share prompts, cold start and evaluation sampling)",
        )


# --- routing volatility: per update vs cumulative ---------------------------------------------------------------------
PAPER_PER_UPDATE = regime.PAPER_PER_UPDATE
PER_UPDATE = regime.PER_UPDATE


@dataclass(frozen=True)
class Volatility:
    """The routing volatility of a set of runs in the paper's unit (one update) and cumulative, and its regime."""

    per_update: CI
    """Mean over runs of each run's mean over steps of routing_slot_mismatch_mb2 (the change after one update)."""
    cumulative: CI
    """The same of routing_slot_mismatch: the change since pi_old averaged over minibatches 2..M."""
    threshold: float
    in_regime: bool
    """The per-update volatility reaches the threshold (the paper's regime is a change after one update)."""
    sentence: str


def volatility(long: pd.DataFrame, run_ids: Sequence[str] | None = None, *, threshold: float = 0.05) -> Volatility:
    """Per-update and cumulative routing volatility of `run_ids` (every run when None) and the regime verdict: in
    regime only when the per-update volatility reaches `threshold`; "not tested in regime: cumulative X%, per update
    Y%" when only the cumulative one does (many off-policy updates add up to what one update of the paper's model
    does), and when neither does."""
    one, cum = regime.over_runs(long, PER_UPDATE, run_ids), regime.over_runs(long, vocab.ROUTING_SLOT, run_ids)
    in_regime = bool(np.isfinite(one.estimate) and one.estimate >= threshold)
    numbers = f"cumulative {regime.percent(cum.estimate)}, per update {regime.percent(one.estimate)}"
    if in_regime:
        sentence = f"in regime: per update {regime.percent(one.estimate)} >= {regime.percent(threshold)} ({numbers})"
    elif not np.isfinite(one.estimate):
        sentence = f"not tested in regime: per-update volatility ({PER_UPDATE}) not measured; {numbers}"
    else:
        reach = " (only the cumulative reaches it)" if cum.estimate >= threshold else ""
        sentence = f"not tested in regime: {numbers}; threshold {regime.percent(threshold)} per update{reach}"
    return Volatility(one, cum, threshold, in_regime, sentence)


# --- claims in the paper's units --------------------------------------------------------------------------------------
PAPER_CLIP_RATIO = 100.0
"""C2: GSPO's clipped-token fraction over GRPO's in the paper, about two orders of magnitude (0.15 vs 0.0013 read off
its Figure 2: ~115x)."""


@dataclass(frozen=True)
class SizeReading:
    """A ratio read beside the paper's: the direction, and the size as a fraction of the paper's, with its interval."""

    ratio: CI
    paper: float
    direction_supported: bool | None
    """The interval lies above 1 (True), below 1 (False), or spans it (None)."""
    size_of_paper: float
    """log(ratio) / log(paper): 1 = the paper's size, 0.5 = half its orders of magnitude."""
    sentence: str
    size: CI | None = None
    """`size_of_paper` with the ratio's interval on the same scale (log(low) / log(paper), log(high) / log(paper):
    a monotone map of the ratio's interval, so it covers as often); None without a positive interval."""
    paper_outside: str = ""
    """"above" or "below" when the paper's ratio lies outside the ratio's interval, "" when inside or unknown."""


def size_against_paper(ratio: CI, paper: float = PAPER_CLIP_RATIO) -> SizeReading:
    """C2's reading: "direction supported, size X of the paper's (... log scale: size [low, high])" (the size on the
    log scale: orders of magnitude, its interval the ratio's interval on that scale), and whether the paper's ratio
    lies outside the ratio's interval (then the data rule out the paper's size)."""
    direction = None if not np.isfinite(ratio.low) else (True if ratio.low > 1 else False if ratio.high < 1 else None)
    size = float(np.log(ratio.estimate) / np.log(paper)) if ratio.estimate > 0 else np.nan
    band = None
    if np.isfinite(ratio.low) and np.isfinite(ratio.high) and ratio.low > 0:
        lo, hi = (float(np.log(x) / np.log(paper)) for x in (ratio.low, ratio.high))
        band = CI(size, lo, hi, ratio.n, ratio.confidence)
    outside = "" if band is None else "above" if paper > ratio.high else "below" if paper < ratio.low else ""
    ratio_text = f"{ratio.estimate:.3g}x [{ratio.low:.3g}, {ratio.high:.3g}] (n={ratio.n})"
    if direction is True:
        head = "direction supported"
    elif direction is False:
        head = "direction contradicted"
    else:
        head = "direction not decided"
    size_band = f": size [{band.low:.2g}, {band.high:.2g}]" if band is not None else ""
    sentence = (
        f"{head}, size {size:.2g} of the paper's (ratio {ratio_text} vs the paper's ~{paper:g}x, log scale{size_band})"
    )
    if band is not None:
        where = (
            f"the paper's ~{paper:g}x lies {outside} the interval: this study's ratio is not the paper's"
            if outside
            else f"the paper's ~{paper:g}x lies inside the interval"
        )
        sentence = f"{sentence}; {where}"
    return SizeReading(ratio, paper, direction, size, sentence, band, outside)


@dataclass(frozen=True)
class LengthDecomposition:
    """C6's length part, split: the final held-out difference between the longest and shortest budget = the
    cold start's difference (truncation: before any RL) + the difference of RL's gains."""

    short: object
    long: object
    final_difference: CI
    truncation_part: CI
    """cold start(long) - cold start(short): what the budget does to the same starting policy."""
    rl_part: CI
    """gain(long) - gain(short), gain = final - cold start per run: what RL did differently at the longer budget."""
    gains: dict = field(default_factory=dict)
    """RL's gain at each length (mean and t interval over seeds)."""
    pairing: str = "unpaired (Welch)"
    """How the differences were taken: "paired by seed" (within each seed, then over seeds) or "unpaired (Welch)"."""
    n: str = ""
    """The evidence's n: "4 seeds, paired" or "4 vs 4" (runs at the longest vs the shortest length)."""
    rl_differences: tuple[float, ...] = ()
    """Paired: RL's gain at the longest minus at the shortest length, per seed (what a power reading needs)."""


def length_decomposition(
    gains: pd.DataFrame, *, axis: str = vocab.LENGTH_AXIS, unit: str = UNIT
) -> LengthDecomposition:
    """From gain.per_run's table (start = cold start, final, value = final - start, one row per run, `axis` a
    column): RL's gain at each length and the split of the longest-minus-shortest final difference.

    The runs of one seed at different lengths share their prompts, cold start and evaluation sampling (every draw is
    a function of the seed, never of the length), so the design is paired like the arms of a seed: when the longest
    and the shortest length ran the same seeds (two or more, one run each), every difference is taken within a seed
    and then over seeds (`paired_difference`); otherwise Welch's over the runs."""
    from analysis.stats.intervals import mean_difference

    gains = gains.assign(**{axis: gains[axis].astype(float)})
    lengths = sorted(pd.unique(gains[axis]))
    if len(lengths) < 2:
        raise ValueError(f"{axis}: {len(lengths)} value(s) among the runs; the decomposition needs two lengths")
    lo, hi = lengths[0], lengths[-1]
    at = {x: gains[gains[axis] == x] for x in lengths}
    per_length = {x: mean_ci(at[x]["value"].to_numpy(np.float64)) for x in lengths}
    seeds = {x: at[x][unit].tolist() if unit in gains else [] for x in (lo, hi)}
    paired = (
        unit in gains
        and len(seeds[lo]) >= 2
        and set(seeds[lo]) == set(seeds[hi])
        and all(len(set(s)) == len(s) for s in seeds.values())
    )
    if paired:
        parts = {col: paired_arms(gains, axis, hi, lo, unit=unit, value=col) for col in ("final", "start", "value")}
        rl = parts["value"]
        return LengthDecomposition(
            short=lo,
            long=hi,
            final_difference=parts["final"].ci,
            truncation_part=parts["start"].ci,
            rl_part=rl.ci,
            gains=per_length,
            pairing=f"paired by {unit}",
            n=f"{rl.ci.n} {unit}s, paired",
            rl_differences=rl.differences,
        )
    return LengthDecomposition(
        short=lo,
        long=hi,
        final_difference=mean_difference(at[hi]["final"], at[lo]["final"]),
        truncation_part=mean_difference(at[hi]["start"], at[lo]["start"]),
        rl_part=mean_difference(at[hi]["value"], at[lo]["value"]),
        gains=per_length,
        n=f"{len(at[hi])} vs {len(at[lo])}",
    )


# --- aggregate metrics (rliable) --------------------------------------------------------------------------------------
def _stratified(
    stat, scores: Sequence[np.ndarray], *, reps: int, confidence: float, seed: int
) -> tuple[float, float, float]:
    """stat(*matrices) with a stratified percentile bootstrap: each matrix (runs, tasks) resampled over its runs within
    each task column, independently (rliable's StratifiedBootstrap, run here by scipy.stats.bootstrap with one sample
    per (matrix, task): rliable's own runner passes `random_state` to arch, which arch 8 no longer takes)."""
    mats = [np.atleast_2d(np.asarray(m, np.float64).T).T for m in scores]
    cols = [m[:, j] for m in mats for j in range(m.shape[1])]
    shape = [m.shape[1] for m in mats]

    def statistic(*samples: np.ndarray) -> float:
        out, i = [], 0
        for k in shape:
            out.append(np.column_stack(samples[i : i + k]))
            i += k
        return float(stat(*out))

    res = sps.bootstrap(
        cols,
        statistic,
        n_resamples=reps,
        confidence_level=confidence,
        method="percentile",
        vectorized=False,
        paired=False,
        rng=np.random.default_rng(seed),
    )
    return float(stat(*mats)), float(res.confidence_interval.low), float(res.confidence_interval.high)


def iqm_interval(
    scores: Mapping[str, np.ndarray], *, reps: int = 2000, confidence: float = 0.95, seed: int = 0
) -> dict[str, tuple[float, float, float]]:
    """Interquartile mean per algorithm (rliable.metrics.aggregate_iqm: the mean of the middle 50% of all run x task
    scores) with a stratified bootstrap interval; scores[alg] is (runs, tasks), a column per task or stratum.
    {alg: (iqm, low, high)}."""
    from rliable import metrics

    return {
        k: _stratified(metrics.aggregate_iqm, [v], reps=reps, confidence=confidence, seed=seed)
        for k, v in scores.items()
    }


def probability_of_improvement(
    x: np.ndarray, y: np.ndarray, *, reps: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """P(X > Y) (rliable.metrics.probability_of_improvement: the Mann-Whitney statistic per task, averaged over tasks)
    with its stratified bootstrap interval; x, y are (runs, tasks). (estimate, low, high)."""
    from rliable import metrics

    return _stratified(metrics.probability_of_improvement, [x, y], reps=reps, confidence=confidence, seed=seed)


IQM_COVERAGE = {3: 0.75, 4: 0.87, 5: 0.90, 6: 0.91, 8: 0.93, 10: 0.93}
"""How often the IQM's stratified percentile bootstrap at a nominal 95% covers on normal runs with one task, by runs
per task (4,000 simulated studies each; tests/analysis/test_design_coverage.py measures it at 4 runs with
`iqm_interval` itself). Short of 95% at every size here: with 4 runs, say, no resample's IQM leaves the runs' range,
which holds the mean 1 - 2 / 2^4 = 87.5% of the time. The table's note states it; no bootstrap over so few runs
reaches its label."""
ALGORITHM_TABLE_NOTE = (
    "Per algorithm, its runs pooled over the configurations of the other swept axes (tasks): the mean over runs with "
    "its 95% Student t interval; rliable's interquartile mean (the mean of the middle 50% of all run x task scores, "
    "robust to an outlying seed) and its probability of improvement P(algorithm > {ref}) (the Mann-Whitney "
    "statistic per task, averaged over tasks), each with a stratified percentile bootstrap over runs within each "
    "task ({reps} resamples) at a nominal 95%, which covers less with few runs: the IQM's, on normal runs with one "
    "task, "
    + ", ".join(f"{c:.0%} at {n} runs" for n, c in IQM_COVERAGE.items())
    + " (design.IQM_COVERAGE, measured by simulation); the t interval of the mean has its label. A task keeps the "
    "seeds every algorithm ran in it; exploratory (no declared comparison)."
)
"""The text under the report's algorithm table (format with ref, reps)."""


def algorithm_table(
    per_run: pd.DataFrame,
    tasks: Sequence[str],
    *,
    reference: str | None = None,
    reps: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """The report's algorithm table from a per-run table (one row per run: algorithm, `tasks` columns, seed, value, e.g.
    gain.per_run's): per algorithm, n runs (those in the score matrix), the mean with its t interval, the IQM and
    P(algorithm > `reference`) with their stratified bootstrap intervals. Tasks are the combinations of `tasks`
    values; a task keeps the seeds every algorithm has a finite value for in it (so each algorithm's score matrix is
    runs x tasks, rectangular); tasks with no such seed are left out; with one run per task the estimates have no
    interval (NaN). Columns: algorithm, n, mean, low, high, iqm, iqm_low, iqm_high, reference, p_improve, p_low,
    p_high, tasks."""
    from analysis.runs.columns import ALGORITHM

    df = per_run[np.isfinite(per_run["value"].astype(float))].copy()
    df[ALGORITHM] = df[ALGORITHM].astype(str)
    algs = list(dict.fromkeys(df[ALGORITHM]))
    cells = [df[c].astype(object).map(str) for c in tasks]  # a value a run lacks (NaN) is one value, "nan"
    key = pd.Series(["|".join(k) for k in zip(*cells, strict=True)], index=df.index) if tasks else "all"
    df["_task"] = key
    matrices: dict[str, list[np.ndarray]] = {a: [] for a in algs}
    for _, t in df.groupby("_task", sort=True):
        t = t.drop_duplicates([ALGORITHM, SEED])  # a seed identifies one run of an algorithm in a task
        seeds = set.intersection(*(set(t.loc[t[ALGORITHM] == a, SEED]) for a in algs))
        if not seeds:
            continue
        order = sorted(seeds, key=str)
        for a in algs:
            v = t[t[ALGORITHM] == a].drop_duplicates(SEED).set_index(SEED)["value"].astype(float)
            matrices[a].append(v.loc[order].to_numpy())
    cols = [
        "algorithm",
        "n",
        "mean",
        "low",
        "high",
        "iqm",
        "iqm_low",
        "iqm_high",
        "reference",
        "p_improve",
        "p_low",
        "p_high",
        "tasks",
    ]
    if not algs or not matrices[algs[0]]:
        return pd.DataFrame(columns=cols)
    n_tasks = len(matrices[algs[0]])
    width = min(len(m) for m in matrices[algs[0]])
    mats = {a: np.column_stack([m[:width] for m in ms]) for a, ms in matrices.items()}  # (runs, tasks)
    boot = width >= 2  # a bootstrap over runs needs two runs per task; with one, the estimates without interval
    if boot:
        iqm = iqm_interval(mats, reps=reps, seed=seed)
    else:
        from rliable import metrics

        iqm = {a: (float(metrics.aggregate_iqm(m)), np.nan, np.nan) for a, m in mats.items()}
    rows = []
    for a in algs:
        ci = mean_ci(mats[a].ravel())  # the same runs as the IQM's
        p = (np.nan, np.nan, np.nan)
        if reference is not None and reference in mats and a != reference:
            if boot:
                p = probability_of_improvement(mats[a], mats[reference], reps=reps, seed=seed)
            else:
                from rliable import metrics

                p = (float(metrics.probability_of_improvement(mats[a], mats[reference])), np.nan, np.nan)
        rows.append([a, ci.n, ci.estimate, ci.low, ci.high, *iqm[a], reference or "", *p, n_tasks])
    return pd.DataFrame(rows, columns=cols)


__all__ = [
    "ALGORITHM_TABLE_NOTE",
    "IQM_COVERAGE",
    "PAPER_CLIP_RATIO",
    "PAPER_PER_UPDATE",
    "PER_UPDATE",
    "UNIT",
    "LengthDecomposition",
    "Paired",
    "SizeReading",
    "Volatility",
    "algorithm_table",
    "holm",
    "iqm_interval",
    "length_decomposition",
    "paired_arms",
    "paired_difference",
    "per_unit",
    "probability_of_improvement",
    "simultaneous",
    "size_against_paper",
    "volatility",
]
