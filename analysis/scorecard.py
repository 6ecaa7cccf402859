"""The report's scorecard: a verdict per claim C1-C6 of PAPER.md, with its evidence and the rule that produced it.

Every verdict is one of "supported", "contradicted" or "inconclusive" (at this scale) and comes with the numbers it
was decided on (point estimate, 95% percentile bootstrap interval over seeds, n) and the rule as a sentence, so a
reader can disagree with the rule rather than with a hidden threshold. A claim whose algorithms or axis are absent
from the study is "inconclusive" with a reason starting "not in this study".

The claims are about the paper's algorithms, so this module names them (gspo, grpo, grpo_rr, gspo_rr); the Routing
Replay partner of an algorithm is found through the registry (same loss function, routing "replay"), never by name.

Two-group quantities (differences, ratios) are bootstrapped by resampling the seeds of each group independently
(seeded, so a report is reproducible). Failed runs (infrastructure) are excluded; collapsed runs count.

Stratification: runs that differ in another swept axis (dtype, generation length, ...) are never pooled into one
sample. Each claim's comparison is made within every stratum = combination of the swept axes other than the claim's
own axis (seeds are the samples, never a stratum), and the per-stratum verdicts are combined by STRATA_RULE:
contradicted if any stratum with data is contradicted, supported if every stratum with data is supported, else
inconclusive. A stratum "has data" when every compared group has a usable run in it. Two kinds of swept axes are not
stratified, and the rule text names them: axes whose values the compared groups do not share (e.g. a per-algorithm
`hparams.*`: no stratum could hold both groups, so each group is pooled over its own values), and axes fully
determined by the stratified ones (train_dtype given train_precision). With several strata, each stratum's
evidence is listed with its own verdict, plus the pooled estimate for reference (not used in the verdict).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis import stats, style, vocab
from analysis.fit import A_NOISE
from analysis.tidy import ALGORITHM, COMPUTE, RUN_ID, Study

SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "contradicted", "inconclusive"
NO_DATA = "no data"
"""A stratum in which some compared group has no usable run (not counted in the combined verdict)."""
NOT_IN_STUDY = "not in this study"
GSPO, GRPO = "gspo", "grpo"
CLIP_RATIO = 10.0
"""C2: the paper's "two orders of magnitude" read conservatively as >= 10x."""
EQUIV_MARGIN = A_NOISE
"""C4: reward differences within this margin are treated as noise across seeds (ScaleRL's 0.02)."""
FINAL_FRAC = 0.1
"""Final window: the last 10% of the (common) compute grid."""
N_GRID = 100
N_RESAMPLES = 4000
STRATA_RULE = (
    "contradicted if the comparison is contradicted in any stratum with data; supported if it is supported in every "
    "stratum with data; otherwise inconclusive (also when no stratum has data)"
)
"""How per-stratum verdicts combine into the claim's verdict (quoted in every stratified rule)."""
CLAIMS = {
    "C1": "GSPO trains more efficiently than GRPO at equal compute.",
    "C2": "GSPO's clipped-token fraction is >= 10x GRPO's.",
    "C3": "GRPO without Routing Replay is unstable on MoE; with it, it converges.",
    "C4": "GSPO needs no Routing Replay.",
    "C5": "GSPO tolerates inference-engine log-probs as pi_old (precision mismatch) better than GRPO.",
    "C6": "Performance keeps improving with more compute and longer generation length.",
}


