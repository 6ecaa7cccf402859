"""The ScaleRL compute-scaling fit (arXiv 2510.13786), as the GSPO study's specification gives it (docs/references.md).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

C is training compute, A the asymptotic reward, B the efficiency (steepness), C_mid the compute at half of the gain.

Procedure (`fit_curves`):
1. R0 is fixed to the initial reward (the mean over seeds of each run's first logged value).
2. The early phase is dropped: points with C < `skip_frac` (default 5%) x the largest compute are not fitted.
3. The seed-mean curve on a log-spaced compute grid is fitted by least squares (equal weight per grid point).
   ScaleRL searches a grid over (A, C_mid) and solves for B. The same least-squares problem is searched here on a
   grid over (C_mid, B) with A solved exactly: for fixed (C_mid, B) the squared error is a quadratic in A, so its
   bounded minimiser is closed-form. That gives every (A, C_mid, B) cell's best error at once, hence the profile of
   the error over A as well. The best cell is then polished by bounded least squares (no grid quantisation).
4. Uncertainty: a bootstrap over seeds (resample runs, refit the mean curve) when there are at least 2 seeds, and
   always a profile interval for A (the A values whose best error is within an F-test threshold of the minimum; the
   grid points are correlated, so this interval is optimistic and is used only when there is one seed).
5. Identification. Each parameter has bounds: A in [R0 + 0.1% of (a_max - R0), a_max] (rewards live in [0, 1]; the
   curve rises from R0), B in `Grid.b_range`, C_mid in `Grid.c_mid_span` x the fitted compute. A is "identified" only
   when the fitted C_mid lies inside the observed compute (the curve passed its half-gain point), A is not at a
   bound, and A's interval does not reach one. The fit as a whole is identified only when, in addition, no parameter
   sits at a bound and no parameter's interval reaches one (at least (1 - confidence) / 2 of the bootstrap draws at
   it, so the bound lies inside the percentile interval). Otherwise the notes say which parameter, and Figure 7
   draws the points but no curve: flat or falling data fit a step (B at its bound) to an arbitrary A, which is no
   prediction.

Comparison (`compare_fits`): A first (a difference within `a_noise` = 0.02 is noise across seeds); when the A's
tie, both are refitted with A held at their mean and compared by B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import optimize
from scipy import stats as sps

from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, COMPUTE
from analysis.stats import curves

A_NOISE = 0.02


def sigmoid(c: np.ndarray | float, *, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)."""
    c = np.asarray(c, dtype=np.float64)
    with np.errstate(over="ignore", divide="ignore"):
        return r0 + (a - r0) / (1.0 + np.exp(b * (np.log(c_mid) - np.log(c))))


@dataclass(frozen=True)
class Params:
    """Sigmoid parameters."""

    a: float
    b: float
    c_mid: float
    r0: float

    def __call__(self, c: np.ndarray | float) -> np.ndarray:
        return sigmoid(c, r0=self.r0, a=self.a, b=self.b, c_mid=self.c_mid)


