"""The paper's figures from a loaded study (analysis.tidy.Study). No function here names an algorithm.

Each `figureN_*` returns a `Made`: the matplotlib Figure, a file name, a caption, and the tables behind it (for the
report). `make_all` renders every figure whose data the study has and says why it skipped the others.

1. reward and each held-out eval vs training compute, per configuration, seed mean with a t band; the
   held-out panels begin at compute 0 with the starting policy's evaluation (the step-0 row) when runs have one;
2. average clipped-token fraction per algorithm (log scale; total, low, high) and clip fraction over training;
3. with vs without Routing Replay: algorithms that share a loss function and differ by `routing`, one panel per
   loss, every run drawn, collapsed runs marked with an x;
4. precision: final reward and mismatch metrics per (train dtype, rollout dtype, pi_old source) configuration;
4b. precision, per token: trainer vs rollout-engine log-probs of the same sampled tokens (scatter / hexbin per
   configuration) and the histogram of per-sequence log-ratios (from `token_samples.parquet`; skipped, saying why,
   when no run wrote one);
5. length: final reward and efficiency vs maximum generation length;
6. routing volatility: expert-slot mismatch per layer and over training; its relation to the clip fraction;
7. compute-scaling fits (analysis.fit): points, curve, extrapolation, and the table of A, B, C_mid;
8. routing volatility: per configuration of the non-algorithm swept axes, the gaps the claims compare (Routing Replay
   partner minus the algorithm, GSPO minus the GRPO baseline) in final reward and held-out gain against the measured
   expert-slot mismatch, and expert load imbalance and router entropy at the same x.

Metric and axis names: analysis.vocab.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis import collapse, gain, stats, style, vocab
from analysis import fit as fitting
from analysis.natural import natural_keys
from analysis.tidy import ALGORITHM, COMPUTE, EMULATED, PRECISION_KEYS, RUN_ID, VALUE, Study

PFLOP = 1e15


@dataclass
class Made:
    """A built figure: save it with `style.save(made.fig, out_dir / made.name)`."""

    fig: Figure
    name: str
    caption: str
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)


class MissingData(ValueError):
    """The study lacks the metric or axis a figure needs (message says which, and what is there)."""


# --- helpers ----------------------------------------------------------------------------------------------------------
def select(study: Study, where: Mapping[str, Any] | None) -> Study:
    """The runs of `study` whose axis values match `where` (e.g. {"max_new_tokens": 512})."""
    if not where:
        return study
    ids = set(study.runs[RUN_ID].astype(str))
    for key, value in where.items():
        if key not in study.runs.columns:
            raise MissingData(f"cannot select on {key!r}: not a column; axes are {study.axes}")
        ids &= set(study.runs.loc[_equal(study.runs[key], value), RUN_ID].astype(str))
    return _only(study, ids)


def routed(study: Study) -> Study:
    """`study` without its dense-control runs (a model of one expert: nothing to route, so no routing to measure),
    for the routing figures; unchanged when it has none or has nothing else."""
    ids = study.runs[RUN_ID].astype(str).tolist()
    moe = {r for r, m in zip(ids, _model_of(study, ids), strict=True) if m == MOE}
    return study if not moe or len(moe) == len(ids) else _only(study, moe)


def _only(study: Study, ids: set[str]) -> Study:
    """`study` restricted to the runs `ids`."""
    long, runs, layers, tokens, seqs = study.long, study.runs, study.layers, study.tokens, study.sequences
    long = long[long[RUN_ID].astype(str).isin(ids)]
    layers = layers[layers[RUN_ID].astype(str).isin(ids)]
    runs = runs[runs[RUN_ID].astype(str).isin(ids)]
    tokens = tokens[tokens[RUN_ID].astype(str).isin(ids)] if len(tokens) else tokens
    seqs = seqs[seqs[RUN_ID].astype(str).isin(ids)] if len(seqs) else seqs
    return Study(
        long=long,
        runs=runs,
        layers=layers,
        axes=study.axes,
        missing=study.missing,
        configs=study.configs,
        manifests=study.manifests,
        tokens=tokens,
        sequences=seqs,
    )


def emulation_note(runs: pd.DataFrame) -> str:
    """A caption sentence saying which runs' low precision was emulated (runs.precision_emulated); "" when none."""
    if EMULATED not in runs.columns:
        return ""
    flag = runs[EMULATED]
    n_em = int((flag == True).sum())  # noqa: E712 (nullable boolean)
    if n_em == 0:
        return ""
    scope = "every run" if n_em == len(runs) else f"{n_em} of {len(runs)} runs"
    return (
        f" Low precision is EMULATED in {scope} (precision_emulated: fp32 compute rounded where a GPU would round), "
        "not run on low-precision hardware: read mismatch magnitudes as the emulation's."
    )


def _varying(study: Study) -> list[str]:
    """Swept axes that still take more than one value in (a selection of) the study."""
    return [a for a in study.axes if study.runs[a].nunique(dropna=False) > 1]


def _counts(sizes: pd.Series) -> str:
    """{"GRPO": 3, ...} as "GRPO 3, GSPO 3" (registry labels, plain ints); "" when empty."""
    return ", ".join(f"{style.label(str(k))} {int(v)}" for k, v in sizes.items() if int(v))


def _need_metric(study: Study, metric: str) -> None:
    if metric not in study.metrics:
        raise MissingData(f"metric {metric!r} not logged; present: {', '.join(study.metrics)}")


def _need_axis(study: Study, axis: str) -> None:
    if axis not in study.axes:
        raise MissingData(f"axis {axis!r} is not swept in this study; swept axes: {study.axes or 'none'}")


def _group_label(alg: str, extra: Mapping[str, Any]) -> str:
    tail = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in extra.items())
    return f"{style.label(alg)} ({tail})" if tail else style.label(alg)


