"""Declared comparisons: what a sweep file's `comparisons:` block stated before its runs (sweeps/schema.py
COMPARISON_FIELDS), checked against the runs that finished, sized by a power calculation, and read as declared.

`deviations` lists every way the finished runs differ from the declaration (an arm without runs, a seed missing or
extra, a seed with one arm, the metric not logged, no step-0 evaluation for a gain, a stratum value no run has): a
verdict read off runs that deviate is exploratory, and the report says which deviation. `sizing` is the power of the
declared test at the declaration's own numbers (analysis.stats.power), what a confirmation sweep is sized with.
`confirm` reads the declared comparison: the declared window of each run, treatment minus control paired by seed
(analysis.stats.design) or Welch, then the declared test (`read`).

The tests (TESTS; the sweep file's `test:`, chosen before the runs). Each tests one null hypothesis about
D = treatment - control with a t statistic, and its reading is named for what it tested (OUTCOMES):

- difference: H0 D = 0. Two-sided, the (1 - alpha) interval; one-sided (`alternative` greater or less), the
  one-sided (1 - alpha) bound. Supported: 0 excluded on the declared side (`threshold`'s sign: the gap the sweep was
  sized for, which the test does not test); contradicted (two-sided only): 0 excluded on the other side.
- minimum_effect: H0 D <= threshold (greater; less: D >= threshold). Supported: the one-sided (1 - alpha) bound lies
  beyond the threshold: at least the declared size.
- exclude: H0 D >= threshold (greater; less: D <= threshold). Contradicted (the declared gap): the one-sided
  (1 - alpha) bound lies short of the threshold: the declared size excluded.
- equivalence: H0 |D| >= threshold (the margin; TOST, two one-sided tests at alpha). Supported: the (1 - 2 alpha)
  interval lies within (-threshold, threshold), for claims of no effect (C4: GSPO needs no Routing Replay).

Anything else reads inconclusive, named for the test ("no difference detected", "the declared size not excluded").
Each rule's error at its boundary (D = 0 for difference, D = threshold for the others) is at most alpha; the tests
measure it by simulation at the confirmation sweep's n (tests/analysis/test_declared_rules.py). Several comparisons
read together for one claim are a family of m: each is read at alpha / m and its p-value multiplied by m
(Bonferroni), so the intervals and the p-values agree. Fewer than two seeds (paired) or runs per arm, or no spread at
all, is no interval and no reading (TOO_FEW), never a verdict.

An arm, a stratum: the rows whose axis holds the declared value (`_rows_where`), a number compared as a number (the
sweep file's 32 is the runs' 32.0).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from analysis.runs.columns import METRIC, RUN_ID, SEED, START_STEP, STEP, VALUE
from analysis.stats import curves, design, intervals, power
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, SUPPORTED
from runfiles.bounded import read_yaml


@dataclass(frozen=True)
class Comparison:
    """One declared comparison: a `comparisons:` entry (its fields: sweeps.schema.COMPARISON_FIELDS)."""

    name: str
    claim: str
    axis: str
    treatment: Any
    control: Any
    metric: str
    window: str
    threshold: float
    seeds: tuple[int, ...]
    power: float
    assumed_sd: float
    pairing: str
    stratum: dict[str, Any] = field(default_factory=dict)
    test: str = "difference"
    """What the comparison tests (TESTS); the sweep file's `test:`, required there."""
    alternative: str = "two-sided"
    alpha: float = 0.05
    role: str = "secondary"
    assumed_gap: float | None = None
    """The true D the sizing assumes (`sizing`); None: the threshold (difference) or 0 (exclude, equivalence)."""

    def __post_init__(self) -> None:
        """The numbers a reading depends on, refused when they cannot be read (a sweep file the analysis is handed
        need not have passed sweeps.schema's checks): finite, alpha in (0, 1), a nonzero threshold on the side its
        one-sided alternative names."""
        for name in ("threshold", "alpha", "power", "assumed_sd", "assumed_gap"):
            v = getattr(self, name)
            if v is not None and not np.isfinite(v):
                raise ValueError(f"{self.name}: {name} = {v!r}; valid: a finite number")
        if not 0 < self.alpha < 1 or self.threshold == 0:
            raise ValueError(
                f"{self.name}: alpha = {self.alpha!r}, threshold = {self.threshold!r}; valid: 0 < alpha < 1, "
                "threshold != 0"
            )
        if (self.alternative == "greater") != (self.threshold > 0) and self.alternative != "two-sided":
            raise ValueError(
                f"{self.name}: threshold = {self.threshold!r} with alternative = {self.alternative!r}; valid: greater "
                "with threshold > 0, less with threshold < 0"
            )

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Comparison:
        arms = entry["arms"]
        return cls(
            name=entry["name"],
            claim=entry["claim"],
            axis=arms["axis"],
            treatment=arms["treatment"],
            control=arms["control"],
            metric=entry["metric"],
            window=entry["window"],
            threshold=float(entry["threshold"]),
            seeds=tuple(int(s) for s in entry["seeds"]),
            power=float(entry["power"]),
            assumed_sd=float(entry["assumed_sd"]),
            pairing=entry["pairing"],
            stratum=dict(entry.get("stratum") or {}),
            test=_known(entry.get("test"), TESTS, "test"),  # required: what the comparison tests
            alternative=_known(entry.get("alternative", "two-sided"), ALTERNATIVES, "alternative"),
            alpha=float(entry.get("alpha", 0.05)),
            role=entry.get("role", "secondary"),
            assumed_gap=None if entry.get("assumed_gap") is None else float(entry["assumed_gap"]),
        )


