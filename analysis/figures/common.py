"""What the figure modules share: `Made` (a built figure) and `MissingData`, selecting runs (`select`, `routed`), the
compute axis, seed-mean curves and their legend, and the gap markers and top tags of Figures 8 and 9. Names with a
leading underscore are internal to analysis.figures (and analysis.claims.offpolicy, which builds Figure 9's tables)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.figures import style
from analysis.runs import names
from analysis.runs.columns import ALGORITHM, COMPUTE, EMULATED
from analysis.runs.natural import natural_keys
from analysis.runs.select import equal, key, varying
from analysis.runs.tidy import Study
from analysis.stats import curves


@dataclass
class Made:
    """A built figure: save it with `style.save(made.fig, out_dir / made.name)`."""

    fig: Figure
    name: str
    caption: str
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


def emulation_note(runs: pd.DataFrame) -> str:
    """A caption sentence saying which runs' low precision was emulated (runs.precision_emulated); "" when none."""
    flag = runs[EMULATED]
    n_em = int((flag == True).sum())  # noqa: E712 (nullable boolean)
    if n_em == 0:
        return ""
    scope = "every run" if n_em == len(runs) else f"{n_em} of {len(runs)} runs"
    return (
        f" Low precision is EMULATED in {scope} (precision_emulated: fp32 compute rounded where a GPU would round), "
        "not run on low-precision hardware: read mismatch magnitudes as the emulation's."
    )


def _counts(sizes: pd.Series) -> str:
    """{"GRPO": 3, ...} as "GRPO 3, GSPO 3" (registry labels, plain ints); "" when empty."""
    return ", ".join(f"{names.label(str(k))} {int(v)}" for k, v in sizes.items() if int(v))


def _group_label(alg: str, extra: Mapping[str, Any]) -> str:
    tail = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in extra.items())
    return f"{names.label(alg)} ({tail})" if tail else names.label(alg)


def _curves(
    study: Study, metric: str, *, smooth: int | None, n_grid: int, log: bool = True, evaluations: bool = False
) -> pd.DataFrame:
    """Seed-mean curves per configuration: aligned (each begins where all its seeds have a value) and, with
    `smooth`, a centred rolling mean (the first point averages the first steps, it is not one step's reward). With
    `evaluations` (held-out scores, logged at the same steps in every run): the seed mean at each evaluation step,
    at the seeds' mean compute there (`curves.step_points`), from the step-0 evaluation at compute 0 where the runs
    have one."""
    by = [ALGORITHM, *varying(study)]
    if evaluations:
        return curves.step_points(study.long, metric, by=by).sort_values([*by, COMPUTE], kind="stable")
    return curves.aggregate_curves(
        study.long, metric, by=by, smooth=smooth, center=True, aligned=True, n_grid=n_grid, log=log
    )


def _first_step_compute(study: Study) -> float | None:
    """The compute of the first RL step (the smallest positive compute logged); None when there is none."""
    c = study.long[COMPUTE].to_numpy(dtype=np.float64) if len(study.long) else np.array([])
    c = c[np.isfinite(c) & (c > 0)]
    return float(c.min()) if c.size else None


def _unit(study: Study) -> tuple[float, str]:
    """The compute unit of the study's axes (style.compute_unit of its largest compute)."""
    c = study.long[COMPUTE].to_numpy(dtype=np.float64) if len(study.long) else np.array([np.nan])
    return style.compute_unit(float(np.nanmax(c)) if np.isfinite(c).any() else np.nan)


def _compute_axis(ax: Axes, unit: str, *, zero: float | None = None) -> None:
    """A log compute axis; with `zero` (the first step's compute, in the axis unit) drawn from 0: linear up to
    `zero`, logarithmic beyond (style.log_scale), so that the start's evaluation at compute 0 has a place."""
    style.log_scale(ax, "x", zero=zero)
    ax.set_xlabel(f"training compute ({unit})")


def _legend(fig: Figure, axes: Sequence[Axes] = (), *, extra: Sequence[tuple[Any, str]] = ()) -> None:
    """One legend for the whole figure, below its panels (never over data): the labelled artists of `axes` in order,
    each label once, then `extra` (handle, label) pairs."""
    handles, labels = [], []
    for ax in axes:
        for h, lb in zip(*ax.get_legend_handles_labels(), strict=True):
            if lb not in labels:
                handles.append(h)
                labels.append(lb)
    for h, lb in extra:
        handles.append(h)
        labels.append(lb)
    if not handles:
        return
    ncols = style.legend_ncols(labels, width=fig.get_figwidth())
    fig.set_figheight(fig.get_figheight() + 0.17 * -(-len(handles) // ncols) + 0.1)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, handlelength=3.5)  # long enough to show a dash


DASHES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (10, 4)), (0, (1, 3)), (0, (3, 1, 3, 4)))
"""Line styles of the configurations of the other swept axes within one algorithm (colour = algorithm)."""


def _combos(curves: pd.DataFrame, extra_axes: Sequence[str]) -> list[tuple[Any, ...]]:
    """The value combinations of `extra_axes` in `curves`, sorted: their index picks the line style."""
    if not extra_axes:
        return [()]
    keys = curves[list(extra_axes)].drop_duplicates()
    return sorted({key(k) for k in keys.itertuples(index=False, name=None)}, key=natural_keys)