def _curves(
    study: Study, metric: str, *, smooth: int | None, n_grid: int, log: bool = True, evaluations: bool = False
) -> pd.DataFrame:
    """Seed-mean curves per configuration: aligned (each begins where all its seeds have a value) and, with
    `smooth`, a centred rolling mean (the first point averages the first steps, it is not one step's reward). With
    `evaluations` (held-out scores, logged at the same steps in every run): the seed mean at each evaluation step,
    at the seeds' mean compute there (`stats.step_points`), from the step-0 evaluation at compute 0 where the runs
    have one."""
    by = [ALGORITHM, *_varying(study)]
    if evaluations:
        return stats.step_points(study.long, metric, by=by).sort_values([*by, COMPUTE], kind="stable")
    return stats.aggregate_curves(
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


def _key(values: Sequence[Any]) -> tuple[Any, ...]:
    """Axis values as a lookup key: NaN (an axis a run's config lacks, e.g. a model field only a dense control sets)
    as None, which equals itself (NaN does not, so a tuple holding one would never be found again)."""
    return tuple(None if isinstance(v, float) and np.isnan(v) else v for v in values)


def _equal(column: pd.Series, value: Any) -> np.ndarray:
    """Rows of `column` equal to `value`, NaN matching NaN (an axis a run's config lacks: `_key`)."""
    if isinstance(value, float) and np.isnan(value):
        return column.isna().to_numpy()
    return (column == value).to_numpy()


def _combos(curves: pd.DataFrame, extra_axes: Sequence[str]) -> list[tuple[Any, ...]]:
    """The value combinations of `extra_axes` in `curves`, sorted: their index picks the line style."""
    if not extra_axes:
        return [()]
    keys = curves[list(extra_axes)].drop_duplicates()
    return sorted({_key(k) for k in keys.itertuples(index=False, name=None)}, key=natural_keys)


def _curve_legend(curves: pd.DataFrame, extra_axes: Sequence[str]) -> list[tuple[Any, str]]:
    """Legend entries for `_plot_curves`: one per algorithm (its colour), then, with other swept axes, one per value
    combination (its line style, in grey), so a legend of 5 algorithms x 4 configurations has 9 entries, not 20."""
    from matplotlib.lines import Line2D

    algs = style.order(curves[ALGORITHM].astype(str).unique())
    out = [(Line2D([], [], color=style.color(a)), style.label(a)) for a in algs]
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
    algs = style.order(keys[ALGORITHM].astype(str))
    for alg in algs:
        sub = keys[keys[ALGORITHM].astype(str) == alg]
        for _, key in sub.iterrows():
            mask = np.ones(len(curves), dtype=bool)
            for col in [ALGORITHM, *extra_axes]:
                mask &= _equal(curves[col], key[col])
            c = curves[mask]
            ls = DASHES[combos[_key([key[a] for a in extra_axes])] % len(DASHES)]
            label = _group_label(alg, {a: key[a] for a in extra_axes})
            ax.plot(c[x] / scale, c["mean"], color=style.color(alg), ls=ls, label=label)
            if points:
                bars = c[c["low"].notna() & c["high"].notna() & (c["high"] > c["low"])]
                err = np.vstack([bars["mean"] - bars["low"], bars["high"] - bars["mean"]])
                ax.errorbar(
                    bars[x] / scale, bars["mean"], yerr=err, fmt="o", ms=3, capsize=2, lw=0.8, color=style.color(alg)
                )
            else:
                ax.fill_between(c[x] / scale, c["low"], c["high"], color=style.color(alg), alpha=0.2, lw=0)
            at0 = c[c[x] == 0]
            if len(at0):  # the starting policy's evaluation (step 0): a measured point, not an interpolation
                ax.plot(at0[x], at0["mean"], "o", ms=3, color=style.color(alg), gid="start")


# --- Figure 1 ---------------------------------------------------------------------------------------------------------
@style.styled
def figure1_reward(
    study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10, n_grid: int = 100
) -> Made:
    """Training reward and each held-out eval vs training compute (log x, shared), seed mean with a 95% t
    band."""
    st = select(study, where)
    _need_metric(st, vocab.REWARD)
    metrics = [vocab.REWARD, *vocab.eval_metrics(st.metrics)]
    fig = style.new_figure(ncols=len(metrics), width=min(style.WIDTH_DOUBLE, 2.6 * len(metrics)) or None)
    axs = fig.subplots(1, len(metrics), squeeze=False, sharex=True)[0]
    extra = _varying(st)
    scale, unit = _unit(st)
    tables = {}
    for metric in metrics:  # held-out evaluations: per evaluation step, never smoothed
        tables[metric] = _curves(st, metric, smooth=smooth, n_grid=n_grid, evaluations=metric != vocab.REWARD)
    started = [m for m in metrics if (tables[m][COMPUTE] == 0).any()]
    c1 = _first_step_compute(st)
    zero = c1 / scale if started and c1 else None
    for ax, metric in zip(axs, metrics, strict=True):
        _plot_curves(ax, tables[metric], extra, scale=scale, points=metric != vocab.REWARD)
        _compute_axis(ax, unit, zero=zero)
        ax.set_title("training reward" if metric == vocab.REWARD else metric)
    axs[0].set_ylabel("mean reward / pass@1")
    _legend(fig, extra=_curve_legend(tables[vocab.REWARD], extra))
    n = st.runs.groupby(ALGORITHM, observed=True).size()
    if zero:
        n_start = int(st.runs["start_eval"].sum()) if "start_eval" in st.runs else len(st.runs)
        start_note = (
            " The training reward begins at the first RL step; the held-out panels begin at compute 0 (dot) with the "
            "evaluation of the starting policy (step 0, the cold start"
            + (f"; {n_start} of {len(st.runs)} runs have one" if n_start < len(st.runs) else "")
            + f"): the compute axis is linear from 0 to the first step's {c1 / scale:.3g} {unit} and logarithmic "
            "beyond."
        )
    else:
        start_note = (
            " No run has an evaluation of its starting policy (a step-0 row; runs written before the loop evaluated "
            "its start): the held-out panels begin at the first evaluation during training."
            if len(metrics) > 1
            else ""
        )
    caption = (
        "Figure 1. Training reward and held-out evaluation scores against training compute; lines are the mean "
        f"over seeds, bands 95% t intervals over seeds (runs per algorithm: {_counts(n)}). Reward is smoothed "
        f"with a centred {smooth}-step mean (over the steps there are at the ends). Each reward curve begins where "
        "all its seeds have logged, so its first point is a mean over every seed; where fewer seeds reach a compute "
        "(a run stopped early), the band is over those that do. A held-out point is the seed mean at one evaluation "
        "step, at the seeds' mean compute there, with its 95% t interval as an error bar (nothing is measured "
        "between evaluations)." + start_note + _temperature_note(st)
    )
    return Made(fig, "figure1_reward", caption, tables)


def _temperature_note(st: Study) -> str:
    """Where runs sample at a temperature other than 1: at which the rollouts (the training reward) and the held-out
    evaluations sampled (the two differ: a training reward at T > 1 is below what the same policy scores at T = 1)."""

    def values(key: str) -> str:
        found = sorted({float(c.get(key, 1.0)) for c in st.configs.values()})
        return " / ".join(f"{t:g}" for t in found) or "1"

    rollout, held_out = values("temperature"), values("eval_temperature")
    if rollout == held_out == "1":
        return ""
    return (
        f" The training reward is the rollouts', sampled at temperature {rollout}; the held-out evaluations "
        f"sample at temperature {held_out}."
    )


# --- Figure 2 ---------------------------------------------------------------------------------------------------------
def clip_table(study: Study, *, confidence: float = 0.95) -> pd.DataFrame:
    """Average clipped-token fraction per algorithm (mean over all steps per run, then mean and CI over seeds).

    Columns: algorithm, part (total / low / high), mean, low, high, n; algorithms in registry order.
    """
    parts = {"total": vocab.CLIP, "low": vocab.CLIP_LOW, "high": vocab.CLIP_HIGH}
    frames = []
    for part, metric in parts.items():
        _need_metric(study, metric)
        per_run = stats.run_mean(study.long, metric)
        s = stats.summarize(per_run, by=[ALGORITHM], confidence=confidence)
        s.insert(1, "part", part)
        frames.append(s)
    out = pd.concat(frames, ignore_index=True)
    algs = style.order(out[ALGORITHM].astype(str))
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
            color=[style.color(a) for a in algs],
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
    ax.set_xticks(np.arange(len(algs)), [style.label(a) for a in algs], rotation=30, ha="right")
    ax.set_ylabel("avg. fraction of clipped tokens")
    ax.grid(axis="x", visible=False)
    curves = _curves(st, vocab.CLIP, smooth=smooth, n_grid=100)
    scale, unit = _unit(st)
    _plot_curves(ax2, curves, _varying(st), scale=scale)
    _compute_axis(ax2, unit)
    style.log_scale(ax2, "y")
    ax2.set_ylabel("clipped-token fraction")
    parts = [
        (Patch(facecolor=style.NEUTRAL, alpha=shades[p], hatch=hatches[p], edgecolor="white"), f"bars: {p}")
        for p in shades
    ]
    _legend(fig, extra=[*_curve_legend(curves, _varying(st)), *parts])
    tot = table[table["part"] == "total"].set_index(ALGORITHM)["mean"]
    caption = (
        "Figure 2. Average fraction of clipped tokens (token-weighted, clipped branch active) per algorithm, split "
        "into the low side (ratio < 1 - eps_low, A < 0) and the high side (ratio > 1 + eps_high, A > 0); mean over "
        "training steps per run, then mean and 95% t interval over seeds. Right: over training. Averages: "
        + ", ".join(f"{style.label(str(a))} {v:.3g}" for a, v in tot.items())
        + "."
    )
    return Made(fig, "figure2_clipping", caption, {"clip_fraction": table, "clip_over_training": curves})


# --- Figure 3 ---------------------------------------------------------------------------------------------------------
def routing_families(names: Sequence[str]) -> list[list[str]]:
    """Groups of algorithms that share a loss function but differ in routing mode (the registry's `routing_variants`),
    registry order, free first.

    Only groups with at least two routing modes present are returned (these are the Routing Replay ablations).
    """
    reg = style.registry()
    ordered = style.order(names)
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
    _need_metric(st, vocab.REWARD)
    fams = routing_families(st.runs[ALGORITHM].dropna().astype(str).unique())
    if not fams:
        raise MissingData("no pair of algorithms with the same loss and different routing in this study")
    rows = stats.metric_rows(st.long, vocab.REWARD)
    grid = stats.compute_grid(rows[COMPUTE].to_numpy(), n=100)
    info, mat = stats.interpolate_runs(rows, grid, smooth=smooth, center=True)
    cfg_cols = [c for c in stats.group_columns(rows) if c in info.columns and c != ALGORITHM]
    configs = list(info[cfg_cols].drop_duplicates().sort_values(cfg_cols).itertuples(index=False)) if cfg_cols else [()]
    fig = style.new_figure(ncols=len(fams), nrows=len(configs), width=min(style.WIDTH_DOUBLE, 3.5 * len(fams)))
    grid_axs = fig.subplots(len(configs), len(fams), squeeze=False, sharey=True, sharex=True)
    starts = stats.run_starts(rows)
    scale, unit = _unit(st)
    coll = collapse.collapse_table(st.long, st.runs, vocab.REWARD, **collapse_rules)
    coll_by = coll.set_index(RUN_ID)
    reg = style.registry()
    algs = info[ALGORITHM].astype(str).to_numpy()
    for axs, cfg in zip(grid_axs, configs, strict=True):
        in_cfg = np.ones(len(info), dtype=bool)
        for col, value in zip(cfg_cols, cfg, strict=True):
            in_cfg &= _equal(info[col], value)
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
                col = style.color(alg)
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
                    mean = stats.mean_band(m)[0]
                    ax.plot(grid / scale, mean, color=col, lw=1.8, label=f"{style.label(alg)} ({reg.get(alg).routing})")
            _compute_axis(ax, unit)
            ax.set_title(style.label(fam[0]) + (f"\n{where_cfg}" if where_cfg else ""))
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
    for alg in style.order(c[ALGORITHM].astype(str)):
        by = c[c[ALGORITHM].astype(str) == alg]["flagged_by"].value_counts()
        parts.append(f"{style.label(alg)} {int(by.sum())} (" + ", ".join(f"{k} {int(v)}" for k, v in by.items()) + ")")
    return ", ".join(parts)


# --- Figure 4 ---------------------------------------------------------------------------------------------------------
def _config_bars(
    ax: Axes, summary: pd.DataFrame, config_cols: Sequence[str], *, ylabel: str, log: bool = False
) -> list[str]:
    """Grouped bars: x = configuration (joined axis values), one bar per algorithm, 95% CI error bars."""
    summary = summary.copy()
    summary["_cfg"] = summary[list(config_cols)].astype(str).agg(" / ".join, axis=1)
    cfgs = list(dict.fromkeys(summary.sort_values(list(config_cols))["_cfg"]))
    algs = style.order(summary[ALGORITHM].astype(str))
    width = 0.8 / max(1, len(algs))
    for k, alg in enumerate(algs):
        s = summary[summary[ALGORITHM].astype(str) == alg].set_index("_cfg").reindex(cfgs)
        xs = np.arange(len(cfgs)) + (k - (len(algs) - 1) / 2) * width
        h = s["mean"].to_numpy(float)
        err = np.vstack([h - s["low"].to_numpy(float), s["high"].to_numpy(float) - h])
        err = np.where(np.isfinite(err), np.maximum(err, 0), 0)
        ax.bar(xs, h, width, yerr=err.tolist(), color=style.color(alg), label=style.label(alg), error_kw={"lw": 0.7})
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
    axes: Sequence[str] = (vocab.TRAIN_DTYPE_AXIS, vocab.ROLLOUT_DTYPE_AXIS, vocab.OLD_LOGP_AXIS),
    mismatch: Sequence[str] = (vocab.MISMATCH_MEAN_ABS, vocab.MISMATCH_K3),
    frac: float = 0.1,
) -> Made:
    """Final reward and training-inference mismatch per precision configuration (the axes among `axes` that the
    study sweeps), bars per algorithm with 95% CIs over seeds."""
    present = [a for a in axes if a in study.axes]
    if not present:
        raise MissingData(f"none of the precision axes {list(axes)} is swept; swept axes: {study.axes or 'none'}")
    for m in (vocab.REWARD, *mismatch):
        _need_metric(study, m)
    by = [ALGORITHM, *present]
    fig = style.new_figure(ncols=1 + len(mismatch), width=style.WIDTH_DOUBLE, height=3.0)
    axs = fig.subplots(1, 1 + len(mismatch), squeeze=False)[0]
    tables = {}
    for ax, metric in zip(axs, [vocab.REWARD, *mismatch], strict=True):
        s = stats.final_summary(study.long, metric, frac=frac, by=by, runs=study.runs)
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


