"""Per-run reductions and curves of the tidy long table (`analysis.runs.tidy`): a metric's rows per run, the final
windows, summaries over seeds per configuration, and curves aggregated on a common compute grid.

"A configuration" is a group of runs that differ only by seed: by default the grouping columns are `algorithm` and
every swept axis (all columns of the long table that are not run_id, seed, step, compute_flops, wall_s, metric, value).

The final window is the last WINDOW_FRAC (10%) of a run's training (the step-0 evaluation of the start is not part of
it), read one of two ways:

- by points (`final_window`): the last 10% of the points the run logged, at least one, whatever compute they
  span. Figures 4 and 5 read it (Figure 4 through `final_summary`), and `run_mean` is its frac 1: every point.
- by compute (`compute_window`): the steps whose compute_flops lie in [(1 - frac) x C, C], C the run's last logged
  compute (RUN_END) or one budget for every run (COMMON_END: the compute every compared group reached, so that every
  run is read over the same compute range). The claims and Figures 8 and 9 read it; WINDOW_RULE (`window_rule`) is
  its text, which they quote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from analysis.runs.columns import COMPUTE, METRIC, RUN_ID, SEED, START_STEP, STEP, VALUE, WALL
from analysis.stats.intervals import mean_band, mean_ci

NON_GROUP = frozenset({RUN_ID, SEED, STEP, COMPUTE, WALL, METRIC, VALUE, "layer"})


def group_columns(long: pd.DataFrame) -> list[str]:
    """Columns that identify a configuration: algorithm and the swept axes, in table order."""
    return [c for c in long.columns if c not in NON_GROUP and c != "state"]


# --- per-run reductions -----------------------------------------------------------------------------------------------
def metric_rows(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The rows of one metric, sorted by run then step (raises listing the metrics present)."""
    col = long[METRIC]
    cats = col.cat.categories if isinstance(col.dtype, pd.CategoricalDtype) else pd.Index(col.unique())
    if metric not in cats:
        raise KeyError(f"metric {metric!r} not in the table; present: {', '.join(map(str, cats))}")
    if isinstance(col.dtype, pd.CategoricalDtype):
        rows = long[col.cat.codes.to_numpy() == cats.get_loc(metric)]
    else:
        rows = long[col.to_numpy() == metric]
    run = rows[RUN_ID]
    codes = run.cat.codes.to_numpy() if isinstance(run.dtype, pd.CategoricalDtype) else pd.factorize(run)[0]
    step = rows[STEP].to_numpy()
    same_run = codes[1:] == codes[:-1]
    if not (np.all(codes[1:] >= codes[:-1]) and np.all(step[1:][same_run] >= step[:-1][same_run])):
        rows = rows.iloc[np.lexsort((step, codes))]
    return rows


def run_slices(rows: pd.DataFrame) -> list[tuple[int, int]]:
    """(start, stop) of each run's contiguous block in `rows` (sorted by run)."""
    run = rows[RUN_ID]
    codes = run.cat.codes.to_numpy() if isinstance(run.dtype, pd.CategoricalDtype) else pd.factorize(run)[0]
    if codes.size == 0:
        return []
    cuts = np.flatnonzero(codes[1:] != codes[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [codes.size]])
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def run_info(rows: pd.DataFrame, slices: list[tuple[int, int]], cols: Sequence[str]) -> pd.DataFrame:
    """The run id and `cols` of each run (its first row), categoricals as their values' dtype; an axis some runs
    lack (a model field only the dense control overrides: NaN for the others) as objects, its values unchanged."""
    first = np.array([s for s, _ in slices], dtype=np.int64)
    info = rows.iloc[first][[RUN_ID, *cols]].reset_index(drop=True)
    for c in info.columns:
        if isinstance(info[c].dtype, pd.CategoricalDtype):
            info[c] = info[c].astype(object if info[c].isna().any() else info[c].cat.categories.dtype)
    return info


