"""Figure 3 (the paper's Figure 3): reward with vs without Routing Replay per loss function, every run drawn,
from the table `collapses` (analysis.stats.collapse.collapse_table)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made, _compute_axis, _legend, _unit
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, COMPUTE, RUN_ID
from analysis.runs.select import MissingData, equal, need_metric, select
from analysis.runs.tidy import Study
from analysis.stats import collapse, curves, intervals


def routing_families(present: Sequence[str]) -> list[list[str]]:
    """Groups of algorithms that share a loss function but differ in routing mode (the registry's `routing_variants`),
    registry order, free first.

    Only groups with at least two routing modes present are returned (these are the Routing Replay ablations).
    """
    reg = names.registry()
    ordered = names.order(present)
    modes = {m: i for i, m in enumerate(reg.ROUTING_MODES)}
    out, seen = [], set()
    for n in ordered:
        if n in seen:
            continue
        variants = set(reg.routing_variants(n))
        members = [m for m in ordered if m in variants]
        seen.update(members)
        if len({reg.get(m).routing for m in members}) > 1:
            out.append(sorted(members, key=lambda m: modes[reg.get(m).routing]))
    return out


@style.styled
def figure3_routing_replay(
    study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10, **collapse_rules: Any
) -> Made:
    """Reward vs compute with and without Routing Replay, one panel per loss function (a row of panels per
    configuration of the other swept axes: a mean over configurations would mix runs that differ by design); every
    run drawn thin, the seed mean thick, collapsed runs (reported in status.json or detected in the reward) marked
    with an x."""
    st = select(study, where)
    need_metric(st, vocab.REWARD)
    fams = routing_families(st.runs[ALGORITHM].dropna().astype(str).unique())
    if not fams:
        raise MissingData("no pair of algorithms with the same loss and different routing in this study")
    rows = curves.metric_rows(st.long, vocab.REWARD)
    grid = curves.compute_grid(rows[COMPUTE].to_numpy(), n=100)
    info, mat = curves.interpolate_runs(rows, grid, smooth=smooth, center=True)
    cfg_cols = [c for c in curves.group_columns(rows) if c in info.columns and c != ALGORITHM]
    configs = list(info[cfg_cols].drop_duplicates().sort_values(cfg_cols).itertuples(index=False)) if cfg_cols else [()]
    fig = style.new_figure(ncols=len(fams), nrows=len(configs), width=min(style.WIDTH_DOUBLE, 3.5 * len(fams)))
    grid_axs = fig.subplots(len(configs), len(fams), squeeze=False, sharey=True, sharex=True)
    starts = curves.run_starts(rows)
    scale, unit = _unit(st)
    coll = collapse.collapse_table(st.long, st.runs, vocab.REWARD, **collapse_rules)
    coll_by = coll.set_index(RUN_ID)
    reg = names.registry()
    algs = info[ALGORITHM].astype(str).to_numpy()
    for axs, cfg in zip(grid_axs, configs, strict=True):
        in_cfg = np.ones(len(info), dtype=bool)
        for col, value in zip(cfg_cols, cfg, strict=True):
            in_cfg &= equal(info[col], value)
        where_cfg = ", ".join(f"{c}={v}" for c, v in zip(cfg_cols, cfg, strict=True))
        for ax, fam in zip(axs, fams, strict=True):
            if not any(((algs == alg) & in_cfg).any() for alg in fam):  # a cell the sweep left out, said as such
                ax.text(
                    0.5,
                    0.5,
                    "not run in this configuration",
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    color=style.NEUTRAL,
                    fontsize="small",
                )
            for alg in fam:
                idx = np.flatnonzero((algs == alg) & in_cfg)
                col = names.color(alg)
                for i in idx:
                    ax.plot(grid / scale, mat[i], color=col, lw=0.5, alpha=0.35)
                    rid = str(info[RUN_ID].iloc[i])
                    if rid in coll_by.index and bool(coll_by.loc[rid, "collapsed"]):
                        cx = coll_by.loc[rid, "collapse_compute"]
                        last = np.flatnonzero(np.isfinite(mat[i]))
                        if np.isfinite(cx) and last.size:
                            yv = np.interp(np.log(cx), np.log(grid[last]), mat[i][last])
                            ax.plot([cx / scale], [yv], marker="x", ms=6, mew=1.5, color=col, ls="none", gid="collapse")
                if idx.size:  # the mean begins where every seed has logged (its first point is a mean over all)
                    m = mat[idx].copy()
                    m[:, grid < np.nanmax(starts[idx]) * (1 - 1e-12)] = np.nan
                    mean = intervals.mean_band(m)[0]
                    ax.plot(grid / scale, mean, color=col, lw=1.8, label=f"{names.label(alg)} ({reg.get(alg).routing})")
            _compute_axis(ax, unit)
            ax.set_title(names.label(fam[0]) + (f"\n{where_cfg}" if where_cfg else ""))
    for axs in grid_axs:
        axs[0].set_ylabel("training reward")
    from matplotlib.lines import Line2D

    mark = Line2D([], [], marker="x", ls="none", color=style.NEUTRAL, mew=1.5)
    _legend(fig, list(grid_axs.ravel()), extra=[(mark, "collapsed (x)")])
    caption = (
        "Figure 3. With vs without Routing Replay: algorithms sharing a loss function, differing only in routing "
        f"mode{' (a row per configuration of ' + ', '.join(cfg_cols) + ')' if cfg_cols else ''}. Thin lines are "
        f"individual seeds, thick lines their mean (a centred {smooth}-step mean of the reward); "
        "x marks where a run collapsed: reported by "
        "the run itself (status.json: the trainer's guard) or flagged by analysis. "
        + collapse.collapse_rule(**collapse_rules)
        + " Collapsed runs: "
        + collapse_counts(coll)
        + "."
    )
    return Made(fig, "figure3_routing_replay", caption, {"collapses": coll})


def collapse_counts(coll: pd.DataFrame) -> str:
    """ "GRPO 2 (status.json 1, reward drop 1), GSPO 1 (reward drop 1)" from a `collapse.collapse_table`; "none"."""
    c = coll[coll["collapsed"]]
    if c.empty:
        return "none"
    parts = []
    for alg in names.order(c[ALGORITHM].astype(str)):
        by = c[c[ALGORITHM].astype(str) == alg]["flagged_by"].value_counts()
        parts.append(f"{names.label(alg)} {int(by.sum())} (" + ", ".join(f"{k} {int(v)}" for k, v in by.items()) + ")")
    return ", ".join(parts)
