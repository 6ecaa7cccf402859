"""The study report: `results/<study>/report/index.html` (one self-contained page, figures embedded as base64 PNG)
and its Markdown twin `index.md`, rebuilt from run directories alone (nothing is rerun).

Contents: the study and its provenance (git sha, package versions, machine from the manifests; the config common to
every run, the swept axes, and every run with its axis values and state), the scorecard (analysis.scorecard; stratified
claims with their per-stratum verdicts), every figure with its caption and links to its PDF and SVG (analysis.figures;
skipped figures say why), the figures' tables (small ones inline, every one as CSV under `tables/`), and the
failed, collapsed and missing runs. Every file is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import figures, scorecard, stats, style, vocab
from analysis.tidy import ALGORITHM, EMULATED, RUN_ID, Study, load_study

MAX_INLINE_ROWS = 40
"""Tables longer than this are linked as CSV instead of printed."""


@dataclass
class Report:
    """What `build_report` wrote."""

    html: Path
    markdown: Path
    figures: dict[str, Path]
    """figure name -> PNG embedded in the page."""
    skipped: dict[str, str]
    scorecard: list[scorecard.ClaimResult]


def _atomic_write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _common_config(configs: Mapping[str, Mapping[str, Any]], axes: Sequence[str]) -> dict[str, Any]:
    """Flattened config keys with one value across every run (seed, algorithm and the swept axes excluded)."""
    items = list(configs.values())
    if not items:
        return {}
    out = {}
    for key in sorted({k for c in items for k in c}):
        if key in axes or key.rsplit(".", 1)[-1] in ("seed", "algorithm"):
            continue
        vals = {json.dumps(c.get(key), sort_keys=True, default=str) for c in items}
        if len(vals) == 1:
            out[key] = items[0].get(key)
    return out


def provenance(study: Study) -> dict[str, Any]:
    """What the manifests say: git shas, package versions, python, machine and host (each with its run count)."""
    mans = list(study.manifests.values())

    def count(key: str) -> dict[str, int]:
        return dict(Counter(str(m.get(key)) for m in mans if m.get(key) is not None))

    packages: dict[str, Counter[str]] = {}
    for m in mans:
        for name, ver in (m.get("packages") or {}).items():
            packages.setdefault(name, Counter())[str(ver)] += 1
    return {
        "git_sha": count("git_sha"),
        "python": count("python"),
        "machine": count("machine"),
        "host": count("host"),
        "cpu_count": count("cpu_count"),
        "packages": {k: dict(v) for k, v in sorted(packages.items())},
    }


def problem_runs(study: Study) -> pd.DataFrame:
    """Failed, collapsed (reported or detected in the reward) and unknown-state runs, plus missing run ids."""
    runs = study.runs
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "state", "last_step", "collapse_step", "reason"]
    detected: dict[str, Any] = {}
    if vocab.REWARD in study.metrics:
        coll = stats.collapse_table(study.long, runs, vocab.REWARD)
        detected = {
            str(r): (s, why)
            for r, s, why, c in zip(
                coll[RUN_ID], coll["detected_step"], coll["detected_reason"], coll["collapsed"], strict=True
            )
            if c
        }
    records = []
    for _, r in runs.iterrows():
        rid = str(r[RUN_ID])
        bad = r["state"] in ("failed", "collapsed", "unknown") or rid in detected
        if not bad:
            continue
        reason = r["error"] if r["state"] in ("failed", "unknown") else r["collapse_reason"]
        step = r["collapse_step"]
        if r["state"] not in ("failed", "collapsed", "unknown") and rid in detected:
            step, reason = detected[rid][0], f"detected: {detected[rid][1]}"
        rec = {c: r.get(c) for c in cols if c in runs.columns}
        rec.update(collapse_step=step, reason=reason)
        records.append(rec)
    for rid in study.missing:
        records.append({RUN_ID: rid, "state": "missing", "reason": "no run directory"})
    return pd.DataFrame.from_records(records, columns=cols)


def runs_table(study: Study) -> pd.DataFrame:
    """Every run: id, algorithm and its registry label, swept axes, seed, state, steps, precision emulation."""
    runs = study.runs
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "state", "last_step"]
    out = runs[[c for c in cols if c in runs.columns]].copy()
    labels = []
    for a in out[ALGORITHM]:
        try:
            labels.append(style.label(str(a)))
        except (KeyError, ValueError):  # an algorithm the registry does not know (an old run): its name
            labels.append(str(a))
    out.insert(2, "label", labels)
    if EMULATED in runs.columns and runs[EMULATED].notna().any():
        out[EMULATED] = runs[EMULATED]
    return out.reset_index(drop=True)


# --- rendering --------------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)


def _html_table(df: pd.DataFrame, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
        for row in df.itertuples(index=False, name=None)
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _md_cell(v: Any) -> str:
    return _fmt(v).replace("|", "\\|").replace("\n", " ")


def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)\n"
    lines = ["| " + " | ".join(_md_cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in df.itertuples(index=False, name=None)]
    return "\n".join(lines) + "\n"


def _kv(d: Mapping[str, Any]) -> pd.DataFrame:
    return pd.DataFrame({"key": list(d), "value": [json.dumps(v, default=str) for v in d.values()]})


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.85em}td,th{border:1px solid #ccc;padding:.2em .5em;
vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:.9em}
.supported{background:#e5f5e0}.contradicted{background:#fde0dd}.inconclusive{background:#f7f7f7}"""