def _precision_label(frame: pd.DataFrame, cols: Sequence[str]) -> pd.Series:
    """ "bf16 / bf16 / rollout" per row from the precision columns (unset values shown as "unset")."""
    if not cols:
        return pd.Series("all runs", index=frame.index)
    parts = [frame[c].astype(object).where(frame[c].notna(), "unset").astype(str) for c in cols]
    out = parts[0]
    for p in parts[1:]:
        out = out + " / " + p
    return out


def token_logprob_tables(
    study: Study, *, axes: Sequence[str] = PRECISION_KEYS, bins: int = 60
) -> dict[str, pd.DataFrame]:
    """Figure 4b's data per precision configuration (`axes` joined by " / ", column `config`):

    - `tokens`: n_runs, n_tokens (plotted), mean and mean |trainer_logp - engine_logp|, Pearson r, emulated;
    - `seq_log_ratio`: n_sequences, mean, std, quantiles 1/50/99% of seq_log_ratio (every sampled sequence);
    - `seq_log_ratio_hist`: bin_left, bin_right, count, fraction. Common equal-width bins over the pooled 0.1-99.9%
      quantile range (widened to include 0); values beyond it are counted in the edge bins, so counts sum to n.
    """
    tok, seq = study.tokens, study.sequences
    if tok.empty or seq.empty:
        raise MissingData(
            "no run wrote token_samples.parquet (runs from before the loop logged token samples have none): "
            "no token log-prob scatter or sequence log-ratio histogram"
        )
    cols = [a for a in axes if a in tok.columns]
    tok_cfg, seq_cfg = _precision_label(tok, cols), _precision_label(seq, cols)
    configs = sorted(seq_cfg.unique())
    diff = tok[vocab.TRAINER_LOGP].to_numpy(np.float64) - tok[vocab.ENGINE_LOGP].to_numpy(np.float64)
    emulated = seq[EMULATED].astype(object) if EMULATED in seq.columns else pd.Series(None, index=seq.index)
    tok_rows, seq_rows, hist_rows = [], [], []
    r_all = seq["seq_log_ratio"].to_numpy(np.float64)
    finite = r_all[np.isfinite(r_all)]
    lo, hi = np.quantile(finite, [0.001, 0.999]) if finite.size else (-1.0, 1.0)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo <= 0:
        lo, hi = lo - 1e-6, hi + 1e-6
    edges = np.linspace(lo, hi, bins + 1)
    for cfg in configs:
        tm = (tok_cfg == cfg).to_numpy()
        sm = (seq_cfg == cfg).to_numpy()
        x = tok[vocab.TRAINER_LOGP].to_numpy(np.float64)[tm]
        y, d = tok[vocab.ENGINE_LOGP].to_numpy(np.float64)[tm], diff[tm]
        r = r_all[sm]
        em = emulated[sm]
        tok_rows.append(
            {
                "config": cfg,
                "n_runs": int(seq.loc[sm, RUN_ID].nunique()),
                "n_tokens": int(tm.sum()),
                "diff_mean": float(d.mean()) if d.size else np.nan,
                "abs_diff_mean": float(np.abs(d).mean()) if d.size else np.nan,
                "pearson_r": float(np.corrcoef(x, y)[0, 1]) if d.size > 1 and x.std() > 0 and y.std() > 0 else np.nan,
                "emulated": bool((em == True).any()) if em.notna().any() else None,  # noqa: E712
            }
        )
        rf = r[np.isfinite(r)]
        q = np.quantile(rf, [0.01, 0.5, 0.99]) if rf.size else [np.nan] * 3
        seq_rows.append(
            {
                "config": cfg,
                "n_sequences": int(r.size),
                "mean": float(rf.mean()) if rf.size else np.nan,
                "std": float(rf.std(ddof=1)) if rf.size > 1 else np.nan,
                "q01": q[0],
                "median": q[1],
                "q99": q[2],
            }
        )
        counts, _ = np.histogram(np.clip(rf, edges[0], edges[-1]), bins=edges)
        hist_rows.append(
            pd.DataFrame(
                {
                    "config": cfg,
                    "bin_left": edges[:-1],
                    "bin_right": edges[1:],
                    "count": counts,
                    "fraction": counts / max(1, rf.size),
                }
            )
        )
    return {
        "tokens": pd.DataFrame(tok_rows),
        "seq_log_ratio": pd.DataFrame(seq_rows),
        "seq_log_ratio_hist": pd.concat(hist_rows, ignore_index=True),
    }


