"""The study report: `results/<study>/report/index.html` (one self-contained page, figures embedded as base64 PNG)
and its Markdown twin `index.md`, rebuilt from run directories alone (nothing is rerun). Both are written from one
list of blocks (headings, paragraphs, tables, figures, the scorecard), each of which writes itself as HTML and as
Markdown, so the two cannot list different contents.

Contents, in the order a reader needs them: a line on the study; the headline (one line per claim C1-C6: its
verdict and the number it was decided on); Figures 1-3; the scorecard (analysis.scorecard; rules, evidence with
intervals, per-stratum verdicts); the other figures (analysis.figures; each with its caption and links to its PDF and
SVG; skipped figures say why); the figures' tables (small ones inline, every one as CSV under `tables/`); the failed,
collapsed and missing runs with the rule that flagged each; and at the end the study and its provenance (git sha,
package versions, machine from the manifests; the config common to every run, the swept axes, and every run with its
axis values and state). Values are written as text ("completed 12"), never as JSON. Every file is written atomically
(temporary file, then rename).
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

import numpy as np
import pandas as pd

from analysis import figures, files, power, scorecard, stats, style, vocab
from analysis.tidy import ALGORITHM, EMULATED, METRIC, RUN_ID, STEP, VALUE, Study, load_study

MAX_INLINE_ROWS = 40
CSV_EXACT: dict[str, Any] = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
"""read_csv arguments that read back exactly the floats `to_csv` wrote: pandas 3's default parser does (and warns
that float_precision is deprecated, Pandas4Warning); pandas 2's needs float_precision="round_trip"."""
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
    return files.write_text(path, data) if isinstance(data, str) else files.write_bytes(path, data)


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
    """Failed, collapsed (reported in status.json or flagged by analysis's rules on the reward) and unknown-state
    runs, plus missing run ids; `flagged_by` says which: "error", "status.json" (the trainer's own guard: non-finite
    loss, exploding ratio, reward floor), or the analysis rule (stats.NON_FINITE, FLOOR, DROP)."""
    runs = study.runs
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "state", "last_step", "flagged_by", "collapse_step", "reason"]
    detected: dict[str, tuple[Any, Any, Any]] = {}
    if vocab.REWARD in study.metrics:
        coll = stats.collapse_table(study.long, runs, vocab.REWARD)
        detected = {
            str(r): (s, why, rule)
            for r, s, why, rule in zip(
                coll[RUN_ID], coll["detected_step"], coll["detected_reason"], coll["detected_rule"], strict=True
            )
            if rule
        }
    records = []
    for _, r in runs.iterrows():
        rid = str(r[RUN_ID])
        if r["state"] in ("failed", "unknown"):
            flagged, step, reason = "error", r["collapse_step"], r["error"]
        elif r["state"] == "collapsed":
            flagged, step, reason = "status.json", r["collapse_step"], r["collapse_reason"]
        elif rid in detected:
            step, reason, rule = detected[rid]
            flagged = f"analysis: {rule}"
        else:
            continue
        rec = {c: r.get(c) for c in cols if c in runs.columns}
        rec.update(flagged_by=flagged, collapse_step=step, reason=reason)
        records.append(rec)
    order = {a: i for i, a in enumerate(style_order({str(r.get(ALGORITHM)) for r in records}))}
    records.sort(key=lambda r: (str(r["state"]), order.get(str(r.get(ALGORITHM)), 0), *(str(r.get(c)) for c in cols)))
    for rid in study.missing:
        records.append({RUN_ID: rid, "state": "missing", "reason": "no run directory"})
    return pd.DataFrame.from_records(records, columns=cols)


def cleared_runs(study: Study) -> pd.DataFrame:
    """Runs whose reward fell by the per-run drop rule but which the seed-band check did not flag (stats.COLLAPSE_RULE):
    run_id, algorithm, the swept axes, seed, why (the band and the run's last-window mean)."""
    cols = [RUN_ID, ALGORITHM, *study.axes, "seed", "why not flagged"]
    if vocab.REWARD not in study.metrics:
        return pd.DataFrame(columns=cols)
    coll = stats.collapse_table(study.long, study.runs, vocab.REWARD)
    coll = coll[coll["in_band"].astype(bool)]
    keep = [c for c in [RUN_ID, *study.axes, "seed"] if c in study.runs.columns]
    out = coll[[RUN_ID, ALGORITHM, "in_band"]].merge(study.runs[keep], on=RUN_ID, how="left")
    out = out.rename(columns={"in_band": "why not flagged"})
    return out[[c for c in cols if c in out.columns]].reset_index(drop=True)


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
        return "" if pd.isna(v) else f"{v:.4g}"
    if v is None or v is pd.NA:
        return ""
    return _text(v)