@dataclass
class ScalingFit:
    """A fitted compute-scaling curve with its uncertainty and the data it was fitted to."""

    params: Params
    sse: float
    x: np.ndarray
    """Compute grid points used in the fit (after the early phase)."""
    y: np.ndarray
    """Seed-mean reward at those points."""
    runs: np.ndarray
    """(seeds, points) per-run rewards at those points (the bootstrap resamples rows)."""
    c_max: float
    """Largest compute observed."""
    skip_compute: float
    """Points below this compute were dropped as the early phase."""
    a_max: float
    a_ci: tuple[float, float] = (np.nan, np.nan)
    b_ci: tuple[float, float] = (np.nan, np.nan)
    c_mid_ci: tuple[float, float] = (np.nan, np.nan)
    a_profile: tuple[float, float] = (np.nan, np.nan)
    ci_method: str = "none"
    confidence: float = 0.95
    boot: np.ndarray = field(default_factory=lambda: np.empty((0, 3)))
    """(n_boot, 3) bootstrap draws of (A, B, C_mid)."""
    notes: list[str] = field(default_factory=list)
    a_fixed: bool = False
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Each parameter's (lower, upper) bound in the fit: "A", "B", "C_mid"."""
    boot_at_bound: dict[str, float] = field(default_factory=dict)
    """Fraction of the bootstrap draws at each bound ("A lower", "B upper", ...)."""
    problems: list[str] = field(default_factory=list)
    """What the data do not identify, in short ("B at its upper bound"); the notes say it in full."""

    @property
    def n_seeds(self) -> int:
        return int(self.runs.shape[0])

    @property
    def a_identified(self) -> bool:
        """False when the data do not identify A (see the module docstring, step 5)."""
        return not any(n.startswith("A not identified") for n in self.notes)

    @property
    def identified(self) -> bool:
        """False when the data do not identify the curve: A is not identified, or a parameter or its interval sits
        at a bound (module docstring, step 5). Such a fit is reported, not drawn."""
        return self.a_identified and not any(n.startswith("not identified") for n in self.notes)

    @property
    def why_not_identified(self) -> str:
        """`problems` in one short line ("C_mid beyond the data; at a bound: A, B; interval at a bound: B"); "" when
        the fit is identified."""
        if self.identified:
            return ""
        parts = [p for p in self.problems if " bound" not in p]
        for kind, test in (
            ("at a bound", lambda p: " at its " in p and "interval" not in p),
            ("interval at a bound", lambda p: "interval" in p),
        ):
            names = list(dict.fromkeys(p.split()[0].removesuffix("'s") for p in self.problems if test(p)))
            if names:
                parts.append(f"{kind}: {', '.join(names)}")
        return "; ".join(parts)

    def predict(self, c: np.ndarray | float) -> np.ndarray:
        return self.params(c)

    def row(self) -> dict[str, object]:
        """One row of the fit table (A, B, C_mid with intervals, identification, method)."""
        p = self.params
        return {
            "A": p.a,
            "A_low": self.a_ci[0],
            "A_high": self.a_ci[1],
            "B": p.b,
            "B_low": self.b_ci[0],
            "B_high": self.b_ci[1],
            "C_mid": p.c_mid,
            "C_mid_low": self.c_mid_ci[0],
            "C_mid_high": self.c_mid_ci[1],
            "R0": p.r0,
            "C_max": self.c_max,
            "n_seeds": self.n_seeds,
            "n_points": len(self.x),
            "A_identified": self.a_identified,
            "identified": self.identified,
            "ci": self.ci_method,
            "notes": "; ".join(self.notes),
        }


@dataclass(frozen=True)
class Grid:
    """Search grid of the fit (log C_mid relative to the data, B, and the A bounds)."""

    n_c_mid: int = 121
    c_mid_span: tuple[float, float] = (0.1, 100.0)
    """C_mid from span[0] x min(C) to span[1] x max(C)."""
    n_b: int = 121
    b_range: tuple[float, float] = (0.05, 20.0)
    n_a: int = 201