@dataclass(frozen=True)
class Evidence:
    """One number behind a verdict: estimate, bootstrap interval over seeds, sample sizes."""

    name: str
    estimate: float
    low: float
    high: float
    n: str
    """Sample sizes, e.g. "3 vs 3" (runs of each group)."""
    stratum: str = ""
    """The stratum this number is computed in ("max_new_tokens=256, rollout_dtype=bf16"); "" = the whole study."""
    verdict: str = ""
    """The stratum's verdict, on the first evidence line of each stratum of a stratified claim."""

    def __str__(self) -> str:
        head = f"[{self.stratum}] " if self.stratum else ""
        if self.verdict == NO_DATA:
            return f"{head}{NO_DATA}: {self.name}"
        tail = f" -> {self.verdict}" if self.verdict else ""
        return f"{head}{self.name} = {self.estimate:.4g} [{self.low:.4g}, {self.high:.4g}] (n={self.n}){tail}"


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
class ClaimResult:
    """A claim's verdict, the rule that produced it and its evidence."""

    claim: str
    statement: str
    verdict: str
    rule: str
    evidence: list[Evidence] = field(default_factory=list)
    reason: str = ""
    """Why the verdict is what it is (e.g. "not in this study: gspo absent"), or the deciding comparison."""
    strata: list[Stratum] = field(default_factory=list)
    """Per-stratum verdicts (one entry, key {}, when no other axis is swept)."""

    @property
    def strata_summary(self) -> str:
        """E.g. "4 strata: supported 2, contradicted 1, no data 1"; "" when the claim was not stratified."""
        if len(self.strata) <= 1:
            return ""
        counts = {v: sum(s.verdict == v for s in self.strata) for v in (SUPPORTED, CONTRADICTED, INCONCLUSIVE, NO_DATA)}
        return f"{len(self.strata)} strata: " + ", ".join(f"{v} {c}" for v, c in counts.items() if c)

    @property
    def label(self) -> str:
        """The verdict with its reason when inconclusive, e.g. "inconclusive: not in this study (gspo absent)"."""
        if self.verdict == INCONCLUSIVE and self.reason:
            return f"{INCONCLUSIVE}: {self.reason}"
        return self.verdict


