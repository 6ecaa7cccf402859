"""The report's headline, what a reader takes in at a glance: did the paper's claims hold here?

One table, a row per claim C1-C6: the claim in a few words, what the paper found, this study's estimate with its
95% interval (the number the verdict was read off, analysis.figures.claims_forest.estimates), the verdict as a
coloured label and its regime (whether the runs reached the precondition the claim is about, or the claim is not in
this study). Under it one line each, when there is any, on runs that could not be read or failed and on runs that
deviate from a declared comparison; then the claims' forest figure; then, one click away (collapsed), how each
verdict was read (split, pairing, role). The decision rules are under the scorecard, collapsed too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.claims import scorecard
from analysis.figures.claims_forest import Estimate, estimates, is_precondition
from analysis.report import render
from analysis.report.sections import not_read
from analysis.runs.tidy import Study
from analysis.stats import design, regime
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, NOT_IN_REGIME, SUPPORTED, css_class

IN_A_FEW_WORDS = {
    "C1": "GSPO beats GRPO at equal compute",
    "C2": "GSPO clips \u2265 10x more tokens",
    "C3": "GRPO collapses without Routing Replay",
    "C4": "GSPO needs no Routing Replay",
    "C5": "GSPO tolerates engine log-probs better",
    "C6": "more compute and length keep helping",
}
"""Each claim in a few words (its statement: scorecard.CLAIMS)."""

PAPER = {
    "C1": "GSPO ahead (Fig. 1)",
    "C2": f"~{design.PAPER_CLIP_RATIO:g}x (Fig. 2)",
    "C3": "no convergence without it (Fig. 3)",
    "C4": "none needed (\u00a75.3)",
    "C5": "tolerant (\u00a75.4, not measured)",
    "C6": "keeps improving (Fig. 1)",
}
"""What the paper found (docs/references.md)."""

PAPER_REGIME = {regime.PER_UPDATE: regime.PAPER_PER_UPDATE}
"""The paper's value of a precondition's metric, where it gives one (the routing's change after one update)."""

COLUMNS = ("claim", "in a few words", "verdict", "paper", "this study: estimate [95% CI]", "regime")
TESTED = (SUPPORTED, CONTRADICTED, INCONCLUSIVE)
"""Verdicts of strata that count in the claim's verdict."""


def _interval(e: Estimate) -> str:
    """ "0.017 [-0.0276, 0.0616]"; a one-sided bound open on its other side: "-0.000895 [-0.0135, +inf)"."""
    if np.isfinite(e.low) and np.isfinite(e.high):
        return f"{e.estimate:.3g} [{e.low:.3g}, {e.high:.3g}]"
    if np.isfinite(e.low) and e.high == np.inf:
        return f"{e.estimate:.3g} [{e.low:.3g}, +inf)"
    if np.isfinite(e.high) and e.low == -np.inf:
        return f"{e.estimate:.3g} (-inf, {e.high:.3g}]"
    return f"{e.estimate:.3g}"


def estimate_text(card: scorecard.ClaimResult) -> str:
    """The claim's number: "0.0362 [0.0315, 0.0408] (n=5 seeds, paired)"; over strata the smallest and the largest
    estimate with their intervals ("0.0796 [0.0653, 0.094] to 0.0932 [0.0826, 0.104] in 4 strata", strata not in
    regime left out when some are in it); per part when the claim has parts ("compute: ..."); "—" without a number."""
    ests = estimates(card)
    if not ests:
        return "\u2014"
    quantities = list(dict.fromkeys(e.part or e.short for e in ests))
    parts = []
    for q in quantities:
        of = [e for e in ests if (e.part or e.short) == q]
        tested = [e for e in of if e.verdict in TESTED] or of
        lo, hi = min(tested, key=lambda e: e.estimate), max(tested, key=lambda e: e.estimate)
        if len(tested) == 1:
            text = _interval(lo) + (f" (n={lo.n})" if len(ests) == 1 else "")
        elif _interval(lo) == _interval(hi):
            text = f"{_interval(lo)} in each of {len(tested)} strata"
        else:
            text = f"{_interval(lo)} to {_interval(hi)} in {len(tested)} strata"
        parts.append(f"{q}: {text}" if len(quantities) > 1 or of[0].part else text)
    return "; ".join(parts)


def _evidence_of(card: scorecard.ClaimResult) -> list[scorecard.Evidence]:
    return [e for s in card.strata for e in s.evidence] if card.strata else list(card.evidence)


def regime_text(card: scorecard.ClaimResult, rules: scorecard.Rules = scorecard.RULES) -> str:
    """ "in regime: 8.1% per update (needs 5%)", "emulated regime: 10% per update (needs 5%; paper ~10%)" (reached
    through an emulation: regime.EMULATED), "not in regime: 0.29% per update (needs 5%; paper ~10%)", "in regime in 2
    of 4 strata: ...", "not in this study", or "—" for a claim without a precondition."""
    if card.reason.startswith(scorecard.NOT_IN_STUDY):
        return scorecard.NOT_IN_STUDY if not estimates(card) else f"partly {scorecard.NOT_IN_STUDY}"
    lines = [e for e in _evidence_of(card) if is_precondition(e.name)]
    if not lines:
        return "\u2014"
    pre = next(p for p in rules.preconditions() if lines[0].name.startswith(p.quantity + " ("))
    values = [e.estimate for e in lines if np.isfinite(e.estimate)]
    of = f" {pre.name}" if pre.name else ""
    shown = list(dict.fromkeys(pre.fmt(v) for v in sorted(values)))
    measured = (shown[0] + (f" to {shown[-1]}" if len(shown) > 1 else "") + of) if values else "not measured"
    paper = f"; paper ~{pre.fmt(PAPER_REGIME[pre.metric])}" if pre.metric in PAPER_REGIME else ""
    needs = f"(needs {'at most ' if pre.at_most else ''}{pre.fmt(pre.threshold)}{paper})"
    below = sum(s.verdict == NOT_IN_REGIME for s in card.strata)
    if card.verdict == NOT_IN_REGIME or below == len(lines):
        return f"not in regime: {measured} {needs}"
    reached = regime.EMULATED if any(regime.EMULATED in e.name for e in lines) else "in regime"
    if card.regime and below:
        return f"{reached} in {len(lines) - below} of {len(lines)} strata: {measured} {needs}"
    return f"{reached}: {measured} {needs}"


def verdict_text(card: scorecard.ClaimResult) -> str:
    """The verdict; a verdict decided from a declared comparison with its role ("primary: supported"); "not tested in
    regime" without one (a declared comparison below the claim's regime decides nothing)."""
    return f"{card.role}: {card.verdict}" if card.declared and card.verdict != NOT_IN_REGIME else card.verdict


def _one_declared(card: scorecard.ClaimResult) -> bool:
    """Whether one declared comparison decided the claim: its name goes beside the claim's words (several are each
    named before their estimate)."""
    return bool(card.declared) and "," not in card.declared


def headline_table(cards: Sequence[scorecard.ClaimResult], rules: scorecard.Rules = scorecard.RULES) -> render.Table:
    """One row per claim (COLUMNS), its verdict a coloured label."""
    df = pd.DataFrame(
        [
            (
                c.claim,
                IN_A_FEW_WORDS.get(c.claim, c.statement) + (f" (declared {c.declared})" if _one_declared(c) else ""),
                verdict_text(c),
                PAPER.get(c.claim, ""),
                estimate_text(c),
                regime_text(c, rules),
            )
            for c in cards
        ],
        columns=list(COLUMNS),
    )
    return render.Table(df, ("verdict", tuple(css_class(c.verdict) for c in cards)), "headline")


PROBLEMS = "'Failed, collapsed, unreadable and missing runs'"
"""The section that lists every problem run with its reason."""


def problem_line(study: Study) -> tuple[str, str, str] | None:
    """One line on the runs in no verdict: unreadable or missing (in no figure or table either), and failed or of
    unknown state (an infrastructure failure, left out of the verdicts); None when there are none."""
    asked, gone = not_read(study)
    states = study.runs["state"].astype(str)
    kinds = (("failed", "failed"), ("unknown", "of unknown state"))
    failed = ", ".join(f"{n} {said}" for state, said in kinds if (n := int((states == state).sum())))
    if not gone and not failed:
        return None
    where = f"each is listed with its reason under {PROBLEMS}."
    if not gone:
        return ("not-read", "Runs failed:", f"{failed} of the {asked} runs of the study, in no verdict; {where}")
    what = ", ".join(
        f"{n} {k}" for k, n in (("unreadable", len(study.unreadable)), ("missing", len(study.missing))) if n
    )
    text = f"{gone} of the {asked} runs of the study ({what}) are in no verdict, figure or table"
    return ("not-read", "Runs not read:", text + (f"; {failed}, in no verdict" if failed else "") + f"; {where}")


def deviation_line(cards: Sequence[scorecard.ClaimResult]) -> tuple[str, str, str] | None:
    """One line on the claims whose runs deviate from what the sweep file declared (each deviation listed): their
    verdicts are exploratory; None when none deviates."""
    deviating = [c for c in cards if c.deviations]
    if not deviating:
        return None
    which = ", ".join(c.claim for c in deviating)
    parts = "; ".join(f"{c.claim} ({c.declared}): " + "; ".join(c.deviations) for c in deviating)
    verb = "is" if len(deviating) == 1 else "are"
    return (
        "deviation",
        "Deviation from the declared comparison:",
        f"{which} {verb} exploratory, not confirmed: {parts}.",
    )


def reading_table(cards: Sequence[scorecard.ClaimResult]) -> pd.DataFrame:
    """How each verdict was read (ClaimResult.design): its split, its pairing with the unit of replication, and its
    role (the declared comparison, or why exploratory)."""
    return pd.DataFrame({"claim": [c.claim for c in cards], "how it was read": [c.design for c in cards]})


READING_NOTE = (
    "Regime: whether the compared runs reached what the claim is about (C3, C4: the routing's change after one "
    "update; C5: the engine/trainer log-prob mismatch; C6's length part: a shortest budget that does not cut the "
    "answers); outside it a claim is not tested, whatever its interval says. "
    "Exploratory: no comparison declared in the sweep file before the runs (or runs that deviate from it): a finding "
    "to confirm. Primary or secondary: decided from the declared comparison alone. The estimates are the quantities "
    "each claim's rule reads (the scorecard below: evidence, per-stratum verdicts, and the decision rules)."
)


def headline_section(
    cards: Sequence[scorecard.ClaimResult],
    study: Study,
    forest: render.Figure | None = None,
    rules: scorecard.Rules = scorecard.RULES,
) -> list[render.Block]:
    """The headline: the claims' table, a line on runs in no verdict and on deviations from the declaration (when
    any), the forest figure, and how each verdict was read, collapsed."""
    lines = [x for x in (deviation_line(cards), problem_line(study)) if x is not None]
    return [
        render.h(2, "Headline", anchor="headline"),
        headline_table(cards, rules),
        *([render.Bullets(tuple(lines), "lines")] if lines else []),
        *([forest] if forest is not None else []),
        render.Details(
            "How each verdict was read: split, pairing, role",
            (render.Table(reading_table(cards)), render.p(READING_NOTE)),
        ),
    ]


__all__ = [
    "COLUMNS",
    "IN_A_FEW_WORDS",
    "PAPER",
    "deviation_line",
    "estimate_text",
    "headline_section",
    "headline_table",
    "problem_line",
    "reading_table",
    "regime_text",
    "verdict_text",
]
