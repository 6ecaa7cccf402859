"""The page a reader opens first: every claim C1-C6 with the paper's finding, and each study's result beside it.

Built from the reports already in a results folder (`python -m analysis claims RESULTS_DIR`): for every study with a
report, its headline table (`report/tables/headline.csv`, the rows of the report's headline), so the page holds no
number its study's report does not. A claim's row per study: the verdict (with its role where a comparison was
declared), the estimate with its interval, and the regime the study reached (natural, emulated, not reached, or the
claim not in the study); a study without a report is listed as not run here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.report import render
from analysis.report.headline import IN_A_FEW_WORDS, PAPER
from analysis.stats.verdicts import css_class
from runfiles import atomic as files

HEADLINE_CSV = "headline.csv"
"""The headline table a report writes under tables/ (one row per claim: analysis.report.headline.COLUMNS)."""
COLUMNS = ("claim", "in a few words", "paper", "study", "verdict", "this study: estimate [95% CI]", "regime")


@dataclass(frozen=True)
class Page:
    """What `write_claims_page` wrote, and from which studies."""

    html: Path
    markdown: Path
    studies: tuple[str, ...]
    """The studies whose headline the page holds, in name order."""
    unread: dict[str, str]
    """Study folder -> why its headline could not be read (no report yet, or a damaged table)."""


def regime_kind(regime: str) -> str:
    """The regime column's kind: "emulated" (an emulated regime reached), "not reached", "not in this study" (or
    "partly not in this study"), "natural" (reached by the runs as they are) or "—" (no precondition)."""
    text = regime.strip()
    if not text or text == "\u2014":
        return "\u2014"
    if "not in this study" in text:
        return text
    if text.startswith("not in regime"):
        return "not reached"
    return "emulated" if "emulated" in text else "natural"


def read_headlines(results_dir: str | os.PathLike[str]) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    """Every study's headline table under `results_dir` (study -> table), and the studies whose table is missing or
    unreadable (study -> why). A study is a folder holding run_ids.txt or a report."""
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results folder {root}: not a directory; valid: a results folder holding studies")
    found: dict[str, pd.DataFrame] = {}
    unread: dict[str, str] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "runs"):
        csv = folder / "report" / "tables" / HEADLINE_CSV
        if not (folder / "run_ids.txt").is_file() and not (folder / "report").is_dir():
            continue
        if not csv.is_file():
            unread[folder.name] = f"no {csv.relative_to(root)} (its report was not built by this version)"
            continue
        try:
            df = pd.read_csv(csv, dtype=str, keep_default_na=False)
        except (OSError, ValueError, pd.errors.ParserError) as err:
            unread[folder.name] = f"{csv.relative_to(root)}: unreadable ({err})"
            continue
        missing = [c for c in ("claim", "verdict", "regime") if c not in df.columns]
        if missing:
            unread[folder.name] = f"{csv.relative_to(root)}: no column(s) {', '.join(missing)}"
            continue
        found[folder.name] = df
    return found, unread


def claims_table(headlines: dict[str, pd.DataFrame]) -> render.Table:
    """A row per (claim, study), claims in order C1-C6 and studies by name; the verdict a coloured label."""
    rows, classes = [], []
    estimate = "this study: estimate [95% CI]"
    for claim in IN_A_FEW_WORDS:
        for study, df in headlines.items():
            row = df[df["claim"] == claim]
            if row.empty:
                continue
            r = row.iloc[0]
            kind = regime_kind(r["regime"])
            detail = r["regime"].split(": ", 1)[-1]  # the measured value and its threshold
            regime = kind if kind == "\u2014" or "not in this study" in kind else f"{kind}: {detail}"
            rows.append((claim, IN_A_FEW_WORDS[claim], PAPER[claim], study, r["verdict"], r.get(estimate, ""), regime))
            classes.append(css_class(r["verdict"].split(": ")[-1]))
    return render.Table(pd.DataFrame(rows, columns=list(COLUMNS)), ("verdict", tuple(classes)), "headline")


def write_claims_page(results_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Page:
    """Write claims.html and claims.md (default: into `results_dir`) from the studies' headline tables."""
    headlines, unread = read_headlines(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir)
    blocks: list[render.Block] = [
        render.p(
            "Each claim of the paper (GSPO vs GRPO on Mixture-of-Experts), what the paper found, and each study's "
            "result as its report's headline gives it: the verdict, the estimate the verdict was read off with its "
            "95% interval, and the regime the study reached. natural: the runs reached the claim's precondition as "
            "they are; emulated: reached through an emulation the study labels (e.g. the routing-volatility dial); "
            "not reached: the verdict is 'not tested in regime'. A verdict outside its regime is not a test."
        )
    ]
    if headlines:
        blocks.append(claims_table(headlines))
    else:
        blocks.append(render.p("No study in this results folder has a report yet."))
    if unread:
        blocks.append(render.h(2, "Studies without a readable headline"))
        blocks.append(render.Table(pd.DataFrame(sorted(unread.items()), columns=["study", "why"])))
    page, md = render.page("The paper's claims, study by study", blocks)
    return Page(files.write(out / "claims.html", page), files.write(out / "claims.md", md), tuple(headlines), unread)


def main(results_dir: str, out_dir: str | None) -> int:
    """`python -m analysis claims`: write the page and say what it holds."""
    try:
        page = write_claims_page(results_dir, out_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{page.html} ({len(page.studies)} studies: {', '.join(page.studies) or 'none'})")
    for study, why in page.unread.items():
        print(f"  {study}: not on the page: {why}")
    return 0


__all__: Sequence[str] = ["Page", "claims_table", "read_headlines", "regime_kind", "write_claims_page"]
