"""C4: GSPO needs no Routing Replay. GSPO without Routing Replay neither collapses more often than with it nor
trails it in final reward by more than the seeds' noise, per stratum, where the routing moved enough
(analysis.claims.replay)."""

from __future__ import annotations

from analysis.claims.common import (
    COLLAPSE_MARGIN,
    FINAL_RULE,
    FREE_COLLAPSE_DECISION,
    GSPO,
    RATE_INTERVAL,
    REPLAY_GAIN_DECISION,
    RULES,
    ClaimResult,
    Rules,
)
from analysis.claims.replay import replay_claim, runs_to_exclude
from analysis.runs.tidy import Study
from analysis.stats import regime
from analysis.stats.verdicts import CONJUNCTION_RULE


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
    return replay_claim(
        study,
        "C4",
        GSPO,
        rule,
        pre,
        collapse=FREE_COLLAPSE_DECISION,
        gain=REPLAY_GAIN_DECISION,
        direction="for the claim",
    )
