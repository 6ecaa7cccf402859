"""The claims at a glance: each claim's estimate and 95% interval, one row per stratum, against the threshold its
verdict is read at and the paper's value, one small panel per claim (the report draws it under its headline table).

One panel per claim rather than one normalised axis: the claims' quantities are in different units (reward
differences, a ratio of clip fractions read on a log scale, differences of collapse rates), most thresholds are 0, so
a quantity divided by its threshold has no meaning, and a reader checks a number against the scorecard in its own
unit. Each panel keeps its unit and draws its own thresholds.

`estimates` picks the number each verdict was read off (the first evidence line of every stratum with data, the
measured precondition of a claim with a regime left out), which the headline table prints too.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.lines import Line2D

from analysis.claims import scorecard
from analysis.figures import style
from analysis.figures.common import Made
from analysis.stats import design, regime
from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, NO_DATA, NOT_IN_REGIME, SUPPORTED

NAME = "claims_forest"
"""The figure's file name."""

VERDICT_COLORS = {
    SUPPORTED: "#009E73",
    CONTRADICTED: "#D55E00",
    INCONCLUSIVE: "#777777",
    NOT_IN_REGIME: "#0072B2",
    NO_DATA: "#BBBBBB",
}
"""A verdict's colour (Okabe-Ito), in the figure and in the report's verdict labels."""

PAPER_VALUES = {"C2": design.PAPER_CLIP_RATIO}
"""The paper's value on the scale of a claim's quantity, where the paper gives one (C2: ~100x, its Figure 2)."""

LOG_SCALE = ("C2",)
"""Claims whose quantity is a ratio, drawn on a log axis."""

_PRECONDITIONS = tuple(p.quantity + " (" for p in (regime.volatility(), regime.mismatch(), regime.truncation()))
"""How a precondition's evidence line starts (regime.Measured.evidence): a claim's regime, not its quantity."""


@dataclass(frozen=True)
class Estimate:
    """The number one stratum's verdict was read off."""

    label: str
    """The stratum ("max_new_tokens=256"; a part first, "length: all runs"), "" for a claim read on all its runs."""
    name: str
    """The quantity (the evidence line's name)."""
    estimate: float
    low: float
    high: float
    n: str
    verdict: str
    part: str = ""
    """The claim's part the stratum belongs to (C6: "compute", "length"), "" for a claim of one part."""

    @property
    def short(self) -> str:
        """The quantity's name without its parenthesis: "RL's length gain", "reward(gspo) - reward(grpo_rr)"."""
        return self.name.split(" (")[0].split(" at ")[0]

    @property
    def quantity(self) -> str:
        """What the panel's axis measures: `short`, or for a declared comparison ("NAME (TEST): METRIC (WINDOW)
        TREATMENT - CONTROL, INTERVAL") the difference it reads ("test_in_dist (gain) algorithm=grpo_rr -
        algorithm=grpo"), which its rows' names already tell apart."""
        _, sep, rest = self.name.partition("): ")
        return rest.rsplit(", ", 1)[0] if sep and " - " in rest else self.short


def is_precondition(name: str) -> bool:
    """Whether an evidence line is a measured precondition (regime.Measured.evidence), not the claim's quantity."""
    return name.startswith(_PRECONDITIONS)


def estimates(card: scorecard.ClaimResult) -> list[Estimate]:
    """Per stratum with data (none: the whole claim; several declared comparisons: each), its first evidence line that
    is not a precondition, with the stratum's verdict; [] for a claim with no number (not in this study)."""
    if card.strata:
        sources = [
            (s.label if len(card.strata) > 1 or s.part else "", s.evidence, s.verdict, s.part)
            for s in card.strata
            if s.verdict != NO_DATA
        ]
    elif card.declared and "," in card.declared:  # several declared comparisons: one row each, named
        sources = [
            (name, [e for e in card.evidence if e.name.startswith(f"{name} (")], card.verdict, "")
            for name in card.declared.split(", ")
        ]
    else:
        sources = [("", card.evidence, card.verdict, "")]
    out = []
    for label, evidence, verdict, part in sources:
        first = next((e for e in evidence if not is_precondition(e.name)), None)
        if first is not None and np.isfinite(first.estimate):
            out.append(Estimate(label, first.name, first.estimate, first.low, first.high, first.n, verdict, part))
    return out


def thresholds(card: scorecard.ClaimResult) -> tuple[float, ...]:
    """The values the claim's verdict is read at: the bounds of its first decision (scorecard.DECISIONS); for a
    verdict decided from declared comparisons, what their tests read against (0, the declared size, the margins)."""
    if card.declared:
        return card.read_at or (0.0,)
    if card.claim not in scorecard.DECISIONS:
        return (0.0,)
    decision = scorecard.DECISIONS[card.claim][0]
    return tuple(sorted({decision.supported.value, decision.contradicted.value}))


def _wrapped(name: str, width: int = 22) -> str:
    """A long declared comparison's name over lines of at most `width` characters, broken after its underscores
    ("replay_gain_grpo_at_paper_volatility" -> "replay_gain_grpo_at_\npaper_volatility"); other labels as they are."""
    if len(name) <= width or " " in name:
        return name
    lines = [""]
    for word in name.split("_"):
        piece = word if not lines[-1] else f"_{word}"
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines[-1] += "_"
            lines.append(word)
        else:
            lines[-1] += piece
    return "\n".join(lines)