def _cell_sse(
    logc: np.ndarray,
    y: np.ndarray,
    r0: float,
    lc: np.ndarray,
    bs: np.ndarray,
    d_lo: float,
    d_hi: float,
    d_fixed: float | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """For every (log C_mid, B) cell: the best d = A - R0 and its SSE (plus the quadratic's terms for profiles)."""
    # s[c, b, p] = 1 / (1 + (C_mid / C_p)^B): the shape; the prediction is r0 + d * s with d = A - r0.
    z = bs[None, :, None] * (lc[:, None, None] - logc[None, None, :])
    s = 1.0 / (1.0 + np.exp(np.clip(z, -700, 700)))
    e = r0 - y  # residual of the prediction at d = 0
    s1 = (e * s).sum(axis=-1)  # sum e s
    s2 = (s * s).sum(axis=-1)  # sum s^2
    e2 = float((e * e).sum())
    # SSE(d) = e2 + 2 d s1 + d^2 s2, minimised over d in [d_lo, d_hi]: a clipped closed form
    d = np.full_like(s1, d_fixed) if d_fixed is not None else np.clip(-s1 / np.maximum(s2, 1e-300), d_lo, d_hi)
    return d, e2 + 2 * d * s1 + d * d * s2, s1, s2, e2


def _grid_search(
    x: np.ndarray,
    y: np.ndarray,
    r0: float,
    a_lo: float,
    a_hi: float,
    grid: Grid,
    a_fixed: float | None,
    profile: bool = True,
    zooms: int = 3,
) -> tuple[tuple[float, float, float], float, np.ndarray, np.ndarray]:
    """Best (A, C_mid, B) on the grid, its SSE, and the profile (A values, min SSE over (C_mid, B) per A).

    After the coarse grid, `zooms` finer 21 x 21 grids around the best cell remove most of the quantisation.
    """
    logc = np.log(x)
    lc = np.linspace(np.log(x.min() * grid.c_mid_span[0]), np.log(x.max() * grid.c_mid_span[1]), grid.n_c_mid)
    lb = np.linspace(np.log(grid.b_range[0]), np.log(grid.b_range[1]), grid.n_b)
    d_fixed = None if a_fixed is None else a_fixed - r0
    d, sse, s1, s2, e2 = _cell_sse(logc, y, r0, lc, np.exp(lb), a_lo - r0, a_hi - r0, d_fixed)
    a_vals = np.linspace(a_lo, a_hi, grid.n_a)
    if a_fixed is None and profile:
        da = (a_vals - r0)[:, None, None]
        prof = (e2 + 2 * da * s1[None] + da * da * s2[None]).reshape(grid.n_a, -1).min(axis=1)
    else:
        prof = np.full(grid.n_a, np.nan)
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    best = (float(r0 + d[i, j]), float(lc[i]), float(lb[j]))
    best_sse = float(sse[i, j])
    hc, hb = lc[1] - lc[0], lb[1] - lb[0]
    for _ in range(zooms):
        lc_z = np.clip(np.linspace(best[1] - hc, best[1] + hc, 21), lc[0], lc[-1])
        lb_z = np.clip(np.linspace(best[2] - hb, best[2] + hb, 21), lb[0], lb[-1])
        d, sse, *_ = _cell_sse(logc, y, r0, lc_z, np.exp(lb_z), a_lo - r0, a_hi - r0, d_fixed)
        i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
        if sse[i, j] <= best_sse:
            best, best_sse = (float(r0 + d[i, j]), float(lc_z[i]), float(lb_z[j])), float(sse[i, j])
        hc, hb = hc / 10, hb / 10
    return (best[0], float(np.exp(best[1])), float(np.exp(best[2]))), best_sse, a_vals, prof


def _polish(
    x: np.ndarray,
    y: np.ndarray,
    r0: float,
    start: tuple[float, float, float],
    a_lo: float,
    a_hi: float,
    grid: Grid,
    a_fixed: float | None,
) -> tuple[tuple[float, float, float], float]:
    """Bounded least squares from the best grid cell over (A, log C_mid, B) (or (log C_mid, B) with A fixed)."""
    lc_lo = np.log(x.min() * grid.c_mid_span[0])
    lc_hi = np.log(x.max() * grid.c_mid_span[1])
    a0, c0, b0 = start

    def resid(theta: np.ndarray) -> np.ndarray:
        a = a_fixed if a_fixed is not None else theta[0]
        lc, b = theta[-2], theta[-1]
        return sigmoid(x, r0=r0, a=a, b=b, c_mid=np.exp(lc)) - y

    if a_fixed is None:
        theta0 = np.array([a0, np.log(c0), b0])
        lo, hi = [a_lo, lc_lo, grid.b_range[0]], [a_hi, lc_hi, grid.b_range[1]]
    else:
        theta0 = np.array([np.log(c0), b0])
        lo, hi = [lc_lo, grid.b_range[0]], [lc_hi, grid.b_range[1]]
    theta0 = np.clip(theta0, np.array(lo) + 1e-12, np.array(hi) - 1e-12)
    res = optimize.least_squares(resid, theta0, bounds=(lo, hi), method="trf", x_scale="jac")
    sse = float((res.fun**2).sum())
    a = a_fixed if a_fixed is not None else float(res.x[0])
    return (a, float(np.exp(res.x[-2])), float(res.x[-1])), sse


PARAMS = ("A", "B", "C_mid")


def param_bounds(x: np.ndarray, r0: float, a_max: float, grid: Grid) -> dict[str, tuple[float, float]]:
    """The bounds `fit_points` fits A, B and C_mid within, for compute points `x` and initial reward `r0`."""
    x = np.asarray(x, np.float64)
    return {
        "A": (r0 + 1e-3 * (a_max - r0), a_max),
        "B": grid.b_range,
        "C_mid": (float(x.min()) * grid.c_mid_span[0], float(x.max()) * grid.c_mid_span[1]),
    }


def at_bounds(p: Params, bounds: dict[str, tuple[float, float]], *, rtol: float = 1e-3) -> dict[str, bool]:
    """Which bounds `p` sits at ("A lower", "B upper", ...): A within rtol of its range, B and C_mid within rtol in
    log (their scale in the fit)."""
    out = {}
    for name, value in zip(PARAMS, (p.a, p.b, p.c_mid), strict=True):
        lo, hi = bounds[name]
        if name == "A":
            tol = rtol * max(hi - lo, 1e-12)
            out["A lower"], out["A upper"] = value <= lo + tol, value >= hi - tol
        else:
            out[f"{name} lower"] = np.log(value) <= np.log(lo) + rtol
            out[f"{name} upper"] = np.log(value) >= np.log(hi) - rtol
    return out


def fit_points(
    x: np.ndarray,
    y: np.ndarray,
    *,
    r0: float,
    a_max: float = 1.0,
    a_fixed: float | None = None,
    grid: Grid = Grid(),
    polish: bool = True,
) -> tuple[Params, float, np.ndarray, np.ndarray]:
    """Least-squares sigmoid through (x, y) with R0 fixed: (params, SSE, A grid, profile SSE over A).

    `polish=False` (the bootstrap's setting) skips the local refinement and the profile: A stays exact (closed
    form), C_mid and B are quantised to the grid.
    """
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0)
    x, y = np.asarray(x, np.float64)[ok], np.asarray(y, np.float64)[ok]
    if x.size < 4:
        raise ValueError(f"{x.size} usable points: the sigmoid fit needs at least 4")
    a_lo = param_bounds(x, r0, a_max, grid)["A"][0]
    best, sse, a_vals, prof = _grid_search(x, y, r0, a_lo, a_max, grid, a_fixed, profile=polish)
    if polish:
        cand, cand_sse = _polish(x, y, r0, best, a_lo, a_max, grid, a_fixed)
        if cand_sse <= sse:
            best, sse = cand, cand_sse
    a, c_mid, b = best
    return Params(a=a, b=b, c_mid=c_mid, r0=r0), sse, a_vals, prof


