"""The study report: `results/<study>/report/index.html` (one self-contained page, figures embedded as base64 PNG)
and its Markdown twin `index.md`, rebuilt from run directories alone (nothing is rerun), with its tables as CSV under
`tables/` and the figures (PNG, PDF, SVG) under `figures/`.

What the report shows is analysis.report.headline (the claims at a glance), analysis.report.evidence (the scorecard
behind them) and analysis.report.sections (the rest); how a block is written as HTML and Markdown,
analysis.report.render; where a study's runs, figures, side tables and notes are found, analysis.runs.results. This
module puts them together: `build_report` for a loaded study, `report_from_results` for a results directory. Every file
is written atomically (runfiles.atomic); the report is written whatever the runs hold: a run that cannot be read is
listed with the reason and counted under the headline, never a crash.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import figures
from analysis.claims import declared, scorecard
from analysis.figures import claims_forest, style
from analysis.report import evidence, headline, render, sections
from analysis.runs import results
from analysis.runs.tidy import Study
from analysis.stats import gain
from runfiles import atomic as files
from runfiles.bounded import read_json


@dataclass
class Report:
    """What `build_report` wrote."""

    html: Path
    markdown: Path
    figures: dict[str, Path]
    """figure name -> PNG embedded in the page (the study's figures, then the claims' forest under the headline)."""
    skipped: dict[str, str]
    scorecard: list[scorecard.ClaimResult]
    study: Study
    """The study the report was built from (its `unreadable` and `missing` runs included)."""


def blocks(
    study: Study,
    cards: Sequence[scorecard.ClaimResult],
    rendered: figures.Rendered,
    problems: pd.DataFrame,
    table_files: dict[str, Path],
    out_dir: Path,
    heldout: gain.HeldOutGain,
    budgets: pd.DataFrame | None = None,
    parity: pd.DataFrame | None = None,
    notes: results.StudyNotes | None = None,
    rules: scorecard.Rules = scorecard.RULES,
    algorithms: tuple[pd.DataFrame, str] | None = None,
    forest: render.Figure | None = None,
) -> list[render.Block]:
    """The page, section by section: a line on the study and the headline (every claim's verdict on the first
    screen, over the claims' `forest` figure), the outcome along off-policy updates over its figure (when drawn),
    Figures 1-3, the scorecard; the provenance, configuration and runs last."""
    main = sections.figure_blocks(rendered, sections.MAIN_FIGURES, out_dir)
    return [
        sections.lead(study),
        *headline.headline_section(cards, study, forest, rules),
        *sections.offpolicy_section(rendered, out_dir, rules.min_volatility),
        *([render.h(2, "Figures 1-3", anchor="main-figures"), *main] if main else []),
        *sections.routing_section(rendered, cards, out_dir),
        *sections.budget_section(budgets),
        *evidence.scorecard_section(cards, heldout, algorithms),
        *sections.parity_section(parity),
        *sections.signal_section(study),
        *sections.setup_section(notes),
        *sections.figures_section(rendered, table_files, out_dir),
        *sections.problems_section(problems, sections.cleared_runs(study)),
        *sections.study_section(study, table_files, out_dir),
    ]


def build_report(
    study: Study,
    out_dir: str | os.PathLike[str],
    *,
    title: str = "study",
    figures_dir: str | os.PathLike[str] | None = None,
    budgets: pd.DataFrame | None = None,
    parity: pd.DataFrame | None = None,
    sweep: str | os.PathLike[str] | None = None,
    doc: str | os.PathLike[str] | None = None,
    rules: scorecard.Rules = scorecard.RULES,
) -> Report:
    """Write index.html, index.md, figures/ and tables/ for `study` under `out_dir`; returns what was written.

    `figures_dir`: a `python -m analysis figures` output; its files and tables are copied when they were drawn from
    the same data (`results.reuse_figures`), else the figures are drawn again (the study workflow's report rule passes
    its figures rule's output, so nothing is drawn twice). `sweep`: the study's sweep file, whose description and
    notes (`doc`, by default docs/studies/<sweep stem>.md: `results.study_notes`) the report shows and whose declared
    comparisons (`comparisons:`) decide their claims (`scorecard.with_declared`). `rules`: the
    scorecard's thresholds (the regimes of C3-C5)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reused = reuse_figures(study, figures_dir, out / "figures") if figures_dir is not None else None
    rendered, sources = reused if reused is not None else (figures.make_all(study, out / "figures"), {})
    table_files: dict[str, Path] = {}
    for name, tables in rendered.tables.items():
        for tname, df in tables.items():
            key = f"{name}.{tname}"
            data = sources[key].read_bytes() if key in sources else df.to_csv(index=False)
            table_files[key] = files.write(out / "tables" / f"{key}.csv", data)
    table_files["runs"] = files.write(out / "tables" / "runs.csv", sections.runs_table(study).to_csv(index=False))
    comparisons = declared.from_sweep(sweep) if sweep is not None else []
    cards = scorecard.scorecard(study, rules, comparisons)
    heldout = gain.heldout_gain(study)
    problems = sections.problem_runs(study)
    algorithms = sections.algorithm_table(study, heldout)
    for name, df in (
        ("algorithms", algorithms[0] if not algorithms[0].empty else None),
        ("scorecard", scorecard.scorecard_table(cards)),
        ("headline", headline.headline_table(cards, rules).df),
        ("heldout_gain", heldout.table),
        ("scorecard_strata", scorecard.strata_table(cards)),
        ("problem_runs", problems),
        ("coldstart_budgets", budgets),
        ("precision_parity", parity),
    ):
        if df is not None and (name not in ("coldstart_budgets", "precision_parity") or not df.empty):
            files.write(out / "tables" / f"{name}.csv", df.to_csv(index=False))
    notes = results.study_notes(sweep, doc) if sweep is not None else None
    made = claims_forest.claims_forest(cards)
    drawn = figures.Rendered(
        {made.name: style.save(made.fig, out / "figures" / made.name)}, {made.name: made.caption}, {}, {}
    )
    (forest,) = sections.figure_blocks(drawn, [made.name], out)
    page, md = render.page(
        f"Report: {title}",
        blocks(
            study,
            cards,
            rendered,
            problems,
            table_files,
            out,
            heldout,
            budgets,
            parity,
            notes,
            rules,
            algorithms,
            forest,
        ),
    )
    html_path = files.write(out / "index.html", page)
    md_path = files.write(out / "index.md", md)
    pngs = {n: next(p for p in ps if p.suffix == ".png") for n, ps in (rendered.paths | drawn.paths).items()}
    return Report(html_path, md_path, pngs, dict(rendered.skipped), cards, study)


def report_from_results(
    results_dir: str | os.PathLike[str],
    *,
    study: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    figures_dir: str | os.PathLike[str] | None = None,
    sweep: str | os.PathLike[str] | None = None,
    doc: str | os.PathLike[str] | None = None,
    rules: scorecard.Rules = scorecard.RULES,
) -> Report:
    """Load the study's runs from `results_dir` (`results.load`: runs that cannot be read set aside with the reason)
    and write its report (default `results_dir/<study>/report`); `figures_dir`, `sweep`, `doc`, `rules`: see
    `build_report`."""
    name = study or "all"
    st = results.load(results_dir, study)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / name / "report"
    return build_report(
        st,
        out,
        title=name,
        figures_dir=figures_dir,
        budgets=results.budget_tables(results_dir, study),
        parity=results.parity_table(results_dir, study),
        sweep=sweep,
        doc=doc,
        rules=rules,
    )


__all__ = ["Report", "blocks", "build_report", "report_from_results"]


def reuse_figures(
    study: Study, figures_dir: str | os.PathLike[str], out_dir: Path
) -> tuple[figures.Rendered, dict[str, Path]] | None:
    """The figures, captions and tables of a `python -m analysis figures` output, copied into `out_dir`, when they were
    drawn from the same data as `study` (`figures.data_fingerprint`); None (with the reason printed) otherwise.
    Also returns the CSV file of each table, "FIGURE.TABLE" -> path, to be copied byte for byte."""
    src = Path(figures_dir)
    try:
        index = read_json(src / figures.INDEX)
        data, entries, skipped = index["data"], index["figures"], index["skipped"]
    except (OSError, ValueError) as exc:
        print(f"figures in {src} not reused ({exc}): drawing them")
        return None
    except KeyError as exc:
        print(f"figures in {src} not reused ({figures.INDEX} has no {exc}): drawing them")
        return None
    if data != figures.data_fingerprint(study):
        print(f"figures in {src} were drawn from other runs: drawing them")
        return None
    needed = [src / f for e in entries.values() for f in e["files"]]
    needed += [src / rel for e in entries.values() for rel in e["tables"].values()]
    if any(not p.is_file() for p in needed):
        print(f"figures in {src} are incomplete: drawing them")
        return None
    rendered = figures.Rendered({}, {}, {}, dict(skipped))
    sources: dict[str, Path] = {}
    for name, entry in entries.items():
        rendered.paths[name] = [files.write(out_dir / f, (src / f).read_bytes()) for f in entry["files"]]
        rendered.captions[name] = entry["caption"]
        rendered.tables[name] = {}
        for tname, rel in entry["tables"].items():
            sources[f"{name}.{tname}"] = src / rel
            rendered.tables[name][tname] = pd.read_csv(src / rel, **results.CSV_EXACT)
    return rendered, sources