TESTS = ("difference", "minimum_effect", "exclude", "equivalence")
"""What a declared comparison may test (the module docstring; sweeps.schema checks the declaration against it)."""
ALTERNATIVES = ("two-sided", "greater", "less")


def _known(value: Any, valid: Sequence[str], what: str) -> str:
    if value not in valid:
        raise ValueError(f"{what} = {value!r}; valid: {', '.join(valid)}")
    return str(value)


def declared(sweep: Mapping[str, Any]) -> list[Comparison]:
    """The comparisons a parsed and validated sweep file declares (none: [])."""
    return [Comparison.from_entry(e) for e in sweep.get("comparisons") or ()]


# --- power ------------------------------------------------------------------------------------------------------------
def sizing(c: Comparison) -> float:
    """The power of the declared test at the declaration's own numbers (assumed_sd, seeds, alpha, pairing) when the
    true D is `assumed_gap`: difference, the t test of 0 (at the threshold by default); minimum_effect and exclude,
    the one-sided t test of the threshold (exclude at D = 0 by default); equivalence, TOST (`power.tost_power`, at
    D = 0 by default)."""
    paired, n, sd = c.pairing == "seed", len(c.seeds), c.assumed_sd
    if c.test == "equivalence":
        gap = 0.0 if c.assumed_gap is None else c.assumed_gap
        return power.tost_power(sd, abs(c.threshold), gap, n, alpha=c.alpha, paired=paired)
    fn = power.power_paired if paired else power.power_unpaired
    if c.test == "difference":
        gap = c.threshold if c.assumed_gap is None else c.assumed_gap
        if c.alternative == "two-sided":
            return fn(sd, abs(gap), n, alpha=c.alpha)
        return fn(sd, gap if c.alternative == "greater" else -gap, n, alpha=c.alpha, alternative="greater")
    sign = 1.0 if c.alternative == "greater" else -1.0
    gap = (0.0 if c.test == "exclude" else np.nan) if c.assumed_gap is None else c.assumed_gap
    beyond = sign * (gap - c.threshold) if c.test == "minimum_effect" else sign * (c.threshold - gap)
    return fn(sd, beyond, n, alpha=c.alpha, alternative="greater")