@style.styled
def figure4b_token_logprobs(
    study: Study,
    *,
    axes: Sequence[str] = PRECISION_KEYS,
    where: Mapping[str, Any] | None = None,
    bins: int = 60,
    hexbin_above: int = 2000,
    max_panels: int = 8,
) -> Made:
    """Per precision configuration: trainer (pi_old recompute) vs rollout-engine log-prob of the same sampled tokens
    (scatter, or hexbin above `hexbin_above` points, with y = x), and below, the histogram of the per-sequence
    log-ratio mean_t(trainer_logp - engine_logp) of every configuration."""
    st = select(study, where)
    tables = token_logprob_tables(st, axes=axes, bins=bins)
    tok = st.tokens
    cols = [a for a in axes if a in tok.columns]
    tok_cfg = _precision_label(tok, cols).to_numpy()
    summary = tables["tokens"].set_index("config")
    configs = list(summary.index)
    shown = configs[:max_panels]
    ncols = min(4, len(shown))
    nrows = -(-len(shown) // ncols)
    fig = style.new_figure(ncols=max(2, ncols), width=style.WIDTH_DOUBLE, height=2.0 * nrows + 2.2)
    gs = fig.add_gridspec(nrows + 1, ncols, height_ratios=[1.0] * nrows + [1.1])
    x_all = tok[vocab.TRAINER_LOGP].to_numpy(np.float64)
    y_all = tok[vocab.ENGINE_LOGP].to_numpy(np.float64)
    both = np.concatenate([x_all[np.isfinite(x_all)], y_all[np.isfinite(y_all)]])
    lo, hi = (float(np.quantile(both, 0.001)), float(both.max())) if both.size else (-1.0, 0.0)
    pad = 0.05 * max(hi - lo, 1e-3)
    lim = (lo - pad, hi + pad)
    hexbins = False
    for k, cfg in enumerate(shown):
        ax = fig.add_subplot(gs[k // ncols, k % ncols])
        m = tok_cfg == cfg
        x, y = x_all[m], y_all[m]
        if len(x) > hexbin_above:
            ax.hexbin(x, y, gridsize=40, bins="log", mincnt=1, cmap="viridis", extent=(*lim, *lim), linewidths=0)
            hexbins = True
        else:
            ax.scatter(x, y, s=3, alpha=0.5, color=style.NEUTRAL, lw=0)
        ax.plot(lim, lim, ls="--", lw=0.8, color="black", gid="y=x")
        ax.set_xlim(lim)
        ax.set_ylim(lim)
        ax.set_aspect("equal", adjustable="box")
        em = summary.loc[cfg, "emulated"]
        ax.set_title(cfg + (" (emulated)" if pd.notna(em) and bool(em) else ""), fontsize=7)
        ax.text(0.04, 0.96, f"r = {summary.loc[cfg, 'pearson_r']:.4f}", transform=ax.transAxes, va="top", fontsize=6)
        if k % ncols == 0:
            ax.set_ylabel("engine log-prob")
        if k // ncols == nrows - 1 or k + ncols >= len(shown):
            ax.set_xlabel("trainer log-prob")
    ax_h = fig.add_subplot(gs[nrows, :])
    hist = tables["seq_log_ratio_hist"]
    cycle = style.config_colors(len(configs))
    for cfg, color in zip(configs, cycle, strict=True):
        h = hist[hist["config"] == cfg]
        edges = np.r_[h["bin_left"].to_numpy(), h["bin_right"].to_numpy()[-1:]]
        n = int(tables["seq_log_ratio"].set_index("config").loc[cfg, "n_sequences"])
        em = summary.loc[cfg, "emulated"]
        name = f"{cfg}{' (emulated)' if pd.notna(em) and bool(em) else ''} (n={n})"
        ax_h.stairs(h["fraction"].to_numpy(), edges, color=color, lw=1.2, label=name, gid=f"hist-{cfg}")
    ax_h.axvline(0.0, color="black", lw=0.6, ls=":")
    ax_h.set_xlabel("sequence log-ratio mean_t(log pi_trainer - log pi_engine) = log s_i")
    ax_h.set_ylabel("fraction of sequences")
    _legend(fig, [ax_h])
    runs = st.runs[st.runs[RUN_ID].astype(str).isin(set(tok[RUN_ID].astype(str)))]
    steps = sorted(int(v) for v in st.sequences["step"].unique())
    caption = (
        "Figure 4b. Token log-probabilities of the same sampled response tokens in the two engines, per precision "
        f"configuration ({' / '.join(cols) or 'none recorded'}): x = the training engine's pi_old recompute (before "
        "the step's update, the weights the engine sampled with), y = the rollout engine's log-prob; dashed y = x"
        + ("; hexbins coloured by token count (log scale)" if hexbins else "")
        + f". {len(tok)} tokens from {len(runs)} run(s) (a random subset per run when a run logged many), sampled at "
        f"steps {', '.join(map(str, steps[:12]))}{' ...' if len(steps) > 12 else ''} (step 1, every eval step and "
        "the last step; up to 64 sequences each)."
        + (
            f" Only the first {max_panels} of {len(configs)} configurations are scattered."
            if len(configs) > len(shown)
            else ""
        )
        + " Bottom: histogram of the per-sequence log-ratio mean_t(log pi_trainer - log pi_engine), the GSPO "
        "length-normalised (mean over the sequence's tokens, not the sum) log-ratio log s_i that using the engine's "
        f"log-probs as pi_old would add, over all {len(st.sequences)} sampled sequences (every token, no subsampling)."
        + emulation_note(runs)
    )
    return Made(fig, "figure4b_token_logprobs", caption, tables)


# --- Figure 5 ---------------------------------------------------------------------------------------------------------
@style.styled
def figure5_length(study: Study, *, axis: str = vocab.LENGTH_AXIS, frac: float = 0.1) -> Made:
    """Final reward and efficiency vs maximum generation length, per algorithm (seed mean, 95% CI).

    Efficiency = (final-window reward - first logged reward) / total training compute, in reward per unit of compute
    (the study's compute unit, style.compute_unit).
    """
    from matplotlib import ticker

    _need_axis(study, axis)
    _need_metric(study, vocab.REWARD)
    scale, unit = _unit(study)
    fw = stats.final_window(study.long, vocab.REWARD, frac=frac)
    first = stats.metric_rows(study.long, vocab.REWARD).groupby(RUN_ID, observed=True)[VALUE].first()
    fw["efficiency"] = (fw["value"].to_numpy() - first.reindex(fw[RUN_ID].astype(str)).to_numpy()) / (
        fw["compute_to"].to_numpy() / scale
    )
    fig = style.new_figure(ncols=2)
    axs = fig.subplots(1, 2, sharex=True)
    tables = {}
    lengths = sorted(float(v) for v in study.runs[axis].dropna().unique())
    for ax, col, ylabel in ((axs[0], "value", "final reward"), (axs[1], "efficiency", f"reward gain per {unit}")):
        s = stats.summarize(fw, value=col, by=[ALGORITHM, axis])
        tables[col] = s
        for alg in style.order(s[ALGORITHM].astype(str)):
            t = s[s[ALGORITHM].astype(str) == alg].sort_values(axis)
            xs = t[axis].to_numpy(dtype=float)
            ax.plot(xs, t["mean"], marker="o", color=style.color(alg), label=style.label(alg))
            ax.fill_between(xs, t["low"].to_numpy(float), t["high"].to_numpy(float), color=style.color(alg), alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{v:g}" for v in lengths], rotation=0 if len(lengths) <= 5 else 45)
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlabel(f"max generation length ({axis})")
        ax.set_ylabel(ylabel)
    _legend(fig, axs[:1])
    caption = (
        f"Figure 5. Final reward (mean of the last {frac:.0%} of steps) and efficiency (reward gained per {unit} of "
        "training compute) against the maximum generation length; seed means with 95% t intervals."
    )
    return Made(fig, "figure5_length", caption, tables)


# --- Figure 6 ---------------------------------------------------------------------------------------------------------
@style.styled
def figure6_routing(study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10) -> Made:
    """Routing volatility: expert-slot mismatch per layer (left), over training (middle), and per run against the
    average clip fraction (right)."""
    from matplotlib import ticker

    st = routed(select(study, where))
    _need_metric(st, vocab.ROUTING_SLOT)
    fig = style.new_figure(ncols=3, height=2.8)
    ax_l, ax_t, ax_c = fig.subplots(1, 3)
    tables: dict[str, pd.DataFrame] = {}
    if len(st.layers) and vocab.LAYER_SLOT in set(st.layers["metric"].astype(str)):
        lay = st.layers[st.layers["metric"].astype(str) == vocab.LAYER_SLOT]
        per_run = lay.groupby([RUN_ID, ALGORITHM, "layer"], observed=True)[VALUE].mean().reset_index()
        s = stats.summarize(per_run, value=VALUE, by=[ALGORITHM, "layer"])
        tables["per_layer"] = s
        for alg in style.order(s[ALGORITHM].astype(str)):
            t = s[s[ALGORITHM].astype(str) == alg].sort_values("layer")
            ax_l.errorbar(
                t["layer"],
                t["mean"],
                yerr=np.nan_to_num(np.vstack([t["mean"] - t["low"], t["high"] - t["mean"]]).clip(min=0)),
                marker="o",
                ms=3,
                color=style.color(alg),
                capsize=1.5,
            )
        ax_l.set_xlabel("MoE layer")
        ax_l.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))
    else:
        ax_l.text(0.5, 0.5, "no per-layer routing table", ha="center", va="center", transform=ax_l.transAxes)
    ax_l.set_ylabel("expert-slot mismatch")
    ax_l.set_title("per layer")
    curves = _curves(st, vocab.ROUTING_SLOT, smooth=smooth, n_grid=100)
    tables["over_training"] = curves
    scale, unit = _unit(st)
    _plot_curves(ax_t, curves, _varying(st), scale=scale)
    _compute_axis(ax_t, unit)
    ax_t.set_title("over training")
    if vocab.CLIP in st.metrics:
        rs = stats.run_mean(st.long, vocab.ROUTING_SLOT).rename(columns={"value": "slot_mismatch"})
        cf = stats.run_mean(st.long, vocab.CLIP)[[RUN_ID, "value"]].rename(columns={"value": vocab.CLIP})
        both = rs.merge(cf, on=RUN_ID)
        tables["vs_clip"] = both
        for alg in style.order(both[ALGORITHM].astype(str)):
            t = both[both[ALGORITHM].astype(str) == alg]
            ax_c.scatter(t["slot_mismatch"], t[vocab.CLIP], s=12, color=style.color(alg))
        style.log_scale(ax_c, "y")
        ax_c.xaxis.set_major_locator(ticker.MaxNLocator(nbins=4))
        ax_c.set_xlabel("avg. expert-slot mismatch")
        ax_c.set_ylabel("avg. clipped-token fraction")
        ax_c.set_title("vs clipping (per run)")
    _legend(fig, extra=_curve_legend(curves, _varying(st)))
    caption = (
        "Figure 6. Routing volatility: the expert-slot mismatch mean(1 - |S_old & S_new| / k) between the routing "
        "before and after an update, per MoE layer (mean over steps and seeds, 95% CI), over training, and per run "
        "against the average clipped-token fraction."
    )
    return Made(fig, "figure6_routing", caption, tables)


# --- Figure 7 ---------------------------------------------------------------------------------------------------------
@style.styled
def figure7_fits(
    study: Study,
    *,
    fits: dict[tuple[object, ...], fitting.ScalingFit] | None = None,
    where: Mapping[str, Any] | None = None,
    extrapolate: float = 10.0,
    n_boot: int = 200,
) -> Made:
    """Compute-scaling fits per algorithm: fitted points, and for a fit the data identify (`ScalingFit.identified`)
    the curve over the data (solid), its extrapolation to `extrapolate` x the largest compute (dashed) and the
    asymptote A (dotted); below, the table of A, B, C_mid, or what the data do not identify."""
    st = select(study, where)
    if fits is None:
        _need_metric(st, vocab.REWARD)  # a study whose runs all failed before their first step has none
        fits = fitting.fit_study(st.long, vocab.REWARD, runs=st.runs, n_boot=n_boot)
    table = fitting.fits_table(fits)
    algs = style.order(str(k[0]) for k in fits)
    scale, unit = _unit(st)
    rows_h = 0.2 * (len(algs) + 1)
    leg_h = 0.2 * -(-len(algs) // style.legend_ncols([f"{style.label(a)} (not identified)" for a in algs]))
    fig = style.new_figure(ncols=1, width=style.WIDTH_DOUBLE, height=2.6 + leg_h + rows_h)
    ax, ax_l, ax_t = fig.subplots(3, 1, height_ratios=[2.6, leg_h, rows_h])
    for alg in algs:
        f = fits[(alg,)]
        col = style.color(alg)
        if f.identified:
            ax.plot(f.x / scale, f.y, "o", ms=2.5, color=col, alpha=0.7, gid=f"fit-points-{alg}")
            xs = np.geomspace(f.x.min(), f.c_max, 100)
            xe = np.geomspace(f.c_max, f.c_max * extrapolate, 50)
            ax.plot(xs / scale, f.predict(xs), color=col, label=style.label(alg), gid=f"fit-curve-{alg}")
            ax.plot(xe / scale, f.predict(xe), color=col, ls="--", gid=f"fit-extrapolation-{alg}")
            ax.axhline(f.params.a, color=col, ls=":", lw=0.8, gid=f"fit-asymptote-{alg}")
        else:  # the points only: a curve through parameters at their bounds would read as a prediction
            label = f"{style.label(alg)} (not identified)"
            ax.plot(f.x / scale, f.y, "o", ms=2.5, mfc="none", color=col, label=label, gid=f"fit-points-{alg}")
    _compute_axis(ax, unit)
    ax.set_ylabel("training reward")
    ax_l.axis("off")  # the legend has a row of its own, between the data and the table
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax_l.legend(handles, labels, loc="center", ncols=style.legend_ncols(labels), borderaxespad=0)
    ax_t.axis("off")

    def ci(v: float, lo: float, hi: float, fmt: str) -> str:
        return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]" if np.isfinite(lo) else f"{v:{fmt}}"

    cells = []
    for alg in algs:
        r = table[table[ALGORITHM] == alg].iloc[0]
        f = fits[(alg,)]
        if f.identified:
            cells.append(
                [
                    style.label(alg),
                    ci(r["A"], r["A_low"], r["A_high"], ".3f"),
                    ci(r["B"], r["B_low"], r["B_high"], ".2f"),
                    ci(r["C_mid"] / scale, r["C_mid_low"] / scale, r["C_mid_high"] / scale, ".3g"),
                    "yes",
                ]
            )
        else:  # no numbers: what the data do not identify, across the columns
            cells.append([style.label(alg), "not identified: " + f.why_not_identified, "", "", ""])
    if cells:  # monospaced text rather than a matplotlib table, whose cells do not grow with their text
        head = ["", "A", "B", f"C_mid ({unit})", "identified"]
        widths = [max(len(row[k]) for row in [head, *cells] if k == 0 or row[2]) for k in range(len(head))]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
        for row in cells:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        rule = "-" * max(len(line) for line in lines)
        ax_t.text(
            0.0,
            1.0,
            "\n".join([lines[0], rule, *lines[1:]]),
            transform=ax_t.transAxes,
            va="top",
            ha="left",
            family="monospace",
            fontsize=6.5,
            gid="fit-table",
        )
    unidentified = [f"{style.label(str(k[0]))} ({f.why_not_identified})" for k, f in fits.items() if not f.identified]
    caption = (
        "Figure 7. ScaleRL fits R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) per algorithm (R0 fixed to the initial "
        "reward, early phase dropped): fitted points, the curve (solid), its extrapolation (dashed) and the "
        "asymptote A (dotted); intervals are "
        + (next(iter(fits.values())).ci_method if fits else "n/a")
        + ". A curve is drawn only where the data identify it: no parameter at a bound of the fit and no interval "
        "reaching one, and C_mid inside the observed compute. "
        + (
            "Not identified, points only and no numbers: " + ", ".join(unidentified) + "."
            if unidentified
            else "Every fit is identified."
        )
        + (
            " Not fitted: " + ", ".join(f"{style.label(str(k[0]))} ({why})" for k, why in fits.skipped.items()) + "."
            if getattr(fits, "skipped", None)
            else ""
        )
    )
    return Made(fig, "figure7_fits", caption, {"fits": table})


# --- Figure 8 ---------------------------------------------------------------------------------------------------------
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
"""Marker per series where colour alone would repeat (Figure 8's comparisons)."""


def _configurations(study: Study, axes: Sequence[str]) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """The value combinations of `axes` among the usable runs (natural order) and run_id -> its combination's index."""
    runs = study.runs[~study.runs["state"].isin(["failed", "unknown"])]
    keys = sorted({_key(r) for r in runs[list(axes)].itertuples(index=False, name=None)}, key=natural_keys)
    index = {k: i for i, k in enumerate(keys)}
    of = {str(rid): index[_key(v)] for rid, *v in runs[[RUN_ID, *axes]].itertuples(index=False, name=None)}
    return keys, of


def routing_volatility_tables(study: Study, *, frac: float = 0.1) -> dict[str, pd.DataFrame]:
    """Figure 8's data, per configuration (combination of the swept axes other than algorithm; failed runs left out):

    - `volatility`: the configuration's routing volatility: each run's mean routing_slot_mismatch over its steps, then
      the mean over every run of the configuration (all algorithms) with a 95% t interval over runs;
    - `gaps`: per comparison the claims make (scorecard.comparison_pairs: C1 GSPO minus the GRPO baseline, C3 and C4
      the Routing Replay partner minus the algorithm), the difference of seed means of the final reward (each run's
      mean over its last `frac` of steps) and, when runs evaluated their start, of the held-out gain (last evaluation
      of eval_in_dist minus step 0): estimate and 95% Welch t interval (independent groups);
    - `routing_load`: per algorithm, the mean over steps per run, then over seeds (95% interval), of
      expert_load_imbalance and router_entropy (the metrics present).
    """
    from analysis import scorecard

    axes = _varying(study)
    if not axes:
        raise MissingData(
            "the routing-volatility figure compares configurations of a swept axis other than algorithm and seed "
            "(e.g. router_lr_scale, the model shape); this study sweeps none"
        )
    for m in (vocab.ROUTING_SLOT, vocab.REWARD):
        _need_metric(study, m)
    keys, cfg_of = _configurations(study, axes)

    def per_config(per_run: pd.DataFrame) -> pd.DataFrame:
        t = per_run[[RUN_ID, ALGORITHM, "value"]].copy()
        t["config"] = t[RUN_ID].astype(str).map(cfg_of)
        t[ALGORITHM] = t[ALGORITHM].astype(str)
        return t.dropna(subset=["config"]).astype({"config": int})

    def label(i: int) -> str:
        return ", ".join(f"{a.rsplit('.', 1)[-1]}={v}" for a, v in zip(axes, keys[i], strict=True))

    vol = per_config(stats.run_mean(study.long, vocab.ROUTING_SLOT))
    rows = []
    for i in range(len(keys)):
        ci = stats.mean_ci(vol.loc[vol["config"] == i, "value"].to_numpy())
        rows.append(
            {
                "config": label(i),
                **dict(zip(axes, keys[i], strict=True)),
                "mean": ci.estimate,
                "low": ci.low,
                "high": ci.high,
                "n": ci.n,
            }
        )
    volatility = pd.DataFrame(rows)

    present = sorted(set(study.runs.loc[~study.runs["state"].isin(["failed", "unknown"]), ALGORITHM].astype(str)))
    pairs = scorecard.comparison_pairs(present)
    quantities = {"final reward": per_config(stats.final_window(study.long, vocab.REWARD, frac=frac))}
    if vocab.EVAL_IN_DIST in study.metrics:
        gains = gain.per_run(study.long, vocab.EVAL_IN_DIST)
        if len(gains):
            quantities["held-out gain"] = per_config(gains)
    rows = []
    for (a, b, claim), (i, _key) in itertools.product(pairs, enumerate(keys)):
        for what, t in quantities.items():
            in_cfg = t[t["config"] == i]
            x = in_cfg.loc[in_cfg[ALGORITHM] == a, "value"].to_numpy()
            y = in_cfg.loc[in_cfg[ALGORITHM] == b, "value"].to_numpy()
            d = stats.mean_difference(x, y)
            rows.append(
                {
                    "config": label(i),
                    "comparison": f"{style.label(a)} - {style.label(b)}",
                    "claim": claim,
                    "minuend": a,
                    "subtrahend": b,
                    "quantity": what,
                    "estimate": d.estimate,
                    "low": d.low,
                    "high": d.high,
                    "n": f"{len(x)} vs {len(y)}",
                }
            )
    gap_cols = ["config", "comparison", "claim", "minuend", "subtrahend", "quantity", "estimate", "low", "high", "n"]
    gaps = pd.DataFrame(rows, columns=gap_cols)

    rows = []
    for metric in (vocab.EXPERT_LOAD, vocab.ROUTER_ENTROPY):
        if metric not in study.metrics:
            continue
        t = per_config(stats.run_mean(study.long, metric))
        for (i, alg), grp in t.groupby(["config", ALGORITHM], sort=True):
            ci = stats.mean_ci(grp["value"].to_numpy())
            rows.append(
                {
                    "config": label(int(i)),
                    ALGORITHM: alg,
                    "metric": metric,
                    "mean": ci.estimate,
                    "low": ci.low,
                    "high": ci.high,
                    "n": ci.n,
                }
            )
    load = pd.DataFrame(rows, columns=["config", ALGORITHM, "metric", "mean", "low", "high", "n"])
    return {"volatility": volatility, "gaps": gaps, "routing_load": load}


def _short(v: Any) -> str:
    """An axis value as a tick label: numbers as %g (30, not 30.0), the rest as text."""
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


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
        color=style.color(alg),
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


@style.styled
def figure8_routing_volatility(study: Study, *, where: Mapping[str, Any] | None = None, frac: float = 0.1) -> Made:
    """Per configuration of the non-algorithm swept axes, against its measured routing volatility (x, with its
    interval): top, the gaps the claims compare (Routing Replay partner minus the algorithm, GSPO minus the GRPO
    baseline) in final reward and in held-out gain; bottom, expert load imbalance and router entropy per algorithm."""
    chosen = select(study, where)
    st = routed(chosen)
    dense = len(chosen.runs) - len(st.runs)
    tables = routing_volatility_tables(st, frac=frac)
    vol, gaps, load = tables["volatility"], tables["gaps"], tables["routing_load"]
    xs = vol.set_index("config")["mean"]
    xerr = pd.DataFrame(_err(vol).T, index=vol["config"], columns=["lo", "hi"])
    finite = xs[np.isfinite(xs) & (xs > 0)]
    log_x = len(finite) == len(xs) and len(finite) > 1 and finite.max() / finite.min() > 3
    fig = style.new_figure(ncols=2, width=style.WIDTH_DOUBLE, height=4.8)
    (ax_r, ax_g), (ax_l, ax_e) = fig.subplots(2, 2, sharex=True)
    pairs = list(dict.fromkeys(zip(gaps["minuend"], gaps["subtrahend"], gaps["claim"], strict=True)))
    for ax, what in ((ax_r, "final reward"), (ax_g, "held-out gain")):
        t = gaps[gaps["quantity"] == what]
        if t.empty:
            why = "no run evaluated its start (step 0)" if pairs else "no two algorithms the claims compare here"
            ax.text(0.5, 0.5, f"no {what} gap: {why}", ha="center", va="center", transform=ax.transAxes, fontsize=7)
        for k, (a, b, claim) in enumerate(pairs):
            p = t[(t["minuend"] == a) & (t["subtrahend"] == b)].copy()
            if p.empty:
                continue
            p["x"] = p["config"].map(xs)
            p = p.sort_values("x")
            _gap_bars(
                ax,
                p["x"],
                p,
                xerr.loc[p["config"]],
                a,
                k,
                f"{style.label(a)} − {style.label(b)} ({claim})",
                f"gap-{what}-{a}-{b}",
            )
        ax.axhline(0.0, color="black", lw=0.6, ls=":")
        ax.set_ylabel(f"{what} gap")
        ax.set_title(f"{what}: gap between the compared algorithms")
    algs = style.order(load[ALGORITHM].astype(str).unique()) if len(load) else []
    n_alg = max(1, len(algs))
    for ax, metric, ylabel in (
        (ax_l, vocab.EXPERT_LOAD, "expert load imbalance (max / mean)"),
        (ax_e, vocab.ROUTER_ENTROPY, "router entropy (nats)"),
    ):
        t = load[load["metric"] == metric]
        if t.empty:
            ax.text(0.5, 0.5, f"{metric} not logged", ha="center", va="center", transform=ax.transAxes, fontsize=7)
        for k, alg in enumerate(algs):
            p = t[t[ALGORITHM] == alg].copy()
            p["x"] = p["config"].map(xs)
            p = p.sort_values("x")
            dodge = (k - (n_alg - 1) / 2) * 0.025  # algorithms side by side at their configuration's volatility
            x = p["x"] * (1 + dodge) if log_x else p["x"] + dodge * float(np.nanmax(xs) - np.nanmin(xs) or 1.0)
            ax.errorbar(
                x,
                p["mean"],
                yerr=_err(p),
                color=style.color(alg),
                marker="o",
                ms=3,
                lw=0.8,
                capsize=1.5,
                label=style.label(alg),
                gid=f"load-{metric}-{alg}",
            )
        ax.set_ylabel(ylabel)
        ax.set_title(metric)
        ax.set_xlabel("routing volatility: expert-slot mismatch since pi_old")
    for ax in (ax_r, ax_g, ax_l, ax_e):
        for x in xs:
            ax.axvline(x, color=style.NEUTRAL, lw=0.5, ls=":", alpha=0.6)
        if log_x:
            style.log_scale(ax, "x")
    axes = _varying(st)
    names = ", ".join(a.rsplit(".", 1)[-1] for a in axes)
    keys = [tuple(vol.loc[i, a] for a in axes) for i in range(len(vol))]
    tags, long_values = [], []
    for i, key in enumerate(keys):  # short values as they are (30, bf16); long ones (a model shape) as #1, #2, ...
        text = [_short(v) for v in key]
        if any(len(t) > 14 for t in text):
            tags.append(f"#{i + 1}")
            long_values.append(f"#{i + 1} = {vol.loc[i, 'config']}")
        else:
            tags.append("\n".join(text))
    _top_tags(fig, (ax_r, ax_g), xs.to_numpy(), tags, names, crowded="configurations: too close to label")
    _legend(fig, [ax_r, ax_l])
    what = "held-out gain" if (gaps["quantity"] == "held-out gain").any() else ""
    comparisons = "; ".join(f"{style.label(a)} minus {style.label(b)} ({c})" for a, b, c in pairs)
    caption = (
        "Figure 8. Routing volatility and the gaps between the algorithms the claims compare, per configuration of "
        f"{', '.join(axes)} ({len(xs)} configurations, dotted lines; their values on top where they fit, else in "
        "the table). x: the configuration's routing volatility, the expert-slot mismatch mean(1 - |S_old & S_new| / "
        "k) between the routing before and after an update (routing_slot_mismatch, measured alongside under replay), "
        "the mean over steps per run then over every run of the configuration, with its 95% t interval over "
        f"runs. Top: {comparisons or 'no two compared algorithms are both in the study'}; the difference of seed "
        f"means of the final reward (each run's mean over its last {frac:.0%} of steps)"
        + (
            " and of the held-out gain (the run's last evaluation of eval_in_dist minus its step-0 one)"
            if what
            else "; no held-out gain (no run evaluated its start at step 0)"
        )
        + ", with 95% Welch t intervals (independent groups). Bottom: expert load "
        "imbalance (most tokens on one expert over the mean per expert, 1 = balanced) and router entropy per "
        "algorithm, the mean over steps per run then over seeds (95% interval), drawn side by side at their "
        "configuration's volatility: what the volatility is read against. The report lists C3 and C4 per "
        "configuration next to this figure."
        + (f" Configurations: {'; '.join(long_values)}." if long_values else "")
        + (f" The {dense} runs of a dense control (one expert: nothing to route) are left out." if dense else "")
    )
    return Made(fig, "figure8_routing_volatility", caption, tables)


# --- Figure 9 ---------------------------------------------------------------------------------------------------------
MOE, DENSE = "MoE", "dense"
"""The `model` column of Figure 9's tables: the MoE, or its dense control (a run whose model has one expert)."""
HELD_OUT, FINAL = "held-out gain", "final reward"
"""Figure 9's quantities (its tables' `quantity` column)."""


def _model_of(study: Study, run_ids: Sequence[str]) -> list[str]:
    """DENSE for a run whose config has one expert (vocab.NUM_EXPERTS_KEY = 1), else MOE."""
    return [
        DENSE if study.configs.get(str(r), {}).get(vocab.NUM_EXPERTS_KEY) in (1, 1.0, "1") else MOE for r in run_ids
    ]


def _mechanism(study: Study, arm: Mapping[tuple[str, str, Any], list[str]]) -> pd.DataFrame:
    """offpolicy_tables' `mechanism`: per (model, algorithm, M) of `arm` (-> its run ids), the mean over its runs of
    each run's mean over steps of the routing volatility and of each log-ratio metric (NaN where none measured it)."""
    names = [vocab.ROUTING_SLOT, *(m for m in vocab.LOGRATIOS if m in study.metrics)]
    per_run = {
        m: dict(zip(r[RUN_ID].astype(str), r["value"].astype(float), strict=True))
        for m in names
        if len(r := stats.run_mean(study.long, m))
    }
    rows = []
    for (mod, alg, m), ids in arm.items():
        row: dict[str, Any] = {"model": mod, ALGORITHM: alg, vocab.MINIBATCH_AXIS: m, "n": len(ids)}
        for name in names:
            vals = np.array([per_run.get(name, {}).get(r, np.nan) for r in ids], np.float64)
            row[name] = float(np.nanmean(vals)) if np.isfinite(vals).any() else np.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", ALGORITHM, vocab.MINIBATCH_AXIS, "n", *names])


def _base_of(alg: str, present: Sequence[str]) -> str | None:
    """The arm at the fewest minibatches an algorithm's off-policy loss is measured from: itself, else the first of
    its routing variants (the same loss under another routing mode, registry order) that ran there: replay is a no-op
    with one minibatch, so a study leaves the replay arms out there."""
    if alg in present:
        return alg
    return next((v for v in style.registry().routing_variants(alg) if v in present), None)


def offpolicy_tables(study: Study, *, frac: float = 0.1, threshold: float | None = None) -> dict[str, pd.DataFrame]:
    """Figure 9's data, along the minibatches per rollout batch M (vocab.MINIBATCH_AXIS), for the MoE and its dense
    control (runs whose model has one expert; failed runs left out). Per run: its routing volatility (mean
    routing_slot_mismatch over its steps), its held-out gain (analysis.gain.per_run) and its final reward (mean over
    its last `frac` of steps).

    - `volatility`: per M, the MoE's volatility: mean over every MoE run at that M (all algorithms) with a 95% t
      interval over runs; `threshold` (default analysis.regime.MIN_VOLATILITY) and whether the mean reaches it;
    - `arms`: per model, algorithm, M and quantity, the mean over seeds with a 95% t interval;
    - `gaps`: per M, each algorithm minus its Routing Replay partner (the pairs of C3 and C4, reversed: what dropping
      replay costs) on the MoE, and the dense control's off-policy loss (its value at M minus at the fewest M), with
      95% Welch intervals, at the MoE's volatility of that M;
    - `offpolicy_loss`: per MoE algorithm and M, its off-policy loss (its value at M minus its routing family's at
      the fewest M, `_base_of`) and that loss's excess over the dense control's (the contrast alg(M) - base(M_0) -
      dense(M) + dense(M_0), Welch-Satterthwaite interval): below 0 when the arm falls beyond the dense control;
    - `mechanism` (only when runs measured the routing log-ratio, routing_attribution): per model, algorithm and M,
      the seed means of each run's step means of the routing volatility and of the off-policy minibatches'
      log-ratios (vocab.LOGRATIOS: the routing's part and the weights');
    - `collapse_rate` (only when some run collapsed, analysis.collapse): per model, algorithm and M, collapsed runs
      of the runs, with a Wilson interval.
    """
    from analysis import regime, scorecard

    threshold = regime.MIN_VOLATILITY if threshold is None else float(threshold)
    axis = vocab.MINIBATCH_AXIS
    varying = _varying(study)
    if axis not in varying:
        raise MissingData(
            f"the off-policy figure compares minibatches per rollout batch ({axis!r}); this study does not sweep it "
            f"(swept axes: {', '.join(varying) or 'none'})"
        )
    for m in (vocab.ROUTING_SLOT, vocab.REWARD):
        _need_metric(study, m)
    other = [a for a in varying if a != axis and a.split(".")[0] != "model"]
    if other:
        raise MissingData(
            f"the off-policy figure reads one configuration besides {axis} and the model; this study "
            f"also sweeps {', '.join(other)}: select one value of each (where=)"
        )
    keys, m_of = _configurations(study, [axis])
    ms = [k[0] for k in keys]
    runs = study.runs[study.runs[RUN_ID].astype(str).isin(m_of)].copy()
    runs["model"] = _model_of(study, runs[RUN_ID].astype(str).tolist())
    shape_cols = [a for a in varying if a.split(".")[0] == "model"]
    moe = runs[runs["model"] == MOE]
    if moe.empty:
        raise MissingData(f"the off-policy figure needs MoE runs; every run's {vocab.NUM_EXPERTS_KEY} is 1")
    if shape_cols and len(moe[shape_cols].astype(str).drop_duplicates()) > 1:
        raise MissingData(
            f"the off-policy figure reads one MoE shape; this study sweeps several ({', '.join(shape_cols)}"
            "): select one (where=)"
        )
    arm = {
        (mod, str(alg), m): grp[RUN_ID].astype(str).tolist()
        for (mod, alg, m), grp in runs.groupby(["model", ALGORITHM, axis], observed=True, sort=False)
    }

    def values(per_run: pd.DataFrame) -> dict[str, float]:
        return dict(zip(per_run[RUN_ID].astype(str), per_run["value"].astype(float), strict=True))

    vol = values(stats.run_mean(study.long, vocab.ROUTING_SLOT))
    quantities = {}
    if vocab.EVAL_IN_DIST in study.metrics:
        gains = gain.per_run(study.long, vocab.EVAL_IN_DIST)
        if len(gains):
            quantities[HELD_OUT] = values(gains)
    quantities[FINAL] = values(stats.final_window(study.long, vocab.REWARD, frac=frac))

    def of(q: Mapping[str, float], mod: str, alg: str, m: Any) -> np.ndarray:
        return np.array([q.get(r, np.nan) for r in arm.get((mod, alg, m), [])], np.float64)

    rows = []
    for m in ms:
        ids = moe.loc[moe[axis] == m, RUN_ID].astype(str)
        v = np.array([vol.get(r, np.nan) for r in ids], np.float64)
        ci = stats.mean_ci(v[np.isfinite(v)])
        rows.append(
            {
                axis: m,
                "mean": ci.estimate,
                "low": ci.low,
                "high": ci.high,
                "n": ci.n,
                "threshold": threshold,
                "in_regime": bool(ci.n > 0 and ci.estimate >= threshold),
            }
        )
    volatility = pd.DataFrame(rows, columns=[axis, "mean", "low", "high", "n", "threshold", "in_regime"])
    x_of = dict(zip(volatility[axis], volatility["mean"], strict=True))

    algs = {mod: style.order({a for (md, a, _m) in arm if md == mod}) for mod in (MOE, DENSE)}
    rows = []
    for mod, q, m in itertools.product((MOE, DENSE), quantities, ms):
        for alg in algs[mod]:
            if (mod, alg, m) in arm:
                ci = stats.mean_ci(of(quantities[q], mod, alg, m))
                rows.append(
                    {
                        "model": mod,
                        ALGORITHM: alg,
                        axis: m,
                        "quantity": q,
                        "mean": ci.estimate,
                        "low": ci.low,
                        "high": ci.high,
                        "n": ci.n,
                    }
                )
    arms = pd.DataFrame(rows, columns=["model", ALGORITHM, axis, "quantity", "mean", "low", "high", "n"])

    present = algs[MOE]
    pairs = [(free, rr) for rr, free, claim in scorecard.comparison_pairs(present) if claim in ("C3", "C4")]
    dense_alg = algs[DENSE][0] if algs[DENSE] else None
    m0 = ms[0]

    def gap_row(what: str, a: str, b: str, model: str, m: Any, q: str, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        d = stats.mean_difference(x, y)
        return {
            "comparison": what,
            "minuend": a,
            "subtrahend": b,
            "model": model,
            axis: m,
            "volatility": x_of[m],
            "quantity": q,
            "estimate": d.estimate,
            "low": d.low,
            "high": d.high,
            "n": f"{np.isfinite(x).sum()} vs {np.isfinite(y).sum()}",
        }

    rows = []
    for q, m in itertools.product(quantities, ms):
        for free, rr in pairs:
            if (MOE, free, m) in arm and (MOE, rr, m) in arm:
                x, y = of(quantities[q], MOE, free, m), of(quantities[q], MOE, rr, m)
                rows.append(gap_row(f"{style.label(free)} - {style.label(rr)}", free, rr, MOE, m, q, x, y))
        if dense_alg is not None and m != m0 and (DENSE, dense_alg, m) in arm and (DENSE, dense_alg, m0) in arm:
            x, y = of(quantities[q], DENSE, dense_alg, m), of(quantities[q], DENSE, dense_alg, m0)
            what = f"dense control ({style.label(dense_alg)}): at M minus at M = {_short(m0)}"
            rows.append(gap_row(what, dense_alg, dense_alg, DENSE, m, q, x, y))
    gap_cols = [
        "comparison",
        "minuend",
        "subtrahend",
        "model",
        axis,
        "volatility",
        "quantity",
        "estimate",
        "low",
        "high",
        "n",
    ]
    gaps = pd.DataFrame(rows, columns=gap_cols)

    rows = []
    at0 = [a for (md, a, m) in arm if md == MOE and m == m0]
    for q, alg, m in itertools.product(quantities, present, ms[1:]):
        base = _base_of(alg, at0)
        if (MOE, alg, m) not in arm or base is None:
            continue
        groups = [of(quantities[q], MOE, alg, m), of(quantities[q], MOE, base, m0)]
        loss = stats.mean_difference(*groups)
        excess = stats.CI(np.nan, np.nan, np.nan, 0)
        if dense_alg is not None and (DENSE, dense_alg, m) in arm and (DENSE, dense_alg, m0) in arm:
            dense = [of(quantities[q], DENSE, dense_alg, m), of(quantities[q], DENSE, dense_alg, m0)]
            excess = stats.contrast_ci([*groups, *dense], (1.0, -1.0, -1.0, 1.0))
        rows.append(
            {
                ALGORITHM: alg,
                "baseline": base,
                axis: m,
                "volatility": x_of[m],
                "quantity": q,
                "loss": loss.estimate,
                "loss_low": loss.low,
                "loss_high": loss.high,
                "excess": excess.estimate,
                "excess_low": excess.low,
                "excess_high": excess.high,
                "n": excess.n or loss.n,
            }
        )
    loss_cols = [
        ALGORITHM,
        "baseline",
        axis,
        "volatility",
        "quantity",
        "loss",
        "loss_low",
        "loss_high",
        "excess",
        "excess_low",
        "excess_high",
        "n",
    ]
    tables = {
        "volatility": volatility,
        "arms": arms,
        "gaps": gaps,
        "offpolicy_loss": pd.DataFrame(rows, columns=loss_cols),
    }
    if vocab.ROUTING_LOGRATIO in study.metrics:  # runs with routing_attribution: the mechanism beside the volatility
        tables["mechanism"] = _mechanism(study, arm)

    coll = collapse.collapse_table(study.long, study.runs)
    fell = dict(zip(coll[RUN_ID].astype(str), coll["collapsed"].astype(bool), strict=True))
    if any(fell.get(r, False) for ids in arm.values() for r in ids):
        rows = []
        for mod, m in itertools.product((MOE, DENSE), ms):
            for alg in algs[mod]:
                ids = arm.get((mod, alg, m), [])
                if ids:
                    k = sum(fell.get(r, False) for r in ids)
                    lo, hi = stats.wilson_interval(k, len(ids))
                    rows.append(
                        {
                            "model": mod,
                            ALGORITHM: alg,
                            axis: m,
                            "collapsed": k,
                            "runs": len(ids),
                            "rate": k / len(ids),
                            "low": lo,
                            "high": hi,
                        }
                    )
        tables["collapse_rate"] = pd.DataFrame(rows)
    return tables


def _log2_axis(ax: Axes, ms: Sequence[Any]) -> None:
    """A log2 axis of minibatches per rollout batch, ticked at the swept values."""
    from matplotlib import ticker

    ax.set_xscale("log", base=2)
    ax.set_xticks([float(m) for m in ms], [_short(m) for m in ms])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("minibatches per rollout batch M")


@style.styled
def figure9_offpolicy_replay(
    study: Study, *, where: Mapping[str, Any] | None = None, frac: float = 0.1, threshold: float | None = None
) -> Made:
    """Routing Replay along off-policy updates: (a) the MoE's routing volatility per M against the regime's
    threshold; (b) held-out gain per algorithm against M, the dense control dashed black; (c) what dropping Routing
    Replay costs (each algorithm minus its replay partner) in held-out gain and final reward against the measured
    volatility, the dense control's off-policy loss in grey (`offpolicy_tables`)."""
    from matplotlib import ticker

    from analysis import regime

    st = select(study, where)
    tables = offpolicy_tables(st, frac=frac, threshold=threshold)
    vol, arms, gaps = tables["volatility"], tables["arms"], tables["gaps"]
    axis = vocab.MINIBATCH_AXIS
    thr = float(vol["threshold"].iloc[0])
    ms = vol[axis].tolist()
    fig = style.new_figure(ncols=2, width=style.WIDTH_DOUBLE, height=5.2)
    (ax_v, ax_g), (ax_ch, ax_cr) = fig.subplots(2, 2)
    pct = ticker.PercentFormatter(1.0, decimals=None)

    # (a) the MoE's routing volatility per M
    has = vol[vol["n"] > 0]
    ax_v.errorbar(
        has[axis].astype(float),
        has["mean"],
        yerr=_err(has),
        color="black",
        marker="o",
        ms=4,
        lw=1.0,
        capsize=2,
        label="MoE: routing volatility",
        gid="volatility",
    )
    ax_v.axhline(thr, color=style.NEUTRAL, lw=0.9, ls="--", label=f"regime threshold {regime.percent(thr)}")
    none = vol.loc[vol["n"] == 0, axis].tolist()
    if none:
        ax_v.text(
            0.02,
            0.95,
            f"M = {', '.join(_short(m) for m in none)}: no off-policy minibatch, no volatility",
            transform=ax_v.transAxes,
            ha="left",
            va="top",
            fontsize=6,
        )
    ax_v.set_ylim(bottom=0, top=max(thr, float(np.nanmax(has["high"].fillna(has["mean"]))) if len(has) else thr) * 1.2)
    ax_v.yaxis.set_major_formatter(pct)
    ax_v.set_ylabel("expert slots changed since pi_old")
    ax_v.set_title("(a) routing volatility (MoE)")

    # (b) held-out gain (else final reward) per algorithm against M
    q_b = HELD_OUT if (arms["quantity"] == HELD_OUT).any() else FINAL
    t = arms[arms["quantity"] == q_b]
    series = [(MOE, a) for a in style.order(t.loc[t["model"] == MOE, ALGORITHM])]
    series += [(DENSE, a) for a in style.order(t.loc[t["model"] == DENSE, ALGORITHM])]
    for k, (mod, alg) in enumerate(series):
        p = t[(t["model"] == mod) & (t[ALGORITHM] == alg)].sort_values(axis)
        dodge = 2 ** ((k - (len(series) - 1) / 2) * 0.04)  # side by side at each M
        dense = mod == DENSE
        ax_g.errorbar(
            p[axis].astype(float) * dodge,
            p["mean"],
            yerr=_err(p),
            color="black" if dense else style.color(alg),
            ls="--" if dense else "-",
            marker="s" if dense else "o",
            ms=3.5,
            lw=1.2 if dense else 1.0,
            capsize=1.5,
            label=f"dense control ({style.label(alg)})" if dense else style.label(alg),
            gid=f"arm-{mod}-{alg}",
        )
    ax_g.axhline(0.0, color="black", lw=0.6, ls=":")
    ax_g.set_ylabel(q_b)
    ax_g.set_title(f"(b) {q_b} per algorithm")
    for ax in (ax_v, ax_g):
        _log2_axis(ax, ms)

    # (c) the gaps against the measured volatility, the dense control's loss in grey
    pairs = list(
        dict.fromkeys(
            zip(gaps.loc[gaps["model"] == MOE, "minuend"], gaps.loc[gaps["model"] == MOE, "subtrahend"], strict=True)
        )
    )
    xerr = pd.DataFrame(_err(vol).T, index=vol[axis], columns=["lo", "hi"])
    drawn = vol[(vol["n"] > 0) & (vol[axis].isin(gaps[axis]))]
    for ax, q, panel in ((ax_ch, HELD_OUT, "c"), (ax_cr, FINAL, "d")):
        g = gaps[(gaps["quantity"] == q) & np.isfinite(gaps["volatility"].astype(float))]
        if g.empty:
            why = "no run evaluated its start (step 0)" if q == HELD_OUT else "no compared pair at a measured M"
            ax.text(0.5, 0.5, f"no {q} gap: {why}", ha="center", va="center", transform=ax.transAxes, fontsize=7)
        d = g[g["model"] == DENSE].sort_values("volatility")
        if len(d):
            ax.errorbar(
                d["volatility"],
                d["estimate"],
                yerr=_err(d, "estimate"),
                xerr=xerr.loc[d[axis]].to_numpy().T,
                color=style.NEUTRAL,
                ls="--",
                marker="D",
                ms=3.5,
                lw=1.0,
                capsize=1.5,
                alpha=0.8,
                label="dense control: off-policy loss",
                gid=f"dense-{q}",
            )
        for k, (a, b) in enumerate(pairs):
            p = g[(g["minuend"] == a) & (g["subtrahend"] == b)].sort_values("volatility")
            if p.empty:
                continue
            _gap_bars(
                ax,
                p["volatility"],
                p,
                xerr.loc[p[axis]],
                a,
                k,
                f"{style.label(a)} − {style.label(b)}",
                f"gap-{q}-{a}-{b}",
            )
        ax.axhline(0.0, color="black", lw=0.6, ls=":")
        ax.axvline(thr, color=style.NEUTRAL, lw=0.9, ls="--")
        ax.xaxis.set_major_formatter(pct)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=5))
        ax.set_xlabel("routing volatility: expert slots changed since pi_old")
        ax.set_ylabel(f"{q} gap")
        ax.set_title(f"({panel}) {q}: cost of dropping replay")
    if len(drawn):
        tags = [f"M={_short(m)}" for m in drawn[axis]]
        _top_tags(
            fig,
            (ax_ch, ax_cr),
            drawn["mean"].to_numpy(float),
            tags,
            "M at its volatility",
            crowded="M: too close to label (see the table)",
        )
    _legend(fig, [ax_v, ax_g, ax_ch])

    n_moe = arms[(arms["model"] == MOE) & (arms["quantity"] == FINAL)]
    n_dense = arms[(arms["model"] == DENSE) & (arms["quantity"] == FINAL)]
    per_arm = ", ".join(
        f"{style.label(a)} {'/'.join(str(int(v)) for v in n_moe.loc[n_moe[ALGORITHM] == a, 'n'])}"
        for a in style.order(n_moe[ALGORITHM])
    )
    dense_n = "/".join(str(int(v)) for v in n_dense["n"]) if len(n_dense) else "0"
    coll = tables.get("collapse_rate")
    caption = (
        "Figure 9. Routing Replay along off-policy updates: M minibatches per rollout batch (M = "
        f"{', '.join(_short(m) for m in ms)}), the first on-policy, each later one after one more update since pi_old. "
        "(a) The MoE's routing volatility per M: the expert-slot mismatch mean(1 - |S_old & S_new| / k) of the update "
        "forward's routing against pi_old's over the off-policy minibatches (routing_slot_mismatch, measured "
        "alongside under replay), each run's mean over its steps, then the mean over the MoE's runs of every "
        f"algorithm with a 95% t interval over runs; dashed: the regime's threshold {regime.percent(thr)} (the "
        f"scorecard's Rules.min_volatility). (b) The {q_b} per algorithm"
        + (" (a run's last evaluation of eval_in_dist minus its step-0 one)" if q_b == HELD_OUT else "")
        + ", seed mean with a 95% t interval, side by side at each M; black dashed: the dense control (the runs "
        f"whose model has {vocab.NUM_EXPERTS_KEY} = 1: one expert of the MoE's active width, nothing to route), the "
        "off-policy damage without routing; minibatch m of M follows m - 1 updates since pi_old. (c), (d) Each "
        "algorithm minus its Routing Replay partner, in held-out gain (c) and in final reward (d: each run's mean "
        f"over its last {frac:.0%} of steps), at the volatility of each M "
        "(negative: dropping replay cost that much), with 95% Welch t intervals; grey: the dense control's "
        "off-policy loss, its value at M minus at the fewest M, with its Welch interval. Runs per M: MoE "
        f"{per_arm or 'none'}; dense control {dense_n}."
        + (
            " Collapsed runs (status.json or the reward-drop rule): "
            + ", ".join(
                f"{style.label(r[ALGORITHM])} ({r['model']}) at M = {_short(r[axis])} {int(r['collapsed'])}"
                f" of {int(r['runs'])}"
                for _, r in coll[coll["collapsed"] > 0].iterrows()
            )
            + " (table collapse_rate)."
            if coll is not None
            else " No run collapsed."
        )
    )
    return Made(fig, "figure9_offpolicy_replay", caption, tables)


# --- all --------------------------------------------------------------------------------------------------------------
FIGURES = {
    "figure1_reward": figure1_reward,
    "figure2_clipping": figure2_clipping,
    "figure3_routing_replay": figure3_routing_replay,
    "figure4_precision": figure4_precision,
    "figure4b_token_logprobs": figure4b_token_logprobs,
    "figure5_length": figure5_length,
    "figure6_routing": figure6_routing,
    "figure7_fits": figure7_fits,
    "figure8_routing_volatility": figure8_routing_volatility,
    "figure9_offpolicy_replay": figure9_offpolicy_replay,
}


INDEX = "figures.json"
"""A figures directory's index (`python -m analysis figures`): figure name -> files, caption and tables, the skipped
figures with the reason, and the fingerprint of the data they were drawn from."""
TABLES = "tables"
"""Subdirectory of a figures directory holding each figure's tables, NAME.TABLE.csv."""


def data_fingerprint(study: Study) -> str:
    """A hash of what a study's figures are drawn from, per run: id, state, rows, last step and compute, and the
    missing and unreadable run ids (with the reason). Run directories only grow (a resumed run appends steps), so
    equal fingerprints mean figures drawn from one can be reused for the other (`analysis.report.build_report(
    figures_dir=...)`)."""
    import hashlib
    import json

    cols = [c for c in (RUN_ID, "state", "n_steps", "last_step", "last_compute") if c in study.runs.columns]
    rows = study.runs[cols].astype(str).sort_values(RUN_ID).values.tolist()
    unread = sorted(zip(study.unreadable[RUN_ID].astype(str), study.unreadable["reason"].astype(str), strict=True))
    text = json.dumps({"runs": rows, "missing": sorted(map(str, study.missing)), "unreadable": unread})
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Rendered:
    """What `make_all` wrote, and why it skipped what it skipped."""

    paths: dict[str, list[Path]]
    captions: dict[str, str]
    tables: dict[str, dict[str, pd.DataFrame]]
    skipped: dict[str, str]


def make_all(study: Study, out_dir: str | os.PathLike[str], *, only: Sequence[str] | None = None) -> Rendered:
    """Render every figure the study has data for into `out_dir` (PNG, PDF, SVG); skipped ones say why (a figure
    whose data is missing, MissingData; or one that failed on these runs, with the error)."""
    out = Rendered({}, {}, {}, {})
    for name, fn in FIGURES.items():
        if only is not None and name not in only:
            continue
        try:
            made = fn(study)
        except MissingData as exc:
            out.skipped[name] = str(exc)
            continue
        except Exception as exc:  # a figure that cannot be drawn from these runs never stops the others
            out.skipped[name] = f"could not be drawn from these runs: {type(exc).__name__}: {exc}"
            continue
        out.paths[name] = style.save(made.fig, Path(out_dir) / made.name)
        out.captions[name] = made.caption
        out.tables[name] = made.tables
    return out


__all__ = [
    "FIGURES",
    "INDEX",
    "TABLES",
    "Made",
    "MissingData",
    "Rendered",
    "clip_table",
    "collapse_counts",
    "data_fingerprint",
    "figure1_reward",
    "figure2_clipping",
    "figure3_routing_replay",
    "figure4_precision",
    "figure4b_token_logprobs",
    "figure5_length",
    "figure6_routing",
    "figure7_fits",
    "figure8_routing_volatility",
    "figure9_offpolicy_replay",
    "make_all",
    "offpolicy_tables",
    "routing_families",
    "routing_volatility_tables",
    "select",
    "token_logprob_tables",
]
