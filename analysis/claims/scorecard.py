"""The report's scorecard: a verdict per claim C1-C6 of the GSPO paper (docs/references.md), with its evidence and
the rule that produced it.

Every verdict is one of "supported", "contradicted", "inconclusive" (at this scale) or "not tested in regime" (the
claim's precondition, a measured quantity of the runs it compares, was not reached: C3 and C4 need the routing
volatility of the off-policy minibatches at or above `Rules.min_volatility`, C5 the engine/trainer mismatch at or
above `Rules.min_mismatch`; the verdict then names the measured value and the threshold) and comes with the numbers it
was decided on (point estimate, 95% Student t interval over seeds, n) and the rule as a sentence, so a
reader can disagree with the rule rather than with a hidden threshold. The verdict is read off the interval by the
claim's `Decision`s (DECISIONS, analysis.stats.verdicts) and the rule quotes their own sentences, so prose and code
agree. A claim whose algorithms or axis are absent from the study is "inconclusive" with a reason starting "not in
this study".

The claims are about the paper's algorithms, so this module names them (gspo, grpo, grpo_rr, gspo_rr); the Routing
Replay partner of an algorithm is the registry's (`algorithms.replay_partner`: same loss function, routing "replay"),
never found by name.

Intervals (analysis.stats): a mean over seeds gets a t interval, a difference or contrast of independent groups'
means Welch's (Welch-Satterthwaite degrees of freedom), a ratio of means Welch's on the log scale; with 3-6 seeds a
percentile bootstrap would be too narrow. Failed runs (infrastructure) are excluded; collapsed runs count.

Stratification (analysis.stats.strata): each claim's comparison is made within every stratum of the other swept axes,
never pooled across them, and the per-stratum verdicts are combined by STRATA_RULE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.claims import declared as declared_
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID
from analysis.runs.tidy import Study
from analysis.stats import collapse, curves, design, gain, intervals, power, regime
from analysis.stats.fit import A_NOISE
from analysis.stats.strata import (
    STRATA_RULE,
    Evaluate,
    Stratification,
    Stratum,
    combine,
    outcome,
    run_strata,
    stratify,
    usable,
)
from analysis.stats.verdicts import (
    CONJUNCTION_RULE,
    CONTRADICTED,
    INCONCLUSIVE,
    NO_DATA,
    NOT_IN_REGIME,
    SUPPORTED,
    VERDICTS,
    Bound,
    Decision,
    Evidence,
    conjunction,
)

NOT_IN_STUDY = "not in this study"
PAPER_SIZE = "beside the paper"
"""The evidence line of a size read against the paper's (C2)."""
EXPLORATORY, PRIMARY, SECONDARY = "exploratory", "primary", "secondary"
"""A verdict's role: decided from a comparison the sweep file declared before its runs (its `role:`, primary or
secondary) on runs that match the declaration, or exploratory (everything else: a finding to confirm)."""
TRAIN, VALIDATION, TEST = "train", "validation", "test"
SPLITS = {
    TRAIN: "the training reward or a metric of the training steps",
    VALIDATION: "eval_in_dist / eval_hard, the held-out sets the design was chosen on",
    TEST: "test_in_dist, the held-out test split no choice of the design saw",
}
"""The data a verdict is read on."""
UNPAIRED = "unpaired (Welch over runs); unit of replication: the run (seed)"
UNPAIRED_RATE = "unpaired (Newcombe over runs); unit of replication: the run (seed)"
PAIRED = "paired by seed (a seed's arms share prompts, cold start and evaluation sampling); unit of replication: seed"


PAIRED_WHERE = (
    "paired by seed where both arms ran the same seeds (the evidence's n says 'paired'), else unpaired (Welch over "
    "runs); unit of replication: seed"
)
PAIRING = {
    "C1": PAIRED_WHERE,
    "C2": "paired by seed on the log scale where both arms ran the same seeds (the evidence's n says 'paired'), else "
    "unpaired (Welch on the log scale over runs); unit of replication: seed",
    "C3": UNPAIRED_RATE,
    "C4": f"reward {PAIRED_WHERE.split(';')[0]}, collapse rate {UNPAIRED_RATE.split(';')[0]} (a rate has no pairs); "
    "unit of replication: seed",
    "C5": "paired by seed where all four arms ran the same seeds (the evidence's n says 'paired'), else unpaired "
    "(Welch over runs); unit of replication: seed",
    "C6": "compute part: within each run (its last quarter minus its third), then over runs; length part: "
    f"{PAIRED_WHERE.replace('both arms', 'the longest and the shortest length')}",
}
"""How each claim's exploratory reading pairs its runs."""


def split_of(metric: str) -> str:
    """The split a metric is measured on: TEST (test_*), VALIDATION (eval_* / eval/*), else TRAIN."""
    if metric.startswith("test_"):
        return TEST
    return VALIDATION if metric.startswith(vocab.EVAL_PREFIXES) else TRAIN


GSPO, GRPO = "gspo", "grpo"
CLIP_RATIO = 10.0
"""C2: the paper's "two orders of magnitude" read conservatively as >= 10x."""
EQUIV_MARGIN = A_NOISE
"""C4: reward differences within this margin are treated as noise across seeds (ScaleRL's 0.02)."""
FINAL_FRAC = design.WINDOW_FRAC
"""Final window: the last 10% of the compute every compared group reached."""
FINAL_RULE = design.window_rule(FINAL_FRAC, design.COMMON_END)
"""The final window's text, quoted by the claims that read it (C1, C4, C5, C6): `design.compute_window`'s rule."""
POSITIVE = Decision(Bound("lower", ">", 0.0), Bound("upper", "<", 0.0))
"""C1, C5 and each gain of C6: a difference the claim says is positive."""
CLIP_DECISION = Decision(Bound("lower", ">=", CLIP_RATIO), Bound("upper", "<", CLIP_RATIO))
"""C2: the ratio of clip fractions against CLIP_RATIO."""
COLLAPSE_MARGIN = 0.5
"""C3, C4: the excess collapse rate (without Routing Replay minus with it) that "unstable" means here. The paper's GRPO
without Routing Replay does not converge at all (its Figure 3); an excess below half of the runs is not that claim."""
RATE_INTERVAL = (
    "Newcombe's hybrid score interval for a difference of proportions (Wilson intervals per group; a bootstrap over "
    "seeds would be [0, 0] whenever no run collapsed, whatever the number of runs)"
)
"""How the 95% interval of a collapse-rate difference is computed (intervals.rate_difference), as the rules say it."""
COLLAPSE_DECISION = Decision(
    Bound("lower", ">", 0.0, "GRPO without Routing Replay collapses more often"),
    Bound("upper", "<", COLLAPSE_MARGIN, f"the data exclude an excess collapse rate of {COLLAPSE_MARGIN:g} or more"),
)
"""C3: collapse rate of GRPO without Routing Replay minus with it (interval: RATE_INTERVAL)."""
REPLAY_GAIN_DECISION = Decision(
    Bound("upper", "<", EQUIV_MARGIN, "replay gains less than seed noise"), Bound("lower", ">", EQUIV_MARGIN)
)
"""C4: reward of GSPO with Routing Replay minus without it, against the noise margin."""
FREE_COLLAPSE_DECISION = Decision(
    Bound("upper", "<", COLLAPSE_MARGIN, f"the data exclude an excess collapse rate of {COLLAPSE_MARGIN:g} or more"),
    Bound("lower", ">", 0.0, "GSPO without Routing Replay collapses more often"),
)
"""C4: collapse rate of GSPO without Routing Replay minus with it (interval: RATE_INTERVAL)."""