def fit_curves(
    x: np.ndarray,
    runs: np.ndarray,
    *,
    r0: float | None = None,
    skip_frac: float = 0.05,
    a_max: float = 1.0,
    a_fixed: float | None = None,
    n_boot: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
    grid: Grid = Grid(),
    boot_grid: Grid = Grid(n_c_mid=81, n_b=81),
) -> ScalingFit:
    """Fit the seed-mean of `runs` (seeds, len(x)) on the compute grid `x` (NaN where a run has no value).

    R0 (unless given) is the mean over runs of each run's first value (its reward at the smallest compute it
    logged); the bootstrap resamples runs and recomputes R0 with them, so R0's uncertainty is in the intervals.
    """
    x = np.asarray(x, dtype=np.float64)
    runs = np.atleast_2d(np.asarray(runs, dtype=np.float64))
    if runs.shape[1] != x.size:
        raise ValueError(f"runs has {runs.shape[1]} points per run, x has {x.size}")
    first = np.array([r[np.isfinite(r)][0] if np.isfinite(r).any() else np.nan for r in runs])
    r0_given = r0 is not None
    r0 = float(r0) if r0 is not None else float(np.nanmean(first))
    c_max = float(np.nanmax(np.where(np.isfinite(runs).any(axis=0), x, np.nan)))
    skip = skip_frac * c_max
    keep = (x >= skip) & np.isfinite(runs).any(axis=0)
    xs, rs = x[keep], runs[:, keep]
    y = np.nanmean(rs, axis=0)
    params, sse, a_vals, prof = fit_points(xs, y, r0=r0, a_max=a_max, a_fixed=a_fixed, grid=grid)
    out = ScalingFit(
        params=params,
        sse=sse,
        x=xs,
        y=y,
        runs=rs,
        c_max=c_max,
        skip_compute=skip,
        a_max=a_max,
        confidence=confidence,
        a_fixed=a_fixed is not None,
        bounds=param_bounds(xs, r0, a_max, grid),
    )
    alpha = (1 - confidence) / 2
    if a_fixed is None:
        # Profile interval: A values whose best SSE is within the F threshold (p = 3 parameters).
        n, p = xs.size, 3
        if n > p and np.isfinite(prof).all():
            thresh = sse * (1 + sps.f.ppf(confidence, 1, n - p) / (n - p))
            inside = a_vals[prof <= max(thresh, prof.min())]
            out.a_profile = (float(inside.min()), float(inside.max()))
    if runs.shape[0] >= 2 and n_boot > 0:
        rng = np.random.default_rng(seed)
        draws = np.empty((n_boot, 3))
        at: dict[str, int] = {}
        for k in range(n_boot):
            idx = rng.integers(0, rs.shape[0], rs.shape[0])
            yb = np.nanmean(rs[idx], axis=0)
            r0b = r0 if r0_given else float(np.nanmean(first[idx]))
            pb, _, _, _ = fit_points(xs, yb, r0=r0b, a_max=a_max, a_fixed=a_fixed, grid=boot_grid, polish=False)
            draws[k] = (pb.a, pb.b, pb.c_mid)
            for name, hit in at_bounds(pb, param_bounds(xs, r0b, a_max, boot_grid)).items():
                at[name] = at.get(name, 0) + int(hit)
        out.boot = draws
        out.boot_at_bound = {name: n / n_boot for name, n in at.items()}
        q = np.quantile(draws, [alpha, 1 - alpha], axis=0)
        out.a_ci, out.b_ci = (float(q[0, 0]), float(q[1, 0])), (float(q[0, 1]), float(q[1, 1]))
        out.c_mid_ci = (float(np.exp(np.quantile(np.log(draws[:, 2]), alpha))), float(q[1, 2]))
        out.ci_method = f"bootstrap over {runs.shape[0]} seeds ({n_boot} resamples)"
    elif a_fixed is None:
        out.a_ci = out.a_profile
        out.ci_method = "profile (one seed: A only)"
    _identify(out)
    return out


