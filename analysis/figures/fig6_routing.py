"""Figure 6 (this study's): expert-slot mismatch per layer, over training and against clipping, from the tables
`per_layer`, `over_training` and `vs_clip`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from analysis.figures import style
from analysis.figures.common import Made, _compute_axis, _curve_legend, _curves, _legend, _plot_curves, _unit
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID, VALUE
from analysis.runs.select import need_metric, routed, select, varying
from analysis.runs.tidy import Study
from analysis.stats import curves


@style.styled
def figure6_routing(study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10) -> Made:
    """Routing volatility: expert-slot mismatch per layer (left), over training (middle), and per run against the
    average clip fraction (right)."""
    from matplotlib import ticker

    st = routed(select(study, where))
    need_metric(st, vocab.ROUTING_SLOT)
    fig = style.new_figure(ncols=3, height=2.8)
    ax_l, ax_t, ax_c = fig.subplots(1, 3)
    tables: dict[str, pd.DataFrame] = {}
    if len(st.layers) and vocab.LAYER_SLOT in set(st.layers["metric"].astype(str)):
        lay = st.layers[st.layers["metric"].astype(str) == vocab.LAYER_SLOT]
        per_run = lay.groupby([RUN_ID, ALGORITHM, "layer"], observed=True)[VALUE].mean().reset_index()
        s = curves.summarize(per_run, value=VALUE, by=[ALGORITHM, "layer"])
        tables["per_layer"] = s
        for alg in names.order(s[ALGORITHM].astype(str)):
            t = s[s[ALGORITHM].astype(str) == alg].sort_values("layer")
            ax_l.errorbar(
                t["layer"],
                t["mean"],
                yerr=np.nan_to_num(np.vstack([t["mean"] - t["low"], t["high"] - t["mean"]]).clip(min=0)),
                marker="o",
                ms=3,
                color=names.color(alg),
                capsize=1.5,
            )
        ax_l.set_xlabel("MoE layer")
        ax_l.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))
    else:
        ax_l.text(0.5, 0.5, "no per-layer routing table", ha="center", va="center", transform=ax_l.transAxes)
    ax_l.set_ylabel("expert-slot mismatch")
    ax_l.set_title("per layer")
    over_training = _curves(st, vocab.ROUTING_SLOT, smooth=smooth, n_grid=100)
    tables["over_training"] = over_training
    scale, unit = _unit(st)
    _plot_curves(ax_t, over_training, varying(st), scale=scale)
    _compute_axis(ax_t, unit)
    ax_t.set_title("over training")
    if vocab.CLIP in st.metrics:
        rs = curves.run_mean(st.long, vocab.ROUTING_SLOT).rename(columns={"value": "slot_mismatch"})
        cf = curves.run_mean(st.long, vocab.CLIP)[[RUN_ID, "value"]].rename(columns={"value": vocab.CLIP})
        both = rs.merge(cf, on=RUN_ID)
        tables["vs_clip"] = both
        for alg in names.order(both[ALGORITHM].astype(str)):
            t = both[both[ALGORITHM].astype(str) == alg]
            ax_c.scatter(t["slot_mismatch"], t[vocab.CLIP], s=12, color=names.color(alg))
        style.log_scale(ax_c, "y")
        ax_c.xaxis.set_major_locator(ticker.MaxNLocator(nbins=4))
        ax_c.set_xlabel("avg. expert-slot mismatch")
        ax_c.set_ylabel("avg. clipped-token fraction")
        ax_c.set_title("vs clipping (per run)")
    _legend(fig, extra=_curve_legend(over_training, varying(st)))
    caption = (
        "Figure 6. Routing volatility: the expert-slot mismatch mean(1 - |S_old & S_new| / k) between pi_old's "
        "routing and the routing of the update's forward in minibatches 2..M of a step, i.e. after 1 to M - 1 "
        "updates since pi_old (the cumulative unit; the per-update one, after exactly one update, is the scorecard's "
        "regime measure), per MoE layer (mean over steps and seeds, 95% CI), over training, and per run against "
        "the average clipped-token fraction."
    )
    return Made(fig, "figure6_routing", caption, tables)
