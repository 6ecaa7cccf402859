"""Figure 8 (this study's): the claims' gaps and the routing load against each configuration's routing volatility,
from `routing_volatility_tables` (`volatility`, `gaps`, `routing_load`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made, _err, _gap_bars, _legend, _top_tags
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID, SEED
from analysis.runs.select import MissingData, configurations, need_metric, routed, select, short, varying
from analysis.runs.tidy import Study
from analysis.stats import curves, design, gain, intervals


def routing_volatility_tables(study: Study, *, frac: float = 0.1) -> dict[str, pd.DataFrame]:
    """Figure 8's data, per configuration (combination of the swept axes other than algorithm; failed runs left out):

    - `volatility`: the configuration's routing volatility: each run's mean routing_slot_mismatch over its steps, then
      the mean over every run of the configuration (all algorithms) with a 95% t interval over runs;
    - `gaps`: per comparison the claims make (scorecard.comparison_pairs: C1 GSPO minus the GRPO baseline, C3 and C4
      the Routing Replay partner minus the algorithm), the gap in final reward (`curves.compute_window`: each run's
      mean over the last `frac` of its compute) and, when runs evaluated their start, in held-out gain (last
      evaluation of eval_in_dist minus step 0): `design.arm_gap`, paired by seed where both arms ran the same seeds,
      else Welch, with its 95% interval; the gaps read as one exploratory family (`design.read_as_family`: Holm's
      p-values, simultaneous intervals);
    - `routing_load`: per algorithm, the mean over steps per run, then over seeds (95% interval), of
      expert_load_imbalance and router_entropy (the metrics present).
    """
    from analysis.claims import scorecard

    axes = varying(study)
    if not axes:
        raise MissingData(
            "the routing-volatility figure compares configurations of a swept axis other than algorithm and seed "
            "(e.g. router_lr_scale, the model shape); this study sweeps none"
        )
    for m in (vocab.ROUTING_SLOT, vocab.REWARD):
        need_metric(study, m)
    keys, cfg_of = configurations(study, axes)

    def per_config(per_run: pd.DataFrame) -> pd.DataFrame:
        t = per_run[[RUN_ID, ALGORITHM, SEED, "value"]].copy()
        t["config"] = t[RUN_ID].astype(str).map(cfg_of)
        t[ALGORITHM] = t[ALGORITHM].astype(str)
        return t.dropna(subset=["config"]).astype({"config": int})

    def label(i: int) -> str:
        return ", ".join(f"{a.rsplit('.', 1)[-1]}={v}" for a, v in zip(axes, keys[i], strict=True))

    vol = per_config(curves.run_mean(study.long, vocab.ROUTING_SLOT))
    rows = []
    for i in range(len(keys)):
        ci = intervals.mean_ci(vol.loc[vol["config"] == i, "value"].to_numpy())
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
    quantities = {"final reward": per_config(curves.compute_window(study.long, vocab.REWARD, frac=frac))}
    if vocab.EVAL_IN_DIST in study.metrics:
        gains = gain.per_run(study.long, vocab.EVAL_IN_DIST)
        if len(gains):
            quantities["held-out gain"] = per_config(gains)
    rows = []
    for (a, b, claim), (i, _key) in itertools.product(pairs, enumerate(keys)):
        for what, t in quantities.items():
            in_cfg = t[t["config"] == i]
            arms = [in_cfg[in_cfg[ALGORITHM] == name] for name in (a, b)]
            x, y = (arm["value"].to_numpy(np.float64) for arm in arms)
            x_by, y_by = (
                None if arm[SEED].duplicated().any() else dict(zip(arm[SEED], arm["value"].astype(float), strict=True))
                for arm in arms
            )
            rows.append(
                {
                    "config": label(i),
                    "comparison": f"{names.label(a)} - {names.label(b)}",
                    "claim": claim,
                    "minuend": a,
                    "subtrahend": b,
                    "quantity": what,
                    **design.arm_gap(x, y, x_by, y_by),
                }
            )
    design.read_as_family(rows)
    gap_cols = [
        "config",
        "comparison",
        "claim",
        "minuend",
        "subtrahend",
        "quantity",
        *design.GAP_COLUMNS,
    ]
    gaps = pd.DataFrame(rows, columns=gap_cols)

    rows = []
    for metric in (vocab.EXPERT_LOAD, vocab.ROUTER_ENTROPY):
        if metric not in study.metrics:
            continue
        t = per_config(curves.run_mean(study.long, metric))
        for (i, alg), grp in t.groupby(["config", ALGORITHM], sort=True):
            ci = intervals.mean_ci(grp["value"].to_numpy())
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
                f"{names.label(a)} − {names.label(b)} ({claim})",
                f"gap-{what}-{a}-{b}",
            )
        ax.axhline(0.0, color="black", lw=0.6, ls=":")
        ax.set_ylabel(f"{what} gap")
        ax.set_title(f"{what}: gap between the compared algorithms")
    algs = names.order(load[ALGORITHM].astype(str).unique()) if len(load) else []
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
                color=names.color(alg),
                marker="o",
                ms=3,
                lw=0.8,
                capsize=1.5,
                label=names.label(alg),
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
    axes = varying(st)
    axis_names = ", ".join(a.rsplit(".", 1)[-1] for a in axes)
    keys = [tuple(vol.loc[i, a] for a in axes) for i in range(len(vol))]
    tags, long_values = [], []
    for i, key in enumerate(keys):  # short values as they are (30, bf16); long ones (a model shape) as #1, #2, ...
        text = [short(v) for v in key]
        if any(len(t) > 14 for t in text):
            tags.append(f"#{i + 1}")
            long_values.append(f"#{i + 1} = {vol.loc[i, 'config']}")
        else:
            tags.append("\n".join(text))
    _top_tags(fig, (ax_r, ax_g), xs.to_numpy(), tags, axis_names, crowded="configurations: too close to label")
    _legend(fig, [ax_r, ax_l])
    what = "held-out gain" if (gaps["quantity"] == "held-out gain").any() else ""
    comparisons = "; ".join(f"{names.label(a)} minus {names.label(b)} ({c})" for a, b, c in pairs)
    caption = (
        "Figure 8. Routing volatility and the gaps between the algorithms the claims compare, per configuration of "
        f"{', '.join(axes)} ({len(xs)} configurations, dotted lines; their values on top where they fit, else in "
        "the table). x: the configuration's routing volatility, the expert-slot mismatch mean(1 - |S_old & S_new| / "
        "k) between pi_old's routing and the update forward's in minibatches 2..M of a step (routing_slot_mismatch, "
        "after 1 to M - 1 updates since pi_old: the cumulative unit; measured alongside under replay), "
        "the mean over steps per run then over every run of the configuration, with its 95% t interval over "
        f"runs. Top: {comparisons or 'no two compared algorithms are both in the study'}; the gap in final reward "
        f"(each run's mean over the last {frac:.0%} of its compute)"
        + (
            " and in held-out gain (the run's last evaluation of eval_in_dist minus its step-0 one)"
            if what
            else "; no held-out gain (no run evaluated its start at step 0)"
        )
        + ", with 95% t intervals paired by seed where both arms ran the same seeds (a seed's arms share prompts, "
        "cold start and evaluation sampling; Welch where they differ); exploratory: the table `gaps` reads them as one "
        "family, with Holm-adjusted p-values and simultaneous intervals. Bottom: expert load "
        "imbalance (most tokens on one expert over the mean per expert, 1 = balanced) and router entropy per "
        "algorithm, the mean over steps per run then over seeds (95% interval), drawn side by side at their "
        "configuration's volatility: what the volatility is read against. The report lists C3 and C4 per "
        "configuration next to this figure."
        + (f" Configurations: {'; '.join(long_values)}." if long_values else "")
        + (f" The {dense} runs of a dense control (one expert: nothing to route) are left out." if dense else "")
    )
    return Made(fig, "figure8_routing_volatility", caption, tables)