# --- helpers ----------------------------------------------------------------------------------------------------------
def _boot_two(
    x: np.ndarray,
    y: np.ndarray,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """fn(mean x, mean y) with a percentile bootstrap interval, x and y resampled independently (NaN: no interval)."""
    x = np.asarray(x, np.float64)[~np.isnan(np.asarray(x, np.float64))]
    y = np.asarray(y, np.float64)[~np.isnan(np.asarray(y, np.float64))]
    if x.size == 0 or y.size == 0:
        return np.nan, np.nan, np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        est = float(fn(np.asarray(x.mean()), np.asarray(y.mean())))
        if x.size < 2 or y.size < 2:
            return est, np.nan, np.nan
        rng = np.random.default_rng(seed)
        mx = x[rng.integers(0, x.size, (n_resamples, x.size))].mean(axis=1)
        my = y[rng.integers(0, y.size, (n_resamples, y.size))].mean(axis=1)
        d = fn(mx, my)
    d = np.where(np.isnan(d), np.inf, d)  # 0/0 cannot happen unless both are 0; treat it as "no evidence" upward
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(d, [alpha, 1 - alpha], method="inverted_cdf")
    return est, float(lo), float(hi)


def _boot_four(
    groups: Sequence[np.ndarray], fn: Callable[..., np.ndarray], *, n_resamples: int = N_RESAMPLES, seed: int = 0
) -> tuple[float, float, float]:
    """fn(mean g0, ..., mean g3) with each group resampled independently (percentile 95%)."""
    gs = [np.asarray(g, np.float64)[~np.isnan(np.asarray(g, np.float64))] for g in groups]
    if any(g.size == 0 for g in gs):
        return np.nan, np.nan, np.nan
    est = float(fn(*[np.asarray(g.mean()) for g in gs]))
    if any(g.size < 2 for g in gs):
        return est, np.nan, np.nan
    rng = np.random.default_rng(seed)
    means = [g[rng.integers(0, g.size, (n_resamples, g.size))].mean(axis=1) for g in gs]
    lo, hi = np.quantile(fn(*means), [0.025, 0.975], method="inverted_cdf")
    return est, float(lo), float(hi)


def _decide(low: float, high: float, *, up: float, down: float) -> str:
    """supported when low >= up, contradicted when high < down, else inconclusive (NaN bounds: inconclusive)."""
    if np.isfinite(low) and low >= up:
        return SUPPORTED
    if np.isfinite(high) and high < down:
        return CONTRADICTED
    return INCONCLUSIVE


def replay_partner(name: str, present: Sequence[str]) -> str | None:
    """The algorithm of `present` with the same loss function as `name` and routing "replay" (via the registry)."""
    reg = style._registry()
    base = reg.get(name)
    for other in present:
        try:
            spec = reg.get(other)
        except (KeyError, ValueError):
            continue
        if other != name and spec.loss_fn is base.loss_fn and spec.routing == "replay":
            return other
    return None


def _free_of(name: str, present: Sequence[str]) -> str | None:
    """`name` itself when present and its routing is free (checked in the registry)."""
    return name if name in present and style._registry().get(name).routing == "free" else None


def _absent(claim: str, rule: str, what: str) -> ClaimResult:
    return ClaimResult(claim, CLAIMS[claim], INCONCLUSIVE, rule, [], f"{NOT_IN_STUDY} ({what})")


def _usable_runs(study: Study) -> pd.DataFrame:
    """Runs that carry evidence: everything but failed (infrastructure) and unknown-state runs."""
    return study.runs[~study.runs["state"].isin(["failed", "unknown"])]


def _final_reward_at_common_compute(
    study: Study, groups: dict[str, pd.Series], metric: str = vocab.REWARD
) -> tuple[dict[str, np.ndarray], float]:
    """Per group (a boolean mask over study.runs): each run's mean `metric` over the last FINAL_FRAC of a compute grid
    that ends where the shortest-running group's longest run ends ("equal compute"). A collapsed run is held at its
    last value after it stops (it does not get to skip the compute it failed at); failed runs are excluded."""
    usable = set(_usable_runs(study)[RUN_ID].astype(str))
    ids = {g: set(study.runs.loc[m, RUN_ID].astype(str)) & usable for g, m in groups.items()}
    rows = stats.metric_rows(study.long, metric)
    rows = rows[rows[RUN_ID].astype(str).isin(set().union(*ids.values()))]
    if rows.empty:
        return {g: np.array([]) for g in groups}, np.nan
    runs = study.runs.set_index(study.runs[RUN_ID].astype(str))
    c_end = min(
        (float(runs.loc[list(v), "last_compute"].max()) for v in ids.values() if v),
        default=np.nan,
    )
    grid = stats.compute_grid(rows[COMPUTE].to_numpy(), n=N_GRID)
    grid = grid[grid <= c_end * (1 + 1e-9)]
    info, mat = stats.interpolate_runs(rows, grid)
    k = max(1, int(np.ceil(FINAL_FRAC * len(grid))))
    out = {}
    rid = info[RUN_ID].astype(str).to_numpy()
    for g, members in ids.items():
        vals = []
        for i in np.flatnonzero(np.isin(rid, list(members))):
            row = mat[i]
            finite = np.flatnonzero(np.isfinite(row))
            if finite.size and runs.loc[rid[i], "state"] == "collapsed":
                row = row.copy()
                row[finite[-1] + 1 :] = row[finite[-1]]
            vals.append(np.nanmean(row[-k:]) if np.isfinite(row[-k:]).any() else np.nan)
        out[g] = np.asarray(vals, np.float64)
    return out, c_end


def _n(*xs: np.ndarray) -> str:
    return " vs ".join(str(int(np.isfinite(x).sum())) for x in xs)


def _alg_mask(study: Study, name: str) -> pd.Series:
    return study.runs[ALGORITHM].astype(str) == name


# --- stratification ---------------------------------------------------------------------------------------------------
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


def _stratify(study: Study, groups: Mapping[str, pd.Series], *, exclude: Sequence[str] = ()) -> Stratification:
    """Strata of the usable runs of `groups` (name -> mask over study.runs) over every swept axis except `exclude`."""
    runs = study.runs
    usable = ~runs["state"].isin(["failed", "unknown"])
    members = usable.copy() & False
    for m in groups.values():
        members |= m & usable
    # axis values as strings, unset (None / NaN) as "unset", so that grouping and matching agree
    text = {a: runs[a].map(lambda v: "unset" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v))
            for a in study.axes if a not in exclude}  # fmt: skip
    sub = pd.DataFrame({a: t[members] for a, t in text.items()})
    strat: list[str] = []
    unshared: list[str] = []
    determined: list[str] = []

    def n_combos(cols: list[str]) -> int:
        return len(sub[cols].drop_duplicates()) if cols else 1

    for a in text:
        if sub[a].nunique() <= 1:
            continue
        shared = set.intersection(*(set(text[a][m & usable]) for m in groups.values()))
        if not shared:
            unshared.append(a)
        elif n_combos([*strat, a]) > n_combos(strat):
            strat.append(a)
        else:
            determined.append(a)
    if not strat:
        return Stratification([], unshared, determined, [({}, pd.Series(True, index=runs.index))])

    def natural(v: str) -> tuple[int, float, str]:  # numbers in numeric order, then strings
        try:
            return (0, float(v), "")
        except ValueError:
            return (1, 0.0, v)

    keys = sorted(set(sub[strat].itertuples(index=False, name=None)), key=lambda k: tuple(natural(v) for v in k))
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
    usable = ~study.runs["state"].isin(["failed", "unknown"])
    return all(bool((m & mask & usable).any()) for m in groups.values())


