"""Figure 1 (the paper's Figure 1): training reward and each held-out evaluation against compute, from one
table per metric (the seed-mean curve per configuration with its 95% t interval)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from analysis.figures import style
from analysis.figures.common import (
    Made,
    _compute_axis,
    _counts,
    _curve_legend,
    _curves,
    _first_step_compute,
    _legend,
    _plot_curves,
    _unit,
)
from analysis.runs import vocab
from analysis.runs.columns import ALGORITHM, COMPUTE
from analysis.runs.select import need_metric, select, varying
from analysis.runs.tidy import Study


@style.styled
def figure1_reward(
    study: Study, *, where: Mapping[str, Any] | None = None, smooth: int | None = 10, n_grid: int = 100
) -> Made:
    """Training reward and each held-out eval vs training compute (log x, shared), seed mean with a 95% t
    band."""
    st = select(study, where)
    need_metric(st, vocab.REWARD)
    metrics = [vocab.REWARD, *vocab.eval_metrics(st.metrics)]
    fig = style.new_figure(ncols=len(metrics), width=min(style.WIDTH_DOUBLE, 2.6 * len(metrics)) or None)
    axs = fig.subplots(1, len(metrics), squeeze=False, sharex=True)[0]
    extra = varying(st)
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
        n_start = int(st.runs["start_eval"].sum())
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
