"""The evidence behind the headline: the scorecard (each claim's verdict, its evidence with 95% intervals, the
per-stratum verdicts, the decision rules one click away), the held-out gain, the algorithm table and the power (the
smallest difference the seeds detect)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.claims import scorecard
from analysis.report import render
from analysis.runs.columns import ALGORITHM
from analysis.stats import gain as gain_
from analysis.stats import power

SHOWN_ELSEWHERE = ("role", "split", "pairing", "rule")
"""Scorecard columns the page shows once, collapsed: how each verdict was read (under the headline), the rules (under
the scorecard). The scorecard's CSV keeps them."""


def gain_lines(gain: gain_.HeldOutGain) -> list[tuple[str, str, str]]:
    """The held-out gain in a line per algorithm: what RL did to held-out pass@1 (HeldOutGain.lines), the line green
    when its interval is above 0 in every configuration; or one line saying why it is not available."""
    out = []
    t = gain.table
    for head, text in gain.lines():
        rows = t[t["label"].astype(str) == head.removeprefix("Held-out gain, ").removesuffix(":")] if len(t) else t
        up = len(rows) > 0 and bool((rows["low"].astype(float) > 0).all())
        out.append(("up" if up else "", head, text))
    return out


def gain_table(gain: gain_.HeldOutGain) -> pd.DataFrame:
    """The held-out gain table as the report prints it (numbers to 3 decimals: pass@1 values)."""
    t = gain.table.copy()
    for c in ("start", "final", "gain", "low", "high"):
        t[c] = [f"{v:.3f}" if pd.notna(v) else "" for v in t[c]]
    return t.drop(columns=[ALGORITHM]).rename(columns={"label": "algorithm", "n": "n (with a gain)"})


def _gain_section(gain: gain_.HeldOutGain) -> list[render.Block]:
    """The held-out gain (what RL did to held-out pass@1): a line per algorithm, its rule and its table, or why it is
    not available."""
    out: list[render.Block] = [
        render.h(3, "Held-out gain", anchor="heldout-gain"),
        render.Bullets(tuple(gain_lines(gain)), "lines"),
        render.p(gain.rule[0].upper() + gain.rule[1:] + "."),
    ]
    out.append(render.Table(gain_table(gain)) if gain.available else render.p(f"Not available: {gain.reason}."))
    return out


SCORECARD_NOTE = (
    "Intervals: 95% Student t over seeds (a mean: t with n - 1 df; a difference, contrast or ratio of independent "
    "groups: within each seed, then over seeds, where the compared arms (or C6's lengths) ran the same seeds, else "
    "Welch's; ratios on the log scale), except collapse "
    "rates (C3, C4): "
    "Newcombe's score interval, which unlike a bootstrap stays wide when no run collapsed; n = runs per group. "
    "Claims are compared within each stratum of the other swept axes, never pooled across them; verdicts combine as: "
    + scorecard.STRATA_RULE
    + " (each claim's rule says what it was stratified on). How each verdict was read (its split, pairing and role) "
    "is under the headline; each claim's decision rule under this table, both collapsed."
)


def scorecard_section(
    cards: Sequence[scorecard.ClaimResult], gain: gain_.HeldOutGain, algorithms: tuple[pd.DataFrame, str] | None = None
) -> list[render.Block]:
    """The scorecard with its note on intervals and strata and its decision rules (collapsed), the held-out gain,
    the algorithm table, then the per-stratum verdicts when any claim has strata, and the power."""
    table = scorecard.scorecard_table(cards)
    out: list[render.Block] = [
        render.h(2, "Scorecard", anchor="scorecard"),
        render.p(SCORECARD_NOTE),
        render.ScorecardTable(tuple(cards), table.drop(columns=list(SHOWN_ELSEWHERE))),
        render.Details(
            "Decision rules: how each verdict is read off its numbers", (render.Table(table[["claim", "rule"]]),)
        ),
        *_gain_section(gain),
    ]
    if algorithms is not None and not algorithms[0].empty:
        out += [
            render.h(3, "Algorithms: mean, IQM and probability of improvement", anchor="algorithms"),
            render.p(algorithms[1]),
            render.Table(algorithms[0]),
        ]
    strata_df = scorecard.strata_table(cards)
    if not strata_df.empty:
        out += [render.h(3, "Per-stratum verdicts"), render.Table(strata_df)]
    return out + _power_section(cards)


def power_table(cards: Sequence[scorecard.ClaimResult]) -> pd.DataFrame:
    """One row per (claim, stratum) with a smallest-detectable-difference line (analysis/stats/power.py): the quantity,
    its estimate and 95% interval, the smallest |difference| these seeds detect, and the verdict."""
    rows = []
    for c in cards:
        sizes = scorecard.detectable_lines(c)
        for d in sizes:
            quantity = d.name.removeprefix(power.PREFIX + " |").split("|")[0]
            stratum = next((s for s in c.strata if (s.label if len(c.strata) > 1 else "") == d.stratum), None)
            e = next((e for e in (stratum.evidence if stratum else []) if e.name == quantity), None)
            rows.append(
                {
                    "claim": c.claim,
                    "stratum": d.stratum or "all runs",
                    "quantity": quantity,
                    "estimate": f"{e.estimate:.3g} [{e.low:.3g}, {e.high:.3g}]" if e else "",
                    "smallest detectable |difference|": f"{d.estimate:.3g}" if np.isfinite(d.estimate) else "n/a",
                    "seed SD, df": d.name.rsplit("seed SD ", 1)[-1].rstrip(")").split("; ")[0],
                    f"seeds per group to detect {power.TARGET:g}": _needed(d.name),
                    "n": d.n,
                    "verdict": stratum.verdict if stratum else "",
                }
            )
    return pd.DataFrame(rows)


def _needed(name: str) -> str:
    """The "TARGET needs N seeds" part of a detectable-difference line (power.sentence), or "n/a"."""
    tail = name.rsplit("; ", 1)[-1]
    return tail.split(" needs ")[1].split(" ")[0] if " needs " in tail else "n/a"


def _power_section(cards: Sequence[scorecard.ClaimResult]) -> list[render.Block]:
    """The smallest difference each stratum's seeds can detect (C5, C6's length part), from the measured seed noise."""
    t = power_table(cards)
    if t.empty:
        return []
    return [
        render.h(3, "Power: the smallest difference these seeds detect", anchor="power"),
        render.p(
            f"From the pooled seed standard deviation of each compared group's final-window reward: smallest "
            f"detectable |d| = (t(1 - {power.ALPHA:g}/2, df) + t({power.POWER:g}, df)) x SE(d), SE(d) = SD x "
            "sqrt(sum of w^2 / n) over the contrast's groups (analysis/stats/power.py). An inconclusive verdict means "
            "the effect, if any, is smaller than about this size; a difference of this size would have been detected "
            f"with probability {power.POWER:.0%}."
        ),
        render.Table(t),
    ]


__all__ = ["SCORECARD_NOTE", "gain_lines", "gain_table", "power_table", "scorecard_section"]