def _run_strata(
    study: Study, strat: Stratification, groups: Mapping[str, pd.Series] | None, evaluate: Evaluate, part: str = ""
) -> list[Stratum]:
    out = []
    for key, mask in strat.strata:
        res = None if groups is not None and not _has_data(study, groups, mask) else evaluate(mask)
        out.append(Stratum(key, NO_DATA, [], part) if res is None else Stratum(key, res[0], res[1], part))
    return out


def combine(verdicts: Sequence[str]) -> str:
    """STRATA_RULE: contradicted if any stratum with data is, supported if all with data are, else inconclusive."""
    with_data = [v for v in verdicts if v != NO_DATA]
    if CONTRADICTED in with_data:
        return CONTRADICTED
    if with_data and all(v == SUPPORTED for v in with_data):
        return SUPPORTED
    return INCONCLUSIVE


def _combined_reason(strata: Sequence[Stratum]) -> str:
    with_data = [s for s in strata if s.verdict != NO_DATA]
    if not with_data:
        return "no stratum has usable runs of every compared group"
    counts = {v: [s.label for s in with_data if s.verdict == v] for v in (SUPPORTED, CONTRADICTED, INCONCLUSIVE)}
    parts = [f"{v} in {len(c)}" for v, c in counts.items() if c]
    out = f"{', '.join(parts)} of {len(with_data)} strata with data"
    if len(with_data) < len(strata):
        out += f" ({len(strata) - len(with_data)} without)"
    if counts[CONTRADICTED]:
        out += "; contradicted in: " + "; ".join(counts[CONTRADICTED])
    return out


def _finish(
    claim: str,
    rule: str,
    strat: Stratification,
    strata: list[Stratum],
    pooled: Evaluate | None,
    *,
    own: Sequence[str] = (),
) -> ClaimResult:
    """The claim's result: a single stratum reads as before; several are combined by STRATA_RULE."""
    rule = rule + strat.text(own)
    if len(strata) == 1:
        s = strata[0]
        if s.verdict == NO_DATA:
            return ClaimResult(
                claim, CLAIMS[claim], INCONCLUSIVE, rule, [], "no usable runs of every compared group", strata
            )
        return ClaimResult(
            claim, CLAIMS[claim], s.verdict, rule, s.evidence, _reason(s.verdict, *s.evidence[:1]), strata
        )
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
    return ClaimResult(claim, CLAIMS[claim], verdict, rule, evidence, _combined_reason(strata), strata)


def _grpo_baseline(present: Sequence[str]) -> str | None:
    """The paper's GRPO baseline of Figures 1-2: GRPO with Routing Replay (registry partner), else plain GRPO."""
    if GRPO not in present:
        return None
    return replay_partner(GRPO, present) or GRPO


def _present(study: Study) -> list[str]:
    return list(study.runs[ALGORITHM].dropna().astype(str).unique())


