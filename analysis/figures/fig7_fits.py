"""Figure 7 (this study's): ScaleRL compute-scaling fits per algorithm, from the table `fits`
(analysis.stats.fit.fits_table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from analysis.figures import style
from analysis.figures.common import Made, _compute_axis, _unit
from analysis.runs import names, vocab
from analysis.runs.columns import ALGORITHM
from analysis.runs.select import need_metric, select
from analysis.runs.tidy import Study
from analysis.stats import fit as fitting


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
        need_metric(st, vocab.REWARD)  # a study whose runs all failed before their first step has none
        fits = fitting.fit_study(st.long, vocab.REWARD, runs=st.runs, n_boot=n_boot)
    table = fitting.fits_table(fits)
    algs = names.order(str(k[0]) for k in fits)
    scale, unit = _unit(st)
    rows_h = 0.2 * (len(algs) + 1)
    leg_h = 0.2 * -(-len(algs) // style.legend_ncols([f"{names.label(a)} (not identified)" for a in algs]))
    fig = style.new_figure(ncols=1, width=style.WIDTH_DOUBLE, height=2.6 + leg_h + rows_h)
    ax, ax_l, ax_t = fig.subplots(3, 1, height_ratios=[2.6, leg_h, rows_h])
    for alg in algs:
        f = fits[(alg,)]
        col = names.color(alg)
        if f.identified:
            ax.plot(f.x / scale, f.y, "o", ms=2.5, color=col, alpha=0.7, gid=f"fit-points-{alg}")
            xs = np.geomspace(f.x.min(), f.c_max, 100)
            xe = np.geomspace(f.c_max, f.c_max * extrapolate, 50)
            ax.plot(xs / scale, f.predict(xs), color=col, label=names.label(alg), gid=f"fit-curve-{alg}")
            ax.plot(xe / scale, f.predict(xe), color=col, ls="--", gid=f"fit-extrapolation-{alg}")
            ax.axhline(f.params.a, color=col, ls=":", lw=0.8, gid=f"fit-asymptote-{alg}")
        else:  # the points only: a curve through parameters at their bounds would read as a prediction
            label = f"{names.label(alg)} (not identified)"
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
                    names.label(alg),
                    ci(r["A"], r["A_low"], r["A_high"], ".3f"),
                    ci(r["B"], r["B_low"], r["B_high"], ".2f"),
                    ci(r["C_mid"] / scale, r["C_mid_low"] / scale, r["C_mid_high"] / scale, ".3g"),
                    "yes",
                ]
            )
        else:  # no numbers: what the data do not identify, across the columns
            cells.append([names.label(alg), "not identified: " + f.why_not_identified, "", "", ""])
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
    unidentified = [f"{names.label(str(k[0]))} ({f.why_not_identified})" for k, f in fits.items() if not f.identified]
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
            " Not fitted: " + ", ".join(f"{names.label(str(k[0]))} ({why})" for k, why in fits.skipped.items()) + "."
            if getattr(fits, "skipped", None)
            else ""
        )
    )
    return Made(fig, "figure7_fits", caption, {"fits": table})
