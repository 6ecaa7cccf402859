"""The held-out gain: what RL did to held-out pass@1, a run's last evaluation during training minus its evaluation of
the starting policy at step 0 (on the same held-out set), per run and per configuration (seed mean with a 95% t
interval). The report's headline gives it per algorithm, its scorecard section the table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID, SEED, START_STEP, STEP, VALUE
from analysis.runs.tidy import Study
from analysis.stats import curves
from analysis.stats.curves import group_columns, metric_rows, run_info, run_slices
from analysis.stats.strata import usable


def per_run(long: pd.DataFrame, metric: str = vocab.EVAL_IN_DIST) -> pd.DataFrame:
    """Per run: its last evaluation of `metric` during training minus its step-0 evaluation (the starting policy's),
    what RL did to held-out pass@1. Runs without a step-0 row (written before runs evaluated their start) or without
    an evaluation after it have none (no row).

    Columns: run_id, the grouping columns, seed, start, final, final_step, value (= final - start).
    """
    rows = metric_rows(long, metric)
    cols = [*group_columns(long), SEED]
    slices = run_slices(rows)
    st, v = rows[STEP].to_numpy(), rows[VALUE].to_numpy(np.float64)
    keep, start, final, final_step = [], [], [], []
    for i, (a, b) in enumerate(slices):
        at0 = np.flatnonzero(st[a:b] == START_STEP)
        later = np.flatnonzero(st[a:b] > START_STEP)
        if at0.size and later.size:
            keep.append(i)
            start.append(float(v[a + at0[0]]))
            final.append(float(v[a + later[-1]]))
            final_step.append(int(st[a + later[-1]]))
    info = run_info(rows, slices, cols).iloc[keep].reset_index(drop=True)
    info["start"], info["final"], info["final_step"] = start, final, final_step
    info["value"] = info["final"] - info["start"]
    return info


GAIN_RULE = (
    "held-out gain = a run's last evaluation of {metric} during training minus its evaluation at step 0 (the starting "
    "policy, before any RL step, on the same held-out set); per configuration (algorithm and the swept axes) the mean "
    "over its seeds with a 95% t interval; failed runs excluded, a collapsed run counts with its "
    "last evaluation before it stopped"
)
"""How the held-out gain is computed (formatted with the metric), as the report prints it."""


@dataclass
class HeldOutGain:
    """The held-out gain per configuration (GAIN_RULE), or why there is none."""

    metric: str
    table: pd.DataFrame
    """One row per configuration: algorithm, label, the swept axes, start, final, final_step (range over seeds),
    gain, low, high, n (runs with a gain), runs (usable runs of the configuration)."""
    axes: list[str]
    reason: str = ""
    """Why the gain is not available ("" when it is)."""

    @property
    def rule(self) -> str:
        return GAIN_RULE.format(metric=self.metric)

    @property
    def split(self) -> str:
        """The metric and what it is: "test_in_dist, the test split, which no choice of the design saw"."""
        return f"{self.metric}, {SPLIT_OF[self.metric]}" if self.metric in SPLIT_OF else self.metric

    @property
    def available(self) -> bool:
        return not self.reason

    def lines(self) -> list[tuple[str, str]]:
        """One (head, text) per algorithm for the headline, e.g. ("Held-out gain, GSPO:", "RL raised held-out pass@1
        (eval_in_dist) by 0.14 [0.12, 0.16] (n=3): 0.307 at step 0 -> 0.447 at step 150"); one line saying why when
        the gain is not available."""
        if not self.available:
            return [("Held-out gain:", f"not available: {self.reason}")]
        out = []
        t = self.table.dropna(subset=["gain"])
        for alg in names.order_or_sorted(t[ALGORITHM].astype(str).unique()):
            rows = t[t[ALGORITHM].astype(str) == alg]
            head = f"Held-out gain, {rows['label'].iloc[0]}:"
            if len(rows) == 1:
                r = rows.iloc[0]
                g = float(r["gain"])
                verb = "raised" if g >= 0 else "lowered"
                interval = f"[{r['low']:.3f}, {r['high']:.3f}]" if np.isfinite(r["low"]) else "(no interval)"
                size = f"{interval} (n={int(r['n'])})"
                text = (
                    f"RL {verb} held-out pass@1 ({self.split}) by "
                    + (f"{g:.3f} {size}" if g >= 0 else f"{-g:.3f}: gain {g:.3f} {size}")
                    + f": {r['start']:.3f} at step 0 -> {r['final']:.3f} at step {r['final_step']}"
                )
            else:
                lo, hi = float(rows["gain"].min()), float(rows["gain"].max())
                up = int((rows["low"] > 0).sum())
                text = (
                    f"RL changed held-out pass@1 ({self.split}) by {lo:+.3f} to {hi:+.3f} over {len(rows)} "
                    f"configurations of {', '.join(self.axes)} (interval above 0 in {up}; each in the table "
                    "'Held-out gain')"
                )
            out.append((head, text))
        return out


SPLIT_OF = {
    vocab.TEST_IN_DIST: "the test split, which no choice of the design saw",
    vocab.EVAL_IN_DIST: "the validation split, the held-out set the design may have been chosen on",
}
"""What each held-out metric the gain can be read on is, for the report's lines."""


def heldout_metric(study: Study) -> str:
    """The held-out set the gain is read on: the test split where the study scored one, else the validation set."""
    return vocab.TEST_IN_DIST if vocab.TEST_IN_DIST in study.metrics else vocab.EVAL_IN_DIST


def heldout_gain(study: Study, metric: str | None = None) -> HeldOutGain:
    """The held-out gain (GAIN_RULE) per configuration of the usable runs, on `metric` (default `heldout_metric`:
    the test split where there is one); `reason` says why when no run has one (the metric not logged, runs written
    before the loop evaluated its start, no evaluation after it)."""
    metric = metric or heldout_metric(study)
    axes = list(study.axes)
    cols = [ALGORITHM, "label", *axes, "start", "final", "final_step", "gain", "low", "high", "n", "runs"]
    empty = pd.DataFrame(columns=cols)
    if metric not in study.metrics:
        return HeldOutGain(metric, empty, axes, f"{metric} not logged")
    runs = per_run(study.long, metric)
    runs = runs[runs[RUN_ID].astype(str).isin(set(study.runs.loc[usable(study.runs), RUN_ID].astype(str)))]
    if runs.empty:
        started = int(study.runs["start_eval"].sum())
        why = (
            f"no run has an evaluation of {metric} after its step-0 one"
            if started
            else f"no run has an evaluation of its starting policy (a step-0 row of {metric} in metrics.parquet; runs "
            "written before the loop evaluated its start), so RL's gain on the runs' own held-out set is unknown"
        )
        return HeldOutGain(metric, empty, axes, why)
    by = [ALGORITHM, *axes]
    summary = curves.summarize(runs, value="value", by=by)
    means = runs.groupby(by, observed=True, dropna=False)[["start", "final"]].mean().reset_index()
    steps = runs.groupby(by, observed=True, dropna=False)["final_step"].agg(["min", "max"]).reset_index()
    steps["final_step"] = [str(a) if a == b else f"{a}-{b}" for a, b in zip(steps["min"], steps["max"], strict=True)]
    counts = study.runs[usable(study.runs)].groupby(by, observed=True, dropna=False).size().rename("runs").reset_index()
    out = summary.merge(means, on=by).merge(steps[[*by, "final_step"]], on=by).merge(counts, on=by, how="left")
    out = out.rename(columns={"mean": "gain"})
    out["label"] = [names.label_or_name(str(a)) for a in out[ALGORITHM]]
    order = {a: i for i, a in enumerate(names.order_or_sorted(out[ALGORITHM].astype(str).unique()))}
    out = out.sort_values(by, key=lambda c: c.astype(str).map(order) if c.name == ALGORITHM else c, kind="stable")
    return HeldOutGain(metric, out[cols].reset_index(drop=True), axes)


__all__ = ["GAIN_RULE", "SPLIT_OF", "HeldOutGain", "heldout_gain", "heldout_metric", "per_run"]
