"""C5: GSPO tolerates inference-engine log-probs as pi_old (precision mismatch) better than GRPO. GRPO's reward
drop from taking the engine's log-probs as pi_old minus GSPO's drop, per stratum of the axes other than the claim's
own, paired by seed where all four arms ran the same seeds, where the engines disagree enough (the mismatch
precondition, analysis.stats.regime)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.claims.common import (
    FINAL_RULE,
    GRPO,
    GSPO,
    POSITIVE,
    RULES,
    ClaimResult,
    Rules,
    absent,
    alg_mask,
    bounds,
    detectable_evidence,
    final_at_common_compute,
    finish,
    measure_strata,
    n_label,
    paired_by_seed,
    present_algorithms,
    regime_note,
    regime_verdict,
    with_power,
    with_regime,
)
from analysis.runs import vocab
from analysis.runs.tidy import Study
from analysis.stats import intervals, regime
from analysis.stats.strata import run_strata, stratify
from analysis.stats.verdicts import Evidence


def claim_c5(study: Study, rules: Rules = RULES, *, axis: str = vocab.OLD_LOGP_AXIS) -> ClaimResult:
    """C5: GRPO's reward drop from using the engine's log-probs as pi_old minus GSPO's drop, per stratum, where the
    engines disagree enough (the mismatch precondition)."""
    present = present_algorithms(study)
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
        return absent("C5", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if axis not in study.axes or not {"recompute", "rollout"} <= set(study.runs[axis].astype(str)):
        return absent("C5", rule, f"axis {axis} with values recompute and rollout not swept")
    if vocab.REWARD not in study.metrics:
        return absent("C5", rule, f"metric {vocab.REWARD} not logged")
    src = study.runs[axis].astype(str)
    groups = {f"{a}|{s}": alg_mask(study, a) & (src == s) for a in (GRPO, GSPO) for s in ("recompute", "rollout")}

    names = [f"{GRPO}|recompute", f"{GRPO}|rollout", f"{GSPO}|recompute", f"{GSPO}|rollout"]
    strat = stratify(study, groups, exclude=[axis])
    measured = measure_strata(study, strat, groups, pre)

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        seeds: dict[str, list] = {}
        vals, _ = final_at_common_compute(study, {g: m & mask for g, m in groups.items()}, seeds=seeds)
        g = [vals[k] for k in names]
        paired = paired_by_seed(g, [seeds[k] for k in names])
        if paired is not None:  # every arm ran the same seeds: the contrast per seed, then over seeds
            d = paired @ np.array([1.0, -1.0, -1.0, 1.0])
            ci = intervals.mean_ci(d)
            est, lo, hi, n = ci.estimate, ci.low, ci.high, f"{d.size} seeds, paired"
            size = detectable_evidence("drop(grpo) - drop(gspo)", [d], (1,), n)
        else:
            est, lo, hi = bounds(intervals.contrast_ci(g, (1, -1, -1, 1)))
            n = n_label(*g)
            size = detectable_evidence("drop(grpo) - drop(gspo)", g, (1, -1, -1, 1))
        ev = [
            Evidence("drop(grpo) - drop(gspo)", est, lo, hi, n),
            Evidence("drop(grpo)", *bounds(intervals.mean_difference(g[0], g[1])), n_label(g[0], g[1])),
            Evidence("drop(gspo)", *bounds(intervals.mean_difference(g[2], g[3])), n_label(g[2], g[3])),
            size,
        ]
        return regime_verdict(POSITIVE(lo, hi), ev, measured.get(id(mask)))

    strata = run_strata(study, strat, groups, evaluate)
    res = with_power(finish("C5", rule, strat, strata, evaluate, own=[axis]))
    return with_regime(res, regime_note(strata, measured, strat))