def render(
    title: str,
    study: Study,
    cards: Sequence[scorecard.ClaimResult],
    rendered: figures.Rendered,
    problems: pd.DataFrame,
    table_files: Mapping[str, Path],
    out_dir: Path,
) -> tuple[str, str]:
    """The HTML page and its Markdown twin."""
    prov = provenance(study)
    common = _common_config(study.configs, study.axes)
    states = study.runs["state"].value_counts().to_dict()
    algs = sorted(study.runs[ALGORITHM].dropna().astype(str).unique())
    axes_vals = {a: sorted(map(str, study.runs[a].dropna().unique())) for a in study.axes}
    summary = {
        "runs": len(study.runs),
        "states": states,
        "missing": len(study.missing),
        "missing run ids": list(study.missing),
        "algorithms": algs,
        "swept axes": axes_vals,
    }
    if EMULATED in study.runs.columns and study.runs[EMULATED].notna().any():
        summary["runs with emulated precision"] = int(study.runs[EMULATED].fillna(False).sum())
    prov_rows = {k: v for k, v in prov.items() if k != "packages"}
    pk = pd.DataFrame(
        {"package": list(prov["packages"]), "versions (runs)": [json.dumps(v) for v in prov["packages"].values()]}
    )
    card_df = scorecard.scorecard_table(cards)
    strata_df = scorecard.strata_table(cards)
    runs_df = runs_table(study)

    h: list[str] = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        "<h2 id='study'>Study</h2>",
        _html_table(_kv(summary)),
        "<h2 id='provenance'>Provenance</h2>",
        _html_table(_kv(prov_rows)),
        "<h3>Packages</h3>",
        _html_table(pk),
        "<h3>Configuration common to every run</h3>",
        _html_table(_kv(common)),
        "<h3>Runs</h3>",
        _table_or_link(runs_df, table_files.get("runs"), out_dir, html_out=True),
        "<h2 id='scorecard'>Scorecard</h2>",
        f"<p>{html.escape(SCORECARD_NOTE)}</p>",
        '<table class="scorecard"><thead><tr><th>claim</th><th>statement</th><th>verdict</th><th>evidence</th>'
        "<th>rule</th></tr></thead><tbody>",
    ]
    for r, row in zip(cards, card_df.itertuples(index=False), strict=True):
        ev = "<br>".join(html.escape(str(e)) for e in r.evidence) or html.escape(r.reason)
        strata = f"<br><small>{html.escape(row.strata)}</small>" if row.strata else ""
        h.append(
            f'<tr class="{r.verdict}"><td>{r.claim}</td><td>{html.escape(r.statement)}</td>'
            f"<td>{html.escape(row.verdict)}{strata}</td><td>{ev}</td><td>{html.escape(r.rule)}</td></tr>"
        )
    h.append("</tbody></table>")
    if not strata_df.empty:
        h += ["<h3>Per-stratum verdicts</h3>", _html_table(strata_df)]
    m: list[str] = [
        f"# {title}\n",
        "## Study\n",
        _md_table(_kv(summary)),
        "## Provenance\n",
        _md_table(_kv(prov_rows)),
        "### Packages\n",
        _md_table(pk),
        "### Configuration common to every run\n",
        _md_table(_kv(common)),
        "### Runs\n",
        _table_or_link(runs_df, table_files.get("runs"), out_dir, html_out=False),
        "## Scorecard\n",
        SCORECARD_NOTE + "\n",
        _md_table(card_df),
    ]
    if not strata_df.empty:
        m += ["### Per-stratum verdicts\n", _md_table(strata_df)]

    h.append("<h2 id='figures'>Figures</h2>")
    m.append("## Figures\n")
    for name, paths in rendered.paths.items():
        png = next(p for p in paths if p.suffix == ".png")
        b64 = base64.b64encode(png.read_bytes()).decode("ascii")
        cap = rendered.captions[name]
        others = [p for p in paths if p.suffix != ".png"]
        links_h = " ".join(f"<a href='{p.relative_to(out_dir).as_posix()}'>{p.suffix[1:].upper()}</a>" for p in others)
        links_m = " ".join(f"[{p.suffix[1:].upper()}]({p.relative_to(out_dir).as_posix()})" for p in others)
        h.append(
            f"<figure id='{name}'><img alt='{html.escape(name)}' src='data:image/png;base64,{b64}'>"
            f"<figcaption>{html.escape(cap)} {links_h}</figcaption></figure>"
        )
        m.append(f"![{name}]({png.relative_to(out_dir).as_posix()})\n\n{cap} {links_m}\n")
        for tname, df in rendered.tables.get(name, {}).items():
            key = f"{name}.{tname}"
            link = table_files[key].relative_to(out_dir).as_posix()
            h.append(f"<h4>{html.escape(key)} (<a href='{link}'>CSV</a>)</h4>")
            m.append(f"#### {key} ([CSV]({link}))\n")
            if len(df) <= MAX_INLINE_ROWS:
                h.append(_html_table(df))
                m.append(_md_table(df))
            else:
                h.append(f"<p>{len(df)} rows: see the CSV.</p>")
                m.append(f"{len(df)} rows: see the CSV.\n")
    if rendered.skipped:
        sk = pd.DataFrame({"figure": list(rendered.skipped), "why skipped": list(rendered.skipped.values())})
        h += ["<h3>Figures not drawn</h3>", _html_table(sk)]
        m += ["### Figures not drawn\n", _md_table(sk)]
    none = "<p>None: every run completed and none was detected as collapsed; no run is missing.</p>"
    h += ["<h2 id='problems'>Failed, collapsed and missing runs</h2>", _html_table(problems) if len(problems) else none]
    m += ["## Failed, collapsed and missing runs\n", _md_table(problems) if len(problems) else none[3:-4] + "\n"]
    h.append("</body></html>")
    return "\n".join(h), "\n".join(m)