LONG_CELL = 60
"""Cells with more characters than this get a minimum width (class "long"), so that a wide table scrolls sideways
rather than squeezing its text columns to one word per line."""


def _html_table(df: pd.DataFrame, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)

    def cell(v: Any) -> str:
        text = _fmt(v)
        long = " class='long'" if len(text) > LONG_CELL else ""
        return f"<td{long}>{html.escape(text)}</td>"

    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in df.itertuples(index=False, name=None))
    return f'<div class="wrap"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _md_cell(v: Any) -> str:
    return _fmt(v).replace("|", "\\|").replace("\n", " ")


def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)\n"
    lines = ["| " + " | ".join(_md_cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in df.itertuples(index=False, name=None)]
    return "\n".join(lines) + "\n"


def _text(v: Any) -> str:
    """A value as a reader writes it: {"completed": 12} -> "completed 12", lists comma-separated, a mapping of lists
    as "axis: a, b; other: c", booleans yes/no, floats to 4 significant digits, None as ""."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.4g}"
    if isinstance(v, Mapping):
        if not v:
            return "none"
        if any(isinstance(x, (Mapping, list, tuple)) for x in v.values()):
            return "; ".join(f"{k}: {_text(x)}" for k, x in v.items())
        return ", ".join(f"{k} {_text(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple, set)):
        return ", ".join(_text(x) for x in v) if v else "none"
    return str(v)


def _kv(d: Mapping[str, Any]) -> pd.DataFrame:
    return pd.DataFrame({"key": list(d), "value": [_text(v) for v in d.values()]})


def _counted(d: Mapping[str, int]) -> str:
    """{"2.13.0": 12} -> "2.13.0 (12 runs)"."""
    return ", ".join(f"{k} ({n} run{'s' if n != 1 else ''})" for k, n in d.items()) if d else "none recorded"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.85em}td,th{border:1px solid #ccc;padding:.2em .5em;
vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:.9em}
.supported{background:#e5f5e0}.contradicted{background:#fde0dd}.inconclusive{background:#f7f7f7}
ul.headline{list-style:none;padding:0}ul.headline li{margin:.3em 0;padding:.3em .6em;border-left:.4em solid #bbb}
ul.headline li.supported{border-color:#009E73}ul.headline li.contradicted{border-color:#D55E00}
ul.headline li.up{border-color:#009E73}
.wrap{overflow-x:auto}td.long{min-width:24em}"""


# --- the page: one list of blocks, each written both as HTML and as Markdown ------------------------------------------
@dataclass(frozen=True)
class Link:
    """A link inside a heading or paragraph: `<a href>` in HTML, `[label](href)` in Markdown."""

    label: str
    href: str


Inline = str | Link


def _inline_html(parts: Sequence[Inline]) -> str:
    return "".join(
        f"<a href='{p.href}'>{html.escape(p.label)}</a>" if isinstance(p, Link) else html.escape(p) for p in parts
    )


def _inline_md(parts: Sequence[Inline]) -> str:
    return "".join(f"[{p.label}]({p.href})" if isinstance(p, Link) else p for p in parts)


@dataclass(frozen=True)
class Heading:
    """A section heading; `anchor` is its HTML id."""

    level: int
    parts: tuple[Inline, ...]
    anchor: str = ""

    def html(self) -> str:
        anchor = f" id='{self.anchor}'" if self.anchor else ""
        return f"<h{self.level}{anchor}>{_inline_html(self.parts)}</h{self.level}>"

    def markdown(self) -> str:
        return f"{'#' * self.level} {_inline_md(self.parts)}\n"


@dataclass(frozen=True)
class Para:
    """A paragraph (text escaped in HTML, verbatim in Markdown)."""

    parts: tuple[Inline, ...]

    def html(self) -> str:
        return f"<p>{_inline_html(self.parts)}</p>"

    def markdown(self) -> str:
        return _inline_md(self.parts) + "\n"


@dataclass(frozen=True)
class Table:
    """A table printed in full."""

    df: pd.DataFrame

    def html(self) -> str:
        return _html_table(self.df)

    def markdown(self) -> str:
        return _md_table(self.df)


@dataclass(frozen=True)
class Figure:
    """A figure: its PNG embedded in HTML (linked in Markdown), its caption and links to its other formats."""

    name: str
    png: Path
    """The PNG file, embedded in the HTML page."""
    png_href: str
    """Its path relative to the report, linked from the Markdown."""
    caption: str
    links: tuple[Link, ...]

    def html(self) -> str:
        b64 = base64.b64encode(self.png.read_bytes()).decode("ascii")
        links = " ".join(_inline_html([lk]) for lk in self.links)
        return (
            f"<figure id='{self.name}'><img alt='{html.escape(self.name)}' src='data:image/png;base64,{b64}'>"
            f"<figcaption>{html.escape(self.caption)} {links}</figcaption></figure>"
        )

    def markdown(self) -> str:
        links = " ".join(_inline_md([lk]) for lk in self.links)
        return f"![{self.name}]({self.png_href})\n\n{self.caption} {links}\n"


@dataclass(frozen=True)
class ScorecardTable:
    """The scorecard: in HTML one row per claim coloured by verdict, its evidence one line each; in Markdown the
    scorecard table."""

    cards: tuple[scorecard.ClaimResult, ...]
    table: pd.DataFrame
    """scorecard.scorecard_table(cards)."""

    def html(self) -> str:
        out = [
            '<table class="scorecard"><thead><tr><th>claim</th><th>statement</th><th>verdict</th><th>evidence</th>'
            "<th>rule</th></tr></thead><tbody>"
        ]
        for r, row in zip(self.cards, self.table.itertuples(index=False), strict=True):
            ev = "<br>".join(html.escape(str(e)) for e in r.evidence) or html.escape(r.reason)
            strata = f"<br><small>{html.escape(row.strata)}</small>" if row.strata else ""
            out.append(
                f'<tr class="{r.verdict}"><td>{r.claim}</td><td>{html.escape(r.statement)}</td>'
                f"<td>{html.escape(row.verdict)}{strata}</td><td>{ev}</td><td>{html.escape(r.rule)}</td></tr>"
            )
        out.append("</tbody></table>")
        return "\n".join(out)

    def markdown(self) -> str:
        return _md_table(self.table)


@dataclass(frozen=True)
class Bullets:
    """A list, one item per line: (css class, text) pairs; in Markdown "- **head** text" lines."""

    items: tuple[tuple[str, str, str], ...]
    """(css class, bold head, text)."""
    cls: str = ""

    def html(self) -> str:
        lis = "".join(
            f'<li class="{c}"><b>{html.escape(head)}</b> {html.escape(text)}</li>' for c, head, text in self.items
        )
        return f'<ul class="{self.cls}">{lis}</ul>'

    def markdown(self) -> str:
        return "\n".join(f"- **{head}** {text}" for _, head, text in self.items) + "\n"


@dataclass(frozen=True)
class Pre:
    """Text kept as written, line breaks and indentation included (a sweep file's notes)."""

    text: str

    def html(self) -> str:
        return f"<pre>{html.escape(self.text)}</pre>"

    def markdown(self) -> str:
        return f"```text\n{self.text}\n```\n"


Block = Heading | Para | Table | Figure | ScorecardTable | Bullets | Pre


def sweep_notes(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(description, notes) of a sweep file: its `description` field and the comment block that opens it, where the
    study's author says what was chosen and why (sweeps/default.yaml's measurements), without the "# " marks."""
    import yaml

    text = Path(path).read_text()
    notes: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            if line.strip() or notes:
                break
            continue
        notes.append(line[2:] if line.startswith("# ") else line[1:])
    data = yaml.safe_load(text)
    description = str(data.get("description", "")) if isinstance(data, dict) else ""
    return description, "\n".join(notes).rstrip()


def _setup_section(sweep: str | os.PathLike[str] | None) -> list[Block]:
    """How the study was set up, in its sweep file's words (none without a sweep file or notes)."""
    if sweep is None:
        return []
    description, notes = sweep_notes(sweep)
    if not (description or notes):
        return []
    name = Path(sweep).name
    return [
        _h(2, "How the study was set up", anchor="setup"),
        _p(f"From the sweep file {name}" + (f": {description}" if description else ".")),
        *([Pre(notes)] if notes else []),
    ]


def _h(level: int, *parts: Inline, anchor: str = "") -> Heading:
    return Heading(level, parts, anchor)


def _p(*parts: Inline) -> Para:
    return Para(parts)


def _table_or_link(df: pd.DataFrame, csv: Path | None, out_dir: Path) -> Block:
    """The table inline when short, else a line linking its CSV."""
    if len(df) <= MAX_INLINE_ROWS or csv is None:
        return Table(df)
    return _p(f"{len(df)} runs: see ", Link("the CSV", csv.relative_to(out_dir).as_posix()), ".")


def _study_summary(study: Study) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "runs": len(study.runs),
        "states": study.runs["state"].value_counts().to_dict(),
        "missing": len(study.missing),
        "missing run ids": list(study.missing),
        "algorithms": [_label(a) for a in style_order(study.runs[ALGORITHM].dropna().astype(str).unique())],
        "seeds": _natural(study.runs["seed"].dropna().unique()) if "seed" in study.runs else [],
        "swept axes": {a: _natural(study.runs[a].dropna().unique()) for a in study.axes},
    }
    if EMULATED in study.runs.columns and study.runs[EMULATED].notna().any():
        summary["runs with emulated precision"] = int(study.runs[EMULATED].fillna(False).sum())
    return summary


