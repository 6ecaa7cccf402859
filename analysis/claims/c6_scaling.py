"""C6: performance keeps improving with more compute and longer generation length. For GSPO, (a) the compute part:
each run's mean reward over the last quarter of its steps minus over the third; (b) the length part: RL's held-out
gain at the longest generation budget minus at the shortest (`design.length_decomposition`, paired by seed where both
lengths ran the same seeds), with truncation's part (the cold start's difference) reported beside it, tested only where
the shortest budget does not cut the answers (`regime.truncation`); each part per stratum of the other swept axes, the
parts joined by `conjunction`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.claims import common
from analysis.claims.common import (
    CLAIMS,
    FINAL_RULE,
    GSPO,
    NOT_IN_STUDY,
    POSITIVE,
    TRAIN,
    ClaimResult,
    absent,
    alg_mask,
    bounds,
    detectable_evidence,
    final_at_common_compute,
    n_label,
    present_algorithms,
    usable_run_ids,
    with_power,
)
from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, RUN_ID
from analysis.runs.tidy import Study
from analysis.stats import curves, design, gain, intervals, regime
from analysis.stats.strata import combine, run_strata, stratify
from analysis.stats.verdicts import CONJUNCTION_RULE, INCONCLUSIVE, NO_DATA, Evidence, conjunction


def claim_c6(study: Study, rules: common.Rules = common.RULES, *, axis: str = vocab.LENGTH_AXIS) -> ClaimResult:
    """C6: GSPO's reward still rises over the last half of training, and is higher at the longest generation length
    where the shortest does not cut the answers (`rules.max_truncation`); each part per stratum of the other swept
    axes, combined by STRATA_RULE, then the parts combined."""
    present = present_algorithms(study)
    held_metric = gain.heldout_metric(study)
    pre = regime.truncation(rules.max_truncation, axis)
    rule = (
        "For GSPO: (a) compute gain = per-run mean reward over the last quarter of its logged steps minus over the "
        f"third quarter; (b) RL's length gain = the held-out gain ({held_metric}'s last evaluation minus its step-0 "
        f"evaluation of the cold start, per run) at the largest {axis} minus at the smallest (paired by seed where "
        "both lengths ran the same seeds, one run each, else Welch over the runs), with RL's gain at each "
        "length; truncation's part (the cold start's difference between the two lengths: what the budget does "
        "before any RL) is reported beside it and does not decide; without step-0 "
        f"evaluations, the final-window reward ({FINAL_RULE}) at the largest minus at the smallest. Each "
        f"gain: {POSITIVE}. The claim: {CONJUNCTION_RULE} (the length part is inconclusive when {axis} is not swept). "
        f"Length part: {pre.rule}"
    )
    if GSPO not in present:
        return absent("C6", rule, f"{GSPO} absent")
    if vocab.REWARD not in study.metrics:
        return absent("C6", rule, f"metric {vocab.REWARD} not logged")
    usable_ids = usable_run_ids(study)
    rows = curves.metric_rows(study.long, vocab.REWARD)
    rows = rows[(rows[ALGORITHM].astype(str) == GSPO) & rows[RUN_ID].astype(str).isin(usable_ids)]
    gains: dict[str, float] = {}
    for rid, r in rows.groupby(RUN_ID, observed=True, sort=False):
        v = r["value"].to_numpy(np.float64)
        q = len(v) // 4
        if q >= 1:
            gains[str(rid)] = v[-q:].mean() - v[-2 * q : -q].mean()
    gspo = {GSPO: alg_mask(study, GSPO)}

    def compute_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        ids = set(study.runs.loc[mask & gspo[GSPO], RUN_ID].astype(str))
        x = np.asarray([g for r, g in gains.items() if r in ids])
        ci = intervals.mean_ci(x)
        if ci.n == 0:
            return None
        name = "compute gain (last vs third quarter)"
        ev = [Evidence(name, ci.estimate, ci.low, ci.high, str(ci.n)), detectable_evidence(name, [x], (1,))]
        return POSITIVE(ci.low, ci.high), ev

    held = gain.per_run(study.long, held_metric) if held_metric in study.metrics else pd.DataFrame()
    truncation: list[str] = []
    measured: dict[int, regime.Measured] = {}

    def length_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
        verdict_ev = _length_part(mask)
        return None if verdict_ev is None else common.regime_verdict(*verdict_ev, measured.get(id(mask)))

    def _length_part(mask: pd.Series) -> tuple[str, list[Evidence]] | None:
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
                Evidence(name, *bounds(dec.rl_part), n),
                *(
                    Evidence(f"RL's held-out gain at {axis}={x:g}", *bounds(ci), str(ci.n))
                    for x, ci in dec.gains.items()
                ),
                Evidence(
                    f"truncation's part before RL (cold start at {axis}={hi_v} minus at {lo_v}; reported, not decided)",
                    *bounds(tr),
                    n,
                ),
                Evidence("final held-out difference (= truncation's part + RL's)", *bounds(dec.final_difference), n),
                detectable_evidence(name, [np.asarray(dec.rl_differences)], (1,))
                if dec.rl_differences
                else detectable_evidence(name, [at[dec.long], at[dec.short]], (1, -1)),
            ]
            truncation.append(
                f"truncation's part before RL (cold start at {axis}={hi_v} minus at {lo_v}) "
                f"{tr.estimate:+.3g} [{tr.low:+.3g}, {tr.high:+.3g}] beside RL's {dec.rl_part.estimate:+.3g} "
                f"[{dec.rl_part.low:+.3g}, {dec.rl_part.high:+.3g}]"
            )
            return POSITIVE(dec.rl_part.low, dec.rl_part.high), ev
        vals, _ = final_at_common_compute(  # no step-0 evaluation: the training reward's difference
            study, {"long": m & (study.runs[axis] == hi_v), "short": m & (study.runs[axis] == lo_v)}
        )
        est, lo, hi = bounds(intervals.mean_difference(vals["long"], vals["short"]))
        name = f"length gain, training reward ({axis} {hi_v} vs {lo_v}; no step-0 evaluation to split off truncation)"
        ev = [
            Evidence(name, est, lo, hi, n_label(vals["long"], vals["short"])),
            detectable_evidence(name, [vals["long"], vals["short"]], (1, -1)),
        ]
        return POSITIVE(lo, hi), ev

    s_compute = stratify(study, gspo)
    strata = run_strata(study, s_compute, gspo, compute_part, part="compute")
    part_verdicts = [combine([s.verdict for s in strata])]
    no_compute = strata[0].verdict == NO_DATA and len(s_compute.strata) == 1
    compute_note = "no data (no GSPO run with at least 4 logged steps)" if no_compute else part_verdicts[0]
    swept = axis in study.axes and study.runs.loc[gspo[GSPO], axis].nunique() > 1
    note = ""
    if swept:
        s_length = stratify(study, gspo, exclude=[axis])
        measured.update(common.measure_strata(study, s_length, gspo, pre))
        length = run_strata(study, s_length, gspo, length_part, part="length")
        note = common.regime_note(length, measured, s_length)
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
    res.split = f"{TRAIN} + {common.split_of(held_metric)}" if truncation else TRAIN
    return common.with_regime(with_power(res), note)
