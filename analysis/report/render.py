"""Rendering the report: one list of blocks (headings, paragraphs, tables, figures, the scorecard, embedded notes),
each of which writes itself as HTML and as Markdown, so the page and its Markdown twin cannot list different
contents; `page` writes both. Values are written as text a reader writes ("completed 12"), never as JSON; every
piece of text is HTML-escaped in the page, and in the Markdown every `<` that could open a tag is escaped
(`md_escape`: a run, algorithm or axis name holding `<script>` stays text in both).
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from analysis.figures.claims_forest import VERDICT_COLORS
from analysis.report import markdown_html
from analysis.stats.verdicts import css_class

if TYPE_CHECKING:
    from analysis.claims.scorecard import ClaimResult

MAX_INLINE_ROWS = 40
"""Tables longer than this are linked as CSV instead of printed."""


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.4g}"
    if v is None or v is pd.NA:
        return ""
    return text(v)


LONG_CELL = 60
"""Cells with more characters than this get a minimum width (class "long"), so that a wide table scrolls sideways
rather than squeezing its text columns to one word per line."""


def _html_table(df: pd.DataFrame, cls: str = "", labels: tuple[str, Sequence[str]] | None = None) -> str:
    """`df` as an HTML table; `labels` = (column, one css class per row): that column's cells written as coloured
    labels (`<span class="label CLASS">`)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    column, classes = labels if labels is not None else (None, ())

    def cell(v: Any, label: str | None) -> str:
        text = fmt(v)
        long = " class='long'" if len(text) > LONG_CELL else ""
        inner = html.escape(text) if label is None else f'<span class="label {label}">{html.escape(text)}</span>'
        return f"<td{long}>{inner}</td>"

    body = "".join(
        "<tr>"
        + "".join(cell(v, classes[i] if c == column else None) for c, v in zip(df.columns, row, strict=True))
        + "</tr>"
        for i, row in enumerate(df.itertuples(index=False, name=None))
    )
    return f'<div class="wrap"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def md_escape(text: str) -> str:
    """`text` as Markdown that never renders as HTML (a Markdown renderer passes raw HTML through): a `<` that could
    open a tag, comment or declaration (followed by a letter, `/`, `!` or `?`) backslash-escaped, with the
    backslashes before it doubled; any other text, `a < b` included, as written."""
    return re.sub(r"(\\*)<(?=[A-Za-z/!?])", lambda m: m.group(1) * 2 + "\\<", text)


def _md_cell(v: Any) -> str:
    return md_escape(fmt(v)).replace("|", "\\|").replace("\n", " ")


