"""Figure 2 (the paper's Figure 2): clipped-token fraction per algorithm and over training, from the tables
`clip_fraction` (`clip_table`) and `clip_over_training`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made, _compute_axis, _curve_legend, _curves, _legend, _plot_curves, _unit
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM
from analysis.runs.select import need_metric, select, varying
from analysis.runs.tidy import Study
from analysis.stats import curves


def clip_table(study: Study, *, confidence: float = 0.95) -> pd.DataFrame:
    """Average clipped-token fraction per algorithm (mean over all steps per run, then mean and CI over seeds).

    Columns: algorithm, part (total / low / high), mean, low, high, n; algorithms in registry order.
    """
    parts = {"total": vocab.CLIP, "low": vocab.CLIP_LOW, "high": vocab.CLIP_HIGH}
    frames = []
    for part, metric in parts.items():
        need_metric(study, metric)
        per_run = curves.run_mean(study.long, metric)
        s = curves.summarize(per_run, by=[ALGORITHM], confidence=confidence)
        s.insert(1, "part", part)
        frames.append(s)
    out = pd.concat(frames, ignore_index=True)
    algs = names.order(out[ALGORITHM].astype(str))
    out["_o"] = out[ALGORITHM].astype(str).map({a: i for i, a in enumerate(algs)})
    out["_p"] = out["part"].map({p: i for i, p in enumerate(parts)})
    return out.sort_values(["_o", "_p"]).drop(columns=["_o", "_p"]).reset_index(drop=True)


@style.styled
def figure2_clipping(study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10) -> Made:
    """Left: average clipped-token fraction per algorithm (log y; total, low, high bars with 95% CIs).
    Right: clip fraction over training compute."""
    from matplotlib.patches import Patch

    st = select(study, where)
    table = clip_table(st)
    fig = style.new_figure(ncols=2)
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.2, 1])
    algs = list(dict.fromkeys(table[ALGORITHM].astype(str)))
    width = 0.27
    shades = {"total": 1.0, "low": 0.55, "high": 0.3}
    hatches = {"total": "", "low": "//", "high": ".."}
    for k, part in enumerate(["total", "low", "high"]):
        t = table[table["part"] == part].set_index(table[table["part"] == part][ALGORITHM].astype(str)).loc[algs]
        xs = np.arange(len(algs)) + (k - 1) * width
        heights = t["mean"].to_numpy(dtype=float)
        err = np.vstack([heights - t["low"].to_numpy(float), t["high"].to_numpy(float) - heights])
        err = np.where(np.isfinite(err), np.maximum(err, 0), 0)
        ax.bar(
            xs,
            heights,
            width,
            yerr=err.tolist(),  # an array warns in matplotlib 3.11 when there is one bar (NumPy scalar conversion)
            color=[names.color(a) for a in algs],
            alpha=shades[part],
            hatch=hatches[part],
            edgecolor="white",
            gid=f"clip-{part}",
            error_kw={"lw": 0.7, "capsize": 1.5},
        )
        for xi, h in zip(xs, heights, strict=True):
            if h == 0:
                ax.annotate("0", (xi, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=6)
    style.log_scale(ax, "y")
    ax.set_xticks(np.arange(len(algs)), [names.label(a) for a in algs], rotation=30, ha="right")
    ax.set_ylabel("avg. fraction of clipped tokens")
    ax.grid(axis="x", visible=False)
    curves = _curves(st, vocab.CLIP, smooth=smooth, n_grid=100)
    scale, unit = _unit(st)
    _plot_curves(ax2, curves, varying(st), scale=scale)
    _compute_axis(ax2, unit)
    style.log_scale(ax2, "y")
    ax2.set_ylabel("clipped-token fraction")
    parts = [
        (Patch(facecolor=style.NEUTRAL, alpha=shades[p], hatch=hatches[p], edgecolor="white"), f"bars: {p}")
        for p in shades
    ]
    _legend(fig, extra=[*_curve_legend(curves, varying(st)), *parts])
    tot = table[table["part"] == "total"].set_index(ALGORITHM)["mean"]
    caption = (
        "Figure 2. Average fraction of clipped tokens (token-weighted, clipped branch active) per algorithm, split "
        "into the low side (ratio < 1 - eps_low, A < 0) and the high side (ratio > 1 + eps_high, A > 0); mean over "
        "training steps per run, then mean and 95% t interval over seeds. Right: over training. Averages: "
        + ", ".join(f"{names.label(str(a))} {v:.3g}" for a, v in tot.items())
        + "."
    )
    return Made(fig, "figure2_clipping", caption, {"clip_fraction": table, "clip_over_training": curves})