def _natural(values: Iterable[Any]) -> list[str]:
    """Values as text, numbers by value (256 before 1024), then the rest alphabetically."""

    def key(v: Any) -> tuple[int, float, str]:
        try:
            return (0, float(v), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(v))

    return [str(v) for v in sorted(values, key=key)]


def _label(name: str) -> str:
    try:
        return style.label(name)
    except (KeyError, ValueError, LookupError):  # an algorithm the registry does not know (an old run): its name
        return name


def style_order(names: Iterable[str]) -> list[str]:
    """`names` in registry order, unknown names (old runs) last."""
    names = list(names)
    try:
        return style.order(names)
    except (KeyError, ValueError, LookupError):
        return sorted(names)


def _lead(study: Study) -> Para:
    """One line on the study under the title: runs and their states, algorithms, seeds, swept axes, missing runs."""
    sm = _study_summary(study)
    swept = _text(sm["swept axes"]) if study.axes else "none"
    missing = f"{sm['missing']} missing" if sm["missing"] else "none missing"
    return _p(
        f"{sm['runs']} runs ({_text(sm['states'])}; {missing}) of {_text(sm['algorithms'])}; "
        f"seeds {_text(sm['seeds'])}; swept axes: {swept}."
    )


def _study_section(study: Study, table_files: Mapping[str, Path], out_dir: Path) -> list[Block]:
    """The study (runs, states, algorithms, swept axes) and its provenance: manifests, packages, common config, runs
    (the end of the report: what a reader checks, not what they came for)."""
    prov = provenance(study)
    packages = pd.DataFrame(
        {"package": list(prov["packages"]), "versions (runs)": [_counted(v) for v in prov["packages"].values()]}
    )
    return [
        _h(2, "Study and provenance", anchor="study"),
        Table(_kv(_study_summary(study))),
        _h(3, "Provenance", anchor="provenance"),
        Table(
            pd.DataFrame(
                {
                    "key": [k for k in prov if k != "packages"],
                    "value": [_counted(v) for k, v in prov.items() if k != "packages"],
                }
            )
        ),
        _h(3, "Packages"),
        Table(packages),
        _h(3, "Configuration common to every run"),
        Table(_kv(_common_config(study.configs, study.axes))),
        _h(3, "Runs"),
        _table_or_link(runs_table(study), table_files.get("runs"), out_dir),
    ]