def runs_to_exclude(margin: float = COLLAPSE_MARGIN) -> int:
    """The fewest runs without Routing Replay, none of them collapsed, from which the 95% interval of the collapse-rate
    difference ends below `margin` (when the replay partner had no collapse either, whatever its number of runs: the
    upper bound is then the Wilson bound z^2 / (n + z^2)). Fewer runs cannot decide C3 against the claim, nor C4 for
    it."""
    n = 1
    while intervals.rate_difference(0, n, 0, 1).high >= margin:
        n += 1
    return n


DECISIONS = {
    "C1": (POSITIVE,),
    "C2": (CLIP_DECISION,),
    "C3": (COLLAPSE_DECISION,),
    "C4": (REPLAY_GAIN_DECISION, FREE_COLLAPSE_DECISION),
    "C5": (POSITIVE,),
    "C6": (POSITIVE,),
}
"""The decisions each claim's verdict is read from (their sentences are quoted in the claim's rule)."""
CLAIMS = {
    "C1": "GSPO trains more efficiently than GRPO at equal compute.",
    "C2": "GSPO's clipped-token fraction is >= 10x GRPO's.",
    "C3": "GRPO without Routing Replay is unstable on MoE; with it, it converges.",
    "C4": "GSPO needs no Routing Replay.",
    "C5": "GSPO tolerates inference-engine log-probs as pi_old (precision mismatch) better than GRPO.",
    "C6": "Performance keeps improving with more compute and longer generation length.",
}


@dataclass(frozen=True)
class Rules:
    """The scorecard's settable thresholds: the preconditions of the claims that need a regime
    (analysis.stats.regime)."""

    min_volatility: float = regime.MIN_VOLATILITY
    """C3, C4: routing volatility in the off-policy minibatches, fraction of expert slots changed since pi_old."""
    min_mismatch: float = regime.MIN_MISMATCH
    """C5: engine/trainer mismatch, mean |logp_train_old - logp_rollout| per response token (nats)."""

    def __post_init__(self) -> None:
        for name in ("min_volatility", "min_mismatch"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"Rules.{name} = {v!r}: a finite number >= 0")


RULES = Rules()
"""The default rules."""


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
    regime: str = ""
    """Where the claim has a precondition (analysis.stats.regime) and some stratum with data did not reach it: the
    measured value against the threshold, e.g. "routing volatility 0.41% of expert slots changed since pi_old (n=12
    runs), below the 5% the claim needs"; "" otherwise."""
    split: str = TRAIN
    """The data the verdict is read on (SPLITS): "train" (the training reward or a training metric), "validation"
    (eval_in_dist / eval_hard, the held-out sets the design was chosen on) or "test" (test_in_dist)."""
    pairing: str = ""
    """How the compared runs are paired and what the unit of replication is (e.g. "unpaired (Welch); unit: run")."""
    role: str = EXPLORATORY
    """PRIMARY or SECONDARY: decided from a comparison the sweep file declared before its runs
    (analysis.claims.declared), and the runs match the declaration; EXPLORATORY otherwise."""
    declared: str = ""
    """The declared comparison(s) the verdict was decided from ("" when none was declared for the claim)."""
    deviations: tuple[str, ...] = ()
    """How the finished runs differ from the declared comparison (analysis.claims.declared.deviations): the verdict is
    then exploratory."""
    paper: str = ""
    """The measured size read beside the paper's (C2: "direction supported, size 0.6 of the paper's"; C6: truncation's
    part beside RL's), "" when the claim has none."""

    @property
    def strata_summary(self) -> str:
        """E.g. "4 strata: supported 2, contradicted 1, no data 1"; "" when the claim was not stratified."""
        if len(self.strata) <= 1:
            return ""
        counts = {v: sum(s.verdict == v for s in self.strata) for v in VERDICTS}
        return f"{len(self.strata)} strata: " + ", ".join(f"{v} {c}" for v, c in counts.items() if c)

    def __post_init__(self) -> None:
        if not self.pairing:
            self.pairing = PAIRING.get(self.claim, "")

    @property
    def reading(self) -> str:
        """The verdict with how it was read: "exploratory: supported" (no declared comparison, or runs that deviate
        from it: a finding to confirm, not a confirmation), "primary: supported" (the declared comparison); "not
        tested in regime" unprefixed (no reading at all)."""
        if self.verdict == NOT_IN_REGIME:
            return self.verdict
        if self.declared:  # the verdict is the declared comparison's, about its declared gap (declared.READING)
            return f"{self.role}, declared {self.declared}: declared gap {self.verdict}"
        return f"{self.role}: {self.verdict}"

    @property
    def design(self) -> str:
        """The split, the pairing and the role in one line, e.g. "split: train; unpaired (Welch); unit: run;
        exploratory (no declared comparison)"."""
        if self.role == EXPLORATORY:
            why = f"the runs deviate from {self.declared}" if self.deviations else "no declared comparison"
            role = f"exploratory ({why})"
        else:
            role = f"{self.role} (declared comparison {self.declared})"
        split = " + ".join(f"{x} ({SPLITS[x]})" for x in self.split.split(" + ") if x in SPLITS) or self.split
        return f"split: {split}; {self.pairing}; {role}"

    @property
    def label(self) -> str:
        """The reading with its reason when inconclusive or not tested in regime, e.g. "exploratory: inconclusive:
        not in this study (gspo absent)"."""
        if (self.verdict in (INCONCLUSIVE, NOT_IN_REGIME) or self.declared) and self.reason:
            return f"{self.reading}: {self.reason}"
        return self.reading


# --- helpers ----------------------------------------------------------------------------------------------------------
def _replay_partner_in(name: str, present: Sequence[str]) -> str | None:
    """The registry's Routing Replay partner of `name` (algorithms.replay_partner) when the study ran it."""
    partner = names.registry().replay_partner(name)
    return partner if partner in present else None


def _free_of(name: str, present: Sequence[str]) -> str | None:
    """`name` itself when present and its routing is free (checked in the registry)."""
    return name if name in present and names.registry().get(name).routing == "free" else None


def _absent(claim: str, rule: str, what: str) -> ClaimResult:
    return ClaimResult(claim, CLAIMS[claim], INCONCLUSIVE, rule, [], f"{NOT_IN_STUDY} ({what})")


def _usable_ids(study: Study) -> set[str]:
    """Ids of the runs that carry evidence: everything but failed (infrastructure) and unknown-state runs."""
    return set(study.runs.loc[usable(study.runs), RUN_ID].astype(str))


