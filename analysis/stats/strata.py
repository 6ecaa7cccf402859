"""Stratification of a claim's comparison: the strata of the other swept axes, a verdict per stratum, one combined.

Runs that differ in another swept axis (dtype, generation length, ...) are never pooled into one sample. A claim's
comparison is made within every stratum = combination of the swept axes other than the claim's own axis (seeds are
the samples, never a stratum), and the per-stratum verdicts are combined by STRATA_RULE: contradicted if any stratum
with data is contradicted, supported if every stratum with data is supported, else inconclusive. A stratum "has data"
when every compared group has a usable run in it. Two kinds of swept axes are not stratified, and the rule text names
them: axes whose values the compared groups do not share (e.g. a per-algorithm `hparams.*`: no stratum could hold
both groups, so each group is pooled over its own values), and axes fully determined by the stratified ones
(rollout_precision given train_precision where it is `same`). With several strata, each stratum's evidence is listed
with its own verdict, plus the pooled estimate for reference (not used in the verdict).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs.natural import natural_keys
from analysis.runs.tidy import Study
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, NO_DATA, NOT_IN_REGIME, SUPPORTED, Evidence, conjunction

UNUSABLE_STATES = ("failed", "unknown")
"""Run states that carry no evidence: failed (infrastructure) and unknown (no readable status.json)."""
STRATA_RULE = (
    "contradicted if the comparison is contradicted in any stratum with data in the claim's regime; supported if it "
    "is supported in every such stratum; not tested in regime if no stratum with data reached the regime; otherwise "
    "inconclusive (also when no stratum has data)"
)
"""How per-stratum verdicts combine into the claim's verdict (quoted in every stratified rule)."""


def usable(runs: pd.DataFrame) -> pd.Series:
    """Boolean mask over `runs` (a Study.runs table): the runs that carry evidence (not in UNUSABLE_STATES)."""
    return ~runs["state"].isin(list(UNUSABLE_STATES))


@dataclass
class Stratum:
    """One stratum of a claim: its axis values, its verdict (or NO_DATA) and its evidence."""

    key: dict[str, Any]
    verdict: str
    evidence: list[Evidence] = field(default_factory=list)
    part: str = ""
    """For claims with several parts (C6): which part this stratum belongs to."""

    @property
    def label(self) -> str:
        key = ", ".join(f"{k}={v}" for k, v in self.key.items()) or "all runs"
        return f"{self.part}: {key}" if self.part else key


@dataclass
class Stratification:
    """How a claim's runs are split: the stratified axes, the swept axes left pooled (and why), the strata."""

    axes: list[str]
    """Axes stratified on."""
    unshared: list[str]
    """Swept axes whose values the compared groups do not share (pooled within each group)."""
    determined: list[str]
    """Swept axes fully determined by the stratified ones (adding them splits nothing)."""
    strata: list[tuple[dict[str, Any], pd.Series]]
    """(axis values, boolean mask over study.runs) per stratum; one ({}, all True) when nothing is stratified."""

    def text(self, own: Sequence[str] = ()) -> str:
        """The sentence appended to a claim's rule."""
        if not self.axes and not self.unshared:
            out = " No other swept axis varies among the compared runs: one comparison over all of them."
        elif not self.axes:
            out = " Nothing to stratify on: one comparison over all the compared runs."
        else:
            out = (
                f" Stratified: the comparison is made separately in each of the {len(self.strata)} combinations of "
                f"{', '.join(self.axes)} (seeds are the samples); combined verdict: {STRATA_RULE}. Each stratum is "
                "decided at 95%, so with many strata a spurious contradiction somewhere is likelier; the per-stratum "
                "evidence is listed so another rule can be applied."
            )
        if own:
            out += f" Not stratified on the claim's own axis {', '.join(own)}."
        if self.unshared:
            out += (
                " CONFOUNDED, not stratified: the compared groups share no value of "
                f"{', '.join(self.unshared)}, so the comparison includes the effect of those axes (each group is "
                "pooled over its own values)."
            )
        if self.determined:
            out += f" Determined by the stratified axes: {', '.join(self.determined)}."
        return out


def stratify(study: Study, groups: Mapping[str, pd.Series], *, exclude: Sequence[str] = ()) -> Stratification:
    """Strata of the usable runs of `groups` (name -> mask over study.runs) over every swept axis except `exclude`."""
    runs = study.runs
    ok = usable(runs)
    members = ok.copy() & False
    for m in groups.values():
        members |= m & ok
    # axis values as strings, unset (None / NaN) as "unset", so that grouping and matching agree
    text = {
        a: runs[a].map(lambda v: "unset" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v))
        for a in study.axes
        if a not in exclude
    }
    sub = pd.DataFrame({a: t[members] for a, t in text.items()})
    strat: list[str] = []
    unshared: list[str] = []
    determined: list[str] = []

    def n_combos(cols: list[str]) -> int:
        return len(sub[cols].drop_duplicates()) if cols else 1

    for a in text:
        if sub[a].nunique() <= 1:
            continue
        shared = set.intersection(*(set(text[a][m & ok]) for m in groups.values()))
        if not shared:
            unshared.append(a)
        elif n_combos([*strat, a]) > n_combos(strat):
            strat.append(a)
        else:
            determined.append(a)
    if not strat:
        return Stratification([], unshared, determined, [({}, pd.Series(True, index=runs.index))])

    keys = sorted(set(sub[strat].itertuples(index=False, name=None)), key=natural_keys)
    out = []
    for key in keys:
        mask = pd.Series(True, index=runs.index)
        for a, v in zip(strat, key, strict=True):
            mask &= text[a] == v
        first = runs.loc[mask & members].iloc[0]  # the axis values as the runs table holds them (numbers as numbers)
        out.append(({a: first[a] for a in strat}, mask))
    return Stratification(strat, unshared, determined, out)