def headline(cards: Sequence[scorecard.ClaimResult]) -> list[tuple[str, str, str]]:
    """One line per claim: (verdict, "C1 supported:", "statement number"), where the number is the quantity the verdict
    was read off (estimate [95% interval] (n)), or its range over the strata, or why there is none."""
    out = []
    for c in cards:
        stratified = len(c.strata) > 1
        firsts = [e for e in c.evidence if e.verdict and e.verdict != scorecard.NO_DATA] if stratified else []
        if stratified and firsts:
            parts = []
            for name in dict.fromkeys(e.name for e in firsts):
                est = [e.estimate for e in firsts if e.name == name]
                parts.append(
                    f"{name} = {min(est):.3g}" + (f" to {max(est):.3g}" if len(est) > 1 else "") + f" over {len(est)}"
                    f" strat{'a' if len(est) > 1 else 'um'}"
                )
            number = "; ".join(parts) + f" ({c.strata_summary})"
        elif c.evidence and not stratified:
            number = str(c.evidence[0])
        else:
            number = c.reason
        why = f" ({c.reason})" if c.verdict == scorecard.INCONCLUSIVE and c.reason and number != c.reason else ""
        out.append((c.verdict, f"{c.claim} {c.verdict}:", f"{c.statement} \u2014 {number}{why}"))
    return out


def gain_headline(gain: scorecard.HeldOutGain) -> list[tuple[str, str, str]]:
    """The headline's held-out gain lines: per algorithm, what RL did to held-out pass@1 (HeldOutGain.lines), the
    line green when its interval is above 0 in every configuration; or one line saying why it is not available."""
    out = []
    t = gain.table
    for head, text in gain.lines():
        rows = t[t["label"].astype(str) == head.removeprefix("Held-out gain, ").removesuffix(":")] if len(t) else t
        up = len(rows) > 0 and bool((rows["low"].astype(float) > 0).all())
        out.append(("up" if up else "", head, text))
    return out


def gain_table(gain: scorecard.HeldOutGain) -> pd.DataFrame:
    """The held-out gain table as the report prints it (numbers to 3 decimals: pass@1 values)."""
    t = gain.table.copy()
    for c in ("start", "final", "gain", "low", "high"):
        t[c] = [f"{v:.3f}" if pd.notna(v) else "" for v in t[c]]
    return t.drop(columns=[ALGORITHM]).rename(columns={"label": "algorithm", "n": "n (with a gain)"})


