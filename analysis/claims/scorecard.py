"""The report's scorecard: a verdict per claim C1-C6 of the GSPO paper (docs/references.md), with its evidence and
the rule that produced it.

Every verdict is one of "supported", "contradicted", "inconclusive" (at this scale) or "not tested in regime" (the
claim's precondition, a measured quantity of the runs it compares, was not reached: C3 and C4 need the routing
volatility of the off-policy minibatches at or above `Rules.min_volatility`, C5 the engine/trainer mismatch at or
above `Rules.min_mismatch`, C6's length part a shortest budget truncating at most `Rules.max_truncation`; the verdict
then names the measured value and the threshold) and comes with the numbers it
was decided on (point estimate, 95% Student t interval over seeds, n) and the rule as a sentence, so a
reader can disagree with the rule rather than with a hidden threshold. The verdict is read off the interval by the
claim's `Decision`s (DECISIONS, analysis.stats.verdicts) and the rule quotes their own sentences, so prose and code
agree. A claim whose algorithms or axis are absent from the study is "inconclusive" with a reason starting "not in
this study".

Each claim is a module of analysis.claims beside the tables it reads (c1_reward, c2_clipping, c3_grpo_replay,
c4_gspo_replay, c5_precision, c6_scaling; C3 and C4 share analysis.claims.replay), the pieces they share are
analysis.claims.common's; this module assembles the scorecard (`scorecard`), decides a claim from a sweep's declared
comparison (`with_declared`) and writes its tables (`scorecard_table`, `strata_table`).

Intervals (analysis.stats): a mean over seeds gets a t interval, a difference or contrast of independent groups'
means Welch's (Welch-Satterthwaite degrees of freedom), a ratio of means Welch's on the log scale; with 3-6 seeds a
percentile bootstrap would be too narrow. Failed runs (infrastructure) are excluded; collapsed runs count.

Stratification (analysis.stats.strata): each claim's comparison is made within every stratum of the other swept axes,
never pooled across them, and the per-stratum verdicts are combined by STRATA_RULE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.claims import declared as declared_
from analysis.claims.c1_reward import claim_c1
from analysis.claims.c2_clipping import claim_c2
from analysis.claims.c3_grpo_replay import claim_c3
from analysis.claims.c4_gspo_replay import claim_c4
from analysis.claims.c5_precision import claim_c5
from analysis.claims.c6_scaling import claim_c6
from analysis.claims.common import (
    CLAIMS,
    DECISIONS,
    EXPLORATORY,
    NOT_IN_STUDY,
    PAIRED,
    PRIMARY,
    RULES,
    SECONDARY,
    TEST,
    UNPAIRED,
    VALIDATION,
    ClaimResult,
    Rules,
    comparison_pairs,
    detectable_lines,
    grpo_baseline,
    precondition,
    split_of,
)
from analysis.runs.tidy import Study
from analysis.stats import intervals
from analysis.stats.strata import STRATA_RULE, Stratification, Stratum, combine
from analysis.stats.verdicts import (
    CONJUNCTION_RULE,
    CONTRADICTED,
    INCONCLUSIVE,
    NO_DATA,
    NOT_IN_REGIME,
    SUPPORTED,
    Evidence,
    conjunction,
)

CLAIM_FUNCTIONS = {"C1": claim_c1, "C2": claim_c2, "C3": claim_c3, "C4": claim_c4, "C5": claim_c5, "C6": claim_c6}


REGIME_CLAIMS = ("C3", "C4", "C5", "C6")
"""The claims with a precondition (analysis.stats.regime), whose functions take the scorecard's `Rules`."""


def scorecard(
    study: Study, rules: Rules = RULES, comparisons: Sequence[declared_.Comparison] = ()
) -> list[ClaimResult]:
    """Every claim C1-C6 of the GSPO paper (docs/references.md) evaluated on `study`; `rules` sets the regime
    thresholds of C3-C5. A claim some of `comparisons` (a sweep file's `comparisons:`, analysis.claims.declared)
    declares is decided from those comparisons only, within its regime (`with_declared`); the others are
    exploratory."""
    cards = [fn(study, rules) if c in REGIME_CLAIMS else fn(study) for c, fn in CLAIM_FUNCTIONS.items()]
    return [with_declared(study, r, [c for c in comparisons if c.claim == r.claim], rules) for r in cards]