SCORECARD_NOTE = (
    "Intervals: 95% percentile bootstrap over seeds (independent per group); n = runs per group. Claims are "
    "compared within each stratum of the other swept axes, never pooled across them; verdicts combine as: "
    + scorecard.STRATA_RULE
    + " (each claim's rule says what it was stratified on)."
)


def _table_or_link(df: pd.DataFrame, csv: Path | None, out_dir: Path, *, html_out: bool) -> str:
    """The table inline when short, else a line linking its CSV."""
    if len(df) <= MAX_INLINE_ROWS or csv is None:
        return _html_table(df) if html_out else _md_table(df)
    link = csv.relative_to(out_dir).as_posix()
    return (
        f"<p>{len(df)} runs: see <a href='{link}'>the CSV</a>.</p>"
        if html_out
        else f"{len(df)} runs: see [the CSV]({link}).\n"
    )


def reuse_figures(
    study: Study, figures_dir: str | os.PathLike[str], out_dir: Path
) -> tuple[figures.Rendered, dict[str, Path]] | None:
    """The figures, captions and tables of a `python -m analysis figures` output, copied into `out_dir`, when they were
    drawn from the same data as `study` (`figures.data_fingerprint`); None (with the reason printed) otherwise.
    Also returns the CSV file of each table, "FIGURE.TABLE" -> path, to be copied byte for byte."""
    src = Path(figures_dir)
    try:
        index = json.loads((src / figures.INDEX).read_text())
    except (OSError, ValueError) as exc:
        print(f"figures in {src} not reused ({exc}): drawing them")
        return None
    if "data" not in index:
        print(f"figures in {src} carry no data fingerprint (written by an older version): drawing them")
        return None
    if index["data"] != figures.data_fingerprint(study):
        print(f"figures in {src} were drawn from other runs: drawing them")
        return None
    entries = index.get("figures", {})
    needed = [src / f for e in entries.values() for f in e["files"]]
    needed += [src / rel for e in entries.values() for rel in e.get("tables", {}).values()]
    if any(not p.is_file() for p in needed):
        print(f"figures in {src} are incomplete: drawing them")
        return None
    rendered = figures.Rendered({}, {}, {}, dict(index.get("skipped", {})))
    sources: dict[str, Path] = {}
    for name, entry in entries.items():
        rendered.paths[name] = [_atomic_write(out_dir / f, (src / f).read_bytes()) for f in entry["files"]]
        rendered.captions[name] = entry["caption"]
        rendered.tables[name] = {}
        for tname, rel in entry.get("tables", {}).items():
            sources[f"{name}.{tname}"] = src / rel
            rendered.tables[name][tname] = pd.read_csv(src / rel, float_precision="round_trip")
    return rendered, sources