def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)\n"
    lines = ["| " + " | ".join(_md_cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in df.itertuples(index=False, name=None)]
    return "\n".join(lines) + "\n"


def text(v: Any) -> str:
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
            return "; ".join(f"{k}: {text(x)}" for k, x in v.items())
        return ", ".join(f"{k} {text(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple, set)):
        return ", ".join(text(x) for x in v) if v else "none"
    return str(v)


def kv(d: Mapping[str, Any]) -> pd.DataFrame:
    return pd.DataFrame({"key": list(d), "value": [text(v) for v in d.values()]})


def counted(d: Mapping[str, int]) -> str:
    """{"2.13.0": 12} -> "2.13.0 (12 runs)"."""
    return ", ".join(f"{k} ({n} run{'s' if n != 1 else ''})" for k, n in d.items()) if d else "none recorded"


def _label_css() -> str:
    """A verdict label's border in its verdict's colour (the headline figure's, claims_forest.VERDICT_COLORS)."""
    return "".join(f".label.{css_class(v)}{{border-color:{c}}}" for v, c in VERDICT_COLORS.items())


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.85em}td,th{border:1px solid #ccc;padding:.2em .5em;
vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:.9em}
.supported{background:#e5f5e0}.contradicted{background:#fde0dd}.inconclusive{background:#f7f7f7}
.not-tested-in-regime{background:#e3eef8}
.label{display:inline-block;padding:0 .5em;border:2px solid #bbb;border-radius:.8em;font-weight:600;
white-space:nowrap}table.headline{margin-bottom:.5em}table.headline td{vertical-align:middle}
table.headline td:nth-child(2){min-width:13em}table.headline td:nth-child(5){max-width:24em;overflow-wrap:anywhere}
table.headline td:nth-child(6){min-width:12em;max-width:16em}
details{margin:.5em 0 1em}summary{cursor:pointer;color:#0072B2}
ul.lines{list-style:none;padding:0}ul.lines li{margin:.3em 0;padding:.3em .6em;border-left:.4em solid #bbb}
ul.lines li.not-read{border-color:#E69F00}ul.lines li.up{border-color:#009E73}
ul.lines li.deviation{border-color:#CC79A7;background:#fbe9f3;font-weight:600}
.wrap{overflow-x:auto}td.long{min-width:24em}""" + _label_css()


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
    return md_escape("".join(f"[{p.label}]({p.href})" if isinstance(p, Link) else p for p in parts))


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
    """A paragraph (text escaped in HTML, verbatim in Markdown but for `md_escape`)."""

    parts: tuple[Inline, ...]

    def html(self) -> str:
        return f"<p>{_inline_html(self.parts)}</p>"

    def markdown(self) -> str:
        return _inline_md(self.parts) + "\n"


@dataclass(frozen=True)
class Table:
    """A table printed in full; with `labels` (column, one css class per row) that column's cells are coloured
    labels in HTML (the headline's verdicts), plain text in Markdown."""

    df: pd.DataFrame
    labels: tuple[str, tuple[str, ...]] | None = None
    cls: str = ""

    def html(self) -> str:
        return _html_table(self.df, self.cls, self.labels)

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
        return f"![{md_escape(self.name)}]({self.png_href})\n\n{md_escape(self.caption)} {links}\n"


@dataclass(frozen=True)
class ScorecardTable:
    """The scorecard: in HTML one row per claim coloured by verdict, its evidence one line each; in Markdown the
    table. How each verdict was read (split, pairing, role) and its rule are elsewhere, once (the headline's
    details, the scorecard's collapsed rules)."""

    cards: tuple[ClaimResult, ...]
    table: pd.DataFrame
    """analysis.claims.scorecard.scorecard_table(cards), without the columns shown elsewhere."""

    def html(self) -> str:
        out = [
            '<table class="scorecard"><thead><tr><th>claim</th><th>statement</th><th>verdict</th><th>evidence</th>'
            "</tr></thead><tbody>"
        ]
        for r, row in zip(self.cards, self.table.itertuples(index=False), strict=True):
            ev = "<br>".join(html.escape(str(e)) for e in r.evidence) or html.escape(r.reason)
            strata = f"<br><small>{html.escape(row.strata)}</small>" if row.strata else ""
            if r.deviations:
                strata += "<br><b>deviates from the declaration:</b> " + html.escape("; ".join(r.deviations))
            out.append(
                f'<tr class="{css_class(r.verdict)}"><td>{r.claim}</td><td>{html.escape(r.statement)}</td>'
                f"<td>{html.escape(row.verdict)}{strata}</td><td>{ev}</td></tr>"
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
        return "\n".join(f"- **{md_escape(head)}** {md_escape(text)}" for _, head, text in self.items) + "\n"


@dataclass(frozen=True)
class Pre:
    """Text kept as written, line breaks and indentation included (a sweep file's notes)."""

    text: str

    def html(self) -> str:
        return f"<pre>{html.escape(self.text)}</pre>"

    def markdown(self) -> str:
        return f"```text\n{self.text}\n```\n"


def h(level: int, *parts: Inline, anchor: str = "") -> Heading:
    return Heading(level, parts, anchor)


def p(*parts: Inline) -> Para:
    return Para(parts)


def table_or_link(df: pd.DataFrame, csv: Path | None, out_dir: Path) -> Block:
    """The table inline when short, else a line linking its CSV."""
    if len(df) <= MAX_INLINE_ROWS or csv is None:
        return Table(df)
    return p(f"{len(df)} runs: see ", Link("the CSV", csv.relative_to(out_dir).as_posix()), ".")


@dataclass(frozen=True)
class Notes:
    """A Markdown document embedded in the report (a study's notes): rendered to HTML (analysis.report.markdown_html,
    headings shifted under the section's), kept as written in the Markdown twin (its headings shifted the same)."""

    text: str
    shift: int = 2

    def html(self) -> str:
        return f'<div class="notes">{markdown_html.to_html(self.text, shift=self.shift)}</div>'

    def markdown(self) -> str:
        out, fenced = [], False
        for line in self.text.rstrip().splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif not fenced and line.startswith("#"):
                hashes = len(line) - len(line.lstrip("#"))
                if hashes <= 6 and line[hashes : hashes + 1] in (" ", ""):
                    line = "#" * min(6, hashes + self.shift) + line[hashes:]
            out.append(line)
        return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Details:
    """Blocks one click away: a collapsed `<details>` section in HTML; in Markdown its summary in bold, then the
    blocks."""

    summary: str
    blocks: tuple[Block, ...]

    def html(self) -> str:
        inner = "\n".join(b.html() for b in self.blocks)
        return f"<details><summary>{html.escape(self.summary)}</summary>\n{inner}\n</details>"

    def markdown(self) -> str:
        return "\n".join([f"**{md_escape(self.summary)}**\n", *(b.markdown() for b in self.blocks)])


Block = Heading | Para | Table | Figure | ScorecardTable | Bullets | Pre | Notes | Details


def page(title: str, blocks: Sequence[Block]) -> tuple[str, str]:
    """The HTML page (self-contained: CSS inline, figures embedded) and its Markdown twin, from one list of blocks."""
    html_page = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
        *(b.html() for b in blocks),
        "</body></html>",
    ]
    md = [f"# {md_escape(title)}\n", *(b.markdown() for b in blocks)]
    return "\n".join(html_page), "\n".join(md)


__all__ = [
    "CSS",
    "MAX_INLINE_ROWS",
    "Block",
    "Bullets",
    "Details",
    "Figure",
    "Heading",
    "Inline",
    "Link",
    "Notes",
    "Para",
    "Pre",
    "ScorecardTable",
    "Table",
    "counted",
    "fmt",
    "h",
    "kv",
    "md_escape",
    "p",
    "page",
    "table_or_link",
    "text",
]
