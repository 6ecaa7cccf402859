"""Collapse: which runs collapsed, by the trainer's own guard (status.json) or by analysis's rules on the reward.

`status.json` is the authority (the trainer's guard: non-finite loss, exploding ratio, reward floor; such a run is
always a collapse). Analysis adds rules on the reward so that runs that decay without stopping are marked too
(`detect_collapse`: a non-finite value, optionally a floor, and the reward-drop rule COLLAPSE_RULE), and keeps a drop
only when the run ends below the seed band of its configuration (`collapse_table`): a run inside its seeds' band is
the algorithm's behaviour, not that run's collapse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, COMPUTE, RUN_ID, STEP, VALUE
from analysis.stats.curves import group_columns, metric_rows, run_info, run_slices, training_rows

NON_FINITE, FLOOR, DROP = "non-finite reward", "reward floor", "reward drop"
"""The rules `detect_collapse` applies, as `Collapse.rule` names them."""

COLLAPSE_RULE = (
    "A run is flagged as collapsed by the reward-drop rule when its trailing {window}-step mean reward falls below "
    "{keep:g} x its peak (its highest {window}-step mean, or its first step's reward, the starting policy's own "
    "rollouts, when that is higher) and at least {min_drop:g} under it, stays there to the end (at least "
    "{sustain} steps), and its mean over its last {window} steps lies more than two standard errors below the range, "
    "over the same steps, of the seeds of its configuration that did not fall (when every seed fell, each is flagged)."
)
"""The reward-drop rule as one sentence (formatted by `collapse_rule`); the report and Figure 3 quote it."""


@dataclass(frozen=True)
class Collapse:
    """Where and why a reward curve collapsed, and which rule said so (NON_FINITE, FLOOR or DROP)."""

    step: int
    reason: str
    rule: str = DROP
    last_window: float = np.nan
    """Mean reward over the run's last `window` steps (the DROP rule's seed-band check compares it)."""
    window_steps: tuple[int, int] = (0, 0)
    """First and last step of that window."""
    window_se: float = np.nan
    """Standard error of that mean: the per-step noise (from successive differences, robust) / sqrt(window)."""


def collapse_rule(
    *, rel_drop: float = 0.5, min_drop: float = 0.1, window: int = 10, sustain: int | None = None, **_: object
) -> str:
    """COLLAPSE_RULE with these parameters (those of `detect_collapse`)."""
    sustain = _sustain(window, sustain)
    return COLLAPSE_RULE.format(window=window, keep=1 - rel_drop, min_drop=min_drop, sustain=sustain)


def _sustain(window: int, sustain: int | None) -> int:
    return max(1, window // 2) if sustain is None else max(1, int(sustain))


def detect_collapse(
    steps: np.ndarray,
    values: np.ndarray,
    *,
    floor: float | None = None,
    rel_drop: float | None = 0.5,
    min_drop: float = 0.1,
    window: int = 10,
    sustain: int | None = None,
    min_peak: float = 0.05,
) -> Collapse | None:
    """First step where one run's reward curve collapsed, or None. Its own curve only: `collapse_table` then keeps
    a DROP only when the run also ends below the seed band of its configuration (COLLAPSE_RULE).

    Rules, in order of precedence at each step: a non-finite value (NON_FINITE); the rolling mean (over `window`
    steps) below `floor` (FLOOR); the rolling mean below both (1 - rel_drop) x its running peak and that peak minus
    `min_drop`, once the peak exceeds `min_peak`, where the peak starts at the first step's reward (the starting
    policy's rollouts, before any update: a run that falls within its first window has no higher window mean),
    from some window to the end of the run and for at least `sustain`
    windows (default window // 2) (DROP). A run that never learned cannot collapse by DROP; a dip it recovers from,
    a decline smaller than `min_drop` (rewards live in [0, 1]) and a drop in its last few steps are noise, not a
    collapse. The step reported is the last step of the first window that trips.
    """
    steps = np.asarray(steps)
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    bad = ~np.isfinite(v)
    if bad.any():
        return Collapse(int(steps[np.argmax(bad)]), "non-finite reward", NON_FINITE)
    w = max(1, min(window, v.size))
    roll = np.convolve(v, np.ones(w) / w, mode="valid")  # roll[i] = mean v[i : i + w]
    end = steps[w - 1 :]
    noise = float(np.median(np.abs(np.diff(v)))) / (0.6745 * np.sqrt(2)) if v.size > 2 else np.nan
    last = (float(roll[-1]), (int(steps[-w]), int(steps[-1])), noise / np.sqrt(w))
    hits: list[tuple[int, str, str]] = []
    if floor is not None:
        below = roll < floor
        if below.any():
            i = int(np.argmax(below))
            hits.append((i, f"{w}-step mean reward {roll[i]:.3g} < floor {floor:g}", FLOOR))
    if rel_drop is not None:
        peak = np.maximum.accumulate(np.maximum(roll, v[0]))
        limit = np.minimum((1.0 - rel_drop) * peak, peak - min_drop)
        drop = (peak > min_peak) & (roll < limit)
        # only a drop the run never recovers from, held long enough: noisy small-batch rewards dip and come back
        i = len(drop) - int(np.argmin(drop[::-1])) if not drop.all() else 0
        held = len(drop) - i
        if drop[-1] and held >= _sustain(window, sustain):
            hits.append(
                (
                    i,
                    f"{w}-step mean reward {roll[i]:.3g} < min({1 - rel_drop:g} x peak, peak - {min_drop:g}) with "
                    f"peak {peak[i]:.3g}, from step {int(end[i])} to the end ({held} steps)",
                    DROP,
                )
            )
    if not hits:
        return None
    i, reason, rule = min(hits)
    return Collapse(int(end[i]), reason, rule, *last)


def collapse_table(
    long: pd.DataFrame,
    runs: pd.DataFrame,
    metric: str = vocab.REWARD,
    *,
    seed_band: bool = True,
    **rules: float | int | None,
) -> pd.DataFrame:
    """Per run: the collapse the run reported (status.json, the trainer's guard) and the one analysis detects in
    `metric` (`detect_collapse` with `rules`, then for a DROP the seed-band check of COLLAPSE_RULE unless
    `seed_band` is False).

    Columns: run_id, algorithm, state, reported_step, reported_reason, detected_step, detected_reason, detected_rule,
    collapsed (reported or detected), collapse_step (reported if any, else detected), collapse_compute (compute at
    that step), flagged_by ("status.json" or the rule that detected it, "" when not collapsed), in_band (a DROP the
    seed-band check cleared, with the band, or "").
    """
    rows = training_rows(metric_rows(long, metric))
    detected: dict[str, Collapse | None] = {}
    compute_at: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    st, v, cx = rows[STEP].to_numpy(), rows[VALUE].to_numpy(), rows[COMPUTE].to_numpy()
    rid = rows[RUN_ID].astype(str).to_numpy()
    slices = run_slices(rows)
    for start, stop in slices:
        detected[rid[start]] = detect_collapse(st[start:stop], v[start:stop], **rules)  # type: ignore[arg-type]
        compute_at[rid[start]] = (st[start:stop], cx[start:stop])
        series[rid[start]] = (st[start:stop], v[start:stop].astype(np.float64))
    cleared: dict[str, str] = {}
    if seed_band and slices:
        cfg_cols = [c for c in group_columns(long) if c in rows.columns]
        info = run_info(rows, slices, cfg_cols)
        configs = info.groupby(cfg_cols, sort=False, dropna=False, observed=True).indices if cfg_cols else {}
        for idx in configs.values():
            members = [str(info[RUN_ID].iloc[i]) for i in idx]
            fell = {r for r in members if detected.get(r) is not None}
            for r in members:
                c = detected.get(r)
                if c is None or c.rule != DROP:
                    continue
                verdict = _seed_band(c, [series[p] for p in members if p not in fell])
                if verdict.startswith("inside"):
                    cleared[r] = verdict
                    detected[r] = None
                else:
                    if verdict:
                        why = verdict
                    elif len(members) == 1:
                        why = "no other seed of its configuration to compare with"
                    elif len(fell) == len(members):
                        why = f"every one of the {len(members)} seeds of its configuration fell"
                    else:
                        why = "no seed of its configuration that did not fall logged those steps"
                    detected[r] = Collapse(
                        c.step, f"{c.reason}; {why}", c.rule, c.last_window, c.window_steps, c.window_se
                    )
    out = runs[[RUN_ID, ALGORITHM, "state", "collapse_step", "collapse_reason"]].rename(
        columns={"collapse_step": "reported_step", "collapse_reason": "reported_reason"}
    )
    out = out.copy()
    ids = out[RUN_ID].astype(str)
    out["detected_step"] = pd.array([getattr(detected.get(r), "step", None) for r in ids], dtype="Int64")
    out["detected_reason"] = [getattr(detected.get(r), "reason", None) for r in ids]
    out["detected_rule"] = [getattr(detected.get(r), "rule", None) for r in ids]
    reported = out["state"].eq("collapsed")
    out["collapsed"] = reported | out["detected_step"].notna()
    out["collapse_step"] = out["reported_step"].fillna(out["detected_step"])
    comp = []
    for r, s in zip(ids, out["collapse_step"], strict=True):
        if pd.isna(s) or r not in compute_at:
            comp.append(np.nan)
            continue
        steps, cs = compute_at[r]
        i = min(int(np.searchsorted(steps, int(s))), len(steps) - 1)
        comp.append(float(cs[i]))
    out["collapse_compute"] = comp
    out["flagged_by"] = np.where(
        reported, "status.json", np.where(out["detected_step"].notna(), out["detected_rule"].astype(object), "")
    )
    out["in_band"] = [cleared.get(r, "") for r in ids]
    return out


def _seed_band(c: Collapse, peers: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    """Where a falling run's last-window mean lies against the same steps of the seeds that did not fall: "inside
    ..." / "... below ..." / "" when no such seed logged those steps."""
    lo_step, hi_step = c.window_steps
    means = []
    for steps, vals in peers:
        m = (steps >= lo_step) & (steps <= hi_step) & np.isfinite(vals)
        if m.any():
            means.append(float(vals[m].mean()))
    if not means:
        return ""
    lo, hi = min(means), max(means)
    tol = 2 * np.sqrt(2) * c.window_se if np.isfinite(c.window_se) else 0.0  # two s.e. of a difference of means
    where = (
        f"the seed band [{lo:.3g}, {hi:.3g}] (steps {lo_step}-{hi_step}) of the {len(means)} other seed(s) that did "
        "not fall"
    )
    if c.last_window >= lo - tol:
        return f"inside {where} (less 2 s.e. = {tol:.2g}): last-window mean {c.last_window:.3g}"
    return f"last-window mean {c.last_window:.3g} below {where} by more than 2 s.e. ({tol:.2g})"


__all__ = [
    "COLLAPSE_RULE",
    "DROP",
    "FLOOR",
    "NON_FINITE",
    "Collapse",
    "collapse_rule",
    "collapse_table",
    "detect_collapse",
]