DECLARED_RULE = (
    "Decided from the sweep file's declared comparison(s) only (analysis.claims.declared.confirm): the declared "
    "metric and window per run, in the declared stratum and seeds, treatment minus control paired by seed (or Welch "
    "when declared unpaired), then the test the sweep file declared, at its alpha (several declared for one claim: a "
    "family of m, each read at alpha / m with its p-value times m, Bonferroni; their verdicts combined: "
    + CONJUNCTION_RULE
    + "). Each reading is named for what its test tested: "
    + declared_.READING
    + ". The claim's regime holds for its declared comparisons too, measured on the runs they read: below it the "
    "claim is not tested in regime and the declared reading is reported beside it as the replication of a gap at "
    "this scale. Runs that deviate from the declaration make the verdict exploratory, with each deviation listed."
)
BELOW_REGIME = "replication of an exploratory gap below the claim's regime"
"""How a declared reading is named when its runs did not reach the claim's precondition: not a test of the claim."""


def _confirm(study: Study, c: declared_.Comparison) -> tuple[declared_.Confirmation, str]:
    """The declared comparison read on the study (`declared.confirm`), and "" ; or, when the runs lack what it reads
    (two runs of one seed in an arm, a missing axis), a confirmation without a reading and why."""
    try:
        return declared_.confirm(study.long, c, study.runs), ""
    except (KeyError, ValueError) as exc:  # the runs lack what the declaration reads: a deviation, no reading
        why = str(exc).strip("'\"")
        devs = tuple(declared_.deviations(study.long, c, study.runs)) or (f"{c.name}: {exc}",)
        nan = intervals.CI(np.nan, np.nan, np.nan, 0)
        none = declared_.Reading(f"no reading ({why})", INCONCLUSIVE, nan, np.nan, c.alpha)
        return declared_.Confirmation(c, None, intervals.Spread(np.nan, np.nan, np.nan, 0), none, devs), why


