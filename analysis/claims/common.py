"""What the claims C1-C6 share: a claim's result (`ClaimResult`) and the scorecard's thresholds (`Rules`), the
texts a verdict is described with (its split, its pairing, its role), the decisions each claim's verdict is read from
(DECISIONS, analysis.stats.verdicts: their sentences are quoted in the claims' rules), and the helpers several claims
use: the runs and algorithms compared, the final window at equal compute, a difference paired by seed where the arms
share seeds, the smallest difference the seeds detect, and the regime a claim is tested in (analysis.stats.regime).

The claims are about the paper's algorithms, so these modules name them (gspo, grpo); the Routing Replay partner of
an algorithm is the registry's (`algorithms.replay_partner`: same loss function, routing "replay"), never found by
name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID
from analysis.runs.tidy import Study
from analysis.stats import curves, intervals, power, regime
from analysis.stats.fit import A_NOISE
from analysis.stats.strata import Evaluate, Stratification, Stratum, outcome, usable
from analysis.stats.verdicts import INCONCLUSIVE, NOT_IN_REGIME, VERDICTS, Bound, Decision, Evidence

NOT_IN_STUDY = "not in this study"
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
FINAL_RULE = curves.window_rule(curves.WINDOW_FRAC, curves.COMMON_END)
"""The final window (the last 10% of the compute every compared group reached) as the claims that read it quote it
(C1, C4, C5, C6): `curves.compute_window`'s rule."""
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
    max_truncation: float = regime.MAX_TRUNCATION
    """C6's length part: the most the shortest compared budget may truncate, fraction of rollout responses."""

    def __post_init__(self) -> None:
        for name in ("min_volatility", "min_mismatch", "max_truncation"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"Rules.{name} = {v!r}: a finite number >= 0")

    def preconditions(self) -> tuple[regime.Precondition, ...]:
        """Every claim's precondition at these thresholds."""
        return (
            regime.volatility(self.min_volatility),
            regime.mismatch(self.min_mismatch),
            regime.truncation(self.max_truncation),
        )


RULES = Rules()
"""The default rules."""


def precondition(claim: str, rules: Rules = RULES) -> regime.Precondition | None:
    """The precondition a claim is tested under (C3, C4: the routing volatility; C5: the engine/trainer mismatch; C6:
    its length part's truncation at the shortest budget; at `rules`' thresholds); None for a claim without one. A
    declared comparison filed under the claim keeps it."""
    volatility, mismatch, truncation = rules.preconditions()
    return {"C3": volatility, "C4": volatility, "C5": mismatch, "C6": truncation}.get(claim)


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
    read_at: tuple[float, ...] = ()
    """The values the declared readings were read against (0 for a difference, the declared size for a minimum
    effect or an exclusion, +-margin for an equivalence); () without a declared comparison."""
    deviations: tuple[str, ...] = ()
    """How the finished runs differ from the declared comparison (analysis.claims.declared.deviations): the verdict is
    then exploratory."""
    declared_reading: str = ""
    """What the declared comparison(s) found, named for the test each declared (analysis.claims.declared.OUTCOMES),
    e.g. "replay_cost_grpo: no difference detected"; below the claim's regime, prefixed as the replication of a gap
    it is."""
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
        if self.declared:  # the verdict is the declared test's, named for what it tested (declared.READING)
            return f"{self.role}, declared {self.declared}: {self.verdict} ({self.declared_reading})"
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
def replay_partner_in(name: str, present: Sequence[str]) -> str | None:
    """The registry's Routing Replay partner of `name` (algorithms.replay_partner) when the study ran it."""
    partner = names.registry().replay_partner(name)
    return partner if partner in present else None


def free_of(name: str, present: Sequence[str]) -> str | None:
    """`name` itself when present and its routing is free (checked in the registry)."""
    return name if name in present and names.registry().get(name).routing == "free" else None


def absent(claim: str, rule: str, what: str) -> ClaimResult:
    return ClaimResult(claim, CLAIMS[claim], INCONCLUSIVE, rule, [], f"{NOT_IN_STUDY} ({what})")