def build_report(
    study: Study,
    out_dir: str | os.PathLike[str],
    *,
    title: str = "study",
    figures_dir: str | os.PathLike[str] | None = None,
) -> Report:
    """Write index.html, index.md, figures/ and tables/ for `study` under `out_dir`; returns what was written.

    `figures_dir`: a `python -m analysis figures` output; its files and tables are copied when they were drawn from
    the same data (`reuse_figures`), else the figures are drawn again (the study workflow's report rule passes its
    figures rule's output, so nothing is drawn twice)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reused = reuse_figures(study, figures_dir, out / "figures") if figures_dir is not None else None
    rendered, sources = reused if reused is not None else (figures.make_all(study, out / "figures"), {})
    table_files: dict[str, Path] = {}
    for name, tables in rendered.tables.items():
        for tname, df in tables.items():
            key = f"{name}.{tname}"
            data = sources[key].read_bytes() if key in sources else df.to_csv(index=False)
            table_files[key] = _atomic_write(out / "tables" / f"{key}.csv", data)
    table_files["runs"] = _atomic_write(out / "tables" / "runs.csv", runs_table(study).to_csv(index=False))
    cards = scorecard.scorecard(study)
    _atomic_write(out / "tables" / "scorecard.csv", scorecard.scorecard_table(cards).to_csv(index=False))
    _atomic_write(out / "tables" / "scorecard_strata.csv", scorecard.strata_table(cards).to_csv(index=False))
    problems = problem_runs(study)
    _atomic_write(out / "tables" / "problem_runs.csv", problems.to_csv(index=False))
    page, md = render(f"Report: {title}", study, cards, rendered, problems, table_files, out)
    html_path = _atomic_write(out / "index.html", page)
    md_path = _atomic_write(out / "index.md", md)
    pngs = {n: next(p for p in ps if p.suffix == ".png") for n, ps in rendered.paths.items()}
    return Report(html_path, md_path, pngs, dict(rendered.skipped), cards)


def study_run_ids(results_dir: str | os.PathLike[str], study: str | None) -> list[str] | None:
    """Run ids of study `study`: listed in `results_dir/<study>/run_ids.txt` (one a line) or `study.json`
    ({"run_ids": [...]}) when either exists; otherwise None (every run under results_dir/runs)."""
    if not study:
        return None
    base = Path(results_dir) / study
    txt, js = base / "run_ids.txt", base / "study.json"
    if txt.is_file():
        return [line.strip() for line in txt.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if js.is_file():
        ids: Iterable[str] = json.loads(js.read_text()).get("run_ids", [])
        return [str(i) for i in ids]
    return None


def report_from_results(
    results_dir: str | os.PathLike[str],
    *,
    study: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    figures_dir: str | os.PathLike[str] | None = None,
) -> Report:
    """Load the study's runs from `results_dir` and write its report (default `results_dir/<study>/report`);
    `figures_dir`: see `build_report`."""
    name = study or "all"
    st = load_study(results_dir, study_run_ids(results_dir, study))
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / name / "report"
    return build_report(st, out, title=name, figures_dir=figures_dir)


__all__ = [
    "Report",
    "build_report",
    "problem_runs",
    "provenance",
    "report_from_results",
    "reuse_figures",
    "runs_table",
    "study_run_ids",
]