def with_declared(
    study: Study, res: ClaimResult, comparisons: Sequence[declared_.Comparison], rules: Rules = RULES
) -> ClaimResult:
    """`res` decided from the declared `comparisons` of its claim (none: `res` unchanged, exploratory): each read by
    its declared test (`declared.read`; several: a Bonferroni family, verdicts combined by `conjunction`), within the
    claim's regime measured on the runs the comparisons read (`common.precondition`; below it: NOT_IN_REGIME, the
    declared reading beside it as BELOW_REGIME). The split is the declared metric's, the pairing the declared one,
    the role the declaration's when the runs match it, else exploratory with `declared.deviations` listed; the
    exploratory reading is kept in the reason."""
    if not comparisons:
        return res
    m = len(comparisons)
    pairs = [_confirm(study, c) for c in comparisons]
    pre = precondition(res.claim, rules)
    evidence, sentences, plain, outcomes, verdicts, below = [], [], [], [], [], []
    for conf, why in pairs:
        c = conf.comparison
        r = declared_.read(conf.spread, c, family=m) if m > 1 and not why else conf.reading
        measured = pre.measure(study, declared_.run_ids(study.long, c, study.runs)) if pre is not None else None
        if measured is not None and not measured.met:  # this comparison's runs are below the claim's regime
            below.append(measured.sentence)
            outcomes.append(f"{BELOW_REGIME}: {c.name}: {r.outcome}")
        else:
            verdicts.append(r.verdict)
            outcomes.append(f"{c.name}: {r.outcome}")
        pair = f"{conf.spread.n} seeds, paired" if c.pairing == "seed" else f"{conf.spread.n} runs per arm, unpaired"
        name = f"{c.name} ({c.test}): {c.metric} ({c.window}) {c.axis}={c.treatment} - {c.axis}={c.control}"
        if why:
            evidence.append(Evidence(f"{name}: no reading ({why})", np.nan, np.nan, np.nan, "0"))
            continue
        sentence = _declared_sentence(c, r, m)
        plain.append(sentence)
        sentences.append(sentence if measured is None or measured.met else f"{measured.sentence}; {sentence}")
        ci = r.interval
        evidence.append(Evidence(f"{name}, {_interval_name(c, r)}", ci.estimate, ci.low, ci.high, pair))
        what = f"p x {m} (Bonferroni)" if m > 1 else "p"
        evidence.append(Evidence(f"{c.name}: {what} ({c.test}, alpha {c.alpha:g})", r.p_value, np.nan, np.nan, pair))
        if measured is not None:  # each comparison's own regime, measured on the runs it reads
            evidence.append(dataclasses.replace(measured.evidence(), stratum=c.name))
    devs = tuple(d for conf, _ in pairs for d in conf.deviations)
    splits = {split_of(c.metric) for c in comparisons}
    roles = {c.role for c in comparisons}
    verdict = conjunction(verdicts) if len(verdicts) > 1 else verdicts[0] if verdicts else NOT_IN_REGIME
    reading = "; ".join(outcomes)
    found = "; ".join(sentences)
    regime_ = "; ".join(below)
    if verdict == NOT_IN_REGIME:  # no comparison in regime: the measured regime first, as a stratum below it
        found = f"{regime_}; {BELOW_REGIME}, not a test of the claim: {'; '.join(plain) or reading}"
        regime_lines = [e for e in evidence if e.name.startswith(pre.quantity + " (")] if pre is not None else []
        evidence = regime_lines + [e for e in evidence if e not in regime_lines]
    exploratory = f"the exploratory reading of the whole study: {res.verdict}" + (
        f" ({res.reason})" if res.reason else ""
    )
    return dataclasses.replace(
        res,
        verdict=verdict,
        rule=f"{DECLARED_RULE} Exploratory reading, for reference: {res.rule}",
        evidence=evidence,
        reason=f"{found}; {exploratory}" if found else exploratory,
        strata=[],
        split=splits.pop() if len(splits) == 1 else TEST if TEST in splits else VALIDATION,
        pairing=PAIRED if all(c.pairing == "seed" for c in comparisons) else UNPAIRED,
        role=EXPLORATORY if devs else (PRIMARY if PRIMARY in roles else SECONDARY),
        declared=", ".join(c.name for c in comparisons),
        read_at=tuple(sorted({v for c in comparisons for v in declared_.read_at(c)})),
        deviations=devs,
        regime=regime_,
        declared_reading=reading,
    )


def _interval_name(c: declared_.Comparison, r: declared_.Reading) -> str:
    """What the interval of a reading is: "two-sided 95% interval", "one-sided 95% bound", "90% interval (TOST)"."""
    level = f"{100 * r.interval.confidence:.4g}%"
    if c.test == "equivalence":
        return f"{level} interval (TOST at alpha {r.level:.3g})"
    if c.test == "difference" and c.alternative == "two-sided":
        return f"two-sided {level} interval"
    return f"one-sided {level} bound"


def _declared_sentence(c: declared_.Comparison, r: declared_.Reading, family: int) -> str:
    """What the declared test found, in words: what it tested, its outcome, the interval and the p-value."""
    ci = r.interval
    if r.outcome == declared_.TOO_FEW:
        return f"{c.name} declared {declared_.hypothesis(c)}: {r.outcome} ({ci.n} seed(s) or runs per arm)"
    interval = f"{ci.estimate:+.3g} [{ci.low:+.3g}, {ci.high:+.3g}]"
    adj = f" x {family}, Bonferroni" if family > 1 else ""
    return (
        f"{c.name} declared {declared_.hypothesis(c)}: {r.outcome}, {interval} ({_interval_name(c, r)}), "
        f"p = {r.p_value:.3g}{adj} (alpha {c.alpha:g})"
    )


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


"""The GRPO baseline of the claims' comparisons, as the report's algorithm table names it."""

__all__ = [
    "BELOW_REGIME",
    "CLAIMS",
    "CLAIM_FUNCTIONS",
    "CONTRADICTED",
    "DECISIONS",
    "DECLARED_RULE",
    "INCONCLUSIVE",
    "NOT_IN_REGIME",
    "NOT_IN_STUDY",
    "NO_DATA",
    "REGIME_CLAIMS",
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
    "detectable_lines",
    "grpo_baseline",
    "scorecard",
    "scorecard_table",
    "strata_table",
    "with_declared",
]
