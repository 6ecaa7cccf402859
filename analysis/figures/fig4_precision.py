"""Figure 4 (this study's): final reward and engine/trainer mismatch per precision configuration, from one
`curves.final_summary` table per metric."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from analysis.figures import style
from analysis.figures.common import Made, _legend, emulation_note
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM
from analysis.runs.select import MissingData, need_metric
from analysis.runs.tidy import Study
from analysis.stats import curves


def _config_bars(
    ax: Axes, summary: pd.DataFrame, config_cols: Sequence[str], *, ylabel: str, log: bool = False
) -> list[str]:
    """Grouped bars: x = configuration (joined axis values), one bar per algorithm, 95% CI error bars."""
    summary = summary.copy()
    summary["_cfg"] = summary[list(config_cols)].astype(str).agg(" / ".join, axis=1)
    cfgs = list(dict.fromkeys(summary.sort_values(list(config_cols))["_cfg"]))
    algs = names.order(summary[ALGORITHM].astype(str))
    width = 0.8 / max(1, len(algs))
    for k, alg in enumerate(algs):
        s = summary[summary[ALGORITHM].astype(str) == alg].set_index("_cfg").reindex(cfgs)
        xs = np.arange(len(cfgs)) + (k - (len(algs) - 1) / 2) * width
        h = s["mean"].to_numpy(float)
        err = np.vstack([h - s["low"].to_numpy(float), s["high"].to_numpy(float) - h])
        err = np.where(np.isfinite(err), np.maximum(err, 0), 0)
        ax.bar(xs, h, width, yerr=err.tolist(), color=names.color(alg), label=names.label(alg), error_kw={"lw": 0.7})
    ax.set_xticks(np.arange(len(cfgs)), cfgs, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    if log:
        style.log_scale(ax, "y")
    ax.grid(axis="x", visible=False)
    return cfgs


@style.styled
def figure4_precision(
    study: Study,
    *,
    axes: Sequence[str] = (vocab.TRAIN_PRECISION_AXIS, vocab.ROLLOUT_PRECISION_AXIS, vocab.OLD_LOGP_AXIS),
    mismatch: Sequence[str] = (vocab.MISMATCH_MEAN_ABS, vocab.MISMATCH_K3),
    frac: float = 0.1,
) -> Made:
    """Final reward and training-inference mismatch per precision configuration (the axes among `axes` that the
    study sweeps), bars per algorithm with 95% CIs over seeds."""
    present = [a for a in axes if a in study.axes]
    if not present:
        raise MissingData(f"none of the precision axes {list(axes)} is swept; swept axes: {study.axes or 'none'}")
    for m in (vocab.REWARD, *mismatch):
        need_metric(study, m)
    by = [ALGORITHM, *present]
    fig = style.new_figure(ncols=1 + len(mismatch), width=style.WIDTH_DOUBLE, height=3.0)
    axs = fig.subplots(1, 1 + len(mismatch), squeeze=False)[0]
    tables = {}
    for ax, metric in zip(axs, [vocab.REWARD, *mismatch], strict=True):
        s = curves.final_summary(study.long, metric, frac=frac, by=by, runs=study.runs)
        tables[metric] = s
        _config_bars(ax, s, present, ylabel=metric, log=metric != vocab.REWARD)
        ax.set_title("final reward" if metric == vocab.REWARD else metric)
    _legend(fig, axs[:1])
    caption = (
        f"Figure 4. Precision: final reward (mean of the last {frac:.0%} of steps) and training-inference mismatch "
        f"per configuration ({' / '.join(present)}); bars are seed means with 95% t intervals."
        + emulation_note(study.runs)
    )
    return Made(fig, "figure4_precision", caption, tables)