def _final_reward_at_common_compute(
    study: Study, groups: dict[str, pd.Series], metric: str = vocab.REWARD, *, seeds: dict[str, list] | None = None
) -> tuple[dict[str, np.ndarray], float]:
    """Per group (a boolean mask over study.runs): each run's `design.compute_window` of `metric` (the last
    FINAL_FRAC of compute) with C the compute every group reached (the least, over the groups, of each group's longest
    run: "equal compute"), so the window is the same compute range for every run (FINAL_RULE). A collapsed run that
    stopped before the window is held at its last value (it does not get to skip the compute it failed at); failed
    runs are excluded. `seeds`, when given, receives each group's run seeds in the order of its values (for paired
    comparisons)."""
    usable_ids = _usable_ids(study)
    ids = {g: set(study.runs.loc[m, RUN_ID].astype(str)) & usable_ids for g, m in groups.items()}
    members = set().union(*ids.values())
    rows = curves.metric_rows(study.long, metric)
    rows = rows[rows[RUN_ID].astype(str).isin(members)]
    if rows.empty:
        return {g: np.array([]) for g in groups}, np.nan
    runs = study.runs.set_index(study.runs[RUN_ID].astype(str))
    c_end = min(
        (float(runs.loc[list(v), "last_compute"].max()) for v in ids.values() if v),
        default=np.nan,
    )
    win = design.compute_window(rows, metric, frac=FINAL_FRAC, budget=c_end)
    value = dict(zip(win[RUN_ID].astype(str), win["value"].astype(float), strict=True))
    last = curves.training_rows(rows).groupby(RUN_ID, observed=True, sort=False)["value"].last()
    last = {str(k): float(v) for k, v in last.items()}
    out = {}
    for g, member in ids.items():
        order = [r for r in win[RUN_ID].astype(str) if r in member]
        vals = []
        for r in order:
            v = value[r]
            if not np.isfinite(v) and runs.loc[r, "state"] == "collapsed":
                v = last.get(r, np.nan)
            vals.append(v)
        if seeds is not None:
            seeds[g] = [runs.loc[r, "seed"] for r in order]
        out[g] = np.asarray(vals, np.float64)
    return out, c_end


def _ci(ci: intervals.CI) -> tuple[float, float, float]:
    return ci.estimate, ci.low, ci.high


def _difference(
    vals: dict[str, np.ndarray], seeds: dict[str, list], a: str, b: str, *, log: bool = False
) -> tuple[float, float, float, str]:
    """mean(a) - mean(b) (with `log`, the ratio mean(a) / mean(b)) with its interval and n: paired by seed (the
    differences within each seed both arms ran, then a t interval over seeds; with `log` the per-seed log ratios,
    exponentiated) when the arms share at least two seeds and neither has a seed twice (`_paired`), else over
    independent runs (Welch; `intervals.ratio_ci` with `log`)."""
    pairs = _paired([vals[a], vals[b]], [seeds[a], seeds[b]])
    if pairs is not None and (not log or (pairs > 0).all()):
        n = f"{len(pairs)} seeds, paired"
        if log:
            ci = intervals.mean_ci(np.log(pairs[:, 0]) - np.log(pairs[:, 1]))
            return float(np.exp(ci.estimate)), float(np.exp(ci.low)), float(np.exp(ci.high)), n
        return (*_ci(intervals.mean_ci(pairs[:, 0] - pairs[:, 1])), n)
    ci = intervals.ratio_ci(vals[a], vals[b]) if log else intervals.mean_difference(vals[a], vals[b])
    return (*_ci(ci), _n(vals[a], vals[b]))


def _n(*xs: np.ndarray) -> str:
    return " vs ".join(str(int(np.isfinite(x).sum())) for x in xs)


def _alg_mask(study: Study, name: str) -> pd.Series:
    return study.runs[ALGORITHM].astype(str) == name


def _finish(
    claim: str,
    rule: str,
    strat: Stratification,
    strata: list[Stratum],
    pooled: Evaluate | None,
    *,
    own: Sequence[str] = (),
) -> ClaimResult:
    """The claim's result from its per-stratum verdicts (strata.outcome); the rule says how it was stratified."""
    verdict, evidence, reason = outcome(strat, strata, pooled)
    return ClaimResult(claim, CLAIMS[claim], verdict, rule + strat.text(own), evidence, reason, strata)


def comparison_pairs(present: Sequence[str]) -> list[tuple[str, str, str]]:
    """(minuend, subtrahend, claim) of the algorithm comparisons the claims make that `present` allows, in claim
    order: C1 GSPO minus the GRPO baseline (with Routing Replay when present); C3 and C4 each algorithm's Routing
    Replay partner (the registry's) minus the algorithm, for GRPO and GSPO. The routing-volatility figure draws these
    gaps, so it compares what the claims compare."""
    out = []
    base = _grpo_baseline(present)
    if GSPO in present and base is not None:
        out.append((GSPO, base, "C1"))
    for name, claim in ((GRPO, "C3"), (GSPO, "C4")):
        free = _free_of(name, present)
        rr = _replay_partner_in(name, present) if free else None
        if free and rr:
            out.append((rr, free, claim))
    return out


def _grpo_baseline(present: Sequence[str]) -> str | None:
    """The paper's GRPO baseline of Figures 1-2: GRPO with Routing Replay (registry partner), else plain GRPO."""
    if GRPO not in present:
        return None
    return _replay_partner_in(GRPO, present) or GRPO


def _present(study: Study) -> list[str]:
    return list(study.runs[ALGORITHM].dropna().astype(str).unique())


# --- regimes: a claim tested only where its precondition was measured (analysis.stats.regime) -----------------------
def _measure_strata(
    study: Study, strat: Stratification, groups: dict[str, pd.Series], pre: regime.Precondition
) -> dict[int, regime.Measured]:
    """The precondition measured in every stratum over the usable runs of the compared groups, keyed by the id of the
    stratum's mask (what `run_strata` hands the claim's evaluate)."""
    ok = usable(study.runs)
    out = {}
    for _, mask in strat.strata:
        inside = ok & mask & pd.concat(list(groups.values()), axis=1).any(axis=1)
        out[id(mask)] = pre.measure(study, study.runs.loc[inside, RUN_ID].astype(str))
    return out


def _regime_verdict(
    verdict: str, evidence: list[Evidence], measured: regime.Measured | None
) -> tuple[str, list[Evidence]]:
    """A stratum's verdict and evidence with its precondition: below it, NOT_IN_REGIME with the measured value first;
    in it, the verdict with the measured value last. Without a measurement (the pooled reference) unchanged."""
    if measured is None:
        return verdict, evidence
    if not measured.met:
        return NOT_IN_REGIME, [measured.evidence(), *evidence]
    return verdict, [*evidence, measured.evidence()]