def _curve_legend(curves: pd.DataFrame, extra_axes: Sequence[str]) -> list[tuple[Any, str]]:
    """Legend entries for `_plot_curves`: one per algorithm (its colour), then, with other swept axes, one per value
    combination (its line style, in grey), so a legend of 5 algorithms x 4 configurations has 9 entries, not 20."""
    from matplotlib.lines import Line2D

    algs = names.order(curves[ALGORITHM].astype(str).unique())
    out = [(Line2D([], [], color=names.color(a)), names.label(a)) for a in algs]
    if extra_axes:
        for k, combo in enumerate(_combos(curves, extra_axes)):
            tail = ", ".join(f"{a.rsplit('.', 1)[-1]}={v}" for a, v in zip(extra_axes, combo, strict=True))
            out.append((Line2D([], [], color=style.NEUTRAL, ls=DASHES[k % len(DASHES)]), tail))
    return out


def _plot_curves(
    ax: Axes, curves: pd.DataFrame, extra_axes: Sequence[str], *, scale: float, x: str = COMPUTE, points: bool = False
) -> None:
    """Mean line and band per configuration, registry order: colour = algorithm, line style = the combination of the
    other swept axes' values (`_curve_legend` writes the legend). `points` (sparse measurements, such as held-out
    evaluations): the interval as an error bar at each measured point instead of a band between them."""
    combos = {c: k for k, c in enumerate(_combos(curves, extra_axes))}
    keys = curves[[ALGORITHM, *extra_axes]].drop_duplicates()
    algs = names.order(keys[ALGORITHM].astype(str))
    for alg in algs:
        sub = keys[keys[ALGORITHM].astype(str) == alg]
        for _, row in sub.iterrows():
            mask = np.ones(len(curves), dtype=bool)
            for col in [ALGORITHM, *extra_axes]:
                mask &= equal(curves[col], row[col])
            c = curves[mask]
            ls = DASHES[combos[key([row[a] for a in extra_axes])] % len(DASHES)]
            label = _group_label(alg, {a: row[a] for a in extra_axes})
            ax.plot(c[x] / scale, c["mean"], color=names.color(alg), ls=ls, label=label)
            if points:
                bars = c[c["low"].notna() & c["high"].notna() & (c["high"] > c["low"])]
                err = np.vstack([bars["mean"] - bars["low"], bars["high"] - bars["mean"]])
                ax.errorbar(
                    bars[x] / scale, bars["mean"], yerr=err, fmt="o", ms=3, capsize=2, lw=0.8, color=names.color(alg)
                )
            else:
                ax.fill_between(c[x] / scale, c["low"], c["high"], color=names.color(alg), alpha=0.2, lw=0)
            at0 = c[c[x] == 0]
            if len(at0):  # the starting policy's evaluation (step 0): a measured point, not an interpolation
                ax.plot(at0[x], at0["mean"], "o", ms=3, color=names.color(alg), gid="start")


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
"""Marker per series where colour alone would repeat (Figure 8's comparisons)."""


def _err(t: pd.DataFrame, mean: str = "mean") -> np.ndarray:
    """(2, n) non-negative error-bar lengths from low/high columns (0 where there is no interval)."""
    m = t[mean].to_numpy(float)
    e = np.vstack([m - t["low"].to_numpy(float), t["high"].to_numpy(float) - m])
    return np.where(np.isfinite(e), np.maximum(e, 0), 0)


def _gap_bars(
    ax: Axes, x: pd.Series, p: pd.DataFrame, xerr: pd.DataFrame, alg: str, k: int, label: str, gid: str
) -> None:
    """One comparison's gaps (`p`: estimate, low, high) at `x`, with `xerr` (lo, hi columns) the x intervals, in
    `alg`'s colour and the k-th marker: Figures 8 and 9 draw their gaps alike."""
    ax.errorbar(
        x,
        p["estimate"],
        yerr=_err(p, "estimate"),
        xerr=xerr.to_numpy().T,
        color=names.color(alg),
        marker=MARKERS[k % len(MARKERS)],
        ms=4,
        lw=1.0,
        capsize=1.5,
        label=label,
        gid=gid,
    )


def _top_tags(
    fig: Figure, axes: Sequence[Axes], xs: np.ndarray, tags: Sequence[str], title: str, *, crowded: str
) -> None:
    """Tick labels on top of each of `axes` naming what each x in `xs` is (`tags`, 6 pt, lines split by newlines),
    titled `title`; where neighbouring tags would overlap, none is written and the title says `crowded`."""
    from matplotlib import ticker

    fig.draw_without_rendering()  # the layout, so that the tags' room can be measured
    inches = axes[0].transData.transform(np.c_[xs, np.zeros(len(xs))])[:, 0] / fig.dpi
    width = [max(map(len, t.split("\n"))) * 0.6 * 6 / 72 for t in tags]  # 6 pt labels
    order = np.argsort(inches)
    room = all(
        inches[b] - inches[a] >= 0.5 * (width[a] + width[b]) + 0.04 for a, b in itertools.pairwise(order)
    )  # neighbouring tags must not overlap
    for ax in axes:
        top = ax.secondary_xaxis("top")
        top.set_xticks(list(xs), list(tags) if room else [""] * len(tags))
        top.tick_params(labelsize=6, length=2)
        top.xaxis.set_minor_locator(ticker.NullLocator())
        top.set_xlabel(title if room else crowded, fontsize=7)
