"""Figure 5 (this study's): final reward and efficiency against the maximum generation length, from the tables
`value` and `efficiency`."""

from __future__ import annotations

from analysis.figures import style
from analysis.figures.common import Made, _legend, _unit
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM, RUN_ID, VALUE
from analysis.runs.select import need_axis, need_metric
from analysis.runs.tidy import Study
from analysis.stats import curves


@style.styled
def figure5_length(study: Study, *, axis: str = vocab.LENGTH_AXIS, frac: float = 0.1) -> Made:
    """Final reward and efficiency vs maximum generation length, per algorithm (seed mean, 95% CI).

    Efficiency = (final-window reward - first logged reward) / total training compute, in reward per unit of compute
    (the study's compute unit, style.compute_unit).
    """
    from matplotlib import ticker

    need_axis(study, axis)
    need_metric(study, vocab.REWARD)
    scale, unit = _unit(study)
    fw = curves.final_window(study.long, vocab.REWARD, frac=frac)
    first = curves.metric_rows(study.long, vocab.REWARD).groupby(RUN_ID, observed=True)[VALUE].first()
    fw["efficiency"] = (fw["value"].to_numpy() - first.reindex(fw[RUN_ID].astype(str)).to_numpy()) / (
        fw["compute_to"].to_numpy() / scale
    )
    fig = style.new_figure(ncols=2)
    axs = fig.subplots(1, 2, sharex=True)
    tables = {}
    lengths = sorted(float(v) for v in study.runs[axis].dropna().unique())
    for ax, col, ylabel in ((axs[0], "value", "final reward"), (axs[1], "efficiency", f"reward gain per {unit}")):
        s = curves.summarize(fw, value=col, by=[ALGORITHM, axis])
        tables[col] = s
        for alg in names.order(s[ALGORITHM].astype(str)):
            t = s[s[ALGORITHM].astype(str) == alg].sort_values(axis)
            xs = t[axis].to_numpy(dtype=float)
            ax.plot(xs, t["mean"], marker="o", color=names.color(alg), label=names.label(alg))
            ax.fill_between(xs, t["low"].to_numpy(float), t["high"].to_numpy(float), color=names.color(alg), alpha=0.2)
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