def _regime_note(strata: Sequence[Stratum], measured: dict[int, regime.Measured], strat: Stratification) -> str:
    """The measured values of the strata that did not reach the regime, against the threshold ("" when all did)."""
    below = [measured[id(m)] for (_, m), s in zip(strat.strata, strata, strict=True) if s.verdict == NOT_IN_REGIME]
    if not below:
        return ""
    if len(strata) == 1:
        return below[0].sentence
    pre = below[0].precondition
    values = [b.ci.estimate for b in below if b.ci.n]
    what = (
        f"{pre.fmt(min(values))}" + (f" to {pre.fmt(max(values))}" if len(values) > 1 else "") + f" {pre.unit}"
        if values
        else f"not measured (no compared run logged a finite {pre.metric})"
    )
    of = f" {pre.name}" if pre.name else ""
    ref = f" ({pre.reference})" if pre.reference else ""
    return (
        f"{pre.quantity}{of} {what} in {len(below)} of {len(strata)} strata, below the {pre.fmt(pre.threshold)}{of} "
        f"the claim needs{ref}"
    )


def _with_regime(res: ClaimResult, note: str, scale: str = "") -> ClaimResult:
    """The claim's result with its regime note; when no stratum was tested, the reason is the note (and `scale`, what
    the runs below the regime showed at this scale)."""
    res.regime = note
    if res.verdict == NOT_IN_REGIME:
        res.reason = note + (f"; {scale}" if scale else "")
    elif note:
        res.reason = f"{res.reason}; not tested in regime: {note}" if res.reason else f"not tested in regime: {note}"
    return res


def _collapses_at_this_scale(free: str, rr: str, counts: Sequence[Counts]) -> str:
    """What the runs below the regime showed: "at this scale grpo collapsed in 0 of 6 runs and grpo_rr in 0 of 6:
    evidence about this scale, not a test of the claim"."""
    if not counts:
        return ""
    k1, n1 = sum(c[0] for c in counts), sum(c[1] for c in counts)
    k2, n2 = sum(c[2] for c in counts), sum(c[3] for c in counts)
    return (
        f"below the regime, {free} collapsed in {k1} of {n1} runs and {rr} in {k2} of {n2}: evidence about this "
        "scale, not a test of the claim"
    )


