"""Declared comparisons: what a sweep file's `comparisons:` block stated before its runs (sweeps/schema.py
COMPARISON_FIELDS), checked against the runs that finished, sized by a power calculation, and read as declared.

`deviations` lists every way the finished runs differ from the declaration (an arm without runs, a seed missing or
extra, a seed with one arm, the metric not logged, no step-0 evaluation for a gain, a stratum value no run has): a
verdict read off runs that deviate is exploratory, and the report says which deviation. `sizing` is the power of the
declared test at the declaration's own numbers (analysis.stats.power: the noncentral t of the paired or two-sample t
test), what a confirmation sweep is sized with. `confirm` reads the declared comparison: the declared window of each
run, paired by seed (analysis.stats.design), a family of one.

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
from analysis.stats import curves, design, power
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
    alternative: str = "two-sided"
    alpha: float = 0.05
    role: str = "secondary"

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
            alternative=entry.get("alternative", "two-sided"),
            alpha=float(entry.get("alpha", 0.05)),
            role=entry.get("role", "secondary"),
        )


def declared(sweep: Mapping[str, Any]) -> list[Comparison]:
    """The comparisons a parsed and validated sweep file declares (none: [])."""
    return [Comparison.from_entry(e) for e in sweep.get("comparisons") or ()]


# --- power ------------------------------------------------------------------------------------------------------------
def sizing(c: Comparison) -> float:
    """The power the declaration's own numbers give (assumed_sd, threshold, seeds, alpha, alternative, pairing)."""
    fn = power.power_paired if c.pairing == "seed" else power.power_unpaired
    return fn(c.assumed_sd, abs(c.threshold), len(c.seeds), alpha=c.alpha, alternative=c.alternative)


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


@dataclass(frozen=True)
class Confirmation:
    """A declared comparison read as declared."""

    comparison: Comparison
    paired: design.Paired | None
    """The paired estimate (pairing = seed); None unpaired."""
    estimate: Any
    """The interval read (design.Paired.ci or a Welch intervals.CI)."""
    p_value: float
    deviations: tuple[str, ...]
    verdict: str
    """supported / contradicted / inconclusive (`read`: about the declared gap); "exploratory: ..." when the runs
    deviate from the declaration."""
    reading: str = ""
    """The verdict read off the interval and p-value (supported / contradicted / inconclusive), without the
    "exploratory" prefix that deviations add to `verdict`."""


def confirm(long: pd.DataFrame, c: Comparison, runs: pd.DataFrame | None = None) -> Confirmation:
    """The declared comparison on the runs: the window's value per run in the declared stratum, treatment minus
    control paired by seed (or Welch), tested at the declared alpha in the declared direction."""
    from analysis.stats import intervals

    devs = tuple(deviations(long, c, runs))
    per = _in_stratum(window_values(long, c), c)
    per = per[per[SEED].astype(int).isin(c.seeds)]
    arms = [(arm, per[_rows_where(per, c.axis, arm)]) for arm in (c.treatment, c.control)]  # treatment, control
    if c.pairing == "seed":
        paired = design.paired_difference(*(design.per_unit(rows, f"{c.axis} = {arm!r}") for arm, rows in arms))
        est, d = paired.ci, np.asarray(paired.differences)
        p = float(sps.ttest_1samp(d, 0.0, alternative=c.alternative).pvalue) if d.size > 1 else np.nan
    else:
        paired = None
        x, y = (rows["value"].to_numpy(np.float64) for _, rows in arms)
        est = intervals.mean_difference(x, y)
        test = sps.ttest_ind(x, y, equal_var=False, alternative=c.alternative)
        p = float(test.pvalue) if min(x.size, y.size) > 1 else np.nan
    reading = verdict = read(p, est, c)
    if devs:
        verdict = f"exploratory ({verdict}): the runs deviate from the declaration ({len(devs)} deviation(s))"
    return Confirmation(c, paired, est, float(p), devs, verdict, reading)


READING = (
    "supported: the test at the declared alpha rejects no difference, with the declared gap's sign; contradicted: the "
    "95% interval of treatment - control excludes the declared gap (the data rule out a gap as large as the one the "
    "comparison was sized to detect, an opposite difference included); inconclusive: neither"
)
"""How a declared comparison is read (`read`): about its declared gap, not about the claim it is filed under."""


def read(p: float, est: Any, c: Comparison) -> str:
    """supported / contradicted / inconclusive (READING) from the test's p-value and the interval `est`."""
    same_sign = c.alternative != "two-sided" or np.sign(est.estimate) == np.sign(c.threshold)
    if np.isfinite(p) and p < c.alpha and same_sign:
        return "supported"
    short = est.high < c.threshold if c.threshold > 0 else est.low > c.threshold
    if np.isfinite(est.low) and np.isfinite(est.high) and short:
        return "contradicted"
    return "inconclusive"


def hypothesis(c: Comparison) -> str:
    """The declared gap in words, e.g. "test_in_dist (gain) algorithm=grpo - algorithm=grpo_rr = +0.1"."""
    return f"{c.metric} ({c.window}) {c.axis}={c.treatment} - {c.axis}={c.control} = {c.threshold:+g}"


def family(confirmations: Sequence[Confirmation]) -> list[float]:
    """Holm-adjusted p-values of several declared comparisons read together (a sweep's primary is a family of one)."""
    return design.holm([c.p_value for c in confirmations]).tolist()


__all__ = [
    "Comparison",
    "Confirmation",
    "confirm",
    "declared",
    "deviations",
    "family",
    "hypothesis",
    "read",
    "sizing",
    "window_values",
]


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
