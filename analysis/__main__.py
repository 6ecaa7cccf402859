"""`python -m analysis collect|figures|report`: the analysis steps of the study workflow, each runnable by hand.

    python -m analysis collect STATUS.json ... --study NAME --out FILE  # these run directories' ids -> FILE
    python -m analysis figures RESULTS_DIR --study NAME --out DIR       # the study's figures -> DIR (nothing is rerun)
    python -m analysis report RESULTS_DIR --study NAME [--out DIR] [--figures DIR]  # -> RESULTS_DIR/NAME/report/
    python -m analysis claims RESULTS_DIR [--out DIR]  # every claim, each study's headline -> RESULTS_DIR/claims.html

A study's runs are those listed in RESULTS_DIR/NAME/run_ids.txt (what `collect` writes) or study.json; without
--study, every run under RESULTS_DIR/runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import runfiles
from analysis.stats.regime import MAX_TRUNCATION, MIN_MISMATCH, MIN_VOLATILITY
from runfiles import atomic as files
from runfiles.bounded import read_json

CAPTIONS = "captions"
"""Subdirectory of a `figures` output holding one reStructuredText caption per figure (NAME.rst)."""


def rst_escape(text: str) -> str:
    """`text` as one reStructuredText paragraph that renders verbatim: every character but ASCII letters, digits and
    whitespace backslash-escaped, so no `*`, backtick, `_`, `|` or leading `1.` is read as markup."""
    return re.sub(r"([^0-9A-Za-z\s])", r"\\\1", " ".join(text.split()))


def collect(out: str | os.PathLike[str], run_files: Sequence[str], *, study: str) -> Path:
    """Write the run ids of `run_files` (each a run's status.json or the workflow's marker beside it,
    RESULTS/runs/RUN_ID/workflow.done), in the given order, to `out`, one a line after a `# study NAME` header; print
    how many runs ended in each state (their status.json)."""
    ids, states = [], Counter()
    for path in map(Path, run_files):
        if path.name not in (runfiles.STATUS, runfiles.DONE):
            raise SystemExit(f"collect: {path} is not a run's {runfiles.STATUS} or {runfiles.DONE}")
        ids.append(path.parent.name)
        try:
            states[str(read_json(path.parent / runfiles.STATUS).get("state", "unknown"))] += 1
        except (OSError, ValueError, AttributeError):
            states["unreadable"] += 1
    unique = list(dict.fromkeys(ids))
    written = files.write(Path(out), f"# study {study}: {len(unique)} run(s)\n" + "".join(f"{r}\n" for r in unique))
    summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none"
    print(f"{len(unique)} run id(s) of study {study} ({summary}) -> {written}")
    return written


def make_figures(results_dir: str, *, study: str | None, out_dir: str | os.PathLike[str]) -> Path:
    """Render the study's figures into `out_dir` (analysis.figures.make_all: PNG, PDF, SVG), one caption per figure
    under `out_dir/captions/NAME.rst` and the index `out_dir/figures.json`; return the index's path."""
    from analysis import figures
    from analysis.runs import results

    out = Path(out_dir)
    st = results.load(results_dir, study)
    say_not_read(st)
    rendered = figures.make_all(st, out)
    for name, caption in rendered.captions.items():
        files.write(out / CAPTIONS / f"{name}.rst", rst_escape(caption) + "\n")
    tables = {
        name: {
            t: files.write(out / figures.TABLES / f"{name}.{t}.csv", df.to_csv(index=False)).relative_to(out)
            for t, df in dfs.items()
        }
        for name, dfs in rendered.tables.items()
    }
    entries = {
        name: {
            "files": [p.name for p in paths],
            "caption": rendered.captions[name],
            "tables": {t: rel.as_posix() for t, rel in tables.get(name, {}).items()},
        }
        for name, paths in rendered.paths.items()
    }
    index = {
        "study": study or "all",
        "data": figures.data_fingerprint(st),
        "figures": entries,
        "skipped": dict(rendered.skipped),
        "missing": list(st.missing),
        "unreadable": dict(zip(st.unreadable["run_id"], st.unreadable["reason"], strict=True)),
    }
    path = files.write(out / figures.INDEX, json.dumps(index, indent=1) + "\n")
    for name, why in rendered.skipped.items():
        stale = [
            out / CAPTIONS / f"{name}.rst",
            *(out / f"{name}.{ext}" for ext in ("png", "pdf", "svg")),
            *(out / figures.TABLES).glob(f"{name}.*.csv"),
        ]
        for old in stale:
            old.unlink(missing_ok=True)  # drawn by an earlier call into this directory, no longer valid
        print(f"skipped {name}: {why}")
    print(f"{len(rendered.paths)} figure(s) -> {out}")
    return path


def say_not_read(st: Any) -> None:
    """Print every run of the study that could not be read (with the reason) or is missing, to stderr."""
    for rid, why in zip(st.unreadable["run_id"], st.unreadable["reason"], strict=True):
        print(f"run {rid} not read: {why}", file=sys.stderr)
    for rid in st.missing:
        print(f"run {rid} missing: no run directory", file=sys.stderr)