# --- the runs against the declaration --------------------------------------------------------------------------------
def _run_table(long: pd.DataFrame, runs: pd.DataFrame | None) -> pd.DataFrame:
    """One row per run of the long table: run_id, seed and every other column constant within a run; runs whose
    state is failed are left out."""
    keep = [c for c in long.columns if c not in (STEP, "compute_flops", "wall_s", METRIC, VALUE)]
    table = long[keep].drop_duplicates(RUN_ID).reset_index(drop=True)
    for c in table.columns:
        if isinstance(table[c].dtype, pd.CategoricalDtype):
            table[c] = table[c].astype(object)
    if runs is not None and "state" in runs:
        failed = set(runs.loc[runs["state"].astype(str) == "failed", RUN_ID].astype(str))
        table = table[~table[RUN_ID].astype(str).isin(failed)]
    return table


def _rows_where(table: pd.DataFrame, axis: str, value: Any) -> np.ndarray:
    """Which rows of `table` have `value` on `axis` (as declared: equal, or equal as numbers)."""
    return table[axis].map(lambda v: _same(v, value)).to_numpy(dtype=bool)


def _in_stratum(table: pd.DataFrame, c: Comparison) -> pd.DataFrame:
    """The rows of `table` in the declared stratum (a stratum axis `table` lacks raises KeyError)."""
    mask = np.ones(len(table), dtype=bool)
    for axis, value in c.stratum.items():
        mask &= _rows_where(table, axis, value)
    return table[mask]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (float(a) == float(b))
    except (TypeError, ValueError):
        return False


FINISHED = ("completed", "collapsed")
"""The run states whose window is the declared one: the run reached its last step, or stopped there by collapsing."""


def deviations(long: pd.DataFrame, c: Comparison, runs: pd.DataFrame | None = None) -> list[str]:
    """Every way the usable (not failed) runs of `long` differ from the declared comparison `c`; [] when they match.
    Each line names what was declared and what the runs have."""
    out: list[str] = []
    table = _run_table(long, runs)
    for axis in (c.axis, *c.stratum):
        if axis not in table:
            out.append(f"{c.name}: axis {axis!r} is not among the runs' columns ({', '.join(map(str, table.columns))})")
    if out:
        return out
    for axis, value in c.stratum.items():
        if not _rows_where(table, axis, value).any():
            have = sorted(map(str, pd.unique(table[axis])))
            out.append(f"{c.name}: stratum {axis} = {value!r}: no run has it (the runs have {', '.join(have)})")
    table = _in_stratum(table, c)
    metrics = set(map(str, pd.unique(long[METRIC])))
    if c.metric not in metrics:
        out.append(f"{c.name}: metric {c.metric!r} not logged by any run")
    seeds_by_arm = {}
    for side, arm in (("treatment", c.treatment), ("control", c.control)):
        rows = table[_rows_where(table, c.axis, arm)]
        if rows.empty:
            out.append(f"{c.name}: {side} arm {c.axis} = {arm!r}: no usable run")
            continue
        seeds = sorted(int(s) for s in rows[SEED])
        seeds_by_arm[side] = set(seeds)
        missing, extra = sorted(set(c.seeds) - set(seeds)), sorted(set(seeds) - set(c.seeds))
        dup = sorted({s for s in seeds if seeds.count(s) > 1})
        if missing:
            out.append(f"{c.name}: {side} arm {arm!r}: declared seed(s) {missing} have no usable run")
        if extra:
            out.append(f"{c.name}: {side} arm {arm!r}: seed(s) {extra} were not declared")
        if dup:
            out.append(f"{c.name}: {side} arm {arm!r}: several runs of seed(s) {dup} in the stratum")
        if c.metric in metrics:
            ids = set(rows[RUN_ID].astype(str))
            got = long[(long[METRIC].astype(str) == c.metric) & long[RUN_ID].astype(str).isin(ids)]
            got = got[np.isfinite(got[VALUE].to_numpy(np.float64))]
            without = sorted(ids - set(got[RUN_ID].astype(str)))
            if without:
                out.append(f"{c.name}: {side} arm {arm!r}: run(s) {without} logged no {c.metric}")
            if c.window == "gain":
                started = set(got.loc[got[STEP] == START_STEP, RUN_ID].astype(str))
                if ids - started - set(without):
                    out.append(
                        f"{c.name}: {side} arm {arm!r}: window 'gain' needs a step-0 {c.metric}; run(s) "
                        f"{sorted(ids - started - set(without))} have none"
                    )
            if c.window in ("gain", "final_eval"):
                later = set(got.loc[got[STEP] > START_STEP, RUN_ID].astype(str))
                if ids - later - set(without):
                    out.append(
                        f"{c.name}: {side} arm {arm!r}: window {c.window!r} reads a {c.metric} after step 0; run(s) "
                        f"{sorted(ids - later - set(without))} have none"
                    )
        if runs is not None and "state" in runs:
            state = dict(zip(runs[RUN_ID].astype(str), runs["state"].astype(str), strict=True))
            unfinished = [
                f"{r} ({state.get(r, 'unknown')})"
                for r in sorted(rows[RUN_ID].astype(str))
                if state.get(r) not in FINISHED
            ]
            if unfinished:
                out.append(
                    f"{c.name}: {side} arm {arm!r}: run(s) {', '.join(unfinished)} did not finish: read before their "
                    "last step (resume them: the workflow's next invocation does)"
                )
    if c.pairing == "seed" and len(seeds_by_arm) == 2:
        alone = sorted(seeds_by_arm["treatment"] ^ seeds_by_arm["control"])
        if alone:
            out.append(f"{c.name}: paired by seed, but seed(s) {alone} have one arm only")
    return out


