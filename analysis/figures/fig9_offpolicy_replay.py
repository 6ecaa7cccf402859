"""Figure 9 (this study's): Routing Replay along off-policy updates, from analysis.claims.offpolicy.offpolicy_tables
(`volatility`, `arms`, `gaps`, `offpolicy_loss`, `collapse_rate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from analysis.claims import offpolicy
from analysis.figures import style
from analysis.figures.common import Made, _err, _gap_bars, _legend, _top_tags
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM
from analysis.runs.select import DENSE, MOE, select, short
from analysis.runs.tidy import Study
from analysis.stats import curves


def _log2_axis(ax: Axes, ms: Sequence[Any]) -> None:
    """A log2 axis of minibatches per rollout batch, ticked at the swept values."""
    from matplotlib import ticker

    ax.set_xscale("log", base=2)
    ax.set_xticks([float(m) for m in ms], [short(m) for m in ms])
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

    from analysis.stats import regime

    st = select(study, where)
    tables = offpolicy.offpolicy_tables(st, frac=frac, threshold=threshold)
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
    one = vol[vol["per_update_n"] > 0] if "per_update_n" in vol else vol.iloc[:0]
    if len(one):
        ax_v.errorbar(
            one[axis].astype(float),
            one["per_update"],
            yerr=_err(
                pd.DataFrame({k: one[f"per_update{s}"] for k, s in (("mean", ""), ("low", "_low"), ("high", "_high"))})
            ),
            color=style.NEUTRAL,
            marker="^",
            ms=4,
            lw=1.0,
            ls="-.",
            capsize=2,
            label="MoE: per update (after one update)",
            gid="volatility-per-update",
        )
    ax_v.axhline(thr, color=style.NEUTRAL, lw=0.9, ls="--", label=f"regime threshold {regime.percent(thr)} per update")
    none = vol.loc[vol["n"] == 0, axis].tolist()
    if none:
        ax_v.text(
            0.02,
            0.95,
            f"M = {', '.join(short(m) for m in none)}: no off-policy minibatch, no volatility",
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
    q_b = offpolicy.HELD_OUT if (arms["quantity"] == offpolicy.HELD_OUT).any() else offpolicy.FINAL
    t = arms[arms["quantity"] == q_b]
    series = [(MOE, a) for a in names.order(t.loc[t["model"] == MOE, ALGORITHM])]
    series += [(DENSE, a) for a in names.order(t.loc[t["model"] == DENSE, ALGORITHM])]
    for k, (mod, alg) in enumerate(series):
        p = t[(t["model"] == mod) & (t[ALGORITHM] == alg)].sort_values(axis)
        dodge = 2 ** ((k - (len(series) - 1) / 2) * 0.04)  # side by side at each M
        dense = mod == DENSE
        ax_g.errorbar(
            p[axis].astype(float) * dodge,
            p["mean"],
            yerr=_err(p),
            color="black" if dense else names.color(alg),
            ls="--" if dense else "-",
            marker="s" if dense else "o",
            ms=3.5,
            lw=1.2 if dense else 1.0,
            capsize=1.5,
            label=f"dense control ({names.label(alg)})" if dense else names.label(alg),
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
    for ax, q, panel in ((ax_ch, offpolicy.HELD_OUT, "c"), (ax_cr, offpolicy.FINAL, "d")):
        g = gaps[(gaps["quantity"] == q) & np.isfinite(gaps["volatility"].astype(float))]
        if g.empty:
            why = (
                "no run evaluated its start (step 0)" if q == offpolicy.HELD_OUT else "no compared pair at a measured M"
            )
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
                f"{names.label(a)} − {names.label(b)}",
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
        tags = [f"M={short(m)}" for m in drawn[axis]]
        _top_tags(
            fig,
            (ax_ch, ax_cr),
            drawn["mean"].to_numpy(float),
            tags,
            "M at its volatility",
            crowded="M: too close to label (see the table)",
        )
    _legend(fig, [ax_v, ax_g, ax_ch])

    n_moe = arms[(arms["model"] == MOE) & (arms["quantity"] == offpolicy.FINAL)]
    n_dense = arms[(arms["model"] == DENSE) & (arms["quantity"] == offpolicy.FINAL)]
    per_arm = ", ".join(
        f"{names.label(a)} {'/'.join(str(int(v)) for v in n_moe.loc[n_moe[ALGORITHM] == a, 'n'])}"
        for a in names.order(n_moe[ALGORITHM])
    )
    dense_n = "/".join(str(int(v)) for v in n_dense["n"]) if len(n_dense) else "0"
    coll = tables.get("collapse_rate")
    caption = (
        "Figure 9. Routing Replay along off-policy updates: M minibatches per rollout batch (M = "
        f"{', '.join(short(m) for m in ms)}), the first on-policy, each later one after one more update since pi_old. "
        "(a) The MoE's routing volatility per M: the expert-slot mismatch mean(1 - |S_old & S_new| / k) of the update "
        "forward's routing against pi_old's over the off-policy minibatches (routing_slot_mismatch, measured "
        "alongside under replay), each run's mean over its steps, then the mean over the MoE's runs of every "
        f"algorithm with a 95% t interval over runs (black: cumulative, over minibatches 2..M; grey: per update, "
        f"{regime.PER_UPDATE}, the change after one update, the paper's unit); dashed: the regime's threshold "
        f"{regime.percent(thr)} per update (the scorecard's Rules.min_volatility; the paper's model changed "
        f"~{regime.percent(regime.PAPER_PER_UPDATE)} in one update), which the per-update volatility must reach. "
        f"(b) The {q_b} per algorithm"
        + (" (a run's last evaluation of eval_in_dist minus its step-0 one)" if q_b == offpolicy.HELD_OUT else "")
        + ", seed mean with a 95% t interval, side by side at each M; black dashed: the dense control (the runs "
        f"whose model has {vocab.NUM_EXPERTS_KEY} = 1: one expert of the MoE's active width, nothing to route), the "
        "off-policy damage without routing; minibatch m of M follows m - 1 updates since pi_old. (c), (d) Each "
        "algorithm minus its Routing Replay partner, in held-out gain (c) and in final reward (d: the reward over "
        f"{curves.window_rule(frac)}), at the volatility of each M "
        "(negative: dropping replay cost that much), with 95% t intervals paired by seed (a seed's arms share "
        "prompts, cold start and evaluation sampling; Welch where the arms' seeds differ); grey: the dense control's "
        "off-policy loss, its value at M minus at the fewest M, paired alike. The table gaps reads them as one "
        "exploratory family: Holm-adjusted p-values and simultaneous (Bonferroni) intervals beside the unadjusted "
        "ones. Runs per M: MoE "
        f"{per_arm or 'none'}; dense control {dense_n}."
        + (
            " Collapsed runs (status.json or the reward-drop rule): "
            + ", ".join(
                f"{names.label(r[ALGORITHM])} ({r['model']}) at M = {short(r[axis])} {int(r['collapsed'])}"
                f" of {int(r['runs'])}"
                for _, r in coll[coll["collapsed"] > 0].iterrows()
            )
            + " (table collapse_rate)."
            if coll is not None
            else " No run collapsed."
        )
    )
    return Made(fig, "figure9_offpolicy_replay", caption, tables)