def usable_run_ids(study: Study) -> set[str]:
    """Ids of the runs that carry evidence: everything but failed (infrastructure) and unknown-state runs."""
    return set(study.runs.loc[usable(study.runs), RUN_ID].astype(str))


def final_at_common_compute(
    study: Study, groups: dict[str, pd.Series], metric: str = vocab.REWARD, *, seeds: dict[str, list] | None = None
) -> tuple[dict[str, np.ndarray], float]:
    """Per group (a boolean mask over study.runs): each run's `curves.compute_window` of `metric` (the last
    WINDOW_FRAC of compute) with C the compute every group reached (the least, over the groups, of each group's longest
    run: "equal compute"), so the window is the same compute range for every run (FINAL_RULE). A collapsed run that
    stopped before the window is held at its last value (it does not get to skip the compute it failed at); failed
    runs are excluded. `seeds`, when given, receives each group's run seeds in the order of its values (for paired
    comparisons)."""
    usable_ids = usable_run_ids(study)
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
    win = curves.compute_window(rows, metric, frac=curves.WINDOW_FRAC, budget=c_end)
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


def reward_gap(
    study: Study, groups: dict[str, pd.Series], mask: pd.Series, a: str, b: str
) -> tuple[Evidence, dict[str, np.ndarray]]:
    """The final reward of group `a` minus group `b` within the stratum `mask`, at the compute both reached
    (`final_at_common_compute`), paired by seed where they share seeds (`difference`): its evidence line, and each
    group's values."""
    seeds: dict[str, list] = {}
    vals, c_end = final_at_common_compute(study, {g: m & mask for g, m in groups.items()}, seeds=seeds)
    est, lo, hi, n = difference(vals, seeds, a, b)
    return Evidence(f"reward({a}) - reward({b}) at {c_end:.3g} FLOPs", est, lo, hi, n), vals


def bounds(ci: intervals.CI) -> tuple[float, float, float]:
    return ci.estimate, ci.low, ci.high


def difference(
    vals: dict[str, np.ndarray], seeds: dict[str, list], a: str, b: str, *, log: bool = False
) -> tuple[float, float, float, str]:
    """mean(a) - mean(b) (with `log`, the ratio mean(a) / mean(b)) with its interval and n: paired by seed (the
    differences within each seed both arms ran, then a t interval over seeds; with `log` the per-seed log ratios,
    exponentiated) when the arms share at least two seeds and neither has a seed twice (`paired_by_seed`), else over
    independent runs (Welch; `intervals.ratio_ci` with `log`)."""
    pairs = paired_by_seed([vals[a], vals[b]], [seeds[a], seeds[b]])
    if pairs is not None and (not log or (pairs > 0).all()):
        n = f"{len(pairs)} seeds, paired"
        if log:
            ci = intervals.mean_ci(np.log(pairs[:, 0]) - np.log(pairs[:, 1]))
            return float(np.exp(ci.estimate)), float(np.exp(ci.low)), float(np.exp(ci.high)), n
        return (*bounds(intervals.mean_ci(pairs[:, 0] - pairs[:, 1])), n)
    ci = intervals.ratio_ci(vals[a], vals[b]) if log else intervals.mean_difference(vals[a], vals[b])
    return (*bounds(ci), n_label(vals[a], vals[b]))


def n_label(*xs: np.ndarray) -> str:
    return " vs ".join(str(int(np.isfinite(x).sum())) for x in xs)


def alg_mask(study: Study, name: str) -> pd.Series:
    return study.runs[ALGORITHM].astype(str) == name