def window_values(long: pd.DataFrame, c: Comparison) -> pd.DataFrame:
    """Per run: the declared window of the declared metric (columns as analysis.stats.gain.per_run /
    curves.compute_window: the run's axes, seed, value)."""
    from analysis.stats import gain

    if c.window == "gain":
        return gain.per_run(long, c.metric)
    if c.window == "last_10pct_compute":
        return curves.compute_window(long, c.metric)
    per = gain.per_run(long, c.metric)  # final_eval: the run's last evaluation after its start
    return per.assign(value=per["final"])


def run_ids(long: pd.DataFrame, c: Comparison, runs: pd.DataFrame | None = None) -> list[str]:
    """The usable (not failed) runs the comparison reads: both arms, in the declared stratum, of the declared seeds
    (what a claim's precondition is measured on)."""
    table = _run_table(long, runs)
    if any(axis not in table for axis in (c.axis, *c.stratum)):
        return []
    table = _in_stratum(table, c)
    arms = _rows_where(table, c.axis, c.treatment) | _rows_where(table, c.axis, c.control)
    table = table[arms & table[SEED].astype(int).isin(c.seeds).to_numpy()]
    return table[RUN_ID].astype(str).tolist()


# --- the declared test ------------------------------------------------------------------------------------------------
OUTCOMES = {
    ("difference", SUPPORTED): "difference detected, with the declared sign",
    ("difference", CONTRADICTED): "difference detected, opposite to the declared sign",
    ("difference", INCONCLUSIVE): "no difference detected",
    ("minimum_effect", SUPPORTED): "at least the declared size",
    ("minimum_effect", INCONCLUSIVE): "the declared size not shown",
    ("exclude", CONTRADICTED): "the declared size excluded",
    ("exclude", INCONCLUSIVE): "the declared size not excluded",
    ("equivalence", SUPPORTED): "equivalent within the declared margin",
    ("equivalence", INCONCLUSIVE): "equivalence not shown",
}
"""Each test's readings, named for what it tested, and the verdict each gives the declared statement."""
TOO_FEW = "no reading: too few seeds for an interval"
"""Fewer than two paired seeds (or runs in an arm, unpaired), or differences without any spread: no test."""
NO_SPREAD = 1e-9
"""A standard error below this fraction of |estimate| + 1e-3 is the rounding of equal values, not a spread."""
READING = (
    "difference: supported when the test of no difference rejects with the declared sign, contradicted when it "
    "rejects with the other sign (two-sided only); minimum_effect: supported when the one-sided bound lies beyond the "
    "declared size; exclude: contradicted (the declared gap) when the one-sided bound lies short of it; equivalence: "
    "supported when the (1 - 2 alpha) interval lies within the declared margin (TOST); otherwise inconclusive, named "
    "for the test; fewer than two seeds per arm: no reading"
)
"""How a declared comparison is read (`read`): about the hypothesis its test names, not the claim it is filed under."""