# --- claims -----------------------------------------------------------------------------------------------------------
def claim_c1(study: Study) -> ClaimResult:
    """C1: GSPO's final reward at equal compute minus the GRPO baseline's, per stratum."""
    present = _present(study)
    base = _grpo_baseline(present)
    rule = (
        "d = mean reward of GSPO minus GRPO (with Routing Replay when present, else without) over the last "
        f"{FINAL_FRAC:.0%} of the compute both reached (collapsed runs held at their last value, failed runs "
        "excluded); 95% CI lower bound > 0 -> supported; upper bound < 0 -> contradicted; else inconclusive."
    )
    if GSPO not in present or base is None:
        return _absent("C1", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.REWARD not in study.metrics:
        return _absent("C1", rule, f"metric {vocab.REWARD} not logged")
    groups = {GSPO: _alg_mask(study, GSPO), base: _alg_mask(study, base)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        vals, c_end = _final_reward_at_common_compute(study, {g: m & mask for g, m in groups.items()})
        est, lo, hi = _boot_two(vals[GSPO], vals[base], lambda a, b: a - b)
        ev = [
            Evidence(f"reward({GSPO}) - reward({base}) at {c_end:.3g} FLOPs", est, lo, hi, _n(vals[GSPO], vals[base])),
            _mean_ev(f"reward({GSPO})", vals[GSPO]),
            _mean_ev(f"reward({base})", vals[base]),
        ]
        return _decide(lo, hi, up=np.nextafter(0, 1), down=0.0), ev

    strat = _stratify(study, groups)
    return _finish("C1", rule, strat, _run_strata(study, strat, groups, evaluate), evaluate)


def claim_c2(study: Study) -> ClaimResult:
    """C2: ratio of mean clipped-token fractions, GSPO over the GRPO baseline, per stratum."""
    present = _present(study)
    base = _grpo_baseline(present)
    rule = (
        f"r = GSPO's mean clip fraction / GRPO's (with Routing Replay when present), each the mean over all steps "
        f"per run then over seeds; 95% CI lower bound >= {CLIP_RATIO:g} -> supported; upper bound < {CLIP_RATIO:g} "
        "-> contradicted; else inconclusive."
    )
    if GSPO not in present or base is None:
        return _absent("C2", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.CLIP not in study.metrics:
        return _absent("C2", rule, f"metric {vocab.CLIP} not logged")
    per_run = stats.run_mean(study.long, vocab.CLIP)
    usable = set(_usable_runs(study)[RUN_ID].astype(str))
    per_run = per_run[per_run[RUN_ID].astype(str).isin(usable)]
    alg, rid = per_run[ALGORITHM].astype(str), per_run[RUN_ID].astype(str)
    groups = {GSPO: _alg_mask(study, GSPO), base: _alg_mask(study, base)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        inside = rid.isin(set(study.runs.loc[mask, RUN_ID].astype(str)))
        x = per_run.loc[inside & (alg == GSPO), "value"].to_numpy()
        y = per_run.loc[inside & (alg == base), "value"].to_numpy()
        est, lo, hi = _boot_two(x, y, lambda a, b: a / b)
        ev = [
            Evidence(f"clip_frac({GSPO}) / clip_frac({base})", est, lo, hi, _n(x, y)),
            _mean_ev(f"clip_frac({GSPO})", x),
            _mean_ev(f"clip_frac({base})", y),
        ]
        return _decide(lo, hi, up=CLIP_RATIO, down=CLIP_RATIO), ev

    strat = _stratify(study, groups)
    return _finish("C2", rule, strat, _run_strata(study, strat, groups, evaluate), evaluate)


def _collapsed(study: Study) -> pd.DataFrame:
    """Per usable run: 1.0 when it collapsed (reported in status.json or detected in the reward), else 0.0."""
    coll = stats.collapse_table(study.long, study.runs, vocab.REWARD)
    coll = coll[~coll["state"].isin(["failed", "unknown"])]
    return pd.DataFrame(
        {
            RUN_ID: coll[RUN_ID].astype(str).to_numpy(),
            ALGORITHM: coll[ALGORITHM].astype(str).to_numpy(),
            "collapsed": coll["collapsed"].to_numpy(dtype=np.float64),
        }
    )


def _rates(coll: pd.DataFrame, study: Study, mask: pd.Series, name: str) -> np.ndarray:
    inside = coll[RUN_ID].isin(set(study.runs.loc[mask, RUN_ID].astype(str)))
    return coll.loc[inside & (coll[ALGORITHM] == name), "collapsed"].to_numpy()


def claim_c3(study: Study) -> ClaimResult:
    """C3: collapse rate of GRPO without Routing Replay minus with it, per stratum."""
    present = _present(study)
    free = _free_of(GRPO, present)
    rr = replay_partner(GRPO, present) if GRPO in present else None
    rule = (
        "d = collapse rate (status.json or the reward-drop rule) of GRPO without Routing Replay minus GRPO with it "
        "(the registry's replay partner: same loss, routing=replay); 95% CI lower bound > 0 -> supported; upper "
        "bound <= 0 (free GRPO collapses no more often) -> contradicted; else inconclusive."
    )
    if free is None or rr is None:
        return _absent("C3", rule, f"{GRPO} and its Routing Replay partner not both present")
    if vocab.REWARD not in study.metrics:
        return _absent("C3", rule, f"metric {vocab.REWARD} not logged")
    coll = _collapsed(study)
    groups = {free: _alg_mask(study, free), rr: _alg_mask(study, rr)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        a, b = _rates(coll, study, mask, free), _rates(coll, study, mask, rr)
        est, lo, hi = _boot_two(a, b, lambda x, y: x - y)
        if np.isfinite(lo) and lo > 0:
            verdict = SUPPORTED
        elif np.isfinite(hi) and hi <= 0:
            verdict = CONTRADICTED
        else:
            verdict = INCONCLUSIVE
        ev = [
            Evidence(f"collapse_rate({free}) - collapse_rate({rr})", est, lo, hi, _n(a, b)),
            _mean_ev(f"collapse_rate({free})", a),
            _mean_ev(f"collapse_rate({rr})", b),
        ]
        return verdict, ev

    strat = _stratify(study, groups)
    return _finish("C3", rule, strat, _run_strata(study, strat, groups, evaluate), evaluate)


def claim_c4(study: Study) -> ClaimResult:
    """C4: GSPO without Routing Replay neither collapses nor trails GSPO with it by more than the noise margin."""
    present = _present(study)
    free = _free_of(GSPO, present)
    rr = replay_partner(GSPO, present) if GSPO in present else None
    m = EQUIV_MARGIN
    rule = (
        "g = reward of GSPO with Routing Replay minus without it, over the last "
        f"{FINAL_FRAC:.0%} of the compute both reached; supported when no free-routing GSPO run collapsed and g's "
        f"95% CI upper bound < {m:g} (replay gains less than seed noise); contradicted when g's CI lower bound > {m:g} "
        "or free GSPO's collapse-rate CI lower bound > 0; else inconclusive."
    )
    if free is None or rr is None:
        return _absent("C4", rule, f"{GSPO} and its Routing Replay partner not both present")
    if vocab.REWARD not in study.metrics:
        return _absent("C4", rule, f"metric {vocab.REWARD} not logged")
    coll = _collapsed(study)
    groups = {free: _alg_mask(study, free), rr: _alg_mask(study, rr)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        vals, c_end = _final_reward_at_common_compute(study, {g: gm & mask for g, gm in groups.items()})
        est, lo, hi = _boot_two(vals[rr], vals[free], lambda a, b: a - b)
        rates = _rates(coll, study, mask, free)
        rci = stats.bootstrap_ci(rates, n_resamples=N_RESAMPLES)
        if (np.isfinite(lo) and lo > m) or (np.isfinite(rci.low) and rci.low > 0):
            verdict = CONTRADICTED
        elif np.isfinite(hi) and hi < m and rates.size and not rates.any():
            verdict = SUPPORTED
        else:
            verdict = INCONCLUSIVE
        ev = [
            Evidence(f"reward({rr}) - reward({free}) at {c_end:.3g} FLOPs", est, lo, hi, _n(vals[rr], vals[free])),
            Evidence(f"collapse_rate({free})", rci.estimate, rci.low, rci.high, str(rci.n)),
        ]
        return verdict, ev

    strat = _stratify(study, groups)
    return _finish("C4", rule, strat, _run_strata(study, strat, groups, evaluate), evaluate)


def claim_c5(study: Study, *, axis: str = vocab.OLD_LOGP_AXIS) -> ClaimResult:
    """C5: GRPO's reward drop from using the engine's log-probs as pi_old minus GSPO's drop, per stratum."""
    present = _present(study)
    rule = (
        f"drop(alg) = final-window reward with {axis}=recompute minus with {axis}=rollout "
        "(engine log-probs as pi_old); "
        "d = drop(GRPO) - drop(GSPO), both without Routing Replay (replaying the recompute's routes needs the "
        "recompute); 95% CI lower bound > 0 -> supported; upper bound < 0 -> contradicted; else inconclusive."
    )
    if GSPO not in present or GRPO not in present:
        return _absent("C5", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if axis not in study.axes or not {"recompute", "rollout"} <= set(study.runs[axis].astype(str)):
        return _absent("C5", rule, f"axis {axis} with values recompute and rollout not swept")
    if vocab.REWARD not in study.metrics:
        return _absent("C5", rule, f"metric {vocab.REWARD} not logged")
    src = study.runs[axis].astype(str)
    groups = {f"{a}|{s}": _alg_mask(study, a) & (src == s) for a in (GRPO, GSPO) for s in ("recompute", "rollout")}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        vals, _ = _final_reward_at_common_compute(study, {g: m & mask for g, m in groups.items()})
        g = [vals[f"{GRPO}|recompute"], vals[f"{GRPO}|rollout"], vals[f"{GSPO}|recompute"], vals[f"{GSPO}|rollout"]]
        est, lo, hi = _boot_four(g, lambda a, b, c, d: (a - b) - (c - d))
        ev = [
            Evidence("drop(grpo) - drop(gspo)", est, lo, hi, _n(*g)),
            Evidence("drop(grpo)", *_boot_two(g[0], g[1], lambda a, b: a - b), _n(g[0], g[1])),
            Evidence("drop(gspo)", *_boot_two(g[2], g[3], lambda a, b: a - b), _n(g[2], g[3])),
        ]
        return _decide(lo, hi, up=np.nextafter(0, 1), down=0.0), ev

    strat = _stratify(study, groups, exclude=[axis])
    return _finish("C5", rule, strat, _run_strata(study, strat, groups, evaluate), evaluate, own=[axis])


def claim_c6(study: Study, *, axis: str = vocab.LENGTH_AXIS) -> ClaimResult:
    """C6: GSPO's reward still rises over the last half of training, and is higher at the longest generation length;
    each part per stratum of the other swept axes, combined by STRATA_RULE, then the parts combined."""
    present = _present(study)
    rule = (
        "For GSPO: (a) compute gain = per-run mean reward over the last quarter of its logged steps minus over the "
        f"third quarter; (b) length gain = final-window reward at the largest {axis} minus at the smallest. "
        "Supported when both 95% CI lower bounds > 0; contradicted when either CI upper bound < 0; else inconclusive "
        f"(also when {axis} is not swept)."
    )
    if GSPO not in present:
        return _absent("C6", rule, f"{GSPO} absent")
    if vocab.REWARD not in study.metrics:
        return _absent("C6", rule, f"metric {vocab.REWARD} not logged")
    usable = set(_usable_runs(study)[RUN_ID].astype(str))
    rows = stats.metric_rows(study.long, vocab.REWARD)
    rows = rows[(rows[ALGORITHM].astype(str) == GSPO) & rows[RUN_ID].astype(str).isin(usable)]
    gains: dict[str, float] = {}
    for rid, r in rows.groupby(RUN_ID, observed=True, sort=False):
        v = r["value"].to_numpy(np.float64)
        q = len(v) // 4
        if q >= 1:
            gains[str(rid)] = v[-q:].mean() - v[-2 * q : -q].mean()
    gspo = {GSPO: _alg_mask(study, GSPO)}

    def compute_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        ids = set(study.runs.loc[mask & gspo[GSPO], RUN_ID].astype(str))
        ci = stats.bootstrap_ci(np.asarray([g for r, g in gains.items() if r in ids]), n_resamples=N_RESAMPLES)
        if ci.n == 0:
            return None
        ev = [Evidence("compute gain (last vs third quarter)", ci.estimate, ci.low, ci.high, str(ci.n))]
        return _decide(ci.low, ci.high, up=np.nextafter(0, 1), down=0.0), ev

    def length_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        m = gspo[GSPO] & mask & study.runs[RUN_ID].astype(str).isin(usable)
        lens = study.runs.loc[m, axis]
        if lens.nunique() < 2:
            return None
        lo_v, hi_v = lens.min(), lens.max()
        vals, _ = _final_reward_at_common_compute(
            study, {"long": m & (study.runs[axis] == hi_v), "short": m & (study.runs[axis] == lo_v)}
        )
        est, lo, hi = _boot_two(vals["long"], vals["short"], lambda a, b: a - b)
        ev = [Evidence(f"length gain ({axis} {hi_v} vs {lo_v})", est, lo, hi, _n(vals["long"], vals["short"]))]
        return _decide(lo, hi, up=np.nextafter(0, 1), down=0.0), ev

    s_compute = _stratify(study, gspo)
    strata = _run_strata(study, s_compute, gspo, compute_part, part="compute")
    part_verdicts = [combine([s.verdict for s in strata])]
    no_compute = strata[0].verdict == NO_DATA and len(s_compute.strata) == 1
    compute_note = "no data (no GSPO run with at least 4 logged steps)" if no_compute else part_verdicts[0]
    swept = axis in study.axes and study.runs.loc[gspo[GSPO], axis].nunique() > 1
    if swept:
        s_length = _stratify(study, gspo, exclude=[axis])
        length = _run_strata(study, s_length, gspo, length_part, part="length")
        strata += length
        part_verdicts.append(combine([s.verdict for s in length]))
        text = f" (a) {s_compute.text().strip()} (b) {s_length.text([axis]).strip()}"
        reason = f"compute part {compute_note}, length part {part_verdicts[1]} (each combined over its strata)"
    else:
        part_verdicts.append(INCONCLUSIVE)
        reason = f"{NOT_IN_STUDY} (axis {axis} not swept for {GSPO}); compute part: {compute_note}"
        text = f" (a) {s_compute.text().strip()}"
    if CONTRADICTED in part_verdicts:
        verdict = CONTRADICTED
    elif all(p == SUPPORTED for p in part_verdicts):
        verdict = SUPPORTED
    else:
        verdict = INCONCLUSIVE
    evidence = []
    for s in strata:
        label = s.label if (len(s_compute.strata) > 1 or s.part == "length") else ""
        if s.verdict == NO_DATA and label:
            why = "no run with at least 4 logged steps" if s.part == "compute" else "fewer than two lengths"
            evidence.append(Evidence(why, np.nan, np.nan, np.nan, "0", label, NO_DATA))
        for k, e in enumerate(s.evidence):
            evidence.append(
                Evidence(e.name, e.estimate, e.low, e.high, e.n, label, s.verdict if label and k == 0 else "")
            )
    return ClaimResult("C6", CLAIMS["C6"], verdict, rule + text, evidence, reason, strata)


def _mean_ev(name: str, x: np.ndarray) -> Evidence:
    ci = stats.bootstrap_ci(x, n_resamples=N_RESAMPLES)
    return Evidence(name, ci.estimate, ci.low, ci.high, str(ci.n))


def _reason(verdict: str, *ev: Evidence) -> str:
    if verdict == INCONCLUSIVE and any(not np.isfinite(e.low) for e in ev):
        return "no interval (fewer than two usable runs per group)"
    return "; ".join(str(e) for e in ev)


CLAIM_FUNCTIONS = {"C1": claim_c1, "C2": claim_c2, "C3": claim_c3, "C4": claim_c4, "C5": claim_c5, "C6": claim_c6}


def scorecard(study: Study) -> list[ClaimResult]:
    """Every claim C1-C6 of PAPER.md evaluated on `study`."""
    return [fn(study) for fn in CLAIM_FUNCTIONS.values()]


def scorecard_table(results: Sequence[ClaimResult]) -> pd.DataFrame:
    """One row per claim: claim, statement, verdict (with reason when inconclusive), strata (per-stratum verdict
    counts; "" when not stratified), evidence, rule."""
    return pd.DataFrame(
        {
            "claim": [r.claim for r in results],
            "statement": [r.statement for r in results],
            "verdict": [r.label for r in results],
            "strata": [r.strata_summary for r in results],
            "evidence": ["; ".join(str(e) for e in r.evidence) for r in results],
            "rule": [r.rule for r in results],
        }
    )


def strata_table(results: Sequence[ClaimResult]) -> pd.DataFrame:
    """One row per (claim, stratum) of the stratified claims: claim, stratum, verdict, the stratum's first evidence."""
    rows = []
    for r in results:
        if len(r.strata) <= 1:
            continue
        for s in r.strata:
            e = s.evidence[0] if s.evidence else None
            rows.append(
                {
                    "claim": r.claim,
                    "stratum": s.label,
                    "verdict": s.verdict,
                    "evidence": e.name if e else "",
                    "estimate": e.estimate if e else np.nan,
                    "low": e.low if e else np.nan,
                    "high": e.high if e else np.nan,
                    "n": e.n if e else "0",
                }
            )
    cols = ["claim", "stratum", "verdict", "evidence", "estimate", "low", "high", "n"]
    return pd.DataFrame(rows, columns=cols)


__all__ = [
    "CLAIMS",
    "CONTRADICTED",
    "INCONCLUSIVE",
    "NOT_IN_STUDY",
    "NO_DATA",
    "STRATA_RULE",
    "SUPPORTED",
    "ClaimResult",
    "Evidence",
    "Stratification",
    "Stratum",
    "claim_c1",
    "claim_c2",
    "claim_c3",
    "claim_c4",
    "claim_c5",
    "claim_c6",
    "combine",
    "replay_partner",
    "scorecard",
    "scorecard_table",
    "strata_table",
]
