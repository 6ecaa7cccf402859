"""The comparison C3 and C4 make: an algorithm without Routing Replay against its Routing Replay partner (the
registry's), per stratum, where the routing moved enough (the volatility precondition, analysis.stats.regime): the
difference in collapse rate (without minus with replay; Newcombe's interval, RATE_INTERVAL), and for C4 also the
final reward at equal compute. An inconclusive collapse comparison says how many runs would decide it
(`runs_to_exclude`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.claims.common import (
    COLLAPSE_MARGIN,
    NOT_IN_STUDY,
    ClaimResult,
    absent,
    alg_mask,
    finish,
    free_of,
    measure_strata,
    present_algorithms,
    regime_note,
    regime_verdict,
    replay_partner_in,
    reward_gap,
    with_regime,
)
from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, RUN_ID
from analysis.runs.tidy import Study
from analysis.stats import collapse, intervals, regime
from analysis.stats.strata import run_strata, stratify, usable
from analysis.stats.verdicts import INCONCLUSIVE, NOT_IN_REGIME, Decision, Evidence, conjunction


def runs_to_exclude(margin: float = COLLAPSE_MARGIN) -> int:
    """The fewest runs without Routing Replay, none of them collapsed, from which the 95% interval of the collapse-rate
    difference ends below `margin` (when the replay partner had no collapse either, whatever its number of runs: the
    upper bound is then the Wilson bound z^2 / (n + z^2)). Fewer runs cannot decide C3 against the claim, nor C4 for
    it."""
    n = 1
    while intervals.rate_difference(0, n, 0, 1).high >= margin:
        n += 1
    return n


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


def replay_claim(
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
    present = present_algorithms(study)
    free = free_of(name, present)
    rr = replay_partner_in(name, present) if name in present else None
    if free is None or rr is None:
        return absent(claim, rule, f"{name} and its Routing Replay partner not both present")
    if vocab.REWARD not in study.metrics:
        return absent(claim, rule, f"metric {vocab.REWARD} not logged")
    coll = _collapsed(study)
    groups = {free: alg_mask(study, free), rr: alg_mask(study, rr)}
    undecided: list[Counts] = []
    below: list[Counts] = []
    strat = stratify(study, groups)
    measured = measure_strata(study, strat, groups, pre)

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        d, ev, counts = _rate_evidence(coll, study, mask, free, rr)
        collapse_verdict = verdict = collapse(d.low, d.high)
        if gain is not None:
            reward, _ = reward_gap(study, groups, mask, rr, free)
            ev = [reward, *ev]
            verdict = conjunction([gain(reward.low, reward.high), collapse_verdict])
        verdict, ev = regime_verdict(verdict, ev, measured.get(id(mask)))
        if verdict == NOT_IN_REGIME:
            below.append(counts)
        elif collapse_verdict == INCONCLUSIVE and id(mask) in measured:  # not the pooled reference outcome() adds
            undecided.append(counts)
        return verdict, ev

    strata = run_strata(study, strat, groups, evaluate)
    res = finish(claim, rule, strat, strata, evaluate)
    if res.verdict == INCONCLUSIVE:  # unstratified with a reward part, the collapse line leads the reason
        lead = f"{res.evidence[1]}: " if gain is not None and len(res.strata) <= 1 and len(res.evidence) > 1 else ""
        res = _too_few(res, free, undecided, direction=direction, lead=lead)
    return with_regime(res, regime_note(strata, measured, strat), _collapses_at_this_scale(free, rr, below))