@dataclass(frozen=True)
class Reading:
    """A declared test's outcome."""

    outcome: str
    """The reading named for what the test tested (OUTCOMES, or TOO_FEW)."""
    verdict: str
    """supported / contradicted / inconclusive: what the outcome says of the declared statement."""
    interval: Any
    """The interval the test was read from (an intervals.CI at `interval.confidence`; a one-sided bound's other end
    is infinite)."""
    p_value: float
    """The test's p-value, multiplied by the family's size (Bonferroni; NaN without a test)."""
    level: float
    """The per-comparison level the test was read at: the declared alpha over the family's size."""


def decide(
    test: str, alternative: str, threshold: float, level: float, estimate: Any, se: Any, df: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The declared test at `level` on t statistics (numbers or arrays): (supported, contradicted, low, high, p).
    low / high are the interval the test reads (module docstring), p the test's p-value. The one rule the report
    applies and the simulations of the tests measure."""
    est, se, df = (np.asarray(x, np.float64) for x in (estimate, se, df))
    one, two = sps.t.ppf(1 - level, df), sps.t.ppf(1 - level / 2, df)
    sign = -1.0 if alternative == "less" or (alternative == "two-sided" and threshold < 0) else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        if test == "difference" and alternative == "two-sided":
            low, high = est - two * se, est + two * se
            p = 2 * sps.t.sf(np.abs(est) / se, df)
            toward = np.where(sign > 0, low > 0, high < 0)
            return toward, np.where(sign > 0, high < 0, low > 0), low, high, p
        if test == "equivalence":
            m = abs(threshold)
            low, high = est - one * se, est + one * se
            p = np.maximum(sps.t.sf((est + m) / se, df), sps.t.cdf((est - m) / se, df))
            no = np.zeros(est.shape, bool)
            return (low > -m) & (high < m), no, low, high, p
        # one-sided: the bound on the declared side (difference, minimum_effect) or the other (exclude)
        null = 0.0 if test == "difference" else threshold
        toward = sign * (est - null) / se  # t toward the declared side
        lower_bound = (test == "exclude") == (sign < 0)  # the bound read is the lower one
        bound = est - one * se if lower_bound else est + one * se
        inf = np.full(est.shape, np.inf)
        low, high = (bound, inf) if lower_bound else (-inf, bound)
        no = np.zeros(est.shape, bool)
        if test == "exclude":
            return no, np.where(sign > 0, high < null, low > null), low, high, sps.t.cdf(toward, df)
        return np.where(sign > 0, low > null, high < null), no, low, high, sps.t.sf(toward, df)


def read(spread: intervals.Spread, c: Comparison, *, family: int = 1) -> Reading:
    """The declared test of `c` on `spread` (treatment - control with its SE and df), read at alpha / `family`."""
    level = c.alpha / family
    confidence = 1 - 2 * level if c.test == "equivalence" else 1 - level  # one-sided bounds: one-sided level
    spread_at_all = np.isfinite(spread.se) and spread.se > NO_SPREAD * (abs(spread.estimate) + 1e-3)
    if not (spread.n >= 2 and spread_at_all and np.isfinite(spread.df)):
        nan = intervals.CI(spread.estimate, np.nan, np.nan, spread.n, confidence)
        return Reading(TOO_FEW, INCONCLUSIVE, nan, np.nan, level)
    supported, contradicted, low, high, p = decide(
        c.test, c.alternative, c.threshold, level, spread.estimate, spread.se, spread.df
    )
    verdict = SUPPORTED if supported else CONTRADICTED if contradicted else INCONCLUSIVE
    ci = intervals.CI(spread.estimate, float(low), float(high), spread.n, confidence)
    return Reading(OUTCOMES[(c.test, verdict)], verdict, ci, float(min(1.0, family * float(p))), level)


@dataclass(frozen=True)
class Confirmation:
    """A declared comparison read as declared."""

    comparison: Comparison
    paired: design.Paired | None
    """The paired estimate (pairing = seed); None unpaired."""
    spread: intervals.Spread
    """treatment - control with its SE and df (paired: over seeds; unpaired: Welch)."""
    reading: Reading
    """The declared test read as a family of one (`read`)."""
    deviations: tuple[str, ...]

    @property
    def verdict(self) -> str:
        """The reading's verdict; "exploratory (...)" when the runs deviate from the declaration."""
        v = self.reading.verdict
        if self.deviations:
            return f"exploratory ({v}): the runs deviate from the declaration ({len(self.deviations)} deviation(s))"
        return v


def confirm(long: pd.DataFrame, c: Comparison, runs: pd.DataFrame | None = None) -> Confirmation:
    """The declared comparison on the runs: the window's value per run in the declared stratum, treatment minus
    control paired by seed (or Welch), tested as declared (`read`)."""
    devs = tuple(deviations(long, c, runs))
    per = _in_stratum(window_values(long, c), c)
    per = per[per[SEED].astype(int).isin(c.seeds)]
    arms = [(arm, per[_rows_where(per, c.axis, arm)]) for arm in (c.treatment, c.control)]  # treatment, control
    if c.pairing == "seed":
        paired = design.paired_difference(*(design.per_unit(rows, f"{c.axis} = {arm!r}") for arm, rows in arms))
        spread = intervals.mean_spread(np.asarray(paired.differences))
    else:
        paired = None
        spread = intervals.contrast_spread([rows["value"].to_numpy(np.float64) for _, rows in arms], (1.0, -1.0))
    return Confirmation(c, paired, spread, read(spread, c), devs)


def read_at(c: Comparison) -> tuple[float, ...]:
    """The values the declared test reads its interval against: 0 for a difference, the declared size for a minimum
    effect or an exclusion, -margin and +margin for an equivalence."""
    if c.test == "difference":
        return (0.0,)
    return (-abs(c.threshold), abs(c.threshold)) if c.test == "equivalence" else (c.threshold,)


def hypothesis(c: Comparison) -> str:
    """What the declared test tests, in words, e.g. "test_in_dist (gain) algorithm=grpo - algorithm=grpo_rr differs
    from 0 (two-sided; sized for +0.1)"."""
    d = f"{c.metric} ({c.window}) {c.axis}={c.treatment} - {c.axis}={c.control}"
    at_least = ">=" if c.alternative == "greater" else "<="
    return {
        "difference": f"{d} differs from 0 ({c.alternative}; sized for {c.threshold:+g})",
        "minimum_effect": f"{d} {at_least} {c.threshold:+g} (at least the declared size)",
        "exclude": f"{d} {at_least} {c.threshold:+g}, tested for exclusion",
        "equivalence": f"|{d}| < {abs(c.threshold):g} (equivalence margin, TOST)",
    }[c.test]


def from_sweep(sweep: str | os.PathLike[str]) -> list[Any]:
    """The comparisons sweep file `sweep` declares (`comparisons:`, as `Comparison`s; none: []). A file
    that cannot be read, or an entry without a field the declaration needs, raises ValueError naming it."""
    import yaml

    try:
        data = read_yaml(Path(sweep))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"sweep file {sweep}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        return []
    out = []
    for i, entry in enumerate(data.get("comparisons") or ()):
        try:
            out.append(Comparison.from_entry(entry))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"sweep file {sweep}: comparisons[{i}]: {type(exc).__name__} {exc}; the fields are "
                "sweeps.schema.COMPARISON_FIELDS"
            ) from exc
    return out


__all__ = [
    "OUTCOMES",
    "READING",
    "TESTS",
    "TOO_FEW",
    "Comparison",
    "Confirmation",
    "Reading",
    "confirm",
    "decide",
    "declared",
    "deviations",
    "from_sweep",
    "hypothesis",
    "read",
    "read_at",
    "run_ids",
    "sizing",
    "window_values",
]