def check_comparisons(sweep: str) -> None:
    """The comparisons sweep file `sweep` declares can be read (analysis.claims.declared.from_sweep), or ValueError
    naming the file and the entry."""
    from analysis.claims import declared

    try:
        declared.from_sweep(sweep)
    except TypeError as err:  # `comparisons:` that is no list
        raise ValueError(
            f"sweep file {sweep}: comparisons: {err}; valid: a list of comparisons (sweeps.schema.COMPARISON_FIELDS)"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m analysis", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    study_help = "study name: its runs are listed in RESULTS_DIR/NAME/run_ids.txt or study.json"

    col = sub.add_parser("collect", help="write the run ids of the given run directories' files")
    col.add_argument(
        "status", nargs="*", help="RESULTS_DIR/runs/RUN_ID/status.json (or workflow.done) of every run of the study"
    )
    col.add_argument("--study", required=True, help="study name (written in the file's header)")
    col.add_argument("--out", required=True, help="output file (RESULTS_DIR/<study>/run_ids.txt)")

    fig = sub.add_parser("figures", help="render the study's figures (PNG, PDF, SVG) with their captions")
    fig.add_argument("results_dir", help="the results directory (holding runs/{run_id}/)")
    fig.add_argument("--study", default=None, help=study_help)
    fig.add_argument("--out", required=True, help="output directory (the workflow's: RESULTS_DIR/<study>/figures)")

    rep = sub.add_parser("report", help="rebuild results/<study>/report/index.html (+ index.md) from run directories")
    rep.add_argument("results_dir", help="the results directory (holding runs/{run_id}/)")
    rep.add_argument("--study", default=None, help=study_help)
    rep.add_argument("--out", default=None, help="output directory (default RESULTS_DIR/<study or 'all'>/report)")
    rep.add_argument(
        "--figures",
        default=None,
        help="a `figures` output drawn from the same runs: its files and tables are copied instead of "
        "drawn again (drawn again if its runs differ)",
    )
    rep.add_argument(
        "--sweep",
        default=None,
        help="the study's sweep file: the report shows its description and the "
        "study's notes, docs/studies/<sweep stem>.md (what was chosen and why)",
    )
    rep.add_argument("--doc", default=None, help="the study's notes (Markdown) when not docs/studies/<sweep stem>.md")
    rep.add_argument(
        "--min-volatility",
        type=float,
        default=MIN_VOLATILITY,
        metavar="FRACTION",
        help="C3, C4 are tested only where the compared runs' routing volatility per update "
        "(routing_slot_mismatch_mb2: the change after one update, the paper's unit, ~0.1 in the paper) "
        "reaches this fraction of expert slots (default %(default)g)",
    )
    rep.add_argument(
        "--min-mismatch",
        type=float,
        default=MIN_MISMATCH,
        metavar="NATS",
        help="C5 is tested only where the compared runs' engine/trainer mismatch (mismatch_mean_abs, "
        "nats per response token) reaches this (default %(default)g)",
    )
    rep.add_argument(
        "--max-truncation",
        type=float,
        default=MAX_TRUNCATION,
        metavar="FRACTION",
        help="C6's length part is tested only where the shortest compared budget cuts at most this fraction of "
        "rollout responses (truncation_rate) (default %(default)g)",
    )
    cla = sub.add_parser("claims", help="write RESULTS_DIR/claims.html (+ .md): every claim, each study's verdict")
    cla.add_argument("results_dir")
    cla.add_argument("--out", default=None, help="folder for claims.html and claims.md (default: RESULTS_DIR)")
    args = parser.parse_args(argv)

    if args.command == "collect":
        collect(args.out, args.status, study=args.study)
        return 0
    if args.command == "claims":
        from analysis.report import claims_page

        return claims_page.main(args.results_dir, args.out)
    from analysis.runs.results import check_study

    try:
        check_study(args.results_dir, args.study)  # before anything is written
        if args.command == "report" and args.sweep is not None:
            check_comparisons(args.sweep)  # before any figure is drawn
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    if args.command == "figures":
        make_figures(args.results_dir, study=args.study, out_dir=args.out)
        return 0
    from analysis.claims.scorecard import Rules
    from analysis.report import build as report

    try:
        rules = Rules(args.min_volatility, args.min_mismatch, args.max_truncation)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = report.report_from_results(
        args.results_dir,
        study=args.study,
        out_dir=args.out,
        figures_dir=args.figures,
        sweep=args.sweep,
        doc=args.doc,
        rules=rules,
    )
    from analysis.report import sections

    asked, gone = sections.not_read(result.study)
    if gone:
        print(f"{gone} of {asked} run(s) not read (listed in the report with the reason):", file=sys.stderr)
        say_not_read(result.study)
    print(result.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