def _short_stratum(label: str) -> str:
    """ "length: max_new_tokens=256, rollout_precision=bf16" -> "length: 256, bf16" (the panel's rows are narrow)."""
    part, _, key = label.rpartition(": ")
    values = "" if key == "all runs" else ", ".join(kv.split("=", 1)[-1] for kv in key.split(", "))
    return ": ".join(x for x in (part, values) if x) or key


def _arrows(ax: Axes, one_sided: list[tuple[float, Estimate, str]], values: list[float]) -> None:
    """Each one-sided interval as an arrow from its finite bound to the panel's edge on the open side, the panel
    widened to hold every finite value with a margin (an open end has no value to draw)."""
    finite = [v for v in values if np.isfinite(v)]
    lo, hi = min(finite), max(finite)
    pad = 0.15 * (hi - lo) if hi > lo else 0.01
    ax.set_xlim(lo - pad, hi + pad)
    for yi, e, color in one_sided:
        start, end = (e.low, hi + pad) if np.isfinite(e.low) else (e.high, lo - pad)
        ax.annotate("", xy=(end, yi), xytext=(start, yi), arrowprops={"arrowstyle": "->", "color": color, "lw": 2})


@style.styled
def claims_forest(cards: Sequence[scorecard.ClaimResult]) -> Made:
    """One panel per claim: each stratum's estimate and 95% interval coloured by its verdict (a one-sided bound as an
    arrow to the panel's edge), the thresholds the verdict is read at (dashed) and the paper's value (dotted), the
    panel's title the claim's verdict."""
    ncols = 3
    nrows = -(-len(cards) // ncols)
    rows = max([len(estimates(c)) for c in cards] + [3])
    fig = style.new_figure(ncols, nrows, height=0.4 + nrows * (0.8 + 0.2 * rows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(cards) :]:
        ax.set_axis_off()
    for ax, card in zip(axes, cards, strict=False):
        ests = estimates(card)
        ax.set_title(f"{card.claim}: {card.verdict}", color=VERDICT_COLORS.get(card.verdict, style.NEUTRAL), loc="left")
        if not ests:
            ax.set_axis_off()
            ax.text(0.0, 0.8, textwrap.fill(card.reason.split(";")[0], 34), transform=ax.transAxes, va="top", size=7)
            continue
        y = np.arange(len(ests))[::-1]
        one_sided = []
        for yi, e in zip(y, ests, strict=True):
            color = VERDICT_COLORS.get(e.verdict, style.NEUTRAL)
            if np.isfinite(e.low) and np.isfinite(e.high):
                ax.plot([e.low, e.high], [yi, yi], color=color, lw=2, solid_capstyle="butt")
            elif np.isfinite(e.low) or np.isfinite(e.high):  # a one-sided bound: an arrow to the panel's edge
                one_sided.append((yi, e, color))
            ax.plot([e.estimate], [yi], "o", color=color, ms=5, mec="white", mew=0.8)
        for t in thresholds(card):
            ax.axvline(t, color=style.NEUTRAL, ls="--", lw=0.8)
        if one_sided:
            _arrows(ax, one_sided, [*thresholds(card), *(v for e in ests for v in (e.estimate, e.low, e.high))])
        paper = PAPER_VALUES.get(card.claim)
        if paper is not None and not card.declared:
            ax.axvline(paper, color="black", ls=":", lw=1.2)
        if card.claim in LOG_SCALE and all(e.low > 0 for e in ests if np.isfinite(e.low)):
            style.log_scale(ax, "x")
        ax.set_yticks(y, [_wrapped(_short_stratum(e.label)) if e.label else "all runs" for e in ests])
        ax.set_ylim(-0.7, len(ests) - 0.3)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel(textwrap.fill(" | ".join(dict.fromkeys(e.quantity for e in ests)), 30))
    handles = [
        Line2D([], [], color=c, marker="o", ms=5, mec="white", mew=0.8, lw=2, label=v)
        for v, c in VERDICT_COLORS.items()
        if v != NO_DATA and any(e.verdict == v for card in cards for e in estimates(card))
    ]
    handles += [
        Line2D([], [], color=style.NEUTRAL, ls="--", lw=0.8, label="threshold the verdict is read at"),
        Line2D([], [], color="black", ls=":", lw=1.2, label="the paper's value"),
    ]
    labels = [h.get_label() for h in handles]
    fig.legend(handles=handles, loc="outside lower center", ncols=style.legend_ncols(labels, max_cols=len(labels)))
    caption = (
        "Each claim's estimate and 95% interval per stratum (a one-sided bound: an arrow towards its open side), "
        "coloured by verdict, against the threshold its verdict is read at (dashed) and the paper's value where it "
        "gives one (dotted)."
    )
    return Made(fig, NAME, caption)


__all__ = [
    "LOG_SCALE",
    "NAME",
    "PAPER_VALUES",
    "VERDICT_COLORS",
    "Estimate",
    "claims_forest",
    "estimates",
    "thresholds",
]