def training_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` without the step-0 row (START_STEP: the starting policy's evaluation, before any RL step)."""
    st = rows[STEP].to_numpy()
    return rows[st > START_STEP] if (st <= START_STEP).any() else rows


# --- final windows ----------------------------------------------------------------------------------------------------
WINDOW_FRAC = 0.1
"""The final window's share of a run: its last 10%."""
WINDOW_RULE = (
    "the last {pct:g}% of compute: per run, the mean over its training steps whose compute_flops lie in "
    "[(1 - {frac:g}) x C, C], C {end}"
)
"""The rule text of `compute_window` (format with pct, frac and end, what C is); the text the claims quote."""
RUN_END = "the run's last logged compute"
"""What C is without a budget (`compute_window`'s default)."""
COMMON_END = (
    "the compute every compared group reached (the least, over the groups, of each group's longest run); a collapsed "
    "run that stopped before the window is held at its last value"
)
"""What C is for a comparison at equal compute (`compute_window` with that budget; the claims C1 and C4-C6)."""


def window_rule(frac: float = WINDOW_FRAC, end: str = RUN_END) -> str:
    """WINDOW_RULE for `frac`, C described by `end` (RUN_END: each run's own end; COMMON_END: equal compute)."""
    return WINDOW_RULE.format(pct=100 * frac, frac=frac, end=end)


def _window(long: pd.DataFrame, metric: str, frac: float, inside: Callable[[np.ndarray], np.ndarray]) -> pd.DataFrame:
    """Per run: the mean of `metric` over the training points (step >= 1) `inside` picks, given their compute in
    step order (-> their indices, in order; none: NaN). Columns: run_id, the grouping columns, seed, value,
    n_points, step_from, step_to, compute_from, compute_to."""
    if not 0 < frac <= 1:
        raise ValueError(f"frac = {frac}: valid range is (0, 1]")
    rows = training_rows(metric_rows(long, metric))
    slices = run_slices(rows)
    info = run_info(rows, slices, [*group_columns(long), SEED])
    v, st = rows[VALUE].to_numpy(np.float64), rows[STEP].to_numpy()
    cx = rows[COMPUTE].to_numpy(np.float64) if COMPUTE in rows else np.full(len(rows), np.nan)
    out: dict[str, list] = {k: [] for k in ("value", "n_points", "step_from", "step_to", "compute_from", "compute_to")}
    for start, stop in slices:
        idx = inside(cx[start:stop]) + start
        out["value"].append(float(np.mean(v[idx])) if idx.size else np.nan)
        out["n_points"].append(int(idx.size))
        out["step_from"].append(int(st[idx[0]]) if idx.size else -1)
        out["step_to"].append(int(st[idx[-1]]) if idx.size else -1)
        out["compute_from"].append(float(cx[idx[0]]) if idx.size else np.nan)
        out["compute_to"].append(float(cx[idx[-1]]) if idx.size else np.nan)
    for k, col in out.items():
        info[k] = col
    return info


def final_window(long: pd.DataFrame, metric: str, *, frac: float = WINDOW_FRAC, min_points: int = 1) -> pd.DataFrame:
    """Per run: the mean of `metric` over the last `frac` of its logged points during training (at least
    `min_points`; the step-0 evaluation of the start is not one of them).

    Columns: run_id, the grouping columns, seed, value, n_points, step_from, step_to, compute_to.
    A collapsed or failed run's window is the last stretch it logged before stopping.
    """

    def last_points(c: np.ndarray) -> np.ndarray:
        return np.arange(max(0, c.size - max(min_points, int(np.ceil(frac * c.size)))), c.size)

    return _window(long, metric, frac, last_points).drop(columns="compute_from")


def compute_window(
    long: pd.DataFrame, metric: str, *, frac: float = WINDOW_FRAC, budget: float | None = None
) -> pd.DataFrame:
    """Per run: the mean of `metric` over its training steps (step >= 1) whose compute_flops lie in
    [(1 - frac) C, C], C = `budget` when given (the same for every run: a run that stopped before (1 - frac) C has
    no value, NaN), else the run's last logged compute. At least the last step when the window holds no step.

    Columns: run_id, the grouping columns, seed, value, n_points, step_from, step_to, compute_from, compute_to."""

    def last_compute(c: np.ndarray) -> np.ndarray:
        end = float(budget) if budget is not None else float(np.nanmax(c))
        inside = (c >= (1 - frac) * end) & (c <= end)
        if budget is None and not inside.any():
            inside[-1] = True
        return np.flatnonzero(inside)

    return _window(long, metric, frac, last_compute)


def run_mean(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per run: the mean of `metric` over all its logged RL steps (e.g. the paper's average clip fraction)."""
    return final_window(long, metric, frac=1.0)


def summarize(
    per_run: pd.DataFrame,
    *,
    value: str = "value",
    by: Sequence[str] | None = None,
    confidence: float = 0.95,
) -> pd.DataFrame:
    """Mean and t interval over seeds (`mean_ci`) of a per-run value, one row per configuration (group).

    Columns: the `by` columns, mean, low, high, n (runs with a value), std.
    """
    by = list(by) if by is not None else [c for c in per_run.columns if c in group_columns(per_run)]
    by = [c for c in by if c not in ("value", "n_points", "step_from", "step_to", "compute_to", "state")]
    records = []
    for key, grp in per_run.groupby(by, sort=True, dropna=False, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        ci = mean_ci(grp[value].to_numpy(), confidence=confidence)
        x = grp[value].to_numpy(dtype=np.float64)
        records.append(
            {
                **dict(zip(by, key, strict=True)),
                "mean": ci.estimate,
                "low": ci.low,
                "high": ci.high,
                "n": ci.n,
                "std": float(np.nanstd(x, ddof=1)) if ci.n > 1 else np.nan,
            }
        )
    return pd.DataFrame.from_records(records, columns=[*by, "mean", "low", "high", "n", "std"])


def final_summary(
    long: pd.DataFrame,
    metric: str,
    *,
    frac: float = WINDOW_FRAC,
    by: Sequence[str] | None = None,
    runs: pd.DataFrame | None = None,
    states: Sequence[str] | None = None,
    confidence: float = 0.95,
) -> pd.DataFrame:
    """Final-window mean per run, then mean and CI over seeds per configuration.

    With `runs` (the per-run table), `states` keeps only runs in those states (e.g. ("completed",)) and the summary
    counts the runs of each configuration that collapsed or failed (`n_collapsed`, `n_failed`), so a mean over the
    survivors is never mistaken for a mean over all seeds.
    """
    per_run = final_window(long, metric, frac=frac)
    counts = None
    if runs is not None:
        per_run = per_run.merge(runs[[RUN_ID, "state"]], on=RUN_ID, how="left")
        states_df = per_run.copy()
        if states is not None:
            per_run = per_run[per_run["state"].isin(states)]
        by_cols = list(by) if by is not None else group_columns(long)
        counts = (
            states_df.assign(
                n_collapsed=states_df["state"].eq("collapsed"),
                n_failed=states_df["state"].eq("failed"),
            )
            .groupby(by_cols, sort=False, dropna=False, observed=True)[["n_collapsed", "n_failed"]]
            .sum()
            .reset_index()
        )
    out = summarize(per_run, by=by if by is not None else group_columns(long), confidence=confidence)
    if counts is not None:  # every configuration keeps its row, even when no run of it is in `states`
        out = counts.merge(out, on=[c for c in out.columns if c in counts.columns], how="left")
        out = out[[*[c for c in out.columns if c not in ("n_collapsed", "n_failed")], "n_collapsed", "n_failed"]]
        out["n"] = out["n"].fillna(0).astype(int)
    return out


# --- curves on a common compute grid ---------------------------------------------------------------------------------
def compute_grid(x: np.ndarray, *, n: int = 100, log: bool = True, start: float | None = None) -> np.ndarray:
    """`n` points spanning the positive range of `x` (geometric when `log`), from `start` when given."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x) & ((x > 0) if log else True)]
    if x.size == 0:
        raise ValueError("no finite (positive, for a log grid) x values to build a grid from")
    lo, hi = float(x.min()), float(x.max())
    if start is not None and lo < start <= hi:
        lo = float(start)
    if lo == hi:
        return np.array([lo])
    return np.geomspace(lo, hi, n) if log else np.linspace(lo, hi, n)


def interpolate_runs(
    rows: pd.DataFrame,
    grid: np.ndarray,
    *,
    x: str = COMPUTE,
    log: bool = True,
    smooth: int | None = None,
    center: bool = False,
) -> tuple[pd.DataFrame, np.ndarray]:
    """Each run's curve (one metric's rows) interpolated onto `grid`: (run info, (runs, len(grid)) matrix).

    Interpolation is linear in log x when `log`; a run has NaN outside its own x range (no extrapolation), so a
    collapsed run stops where it stopped. `smooth` applies a rolling mean over that many steps first: trailing, or
    centred when `center` (at the ends, over the steps there are: the first point is then a mean of about smooth / 2
    steps, not one step's value).
    """
    slices = run_slices(rows)
    xs, v = rows[x].to_numpy(dtype=np.float64), rows[VALUE].to_numpy(dtype=np.float64)
    g = np.log(grid) if log else np.asarray(grid, dtype=np.float64)
    mat = np.full((len(slices), len(grid)), np.nan)
    for i, (start, stop) in enumerate(slices):
        xi, vi = xs[start:stop], v[start:stop]
        if smooth and smooth > 1:
            vi = pd.Series(vi).rolling(smooth, min_periods=1, center=center).mean().to_numpy()
        ok = np.isfinite(xi) & np.isfinite(vi) & ((xi > 0) if log else True)
        if not ok.any():
            continue
        xi, vi = (np.log(xi[ok]) if log else xi[ok]), vi[ok]
        mat[i] = np.interp(g, xi, vi, left=np.nan, right=np.nan)
    info = run_info(rows, slices, [c for c in group_columns(rows) if c in rows.columns] + [SEED])
    return info, mat


def run_starts(rows: pd.DataFrame, *, x: str = COMPUTE, log: bool = True) -> np.ndarray:
    """Each run's first x (one metric's rows, sorted by run and step; `_run_slices` order), NaN for a run with none."""
    xs = rows[x].to_numpy(dtype=np.float64)
    out = []
    for start, stop in run_slices(rows):
        xi = xs[start:stop]
        xi = xi[np.isfinite(xi) & ((xi > 0) if log else True)]
        out.append(float(xi.min()) if xi.size else np.nan)
    return np.asarray(out, dtype=np.float64)


def step_points(
    long: pd.DataFrame,
    metric: str,
    *,
    by: Sequence[str] | None = None,
    x: str = COMPUTE,
    confidence: float = 0.95,
) -> pd.DataFrame:
    """Per configuration and step: `metric`'s mean and t interval over the seeds that logged it at that step
    (`mean_band`), at the mean of their x there. For sparse metrics logged at the same steps in every run (held-out
    evaluations): interpolating them on a compute grid would drop an evaluation whose compute differs by seed (the
    last, when a run evaluates once after its start). Columns as `aggregate_curves`'."""
    by = list(by) if by is not None else group_columns(long)
    cols = [*by, x, "mean", "low", "high", "n"]
    rows = metric_rows(long, metric)
    rows = rows[rows[VALUE].notna().to_numpy()]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    slices = run_slices(rows)
    info = run_info(rows, slices, by)
    run_of = np.repeat(np.arange(len(slices)), [b - a for a, b in slices])
    steps = rows[STEP].to_numpy()
    values, xs = rows[VALUE].to_numpy(np.float64), rows[x].to_numpy(np.float64)
    frames = []
    for key, idx in info.groupby(by, sort=True, dropna=False).indices.items():
        mine = np.isin(run_of, idx)
        key = key if isinstance(key, tuple) else (key,)
        for step in np.unique(steps[mine]):
            at = mine & (steps == step)
            mean, low, high, n = mean_band(values[at], confidence=confidence)
            frame = pd.DataFrame({x: [float(np.mean(xs[at]))], "mean": mean, "low": low, "high": high, "n": n})
            for col, val in zip(by, key, strict=True):
                frame[col] = val
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def aggregate_curves(
    long: pd.DataFrame,
    metric: str,
    *,
    by: Sequence[str] | None = None,
    x: str = COMPUTE,
    grid: np.ndarray | None = None,
    n_grid: int = 100,
    log: bool = True,
    smooth: int | None = None,
    center: bool = False,
    aligned: bool = False,
    confidence: float = 0.95,
) -> pd.DataFrame:
    """Mean curve and t band over seeds (`mean_band`) per configuration, on one grid shared by every configuration.

    `aligned`: each configuration's curve begins at the last of its runs' first x (`run_starts`), so its first point
    is a mean over all its seeds, not over the one or two that started earliest; the grid begins at the earliest
    such point. `smooth`, `center`: see `interpolate_runs`.
    Columns: the `by` columns, x (named as `x`), mean, low, high, n (runs with a value at that x).
    """
    rows = metric_rows(long, metric)
    by = list(by) if by is not None else group_columns(long)
    slices = run_slices(rows)
    groups = run_info(rows, slices, by).groupby(by, sort=True, dropna=False).indices
    starts = run_starts(rows, x=x, log=log)
    # where each configuration's curve begins: at the last of its runs' first points when aligned
    begin = {
        k: (float(np.nanmax(starts[idx])) if aligned and np.isfinite(starts[idx]).any() else -np.inf)
        for k, idx in groups.items()
    }
    if grid is None:
        first = min(begin.values()) if begin and aligned else None
        grid = compute_grid(rows[x].to_numpy(), n=n_grid, log=log, start=first)
    grid = np.asarray(grid, np.float64)
    _, mat = interpolate_runs(rows, grid, x=x, log=log, smooth=smooth, center=center)
    frames = []
    for key, idx in groups.items():
        m = mat[idx]
        m[:, grid < begin[key] * (1 - 1e-12)] = np.nan
        mean, low, high, n = mean_band(m, confidence=confidence)
        key = key if isinstance(key, tuple) else (key,)
        frame = pd.DataFrame({x: grid, "mean": mean, "low": low, "high": high, "n": n})
        for col, val in zip(by, key, strict=True):
            frame[col] = val
        frames.append(frame)
    cols = [*by, x, "mean", "low", "high", "n"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)
