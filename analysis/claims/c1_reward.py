"""C1: GSPO trains more efficiently than GRPO at equal compute. GSPO's final reward minus the GRPO baseline's (with
Routing Replay when the study ran it), over the last 10% of the compute both reached, per stratum of the other swept
axes; paired by seed where both ran the same seeds."""

from __future__ import annotations

import pandas as pd

from analysis.claims.common import (
    FINAL_RULE,
    GRPO,
    GSPO,
    POSITIVE,
    ClaimResult,
    absent,
    alg_mask,
    finish,
    grpo_baseline,
    mean_evidence,
    present_algorithms,
    reward_gap,
)
from analysis.runs import vocab
from analysis.runs.tidy import Study
from analysis.stats.strata import run_strata, stratify
from analysis.stats.verdicts import Evidence


def claim_c1(study: Study) -> ClaimResult:
    """C1: GSPO's final reward at equal compute minus the GRPO baseline's, per stratum."""
    present = present_algorithms(study)
    base = grpo_baseline(present)
    rule = (
        "d = mean reward of GSPO minus GRPO (with Routing Replay when present, else without) over "
        f"{FINAL_RULE} (failed runs excluded), within each seed both ran, then over seeds (paired; else over "
        f"independent runs, Welch); {POSITIVE}."
    )
    if GSPO not in present or base is None:
        return absent("C1", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.REWARD not in study.metrics:
        return absent("C1", rule, f"metric {vocab.REWARD} not logged")
    groups = {GSPO: alg_mask(study, GSPO), base: alg_mask(study, base)}

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        gap, vals = reward_gap(study, groups, mask, GSPO, base)
        ev = [gap, mean_evidence(f"reward({GSPO})", vals[GSPO]), mean_evidence(f"reward({base})", vals[base])]
        return POSITIVE(gap.low, gap.high), ev

    strat = stratify(study, groups)
    return finish("C1", rule, strat, run_strata(study, strat, groups, evaluate), evaluate)
