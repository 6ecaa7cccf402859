"""C3: GRPO without Routing Replay is unstable on MoE; with it, it converges. The collapse rate of GRPO without
Routing Replay minus with it, per stratum, where the routing moved enough (analysis.claims.replay)."""

from __future__ import annotations

from analysis.claims.common import (
    COLLAPSE_DECISION,
    COLLAPSE_MARGIN,
    GRPO,
    RATE_INTERVAL,
    RULES,
    ClaimResult,
    Rules,
)
from analysis.claims.replay import replay_claim, runs_to_exclude
from analysis.runs.tidy import Study
from analysis.stats import regime


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
    return replay_claim(study, "C3", GRPO, rule, pre, collapse=COLLAPSE_DECISION, direction="against the claim")