Evaluate = Callable[[pd.Series], tuple[str, list[Evidence]] | None]
"""A claim's comparison within a stratum (mask over study.runs) -> (verdict, evidence), None when there is no data."""


def _has_data(study: Study, groups: Mapping[str, pd.Series], mask: pd.Series) -> bool:
    ok = usable(study.runs)
    return all(bool((m & mask & ok).any()) for m in groups.values())


def run_strata(
    study: Study, strat: Stratification, groups: Mapping[str, pd.Series] | None, evaluate: Evaluate, part: str = ""
) -> list[Stratum]:
    """`evaluate` in every stratum of `strat`; NO_DATA where some group of `groups` has no usable run (or where
    `evaluate` returns None). `groups` None: every stratum is evaluated."""
    out = []
    for key, mask in strat.strata:
        res = None if groups is not None and not _has_data(study, groups, mask) else evaluate(mask)
        out.append(Stratum(key, NO_DATA, [], part) if res is None else Stratum(key, res[0], res[1], part))
    return out


def combine(verdicts: Sequence[str]) -> str:
    """STRATA_RULE: over the strata with data in the claim's regime, contradicted if any is, supported if all are,
    else inconclusive; not tested in regime when strata have data but none is in the regime."""
    tested = [v for v in verdicts if v not in (NO_DATA, NOT_IN_REGIME)]
    if not tested and NOT_IN_REGIME in verdicts:
        return NOT_IN_REGIME
    return conjunction(tested)


def _combined_reason(strata: Sequence[Stratum]) -> str:
    with_data = [s for s in strata if s.verdict != NO_DATA]
    if not with_data:
        return "no stratum has usable runs of every compared group"
    counts = {
        v: [s.label for s in with_data if s.verdict == v]
        for v in (SUPPORTED, CONTRADICTED, INCONCLUSIVE, NOT_IN_REGIME)
    }
    parts = [f"{v} in {len(c)}" for v, c in counts.items() if c]
    out = f"{', '.join(parts)} of {len(with_data)} strata with data"
    if len(with_data) < len(strata):
        out += f" ({len(strata) - len(with_data)} without)"
    if counts[CONTRADICTED]:
        out += "; contradicted in: " + "; ".join(counts[CONTRADICTED])
    return out


def _reason(verdict: str, *ev: Evidence) -> str:
    if verdict == INCONCLUSIVE and any(not np.isfinite(e.low) for e in ev):
        return "no interval (fewer than two usable runs per group)"
    return "; ".join(str(e) for e in ev)


def outcome(
    strat: Stratification, strata: Sequence[Stratum], pooled: Evaluate | None
) -> tuple[str, list[Evidence], str]:
    """(verdict, evidence, reason) of a comparison run in `strata`: a single stratum reads as an unstratified
    comparison; several are combined by STRATA_RULE, their evidence labelled by stratum, followed by `pooled`'s first
    evidence line over every run (reference only, not used in the verdict)."""
    if len(strata) == 1:
        s = strata[0]
        if s.verdict == NO_DATA:
            return INCONCLUSIVE, [], "no usable runs of every compared group"
        return s.verdict, s.evidence, _reason(s.verdict, *s.evidence[:1])
    verdict = combine([s.verdict for s in strata])
    evidence = []
    for s in strata:
        if s.verdict == NO_DATA:
            evidence.append(
                Evidence("some compared group has no usable run", np.nan, np.nan, np.nan, "0", s.label, NO_DATA)
            )
            continue
        for k, e in enumerate(s.evidence):
            evidence.append(Evidence(e.name, e.estimate, e.low, e.high, e.n, s.label, s.verdict if k == 0 else ""))
    if pooled is not None:
        res = pooled(pd.Series(True, index=next(iter(strat.strata))[1].index))
        if res is not None and res[1]:
            e = res[1][0]
            evidence.append(Evidence(e.name, e.estimate, e.low, e.high, e.n, "pooled over strata, reference only"))
    return verdict, evidence, _combined_reason(strata)


__all__ = [
    "STRATA_RULE",
    "UNUSABLE_STATES",
    "Evaluate",
    "Stratification",
    "Stratum",
    "combine",
    "outcome",
    "run_strata",
    "stratify",
    "usable",
]