def _gain_section(gain: scorecard.HeldOutGain) -> list[Block]:
    """The held-out gain (what RL did to held-out pass@1): its rule and its table, or why it is not available."""
    out: list[Block] = [_h(3, "Held-out gain", anchor="heldout-gain"), _p(gain.rule[0].upper() + gain.rule[1:] + ".")]
    out.append(Table(gain_table(gain)) if gain.available else _p(f"Not available: {gain.reason}."))
    return out


SIGNAL_METRICS = ("zero_var_group_frac", "zero_var_solved_frac")
"""Groups without a learning signal (every reward equal), and the part of them the policy solves every time."""


def signal_table(study: Study) -> pd.DataFrame:
    """Per configuration: the fraction of groups with no learning signal over the whole run and in its first and last
    quarter of steps (seed mean), and how much of it is groups every sample solves (the rest: groups none solves).
    Empty when the runs did not log it."""
    long = study.long
    rows = long[long[METRIC].astype(str).isin(SIGNAL_METRICS) & (long[STEP] > 0)].dropna(subset=[VALUE])
    if rows.empty:
        return pd.DataFrame()
    cols = [c for c in study.group_cols if c in rows.columns]
    last = rows.groupby(RUN_ID, observed=True)[STEP].transform("max")
    rows = rows.assign(quarter=(4 * (rows[STEP] - 1) // last.clip(lower=1)).clip(upper=3))
    out = []
    for key, g in rows.groupby(cols, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        per_run = g.pivot_table(index=[RUN_ID, "quarter"], columns=METRIC, values=VALUE, observed=True)
        runs = per_run.groupby(level=RUN_ID).mean()
        by_q = per_run.groupby(level="quarter").mean()
        zv = "zero_var_group_frac"
        row = dict(zip(cols, key, strict=True))
        row[ALGORITHM] = _label(str(row[ALGORITHM]))
        row.update(
            {
                "runs": len(runs),
                "no-signal groups": f"{runs[zv].mean():.2f}",
                "first quarter": f"{by_q[zv].iloc[0]:.2f}",
                "last quarter": f"{by_q[zv].iloc[-1]:.2f}",
            }
        )
        if "zero_var_solved_frac" in runs:
            row["of which solved by every sample"] = f"{runs['zero_var_solved_frac'].mean():.2f}"
        out.append(row)
    return pd.DataFrame(out)


SIGNAL_NOTE = (
    "Learning signal: a group whose G responses all get the same reward gives every response advantage 0. Groups "
    "no sample solves mean the start is too weak for the task; groups every sample solves are problems RL has "
    "mastered, so their share rises as the policy learns."
)


def _signal_section(study: Study) -> list[Block]:
    table = signal_table(study)
    return [] if table.empty else [_h(3, "Learning signal", anchor="signal"), _p(SIGNAL_NOTE), Table(table)]


def _scorecard_section(cards: Sequence[scorecard.ClaimResult], gain: scorecard.HeldOutGain) -> list[Block]:
    """The scorecard with its note on intervals and strata, the held-out gain, then the per-stratum verdicts when any
    claim has strata."""
    out: list[Block] = [
        _h(2, "Scorecard", anchor="scorecard"),
        _p(SCORECARD_NOTE),
        ScorecardTable(tuple(cards), scorecard.scorecard_table(cards)),
        *_gain_section(gain),
    ]
    strata_df = scorecard.strata_table(cards)
    if not strata_df.empty:
        out += [_h(3, "Per-stratum verdicts"), Table(strata_df)]
    return out + _power_section(cards)


def parity_section(parity: pd.DataFrame | None) -> list[Block]:
    """Emulated against real low precision on the machine that made the study (study/tools/parity.py, rule
    precision_parity): the |delta| distributions whose tail C5's mismatch depends on; nothing without the table."""
    if parity is None or parity.empty:
        return []
    shown = parity.copy()
    for c in shown.columns:
        if shown[c].dtype.kind == "f":
            shown[c] = [f"{x:.3g}" for x in shown[c]]
    lines = [
        f"{r['precision']} cross-engine mismatch p99 {r['p99 emulated']:.3g} emulated vs {r['p99 real']:.3g} real "
        f"(ratio {r['p99 emulated/real']:.2f})"
        for _, r in parity[parity["what"] == "mismatch"].iterrows()
    ]
    return [
        _h(3, "Emulated against real low precision on this machine", anchor="precision-parity"),
        _p(
            "The runs' low precision is emulated (fp32 compute rounded where a GPU rounds, study/core/precision.py). "
            "Read C5 with the emulation's fidelity: per engine, |log-prob - fp32 log-prob| of the tiny model's "
            "response tokens (fixed random weights, init_std 0.1), and the cross-engine mismatch |trainer - engine| "
            "that pi_old from the rollout engine brings in, real vs emulated on the machine that ran the study "
            "(`python -m study.tools.parity`, rule precision_parity). "
            + "; ".join(lines)
            + ". An emulated tail lighter than the real one understates the mismatch: a real-precision run "
            "(sweeps/precision.yaml) may show a larger drop."
        ),
        Table(shown),
    ]


def power_table(cards: Sequence[scorecard.ClaimResult]) -> pd.DataFrame:
    """One row per (claim, stratum) with a smallest-detectable-difference line (analysis/power.py): the quantity,
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


def _power_section(cards: Sequence[scorecard.ClaimResult]) -> list[Block]:
    """The smallest difference each stratum's seeds can detect (C5, C6's length part), from the measured seed noise."""
    t = power_table(cards)
    if t.empty:
        return []
    return [
        _h(3, "Power: the smallest difference these seeds detect", anchor="power"),
        _p(
            f"From the pooled seed standard deviation of each compared group's final-window reward: smallest "
            f"detectable |d| = (t(1 - {power.ALPHA:g}/2, df) + t({power.POWER:g}, df)) x SE(d), SE(d) = SD x "
            "sqrt(sum of w^2 / n) over the contrast's groups (analysis/power.py). An inconclusive verdict means the "
            "effect, if any, is smaller than about this size; a difference of this size would have been detected "
            f"with probability {power.POWER:.0%}."
        ),
        Table(t),
    ]


def budget_section(budgets: pd.DataFrame | None) -> list[Block]:
    """The cold start's held-out pass@1 at each generation budget (study/tools/budgets.py, rule coldstart_budgets), with
    a line saying whether it rises with the budget; nothing when the study has no such table."""
    if budgets is None or budgets.empty:
        return []
    lines = []
    for name, t in budgets.groupby("coldstart", sort=False):
        v = t.sort_values("max_new_tokens")["pass_at_1"].to_numpy(float)
        rises = bool(np.all(np.diff(v) >= 0) and v[-1] > v[0])
        lo, hi = t["max_new_tokens"].min(), t["max_new_tokens"].max()
        verb = "rises" if rises else "does not rise"
        lines.append(f"{name}: pass@1 {verb} with the budget ({v[0]:.3f} at {lo} tokens, {v[-1]:.3f} at {hi})")
    shown = budgets.copy()
    for c in ("pass_at_1", "truncated", "reference_fits"):
        shown[c] = [f"{x:.3f}" for x in shown[c]]
    return [
        _h(2, "Generation budget at the cold start", anchor="coldstart-budgets"),
        _p(
            "Before any RL: the cold start's mean pass@1 on the held-out in_dist set at each max_new_tokens the runs "
            "use (the same problems and sampling seed at every budget; a response cut before its answer scores 0); "
            "truncated = share of samples cut at the budget; reference_fits = share of problems whose reference "
            "worked solution fits. Made by `python -m study.tools.budgets` (Snakemake rule coldstart_budgets). "
            + "; ".join(lines)
            + "."
        ),
        Table(shown),
    ]


MAIN_FIGURES = ("figure1_reward", "figure2_clipping", "figure3_routing_replay")
"""The figures the report shows right after its headline; the others follow the scorecard."""
ROUTING_FIGURE = "figure8_routing_volatility"
"""Shown after Figures 1-3 when drawn (a study sweeping an axis besides algorithm), with the Routing Replay claims'
verdicts per configuration beside it."""
ROUTING_CLAIMS = ("C3", "C4")
"""The claims whose per-configuration verdicts sit next to the routing-volatility figure."""


def routing_verdicts(cards: Sequence[scorecard.ClaimResult], claims: Sequence[str] = ROUTING_CLAIMS) -> pd.DataFrame:
    """One row per stratum (configuration) of `claims`: for each claim its verdict there and its evidence (the first
    two lines: the comparison, then for C4 the collapse part); empty when none of them is stratified."""
    by_claim = {c.claim: c for c in cards if c.claim in claims and len(c.strata) > 1}
    labels: list[str] = []
    for c in by_claim.values():
        labels += [s.label for s in c.strata if s.label not in labels]
    rows = []
    for label in labels:
        row: dict[str, str] = {"configuration": label}
        for claim, c in by_claim.items():
            s = next((s for s in c.strata if s.label == label), None)
            row[claim] = s.verdict if s else ""
            ev = [e for e in (s.evidence if s else []) if not e.name.startswith("collapse_rate(") or " - " in e.name]
            row[f"{claim} evidence"] = "; ".join(
                f"{e.name} = {e.estimate:.3g} [{e.low:.3g}, {e.high:.3g}] (n={e.n})" for e in ev[:2]
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _routing_section(rendered: figures.Rendered, cards: Sequence[scorecard.ClaimResult], out_dir: Path) -> list[Block]:
    """The routing-volatility figure, when drawn, with C3 and C4 per configuration beside it."""
    fig = _figure_blocks(rendered, [ROUTING_FIGURE], out_dir)
    if not fig:
        return []
    out: list[Block] = [_h(2, "Routing volatility", anchor="routing-volatility"), *fig]
    verdicts = routing_verdicts(cards)
    if not verdicts.empty:
        out += [
            _p(
                "C3 (GRPO without Routing Replay is unstable; with it, it converges) and C4 (GSPO needs no Routing "
                "Replay) in each configuration, decided by the rules of the scorecard below:"
            ),
            Table(verdicts),
        ]
    return out


def _figure_blocks(rendered: figures.Rendered, names: Sequence[str], out_dir: Path) -> list[Block]:
    """Each figure of `names` that was drawn: its PNG, caption and links to its other formats."""
    out: list[Block] = []
    for name in names:
        paths = rendered.paths.get(name)
        if not paths:
            continue
        png = next(p for p in paths if p.suffix == ".png")
        rel = {p: p.relative_to(out_dir).as_posix() for p in paths}
        links = tuple(Link(p.suffix[1:].upper(), rel[p]) for p in paths if p.suffix != ".png")
        out.append(Figure(name, png, rel[png], rendered.captions[name], links))
    return out


def _figures_section(rendered: figures.Rendered, table_files: Mapping[str, Path], out_dir: Path) -> list[Block]:
    """The figures after the main ones, then every figure's tables (short ones inline, every one linked as CSV),
    then the figures not drawn and why."""
    rest = [n for n in rendered.paths if n not in (*MAIN_FIGURES, ROUTING_FIGURE)]
    out: list[Block] = []
    if rest:
        out += [_h(2, "More figures", anchor="figures"), *_figure_blocks(rendered, rest, out_dir)]
    if rendered.skipped:
        sk = pd.DataFrame({"figure": list(rendered.skipped), "why skipped": list(rendered.skipped.values())})
        out += [_h(3, "Figures not drawn"), Table(sk)]
    out.append(_h(2, "Figure tables", anchor="tables"))
    for name in rendered.paths:
        for tname, df in rendered.tables.get(name, {}).items():
            key = f"{name}.{tname}"
            out.append(_h(4, key, " (", Link("CSV", table_files[key].relative_to(out_dir).as_posix()), ")"))
            out.append(Table(df) if len(df) <= MAX_INLINE_ROWS else _p(f"{len(df)} rows: see the CSV."))
    return out


def _problems_section(problems: pd.DataFrame, cleared: pd.DataFrame) -> list[Block]:
    """The failed, collapsed and missing runs (problem_runs) with the rule that flagged each, or a line saying there
    are none; the collapse rule; the runs whose reward fell but stayed inside their seed band (cleared_runs)."""
    none = "None: every run completed and none was detected as collapsed; no run is missing."
    out: list[Block] = [
        _h(2, "Failed, collapsed and missing runs", anchor="problems"),
        Table(problems) if len(problems) else _p(none),
        _p(
            "flagged_by: status.json = the run's own guard (non-finite loss, exploding ratio, reward floor; always a "
            f"collapse); analysis: {stats.DROP} = {stats.collapse_rule()} analysis: {stats.NON_FINITE} = a NaN or "
            "infinite reward."
        ),
    ]
    if len(cleared):
        out += [_h(3, "Reward fell, inside the seed band: not flagged"), Table(cleared)]
    return out


def render(
    title: str,
    study: Study,
    cards: Sequence[scorecard.ClaimResult],
    rendered: figures.Rendered,
    problems: pd.DataFrame,
    table_files: Mapping[str, Path],
    out_dir: Path,
    gain: scorecard.HeldOutGain | None = None,
    budgets: pd.DataFrame | None = None,
    parity: pd.DataFrame | None = None,
    sweep: str | os.PathLike[str] | None = None,
) -> tuple[str, str]:
    """The HTML page and its Markdown twin, both written from one list of blocks: a line on the study, the headline
    and Figures 1-3 first, the provenance, configuration and runs last."""
    main = _figure_blocks(rendered, MAIN_FIGURES, out_dir)
    gain = gain if gain is not None else scorecard.heldout_gain(study)
    blocks = [
        _lead(study),
        _h(2, "Headline", anchor="headline"),
        Bullets(tuple(headline(cards)) + tuple(gain_headline(gain)), "headline"),
        *([_h(2, "Figures 1-3", anchor="main-figures"), *main] if main else []),
        *_routing_section(rendered, cards, out_dir),
        *budget_section(budgets),
        *_scorecard_section(cards, gain),
        *parity_section(parity),
        *_signal_section(study),
        *_setup_section(sweep),
        *_figures_section(rendered, table_files, out_dir),
        *_problems_section(problems, cleared_runs(study)),
        *_study_section(study, table_files, out_dir),
    ]
    page = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        *(b.html() for b in blocks),
        "</body></html>",
    ]
    md = [f"# {title}\n", *(b.markdown() for b in blocks)]
    return "\n".join(page), "\n".join(md)


SCORECARD_NOTE = (
    "Intervals: 95% Student t over seeds (a mean: t with n - 1 df; a difference, contrast or ratio of independent "
    "groups: Welch's, ratios on the log scale; C5 paired by seed when every arm ran the same seeds), except collapse "
    "rates (C3, C4): "
    "Newcombe's score interval, which unlike a bootstrap stays wide when no run collapsed; n = runs per group. "
    "Claims are compared within each stratum of the other swept axes, never pooled across them; verdicts combine as: "
    + scorecard.STRATA_RULE
    + " (each claim's rule says what it was stratified on)."
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
            rendered.tables[name][tname] = pd.read_csv(src / rel, **CSV_EXACT)
    return rendered, sources


def build_report(
    study: Study,
    out_dir: str | os.PathLike[str],
    *,
    title: str = "study",
    figures_dir: str | os.PathLike[str] | None = None,
    budgets: pd.DataFrame | None = None,
    parity: pd.DataFrame | None = None,
    sweep: str | os.PathLike[str] | None = None,
) -> Report:
    """Write index.html, index.md, figures/ and tables/ for `study` under `out_dir`; returns what was written.
    `sweep`: the study's sweep file, whose description and opening notes the report shows (`sweep_notes`).

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
    gain = scorecard.heldout_gain(study)
    _atomic_write(out / "tables" / "scorecard.csv", scorecard.scorecard_table(cards).to_csv(index=False))
    _atomic_write(out / "tables" / "heldout_gain.csv", gain.table.to_csv(index=False))
    _atomic_write(out / "tables" / "scorecard_strata.csv", scorecard.strata_table(cards).to_csv(index=False))
    problems = problem_runs(study)
    _atomic_write(out / "tables" / "problem_runs.csv", problems.to_csv(index=False))
    if budgets is not None and not budgets.empty:
        _atomic_write(out / "tables" / "coldstart_budgets.csv", budgets.to_csv(index=False))
    if parity is not None and not parity.empty:
        _atomic_write(out / "tables" / "precision_parity.csv", parity.to_csv(index=False))
    page, md = render(f"Report: {title}", study, cards, rendered, problems, table_files, out, gain, budgets, parity,
                      sweep)  # fmt: skip
    html_path = _atomic_write(out / "index.html", page)
    md_path = _atomic_write(out / "index.md", md)
    pngs = {n: next(p for p in ps if p.suffix == ".png") for n, ps in rendered.paths.items()}
    return Report(html_path, md_path, pngs, dict(rendered.skipped), cards)


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
        ids: Iterable[str] = json.loads(js.read_text()).get("run_ids", [])
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
        raise ValueError(f"--study {study!r}: no such study in {results_dir} (no {study}/run_ids.txt, study.json or "
                         f"configs/); valid: {', '.join(known) or 'none yet'}")  # fmt: skip


def report_from_results(
    results_dir: str | os.PathLike[str],
    *,
    study: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    figures_dir: str | os.PathLike[str] | None = None,
    sweep: str | os.PathLike[str] | None = None,
) -> Report:
    """Load the study's runs from `results_dir` and write its report (default `results_dir/<study>/report`);
    `figures_dir`, `sweep`: see `build_report`."""
    name = study or "all"
    st = load_study(results_dir, study_run_ids(results_dir, study))
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / name / "report"
    parity = Path(results_dir) / name / "precision_parity.csv"
    return build_report(st, out, title=name, figures_dir=figures_dir, budgets=budget_tables(results_dir, study),
                        parity=pd.read_csv(parity) if study and parity.is_file() else None, sweep=sweep)  # fmt: skip


def budget_tables(results_dir: str | os.PathLike[str], study: str | None) -> pd.DataFrame | None:
    """The study's cold-start budget tables (results/<study>/coldstart_budgets/*.csv, written by the Snakemake rule
    coldstart_budgets), concatenated; None when there are none."""
    if not study:
        return None
    files = sorted((Path(results_dir) / study / "coldstart_budgets").glob("*.csv"))
    return pd.concat([pd.read_csv(f) for f in files], ignore_index=True) if files else None


__all__ = [
    "Report",
    "build_report",
    "check_study",
    "cleared_runs",
    "headline",
    "problem_runs",
    "provenance",
    "report_from_results",
    "reuse_figures",
    "runs_table",
    "studies",
    "study_run_ids",
]