def _identify(f: ScalingFit) -> None:
    """Append the notes that say what the data do not identify (module docstring, step 5)."""
    if f.a_fixed:
        f.notes.append(f"A held at {f.params.a:.4g}")
        return
    if f.params.c_mid > f.c_max:
        f.notes.append(
            f"A not identified: C_mid {f.params.c_mid:.3g} is beyond the largest compute {f.c_max:.3g} "
            "(the curve has not passed its half-gain point; the run is too short)"
        )
        f.problems.append("C_mid beyond the data")
    values = {"A": f.params.a, "B": f.params.b, "C_mid": f.params.c_mid}
    for name, hit in at_bounds(f.params, f.bounds).items():
        if hit:
            par, side = name.split()
            bound = f.bounds[par][0 if side == "lower" else 1]
            prefix = "A not identified" if par == "A" else "not identified"
            what = " (no gain over R0)" if name == "A lower" else ""
            f.notes.append(f"{prefix}: {par} = {values[par]:.3g} sits at its {side} bound {bound:.3g}{what}")
            f.problems.append(f"{par} at its {side} bound")
    alpha = (1 - f.confidence) / 2
    for name, frac in f.boot_at_bound.items():
        if frac >= alpha and frac > 0:
            par, side = name.split()
            bound = f.bounds[par][0 if side == "lower" else 1]
            prefix = "A not identified" if par == "A" else "not identified"
            f.notes.append(
                f"{prefix}: {par}'s interval reaches its {side} bound {bound:.3g} "
                f"({frac:.0%} of the bootstrap fits sit there)"
            )
            f.problems.append(f"{par}'s interval at its {side} bound")
    tol = 1e-3 * max(f.a_max - f.params.r0, 1e-9)
    for name, (_lo, hi) in (("interval", f.a_ci), ("profile interval", f.a_profile)):
        if np.isfinite(hi) and hi >= f.a_max - tol and not any(n.startswith("A not identified: A's") for n in f.notes):
            f.notes.append(f"A not identified: its {name} reaches the bound a_max = {f.a_max:g}")
            f.problems.append(f"A's {name} at its upper bound")
            break
    if np.isfinite(f.c_mid_ci[1]) and f.c_mid_ci[1] > f.c_max and f.params.c_mid <= f.c_max:
        f.notes.append("C_mid interval extends beyond the observed compute")