# --- claims -----------------------------------------------------------------------------------------------------------
def claim_c1(study: Study) -> ClaimResult:
    """C1: GSPO's final reward at equal compute minus the GRPO baseline's, per stratum."""
    present = _present(study)
    base = _grpo_baseline(present)
    rule = (
        "d = mean reward of GSPO minus GRPO (with Routing Replay when present, else without) over "
        f"{FINAL_RULE} (failed runs excluded), within each seed both ran, then over seeds (paired; else over "
        f"independent runs, Welch); {POSITIVE}."
    )
    if GSPO not in present or base is None:
        return _absent("C1", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.REWARD not in study.metrics:
        return _absent("C1", rule, f"metric {vocab.REWARD} not logged")
    groups = {GSPO: _alg_mask(study, GSPO), base: _alg_mask(study, base)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        seeds: dict[str, list] = {}
        vals, c_end = _final_reward_at_common_compute(study, {g: m & mask for g, m in groups.items()}, seeds=seeds)
        est, lo, hi, n = _difference(vals, seeds, GSPO, base)
        ev = [
            Evidence(f"reward({GSPO}) - reward({base}) at {c_end:.3g} FLOPs", est, lo, hi, n),
            _mean_ev(f"reward({GSPO})", vals[GSPO]),
            _mean_ev(f"reward({base})", vals[base]),
        ]
        return POSITIVE(lo, hi), ev

    strat = stratify(study, groups)
    return _finish("C1", rule, strat, run_strata(study, strat, groups, evaluate), evaluate)


def claim_c2(study: Study) -> ClaimResult:
    """C2: ratio of mean clipped-token fractions, GSPO over the GRPO baseline, per stratum."""
    present = _present(study)
    base = _grpo_baseline(present)
    rule = (
        f"r = GSPO's mean clip fraction / GRPO's (with Routing Replay when present), each the mean over all steps "
        "per run; paired, the geometric mean over seeds both ran of the per-seed ratio (a t interval on the log "
        f"scale), else the ratio of the means over seeds (Welch on the log scale); {CLIP_DECISION}. Beside it, the "
        "ratio against the paper's ~"
        f"{design.PAPER_CLIP_RATIO:g}x (two orders of magnitude): 'direction supported' when the interval lies above "
        "1, and the size as log(ratio) / log(paper's) (1 = the paper's orders of magnitude)."
    )
    if GSPO not in present or base is None:
        return _absent("C2", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.CLIP not in study.metrics:
        return _absent("C2", rule, f"metric {vocab.CLIP} not logged")
    per_run = curves.run_mean(study.long, vocab.CLIP)
    usable_ids = _usable_ids(study)
    per_run = per_run[per_run[RUN_ID].astype(str).isin(usable_ids)]
    alg, rid = per_run[ALGORITHM].astype(str), per_run[RUN_ID].astype(str)
    groups = {GSPO: _alg_mask(study, GSPO), base: _alg_mask(study, base)}
    seed_of = dict(zip(study.runs[RUN_ID].astype(str), study.runs["seed"], strict=True)).get

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        inside = rid.isin(set(study.runs.loc[mask, RUN_ID].astype(str)))
        rows = {g: per_run[inside & (alg == g)] for g in (GSPO, base)}
        vals = {g: r["value"].to_numpy(np.float64) for g, r in rows.items()}
        seeds = {g: r[RUN_ID].astype(str).map(seed_of).tolist() for g, r in rows.items()}
        x, y = vals[GSPO], vals[base]
        est, lo, hi, n = _difference(vals, seeds, GSPO, base, log=True)
        size = design.size_against_paper(intervals.CI(est, lo, hi, min(x.size, y.size), 0.95))
        ev = [
            Evidence(f"clip_frac({GSPO}) / clip_frac({base})", est, lo, hi, n),
            _mean_ev(f"clip_frac({GSPO})", x),
            _mean_ev(f"clip_frac({base})", y),
            Evidence(f"{PAPER_SIZE}: {size.sentence}", size.size_of_paper, np.nan, np.nan, _n(x, y)),
        ]
        return CLIP_DECISION(lo, hi), ev

    strat = stratify(study, groups)
    res = _finish("C2", rule, strat, run_strata(study, strat, groups, evaluate), evaluate)
    sizes = [e for st_ in res.strata for e in st_.evidence if e.name.startswith(PAPER_SIZE)]
    vals = [e.estimate for e in sizes if np.isfinite(e.estimate)]
    if len(sizes) == 1:
        res.paper = sizes[0].name.removeprefix(f"{PAPER_SIZE}: ")
    elif vals:
        res.paper = (
            f"size {min(vals):.2g} to {max(vals):.2g} of the paper's ~{design.PAPER_CLIP_RATIO:g}x over "
            f"{len(vals)} strata (log scale; per stratum in the evidence)"
        )
    return res


def _collapsed(study: Study) -> pd.DataFrame:
    """Per usable run: 1.0 when it collapsed (reported in status.json or detected in the reward), else 0.0."""
    coll = collapse.collapse_table(study.long, study.runs, vocab.REWARD)
    coll = coll[usable(coll)]
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


Counts = tuple[int, int, int, int]
"""(collapsed, runs) without Routing Replay, then (collapsed, runs) with it, in one stratum."""


def _rate_evidence(
    coll: pd.DataFrame, study: Study, mask: pd.Series, free: str, rr: str
) -> tuple[intervals.CI, list[Evidence], Counts]:
    """The collapse-rate difference free - rr in one stratum (intervals.rate_difference), its evidence lines (the
    difference, then each group's rate with its Wilson interval) and the counts."""
    a, b = _rates(coll, study, mask, free), _rates(coll, study, mask, rr)
    k1, n1, k2, n2 = int(a.sum()), a.size, int(b.sum()), b.size
    d = intervals.rate_difference(k1, n1, k2, n2)
    ev = [Evidence(f"collapse_rate({free}) - collapse_rate({rr})", d.estimate, d.low, d.high, f"{n1} vs {n2}")]
    for name, k, n in ((free, k1, n1), (rr, k2, n2)):
        lo, hi = intervals.wilson_interval(k, n)
        ev.append(Evidence(f"collapse_rate({name}), {k} of {n}", k / n if n else np.nan, lo, hi, str(n)))
    return d, ev, (k1, n1, k2, n2)


def _too_few(res: ClaimResult, free: str, counts: Sequence[Counts], *, direction: str, lead: str = "") -> ClaimResult:
    """An inconclusive collapse comparison says why: the runs per undecided stratum (`counts`), and how many runs
    without a collapse it would take to decide `direction`; unstratified, the reason is `lead` then that."""
    if not counts or res.reason.startswith(NOT_IN_STUDY):
        return res
    sizes = " or ".join(str(n) for n in sorted({n1 for _, n1, _, _ in counts}))
    fell = sum(k1 + k2 for k1, _, k2, _ in counts)
    collapsed = "no compared run collapsed" if not fell else f"{fell} of the compared runs collapsed"
    strata = "" if len(res.strata) <= 1 else f" in each of the {len(counts)} undecided strata"
    n_min = runs_to_exclude()
    if all(n1 < n_min for _, n1, _, _ in counts):
        why = (
            f"too few runs: {sizes} run(s) of {free}{strata}, {collapsed}; with no collapse it takes at least {n_min} "
            f"runs of {free} for the interval to exclude an excess collapse rate of {COLLAPSE_MARGIN:g} ({direction})"
        )
    else:
        why = (
            f"{sizes} run(s) of {free}{strata}, {collapsed}: the interval neither excludes 0 nor an excess collapse "
            f"rate of {COLLAPSE_MARGIN:g}"
        )
    res.reason = f"{lead}{why}" if len(res.strata) <= 1 else f"{res.reason}; {why}"
    return res


def claim_c3(study: Study, rules: Rules = RULES) -> ClaimResult:
    """C3: collapse rate of GRPO without Routing Replay minus with it, per stratum, where the routing moved enough
    (the volatility precondition)."""
    pre = regime.volatility(rules.min_volatility)
    rule = (
        "d = collapse rate (status.json or the reward-drop rule) of GRPO without Routing Replay minus GRPO with it "
        f"(the registry's replay partner: same loss, routing=replay), its 95% interval {RATE_INTERVAL}; "
        f"{COLLAPSE_DECISION}. Unstable means an excess collapse rate of {COLLAPSE_MARGIN:g} or more; with no "
        f"collapse in either group the interval ends below {COLLAPSE_MARGIN:g} only from {runs_to_exclude()} runs "
        f"without Routing Replay, so fewer runs without a collapse are inconclusive, not a contradiction. {pre.rule}"
    )
    return _replay_claim(study, "C3", GRPO, rule, pre, collapse=COLLAPSE_DECISION, direction="against the claim")


def claim_c4(study: Study, rules: Rules = RULES) -> ClaimResult:
    """C4: GSPO without Routing Replay neither collapses more often nor trails GSPO with it by more than the noise
    margin, where the routing moved enough (the volatility precondition)."""
    pre = regime.volatility(rules.min_volatility)
    rule = (
        f"g = reward of GSPO with Routing Replay minus without it, over {FINAL_RULE}, paired by seed where both ran "
        "the same seeds (else Welch); c = collapse rate "
        "(status.json or the reward-drop rule) of "
        f"GSPO without Routing Replay minus with it, its 95% interval {RATE_INTERVAL}. g: {REPLAY_GAIN_DECISION}. "
        f"c: {FREE_COLLAPSE_DECISION}; with no collapse in either group c's interval ends below {COLLAPSE_MARGIN:g} "
        f"only from {runs_to_exclude()} runs without Routing Replay. The claim: {CONJUNCTION_RULE}. {pre.rule}"
    )
    return _replay_claim(
        study,
        "C4",
        GSPO,
        rule,
        pre,
        collapse=FREE_COLLAPSE_DECISION,
        gain=REPLAY_GAIN_DECISION,
        direction="for the claim",
    )


def _replay_claim(
    study: Study,
    claim: str,
    name: str,
    rule: str,
    pre: regime.Precondition,
    *,
    collapse: Decision,
    gain: Decision | None = None,
    direction: str,
) -> ClaimResult:
    """C3 and C4: algorithm `name` without Routing Replay against its Routing Replay partner (the registry's), per
    stratum, tested where the precondition `pre` (the routing volatility) holds. A stratum's verdict is `collapse` on
    the collapse-rate difference (without minus with replay); with `gain`, also the reward of the partner minus the
    algorithm's at equal compute, the two joined by `conjunction`. An inconclusive collapse comparison says how many
    runs would decide it `direction` (`_too_few`)."""
    present = _present(study)
    free = _free_of(name, present)
    rr = _replay_partner_in(name, present) if name in present else None
    if free is None or rr is None:
        return _absent(claim, rule, f"{name} and its Routing Replay partner not both present")
    if vocab.REWARD not in study.metrics:
        return _absent(claim, rule, f"metric {vocab.REWARD} not logged")
    coll = _collapsed(study)
    groups = {free: _alg_mask(study, free), rr: _alg_mask(study, rr)}
    undecided: list[Counts] = []
    below: list[Counts] = []
    strat = stratify(study, groups)
    measured = _measure_strata(study, strat, groups, pre)

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        d, ev, counts = _rate_evidence(coll, study, mask, free, rr)
        collapse_verdict = verdict = collapse(d.low, d.high)
        if gain is not None:
            seeds: dict[str, list] = {}
            groups_in = {g: gm & mask for g, gm in groups.items()}
            vals, c_end = _final_reward_at_common_compute(study, groups_in, seeds=seeds)
            est, lo, hi, n = _difference(vals, seeds, rr, free)
            reward = Evidence(f"reward({rr}) - reward({free}) at {c_end:.3g} FLOPs", est, lo, hi, n)
            ev = [reward, *ev]
            verdict = conjunction([gain(lo, hi), collapse_verdict])
        verdict, ev = _regime_verdict(verdict, ev, measured.get(id(mask)))
        if verdict == NOT_IN_REGIME:
            below.append(counts)
        elif collapse_verdict == INCONCLUSIVE and id(mask) in measured:  # not the pooled reference outcome() adds
            undecided.append(counts)
        return verdict, ev

    strata = run_strata(study, strat, groups, evaluate)
    res = _finish(claim, rule, strat, strata, evaluate)
    if res.verdict == INCONCLUSIVE:  # unstratified with a reward part, the collapse line leads the reason
        lead = f"{res.evidence[1]}: " if gain is not None and len(res.strata) <= 1 and len(res.evidence) > 1 else ""
        res = _too_few(res, free, undecided, direction=direction, lead=lead)
    return _with_regime(res, _regime_note(strata, measured, strat), _collapses_at_this_scale(free, rr, below))


def claim_c5(study: Study, rules: Rules = RULES, *, axis: str = vocab.OLD_LOGP_AXIS) -> ClaimResult:
    """C5: GRPO's reward drop from using the engine's log-probs as pi_old minus GSPO's drop, per stratum, where the
    engines disagree enough (the mismatch precondition)."""
    present = _present(study)
    pre = regime.mismatch(rules.min_mismatch)
    rule = (
        f"drop(alg) = final-window reward ({FINAL_RULE}) with {axis}=recompute minus with {axis}=rollout "
        "(engine log-probs as pi_old); "
        "d = drop(GRPO) - drop(GSPO), both without Routing Replay (replaying the recompute's routes needs the "
        f"recompute); {POSITIVE}. When all four arms ran the same seeds (a seed fixes the prompts and the sampling "
        "seeds of every arm), d is computed within each seed, then its mean and t interval over seeds (paired; a seed "
        "some arm lacks is left out); with fewer than two such seeds the four groups are independent (Welch). "
        + pre.rule
    )
    if GSPO not in present or GRPO not in present:
        return _absent("C5", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if axis not in study.axes or not {"recompute", "rollout"} <= set(study.runs[axis].astype(str)):
        return _absent("C5", rule, f"axis {axis} with values recompute and rollout not swept")
    if vocab.REWARD not in study.metrics:
        return _absent("C5", rule, f"metric {vocab.REWARD} not logged")
    src = study.runs[axis].astype(str)
    groups = {f"{a}|{s}": _alg_mask(study, a) & (src == s) for a in (GRPO, GSPO) for s in ("recompute", "rollout")}

    names = [f"{GRPO}|recompute", f"{GRPO}|rollout", f"{GSPO}|recompute", f"{GSPO}|rollout"]
    strat = stratify(study, groups, exclude=[axis])
    measured = _measure_strata(study, strat, groups, pre)

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        seeds: dict[str, list] = {}
        vals, _ = _final_reward_at_common_compute(study, {g: m & mask for g, m in groups.items()}, seeds=seeds)
        g = [vals[k] for k in names]
        paired = _paired(g, [seeds[k] for k in names])
        if paired is not None:  # every arm ran the same seeds: the contrast per seed, then over seeds
            d = paired @ np.array([1.0, -1.0, -1.0, 1.0])
            ci = intervals.mean_ci(d)
            est, lo, hi, n = ci.estimate, ci.low, ci.high, f"{d.size} seeds, paired"
            det = power.detectable([d], (1,))
            needed = power.seeds_needed([d], (1,), power.TARGET)
            size = Evidence(power.sentence("drop(grpo) - drop(gspo)", det, needed), det.mdd, np.nan, np.nan, n)
        else:
            est, lo, hi = _ci(intervals.contrast_ci(g, (1, -1, -1, 1)))
            n = _n(*g)
            size = _detectable_ev("drop(grpo) - drop(gspo)", g, (1, -1, -1, 1))
        ev = [
            Evidence("drop(grpo) - drop(gspo)", est, lo, hi, n),
            Evidence("drop(grpo)", *_ci(intervals.mean_difference(g[0], g[1])), _n(g[0], g[1])),
            Evidence("drop(gspo)", *_ci(intervals.mean_difference(g[2], g[3])), _n(g[2], g[3])),
            size,
        ]
        return _regime_verdict(POSITIVE(lo, hi), ev, measured.get(id(mask)))

    strata = run_strata(study, strat, groups, evaluate)
    res = _with_power(_finish("C5", rule, strat, strata, evaluate, own=[axis]))
    return _with_regime(res, _regime_note(strata, measured, strat))


def claim_c6(study: Study, *, axis: str = vocab.LENGTH_AXIS) -> ClaimResult:
    """C6: GSPO's reward still rises over the last half of training, and is higher at the longest generation length;
    each part per stratum of the other swept axes, combined by STRATA_RULE, then the parts combined."""
    present = _present(study)
    rule = (
        "For GSPO: (a) compute gain = per-run mean reward over the last quarter of its logged steps minus over the "
        f"third quarter; (b) RL's length gain = the held-out gain (eval_in_dist's last evaluation minus its step-0 "
        f"evaluation of the cold start, per run) at the largest {axis} minus at the smallest (Welch: each length its "
        "own runs), with RL's gain at each length; truncation's part (the cold start's difference between the two "
        "lengths: what the budget does before any RL) is reported beside it and does not decide; without step-0 "
        f"evaluations, the final-window reward ({FINAL_RULE}) at the largest minus at the smallest. Each "
        f"gain: {POSITIVE}. The claim: {CONJUNCTION_RULE} (the length part is inconclusive when {axis} is not swept)."
    )
    if GSPO not in present:
        return _absent("C6", rule, f"{GSPO} absent")
    if vocab.REWARD not in study.metrics:
        return _absent("C6", rule, f"metric {vocab.REWARD} not logged")
    usable_ids = _usable_ids(study)
    rows = curves.metric_rows(study.long, vocab.REWARD)
    rows = rows[(rows[ALGORITHM].astype(str) == GSPO) & rows[RUN_ID].astype(str).isin(usable_ids)]
    gains: dict[str, float] = {}
    for rid, r in rows.groupby(RUN_ID, observed=True, sort=False):
        v = r["value"].to_numpy(np.float64)
        q = len(v) // 4
        if q >= 1:
            gains[str(rid)] = v[-q:].mean() - v[-2 * q : -q].mean()
    gspo = {GSPO: _alg_mask(study, GSPO)}

    def compute_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        ids = set(study.runs.loc[mask & gspo[GSPO], RUN_ID].astype(str))
        x = np.asarray([g for r, g in gains.items() if r in ids])
        ci = intervals.mean_ci(x)
        if ci.n == 0:
            return None
        name = "compute gain (last vs third quarter)"
        ev = [Evidence(name, ci.estimate, ci.low, ci.high, str(ci.n)), _detectable_ev(name, [x], (1,))]
        return POSITIVE(ci.low, ci.high), ev

    held = gain.per_run(study.long, vocab.EVAL_IN_DIST) if vocab.EVAL_IN_DIST in study.metrics else pd.DataFrame()
    truncation: list[str] = []

    def length_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        m = gspo[GSPO] & mask & study.runs[RUN_ID].astype(str).isin(usable_ids)
        lens = study.runs.loc[m, axis]
        if lens.nunique() < 2:
            return None
        lo_v, hi_v = lens.min(), lens.max()
        ids = set(study.runs.loc[m & study.runs[axis].isin([lo_v, hi_v]), RUN_ID].astype(str))
        g = held[held[RUN_ID].astype(str).isin(ids)] if len(held) else held
        if len(g) and g[axis].nunique() >= 2:  # RL's part: the held-out gain at each length
            dec = design.length_decomposition(g, axis=axis)
            at = {x: g.loc[g[axis].astype(float) == x, "value"].to_numpy(np.float64) for x in (dec.long, dec.short)}
            n = dec.n
            name = f"RL's length gain ({axis} {hi_v} vs {lo_v}: held-out gain at the longest minus at the shortest)"
            tr = dec.truncation_part
            ev = [
                Evidence(name, *_ci(dec.rl_part), n),
                *(Evidence(f"RL's held-out gain at {axis}={x:g}", *_ci(ci), str(ci.n)) for x, ci in dec.gains.items()),
                Evidence(
                    f"truncation's part before RL (cold start at {axis}={hi_v} minus at {lo_v}; reported, not decided)",
                    *_ci(tr),
                    n,
                ),
                Evidence("final held-out difference (= truncation's part + RL's)", *_ci(dec.final_difference), n),
                _detectable_ev(name, [np.asarray(dec.rl_differences)], (1,))
                if dec.rl_differences
                else _detectable_ev(name, [at[dec.long], at[dec.short]], (1, -1)),
            ]
            truncation.append(
                f"truncation's part before RL (cold start at {axis}={hi_v} minus at {lo_v}) "
                f"{tr.estimate:+.3g} [{tr.low:+.3g}, {tr.high:+.3g}] beside RL's {dec.rl_part.estimate:+.3g} "
                f"[{dec.rl_part.low:+.3g}, {dec.rl_part.high:+.3g}]"
            )
            return POSITIVE(dec.rl_part.low, dec.rl_part.high), ev
        vals, _ = _final_reward_at_common_compute(  # no step-0 evaluation: the training reward's difference
            study, {"long": m & (study.runs[axis] == hi_v), "short": m & (study.runs[axis] == lo_v)}
        )
        est, lo, hi = _ci(intervals.mean_difference(vals["long"], vals["short"]))
        name = f"length gain, training reward ({axis} {hi_v} vs {lo_v}; no step-0 evaluation to split off truncation)"
        ev = [
            Evidence(name, est, lo, hi, _n(vals["long"], vals["short"])),
            _detectable_ev(name, [vals["long"], vals["short"]], (1, -1)),
        ]
        return POSITIVE(lo, hi), ev

    s_compute = stratify(study, gspo)
    strata = run_strata(study, s_compute, gspo, compute_part, part="compute")
    part_verdicts = [combine([s.verdict for s in strata])]
    no_compute = strata[0].verdict == NO_DATA and len(s_compute.strata) == 1
    compute_note = "no data (no GSPO run with at least 4 logged steps)" if no_compute else part_verdicts[0]
    swept = axis in study.axes and study.runs.loc[gspo[GSPO], axis].nunique() > 1
    if swept:
        s_length = stratify(study, gspo, exclude=[axis])
        length = run_strata(study, s_length, gspo, length_part, part="length")
        strata += length
        part_verdicts.append(combine([s.verdict for s in length]))
        text = f" (a) {s_compute.text().strip()} (b) {s_length.text([axis]).strip()}"
        reason = f"compute part {compute_note}, length part {part_verdicts[1]} (each combined over its strata)"
    else:
        part_verdicts.append(INCONCLUSIVE)
        reason = f"{NOT_IN_STUDY} (axis {axis} not swept for {GSPO}); compute part: {compute_note}"
        text = f" (a) {s_compute.text().strip()}"
    verdict = conjunction(part_verdicts)
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
    res = ClaimResult("C6", CLAIMS["C6"], verdict, rule + text, evidence, reason, strata)
    res.paper = "; ".join(truncation)
    res.split = f"{TRAIN} + {VALIDATION}" if truncation else TRAIN
    return _with_power(res)


def _paired(values: Sequence[np.ndarray], seeds: Sequence[Sequence]) -> np.ndarray | None:
    """(n seeds, groups) matrix of the groups' values aligned by seed, over the seeds every group has a finite value
    for (a seed some arm lacks is left out), when there are at least two such seeds and no group has a seed twice;
    else None (the comparison is then unpaired)."""
    maps = []
    for v, s in zip(values, seeds, strict=True):
        keep = [(k, x) for k, x in zip(s, v, strict=True) if np.isfinite(x)]
        m = dict(keep)
        if len(m) != len(keep):  # a seed twice in a group
            return None
        maps.append(m)
    common = set(maps[0]).intersection(*maps[1:])
    if len(common) < 2:
        return None
    order = sorted(common)
    return np.array([[m[k] for m in maps] for k in order], np.float64)


def _detectable_ev(name: str, groups: Sequence[np.ndarray], weights: Sequence[float]) -> Evidence:
    """The evidence line of the smallest |d| these seeds detect (power.py; estimate = that size, no interval)."""
    d = power.detectable(groups, weights)
    needed = power.seeds_needed(groups, weights, power.TARGET)
    return Evidence(power.sentence(name, d, needed), d.mdd, np.nan, np.nan, _n(*groups))


def detectable_lines(res: ClaimResult) -> list[Evidence]:
    """The claim's smallest-detectable-difference lines (one per stratum with data), stratum label filled in."""
    out = []
    for s in res.strata:
        label = s.label if len(res.strata) > 1 else ""
        out += [dataclasses.replace(e, stratum=label) for e in s.evidence if e.name.startswith(power.PREFIX)]
    return out


def _with_power(res: ClaimResult) -> ClaimResult:
    """An inconclusive claim's reason extended by the smallest difference its seeds could detect (the range over
    its strata), so that "inconclusive" says how large an effect would have been seen."""
    sizes = [e.estimate for e in detectable_lines(res) if np.isfinite(e.estimate)]
    if res.verdict != INCONCLUSIVE or not sizes:
        return res
    rng = f"{min(sizes):.3g}" + (f" to {max(sizes):.3g}" if len(sizes) > 1 else "")
    tail = f"these seeds detect a difference of {rng} or more ({power.POWER:.0%} power, {power.ALPHA:g} two-sided)"
    return dataclasses.replace(res, reason=f"{res.reason}; {tail}" if res.reason else tail)


def _mean_ev(name: str, x: np.ndarray) -> Evidence:
    ci = intervals.mean_ci(x)
    return Evidence(name, ci.estimate, ci.low, ci.high, str(ci.n))


CLAIM_FUNCTIONS = {"C1": claim_c1, "C2": claim_c2, "C3": claim_c3, "C4": claim_c4, "C5": claim_c5, "C6": claim_c6}


REGIME_CLAIMS = ("C3", "C4", "C5")
"""The claims with a precondition (analysis.stats.regime), whose functions take the scorecard's `Rules`."""


def scorecard(
    study: Study, rules: Rules = RULES, comparisons: Sequence[declared_.Comparison] = ()
) -> list[ClaimResult]:
    """Every claim C1-C6 of the GSPO paper (docs/references.md) evaluated on `study`; `rules` sets the regime
    thresholds of C3-C5. A claim some of `comparisons` (a sweep file's `comparisons:`, analysis.claims.declared)
    declares is decided from those comparisons only (`with_declared`); the others are exploratory."""
    cards = [fn(study, rules) if c in REGIME_CLAIMS else fn(study) for c, fn in CLAIM_FUNCTIONS.items()]
    return [with_declared(study, r, [c for c in comparisons if c.claim == r.claim]) for r in cards]


DECLARED_RULE = (
    "Decided from the sweep file's declared comparison(s) only (analysis.claims.declared.confirm): the declared "
    "metric and window per run, in the declared stratum and seeds, treatment minus control paired by seed (or Welch "
    "when declared unpaired), tested at the declared alpha in the declared direction (a family of one per comparison; "
    "several declared for one claim: Holm-adjusted, then combined: " + CONJUNCTION_RULE + "). The verdict is about "
    "the declared gap, not the claim it is filed under: " + declared_.READING + ". Runs that deviate from "
    "the declaration make the verdict exploratory, with each deviation listed."
)


def with_declared(study: Study, res: ClaimResult, comparisons: Sequence[declared_.Comparison]) -> ClaimResult:
    """`res` decided from the declared `comparisons` of its claim (none: `res` unchanged, exploratory): the verdict
    is `declared.confirm`'s (several: Holm-adjusted p-values, verdicts combined by `conjunction`), the split is the
    declared metric's, the pairing the declared one, the role the declaration's when the runs match it, else
    exploratory with `declared.deviations` listed; the exploratory reading is kept in the reason."""
    if not comparisons:
        return res
    confs, unread = [], {}
    for c in comparisons:
        try:
            confs.append(declared_.confirm(study.long, c, study.runs))
        except (KeyError, ValueError) as exc:  # the runs lack what the declaration reads: a deviation, no reading
            unread[c.name] = str(exc).strip("'\"")
            devs = tuple(declared_.deviations(study.long, c, study.runs)) or (f"{c.name}: {exc}",)
            nan = intervals.CI(np.nan, np.nan, np.nan, 0)
            confs.append(declared_.Confirmation(c, None, nan, np.nan, devs, INCONCLUSIVE, INCONCLUSIVE))
    adjusted = declared_.family(confs) if len(confs) > 1 else [c.p_value for c in confs]
    verdicts, evidence, sentences = [], [], []
    for conf, p in zip(confs, adjusted, strict=True):
        c = conf.comparison
        est = conf.estimate
        verdicts.append(declared_.read(p, est, c) if len(confs) > 1 else conf.reading)
        if c.name not in unread:
            sentences.append(_declared_sentence(conf, p, verdicts[-1]))
        pair = f"{est.n} seeds, paired" if c.pairing == "seed" else f"{est.n} runs, unpaired"
        name = f"{c.name}: {c.metric} ({c.window}) {c.axis}={c.treatment} - {c.axis}={c.control}"
        if c.name in unread:
            evidence.append(Evidence(f"{name}: no reading ({unread[c.name]})", np.nan, np.nan, np.nan, "0"))
            continue
        evidence.append(Evidence(name, est.estimate, est.low, est.high, pair))
        what = "Holm-adjusted p" if len(confs) > 1 else "p"
        evidence.append(Evidence(f"{c.name}: {what} ({c.alternative}, alpha {c.alpha:g})", p, np.nan, np.nan, pair))
    devs = tuple(d for conf in confs for d in conf.deviations)
    splits = {split_of(c.metric) for c in comparisons}
    roles = {c.role for c in comparisons}
    return dataclasses.replace(
        res,
        verdict=conjunction(verdicts) if len(verdicts) > 1 else verdicts[0],
        rule=f"{DECLARED_RULE} Exploratory reading, for reference: {res.rule}",
        evidence=evidence,
        reason="; ".join(sentences)
        + ("; " if sentences else "")
        + f"the exploratory reading of the whole study: {res.verdict}"
        + (f" ({res.reason})" if res.reason else ""),
        strata=[],
        split=splits.pop() if len(splits) == 1 else TEST if TEST in splits else VALIDATION,
        pairing=PAIRED if all(c.pairing == "seed" for c in comparisons) else UNPAIRED,
        role=EXPLORATORY if devs else (PRIMARY if PRIMARY in roles else SECONDARY),
        declared=", ".join(c.name for c in comparisons),
        deviations=devs,
        regime="",
    )


def _declared_sentence(conf: declared_.Confirmation, p: float, verdict: str) -> str:
    """What the declared comparison found, in words: its declared gap, the interval and the test."""
    c, est = conf.comparison, conf.estimate
    interval = f"{est.estimate:+.3g} [{est.low:+.3g}, {est.high:+.3g}]"
    if verdict == SUPPORTED:
        found = f"a difference with the declared gap's sign, {interval}, p = {p:.3g} < {c.alpha:g}"
    elif verdict == CONTRADICTED:
        found = f"the 95% interval {interval} excludes the declared gap (p = {p:.3g} against no difference)"
    else:
        found = f"{interval}: neither a difference at alpha {c.alpha:g} (p = {p:.3g}) nor the declared gap excluded"
    return f"{c.name} declared {declared_.hypothesis(c)}: {found}"


def scorecard_table(results: Sequence[ClaimResult]) -> pd.DataFrame:
    """One row per claim: claim, statement, verdict (its reading: role, verdict, reason when inconclusive), role
    (primary / secondary / exploratory), split (train / validation / test), pairing (with the unit of replication),
    deviations (from the declared comparison), strata (per-stratum verdict counts; "" when not stratified), evidence,
    rule."""
    return pd.DataFrame(
        {
            "claim": [r.claim for r in results],
            "statement": [r.statement for r in results],
            "verdict": [r.label for r in results],
            "role": [r.role for r in results],
            "split": [r.split for r in results],
            "pairing": [r.pairing for r in results],
            "deviations": ["; ".join(r.deviations) for r in results],
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
    "NOT_IN_REGIME",
    "NOT_IN_STUDY",
    "NO_DATA",
    "RULES",
    "STRATA_RULE",
    "SUPPORTED",
    "ClaimResult",
    "Evidence",
    "Rules",
    "Stratification",
    "Stratum",
    "claim_c1",
    "claim_c2",
    "claim_c3",
    "claim_c4",
    "claim_c5",
    "claim_c6",
    "combine",
    "comparison_pairs",
    "scorecard",
    "scorecard_table",
    "strata_table",
]
