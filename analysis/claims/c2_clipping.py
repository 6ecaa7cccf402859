"""C2: GSPO's clipped-token fraction is >= 10x GRPO's. The ratio of the mean clip fractions, GSPO over the GRPO
baseline, per stratum (paired by seed on the log scale where both ran the same seeds), read against CLIP_RATIO and
beside the paper's ~100x (`design.size_against_paper`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.claims.common import (
    CLIP_DECISION,
    GRPO,
    GSPO,
    ClaimResult,
    absent,
    alg_mask,
    difference,
    finish,
    grpo_baseline,
    mean_evidence,
    n_label,
    present_algorithms,
    usable_run_ids,
)
from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, RUN_ID
from analysis.runs.tidy import Study
from analysis.stats import curves, design, intervals
from analysis.stats.strata import run_strata, stratify
from analysis.stats.verdicts import Evidence

PAPER_SIZE = "beside the paper"
"""The evidence line of a size read against the paper's."""


def claim_c2(study: Study) -> ClaimResult:
    """C2: ratio of mean clipped-token fractions, GSPO over the GRPO baseline, per stratum."""
    present = present_algorithms(study)
    base = grpo_baseline(present)
    rule = (
        f"r = GSPO's mean clip fraction / GRPO's (with Routing Replay when present), each the mean over all steps "
        "per run; paired, the geometric mean over seeds both ran of the per-seed ratio (a t interval on the log "
        f"scale), else the ratio of the means over seeds (Welch on the log scale); {CLIP_DECISION}. Beside it, the "
        "ratio against the paper's ~"
        f"{design.PAPER_CLIP_RATIO:g}x (two orders of magnitude): 'direction supported' when the interval lies above "
        "1, and the size as log(ratio) / log(paper's) (1 = the paper's orders of magnitude)."
    )
    if GSPO not in present or base is None:
        return absent("C2", rule, ", ".join(n for n in (GSPO, GRPO) if n not in present) + " absent")
    if vocab.CLIP not in study.metrics:
        return absent("C2", rule, f"metric {vocab.CLIP} not logged")
    per_run = curves.run_mean(study.long, vocab.CLIP)
    usable_ids = usable_run_ids(study)
    per_run = per_run[per_run[RUN_ID].astype(str).isin(usable_ids)]
    alg, rid = per_run[ALGORITHM].astype(str), per_run[RUN_ID].astype(str)
    groups = {GSPO: alg_mask(study, GSPO), base: alg_mask(study, base)}
    seed_of = dict(zip(study.runs[RUN_ID].astype(str), study.runs["seed"], strict=True)).get

    def evaluate(mask: pd.Series) -> tuple[str, list[Evidence]]:
        inside = rid.isin(set(study.runs.loc[mask, RUN_ID].astype(str)))
        rows = {g: per_run[inside & (alg == g)] for g in (GSPO, base)}
        vals = {g: r["value"].to_numpy(np.float64) for g, r in rows.items()}
        seeds = {g: r[RUN_ID].astype(str).map(seed_of).tolist() for g, r in rows.items()}
        x, y = vals[GSPO], vals[base]
        est, lo, hi, n = difference(vals, seeds, GSPO, base, log=True)
        size = design.size_against_paper(intervals.CI(est, lo, hi, min(x.size, y.size), 0.95))
        size_ci = (size.size.low, size.size.high) if size.size is not None else (np.nan, np.nan)
        ev = [
            Evidence(f"clip_frac({GSPO}) / clip_frac({base})", est, lo, hi, n),
            mean_evidence(f"clip_frac({GSPO})", x),
            mean_evidence(f"clip_frac({base})", y),
            Evidence(f"{PAPER_SIZE}: {size.sentence}", size.size_of_paper, *size_ci, n_label(x, y)),
        ]
        return CLIP_DECISION(lo, hi), ev

    strat = stratify(study, groups)
    res = finish("C2", rule, strat, run_strata(study, strat, groups, evaluate), evaluate)
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