def fit_study(
    long: pd.DataFrame,
    metric: str = vocab.REWARD,
    *,
    by: Sequence[str] = (ALGORITHM,),
    runs: pd.DataFrame | None = None,
    states: Sequence[str] = ("completed",),
    n_grid: int = 60,
    skip_frac: float = 0.05,
    a_max: float = 1.0,
    n_boot: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
) -> Fits:
    """One fit per configuration (`by`), on a log compute grid shared by all of them.

    With `runs`, only runs in `states` are fitted (a collapsed run is not a scaling curve); the others are listed in
    each fit's notes; a configuration with no such run is in `fits.skipped` with the reason. R0 is the mean over
    runs of their first logged value of `metric`.
    """
    rows = curves.metric_rows(long, metric)
    excluded: dict[tuple[object, ...], int] = {}
    fits = Fits()
    if runs is not None:
        ok_ids = set(runs.loc[runs["state"].isin(states), "run_id"].astype(str))
        drop = ~rows["run_id"].astype(str).isin(ok_ids)
        for key, grp in rows[drop].groupby(list(by), observed=True):
            excluded[key if isinstance(key, tuple) else (key,)] = grp["run_id"].nunique()
        rows = rows[~drop]
        kept = set(rows[list(by)].astype(object).drop_duplicates().itertuples(index=False, name=None))
        for key, n in excluded.items():
            if key not in kept:
                fits.skipped[key] = f"not fitted: none of its {n} run(s) is {'/'.join(states)}"
    if rows.empty:
        return fits
    grid = curves.compute_grid(rows[COMPUTE].to_numpy(), n=n_grid, log=True)
    info, mat = curves.interpolate_runs(rows, grid)
    for key, idx in info.groupby(list(by), sort=True).indices.items():
        key = key if isinstance(key, tuple) else (key,)
        f = fit_curves(
            grid,
            mat[idx],
            skip_frac=skip_frac,
            a_max=a_max,
            n_boot=n_boot,
            confidence=confidence,
            seed=seed,
        )
        if excluded.get(key):
            f.notes.append(f"{excluded[key]} run(s) not in {'/'.join(states)} were not fitted")
        fits[key] = f
    return fits


