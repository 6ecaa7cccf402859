"""Finding a study's results on disk: which runs it has (`study_run_ids`, `studies`, `check_study`), loading them with
the runs that cannot be read set aside with the reason (`load`), the tables other workflow rules wrote beside them
(`budget_tables`, `parity_table`), and the study's notes (`study_notes`: the sweep file's description and
docs/studies/<sweep stem>.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.runs import names, tidy
from analysis.runs.tidy import Study
from runfiles.bounded import read_json, read_yaml

CSV_EXACT: dict[str, Any] = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
"""read_csv arguments that read back exactly the floats `to_csv` wrote: pandas 3's default parser does (and warns
that float_precision is deprecated, Pandas4Warning); pandas 2's needs float_precision="round_trip"."""


def study_run_ids(results_dir: str | os.PathLike[str], study: str | None) -> list[str] | None:
    """Run ids of study `study`: listed in `results_dir/<study>/run_ids.txt` (one a line) or `study.json`
    ({"run_ids": [...]}) when either exists, else the resolved configs `results_dir/<study>/configs/RUN_ID.yaml`
    (a workflow that stopped on a failed run has them but no run_ids.txt); otherwise None (every run under
    results_dir/runs)."""
    if not study:
        return None
    base = Path(results_dir) / study
    txt, js = base / "run_ids.txt", base / "study.json"
    if txt.is_file():
        return [line.strip() for line in txt.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if js.is_file():
        ids: Iterable[str] = read_json(js).get("run_ids", [])
        return [str(i) for i in ids]
    configs = sorted((base / "configs").glob("*.yaml"))
    if configs:
        return [c.stem for c in configs]
    return None


def studies(results_dir: str | os.PathLike[str]) -> list[str]:
    """The studies under `results_dir`: folders holding run_ids.txt, study.json or configs/."""
    root = Path(results_dir)
    marks = ("run_ids.txt", "study.json", "configs")
    return sorted(d.name for d in root.iterdir() if d.is_dir() and any((d / m).exists() for m in marks))


def check_study(results_dir: str | os.PathLike[str], study: str | None) -> None:
    """A results directory and study name that `report`/`figures` can use, or ValueError saying what is wrong:
    a missing results directory, a name that is a path, or a study that is not there (the valid ones listed)."""
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results directory {results_dir}: no such directory")
    if study is None:
        return
    if not study or study in (".", "..") or "/" in study or "\\" in study or study.startswith("."):
        raise ValueError(f"--study {study!r}: a study name, not a path (the folder RESULTS_DIR/NAME)")
    if study_run_ids(root, study) is None:
        known = studies(root)
        raise ValueError(
            f"--study {study!r}: no such study in {results_dir} (no {study}/run_ids.txt, study.json or "
            f"configs/); valid: {', '.join(known) or 'none yet'}"
        )


def budget_tables(results_dir: str | os.PathLike[str], study: str | None) -> pd.DataFrame | None:
    """The study's cold-start budget tables (results/<study>/coldstart_budgets/*.csv, written by the Snakemake rule
    coldstart_budgets), concatenated; None when there are none."""
    if not study:
        return None
    tables = sorted((Path(results_dir) / study / "coldstart_budgets").glob("*.csv"))
    return pd.concat([pd.read_csv(f) for f in tables], ignore_index=True) if tables else None


def load(results_dir: str | os.PathLike[str], study: str | None = None, *, warn_missing: bool = True) -> Study:
    """The study's runs (`study_run_ids`), each run that cannot be read set aside in `Study.unreadable` with the
    reason (`tidy.unreadable_reason`: a config that cannot be read or names no registered algorithm, an unreadable
    status.json, a metrics.parquet that cannot be read), never dropped silently and never a crash."""
    known = set(names.registry().names())
    return tidy.load_study(
        results_dir,
        study_run_ids(results_dir, study),
        warn_missing=warn_missing,
        unreadable=lambda record: tidy.unreadable_reason(record, known),
    )


def parity_table(results_dir: str | os.PathLike[str], study: str | None) -> pd.DataFrame | None:
    """The study's precision parity table (results/<study>/precision_parity.csv, written by the Snakemake rule
    precision_parity); None when there is none."""
    if not study:
        return None
    path = Path(results_dir) / study / "precision_parity.csv"
    return pd.read_csv(path) if path.is_file() else None


STUDY_DOCS = Path("docs") / "studies"
"""Where a study's notes live, relative to the folder above the sweep file's (the repository root for
sweeps/NAME.yaml): docs/studies/NAME.md."""


@dataclass(frozen=True)
class StudyNotes:
    """What the report says about how a study was set up: the sweep file's description and the study's notes."""

    sweep: str
    """The sweep file's name (sweeps/default.yaml -> "default.yaml")."""
    description: str
    doc: str
    """Where the notes are looked for, relative to the repository ("docs/studies/default.md")."""
    text: str | None
    """The notes (Markdown), None when they cannot be read."""
    why_missing: str = ""


def study_notes(sweep: str | os.PathLike[str], doc: str | os.PathLike[str] | None = None) -> StudyNotes:
    """The description of sweep file `sweep` and the study's notes, `doc` or by default docs/studies/<sweep stem>.md
    beside the sweep file's folder; a missing or unreadable file is said, never raised."""
    import yaml

    path = Path(sweep)
    description = ""
    try:
        data = read_yaml(path)
        description = str(data.get("description", "")) if isinstance(data, dict) else ""
    except (OSError, ValueError, yaml.YAMLError) as exc:
        description = f"(the sweep file cannot be read: {type(exc).__name__})"
    rel = STUDY_DOCS / f"{path.stem}.md"
    where = Path(doc) if doc is not None else path.resolve().parent.parent / rel
    shown = str(rel) if doc is None else Path(doc).name
    try:
        return StudyNotes(path.name, description, shown, where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return StudyNotes(path.name, description, shown, None, f"{shown} does not exist")
    except (OSError, UnicodeDecodeError) as exc:
        return StudyNotes(path.name, description, shown, None, f"{shown} cannot be read ({type(exc).__name__})")


__all__ = [
    "CSV_EXACT",
    "STUDY_DOCS",
    "StudyNotes",
    "budget_tables",
    "check_study",
    "load",
    "parity_table",
    "studies",
    "study_notes",
    "study_run_ids",
]