def finish(
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
    base = grpo_baseline(present)
    if GSPO in present and base is not None:
        out.append((GSPO, base, "C1"))
    for name, claim in ((GRPO, "C3"), (GSPO, "C4")):
        free = free_of(name, present)
        rr = replay_partner_in(name, present) if free else None
        if free and rr:
            out.append((rr, free, claim))
    return out


def grpo_baseline(present: Sequence[str]) -> str | None:
    """The paper's GRPO baseline of Figures 1-2: GRPO with Routing Replay (registry partner), else plain GRPO."""
    if GRPO not in present:
        return None
    return replay_partner_in(GRPO, present) or GRPO


def present_algorithms(study: Study) -> list[str]:
    return list(study.runs[ALGORITHM].dropna().astype(str).unique())


# --- regimes: a claim tested only where its precondition was measured (analysis.stats.regime) -----------------------
def measure_strata(
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


def regime_verdict(
    verdict: str, evidence: list[Evidence], measured: regime.Measured | None
) -> tuple[str, list[Evidence]]:
    """A stratum's verdict and evidence with its precondition: below it, NOT_IN_REGIME with the measured value first;
    in it, the verdict with the measured value last. Without a measurement (the pooled reference) unchanged."""
    if measured is None:
        return verdict, evidence
    if not measured.met:
        return NOT_IN_REGIME, [measured.evidence(), *evidence]
    return verdict, [*evidence, measured.evidence()]


def regime_note(strata: Sequence[Stratum], measured: dict[int, regime.Measured], strat: Stratification) -> str:
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
        f"{pre.quantity}{of} {what} in {len(below)} of {len(strata)} strata, {pre.sides[1]} the "
        f"{pre.fmt(pre.threshold)}{of} the claim {'allows at most' if pre.at_most else 'needs'}{ref}"
    )


def with_regime(res: ClaimResult, note: str, scale: str = "") -> ClaimResult:
    """The claim's result with its regime note; when no stratum was tested, the reason is the note (and `scale`, what
    the runs below the regime showed at this scale)."""
    res.regime = note
    if res.verdict == NOT_IN_REGIME:
        res.reason = note + (f"; {scale}" if scale else "")
    elif note:
        res.reason = f"{res.reason}; not tested in regime: {note}" if res.reason else f"not tested in regime: {note}"
    return res


def paired_by_seed(values: Sequence[np.ndarray], seeds: Sequence[Sequence]) -> np.ndarray | None:
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


def detectable_evidence(
    name: str, groups: Sequence[np.ndarray], weights: Sequence[float], n: str | None = None
) -> Evidence:
    """The evidence line of the smallest |d| these seeds detect (power.py; estimate = that size, no interval); `n`
    its n (default: the groups' sizes)."""
    d = power.detectable(groups, weights)
    needed = power.seeds_needed(groups, weights, power.TARGET)
    return Evidence(power.sentence(name, d, needed), d.mdd, np.nan, np.nan, n_label(*groups) if n is None else n)


def detectable_lines(res: ClaimResult) -> list[Evidence]:
    """The claim's smallest-detectable-difference lines (one per stratum with data), stratum label filled in."""
    out = []
    for s in res.strata:
        label = s.label if len(res.strata) > 1 else ""
        out += [dataclasses.replace(e, stratum=label) for e in s.evidence if e.name.startswith(power.PREFIX)]
    return out


def with_power(res: ClaimResult) -> ClaimResult:
    """An inconclusive claim's reason extended by the smallest difference its seeds could detect (the range over
    its strata), so that "inconclusive" says how large an effect would have been seen."""
    sizes = [e.estimate for e in detectable_lines(res) if np.isfinite(e.estimate)]
    if res.verdict != INCONCLUSIVE or not sizes:
        return res
    rng = f"{min(sizes):.3g}" + (f" to {max(sizes):.3g}" if len(sizes) > 1 else "")
    tail = f"these seeds detect a difference of {rng} or more ({power.POWER:.0%} power, {power.ALPHA:g} two-sided)"
    return dataclasses.replace(res, reason=f"{res.reason}; {tail}" if res.reason else tail)


def mean_evidence(name: str, x: np.ndarray) -> Evidence:
    ci = intervals.mean_ci(x)
    return Evidence(name, ci.estimate, ci.low, ci.high, str(ci.n))