def fits_table(fits: dict[tuple[object, ...], ScalingFit], by: Sequence[str] = (ALGORITHM,)) -> pd.DataFrame:
    """The fit table: one row per configuration with A, B, C_mid, their intervals and identification; the
    configurations `fit_study` could not fit are rows too (NaN numbers, the reason in `notes`)."""
    rows = [{**dict(zip(by, key, strict=True)), **f.row()} for key, f in fits.items()]
    for key, reason in getattr(fits, "skipped", {}).items():
        rows.append({**dict(zip(by, key, strict=True)), "A_identified": False, "identified": False, "notes": reason})
    return pd.DataFrame(rows)


class Fits(dict[tuple[object, ...], ScalingFit]):
    """Fits per configuration key, plus `skipped`: configuration key -> why it was not fitted."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[tuple[object, ...], str] = {}


@dataclass(frozen=True)
class Comparison:
    """A vs B of two fitted recipes, and the rule that decided."""

    a_diff: float
    """A(first) - A(second)."""
    a_diff_ci: tuple[float, float]
    winner: int | None
    """0 (first), 1 (second) or None (inconclusive)."""
    decided_by: str
    """'A', 'B at common A', or 'inconclusive'."""
    b_at_common_a: tuple[float, float] = (np.nan, np.nan)
    b_ci_at_common_a: tuple[tuple[float, float], tuple[float, float]] = ((np.nan, np.nan), (np.nan, np.nan))
    common_a: float = np.nan
    rule: str = ""


def compare_fits(
    first: ScalingFit, second: ScalingFit, *, a_noise: float = A_NOISE, n_boot: int = 200, seed: int = 0
) -> Comparison:
    """Compare two recipes ScaleRL's way: by A first, then by B with A held at the mean of the two.

    Rule: if either fit is not identified (`ScalingFit.identified`) -> inconclusive. If |dA| > a_noise and the
    bootstrap interval of dA (when both have seed bootstraps) excludes 0 -> the higher A wins. Otherwise refit both
    with A fixed at the mean A and compare B: the higher B wins when the B intervals do not overlap, else
    inconclusive.
    """
    rule = (
        f"A first (|dA| > {a_noise:g} and its interval excludes 0), then B with A held at the mean A "
        "(non-overlapping B intervals); any unidentified fit -> inconclusive"
    )
    da = first.params.a - second.params.a
    n = min(len(first.boot), len(second.boot))
    da_ci = (np.nan, np.nan)
    if n:
        d = first.boot[:n, 0] - second.boot[:n, 0]
        da_ci = (float(np.quantile(d, 0.025)), float(np.quantile(d, 0.975)))
    if not (first.identified and second.identified):
        return Comparison(da, da_ci, None, "inconclusive", rule=rule + " [a fit is not identified]")
    excludes_zero = not n or not (da_ci[0] <= 0 <= da_ci[1])
    if abs(da) > a_noise and excludes_zero:
        return Comparison(da, da_ci, 0 if da > 0 else 1, "A", rule=rule)
    common = 0.5 * (first.params.a + second.params.a)
    refits = []
    for f in (first, second):
        full_x, full_runs = f.x, f.runs
        refits.append(
            fit_curves(
                full_x,
                full_runs,
                r0=f.params.r0,
                skip_frac=0.0,
                a_max=f.a_max,
                a_fixed=common,
                n_boot=n_boot,
                seed=seed,
            )
        )
    b = (refits[0].params.b, refits[1].params.b)
    cis = (refits[0].b_ci, refits[1].b_ci)
    overlap = not (cis[0][0] > cis[1][1] or cis[1][0] > cis[0][1])
    if np.isnan(cis[0][0]) or np.isnan(cis[1][0]) or overlap:
        return Comparison(da, da_ci, None, "inconclusive", b, cis, common, rule)
    return Comparison(da, da_ci, 0 if b[0] > b[1] else 1, "B at common A", b, cis, common, rule)
