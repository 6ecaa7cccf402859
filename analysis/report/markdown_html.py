"""A small, safe Markdown-to-HTML renderer for the study notes the report embeds (`docs/studies/<name>.md`).

It knows what those notes use: ATX headings (`#`..`######`), paragraphs, unordered (`-`, `*`, `+`) and ordered
(`1.`) lists, nested by indentation, pipe tables with a `|---|` separator row, fenced code blocks (```` ``` ````),
block quotes (`>`), horizontal rules, and inline code spans, `**bold**`, `*emphasis*` and `[links](url)`. Everything
else is text. All text is HTML-escaped before any markup is added, so no tag, attribute or script in a note reaches
the page; a link keeps its URL only when it is relative or http(s)/mailto (anything else, `javascript:` included,
becomes plain text). Headings are shifted down by `shift` levels so a note's `#` sits under the report's own section.
"""

from __future__ import annotations

import html
import re

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+(.*)$")
_RULE = re.compile(r"^\s*([-*_])(\s*\1){2,}\s*$")
_TABLE_SEP = re.compile(r"^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$")
_SAFE_URL = re.compile(r"^(https?://|mailto:|#|\.{0,2}/|[\w.-]+(/|$|#|\.))", re.IGNORECASE)


def _inline(text: str) -> str:
    """One line of inline Markdown as HTML: code spans verbatim (escaped), then links, bold and emphasis on the
    escaped rest."""
    out = []
    for k, part in enumerate(re.split(r"(`+[^`]*?`+)", text)):
        if k % 2:  # a code span
            out.append(f"<code>{html.escape(part.strip('`').strip(), quote=False)}</code>")
            continue
        esc = html.escape(part, quote=False)

        def link(m: re.Match[str]) -> str:
            label, url = m.group(1), html.unescape(m.group(2)).strip()
            if not _SAFE_URL.match(url) or url.lower().startswith(("javascript:", "data:", "vbscript:")):
                return label
            return f'<a href="{html.escape(url, quote=True)}">{label}</a>'

        esc = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, esc)
        esc = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", esc)
        esc = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", esc)
        out.append(esc)
    return "".join(out)


def _cells(row: str) -> list[str]:
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)]


def _table(rows: list[str]) -> str:
    head = "".join(f"<th>{_inline(c)}</th>" for c in _cells(rows[0]))
    body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows[2:])
    return f'<div class="wrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _list(items: list[tuple[int, bool, str]]) -> str:
    """Nested lists from (indent, ordered, text) items."""
    out: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, tag) of the open lists
    for indent, ordered, text in items:
        tag = "ol" if ordered else "ul"
        while stack and indent < stack[-1][0]:
            out.append(f"</li></{stack.pop()[1]}>")
        if stack and indent == stack[-1][0] and tag != stack[-1][1]:  # the other kind of list: a new one
            out.append(f"</li></{stack.pop()[1]}>")
        if not stack or indent > stack[-1][0]:
            out.append(f"<{tag}><li>")
            stack.append((indent, tag))
        else:
            out.append("</li><li>")
        out.append(_inline(text))
    while stack:
        out.append(f"</li></{stack.pop()[1]}>")
    return "".join(out)


def to_html(text: str, *, shift: int = 0) -> str:
    """`text` (Markdown) as an HTML fragment; headings shifted down by `shift` levels (at most h6)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    out: list[str] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append(f"<p>{_inline(' '.join(s.strip() for s in para))}</p>")
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            flush()
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            flush()
            code = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence.group(1)):
                code.append(lines[i])
                i += 1
            out.append(f"<pre><code>{html.escape(chr(10).join(code), quote=False)}</code></pre>")
            i += 1
            continue
        heading = _HEADING.match(line)
        if heading:
            flush()
            level = min(6, len(heading.group(1)) + shift)
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
            i += 1
            continue
        if _RULE.match(line) and not para:
            out.append("<hr>")
            i += 1
            continue
        if "|" in line and i + 1 < len(lines) and _TABLE_SEP.match(lines[i + 1]) and "-" in lines[i + 1]:
            flush()
            rows = [line, lines[i + 1]]
            i += 2
            while i < len(lines) and "|" in lines[i] and lines[i].strip():
                rows.append(lines[i])
                i += 1
            out.append(_table(rows))
            continue
        if line.lstrip().startswith(">"):
            flush()
            quoted = []
            while i < len(lines) and lines[i].lstrip().startswith(">"):
                quoted.append(lines[i].lstrip()[1:].removeprefix(" "))
                i += 1
            out.append(f"<blockquote>{to_html(chr(10).join(quoted), shift=shift)}</blockquote>")
            continue
        if _ITEM.match(line) and not para:
            items: list[tuple[int, bool, str]] = []
            while i < len(lines) and lines[i].strip():
                m = _ITEM.match(lines[i])
                if m:
                    items.append((len(m.group(1).expandtabs(4)), m.group(2)[0].isdigit(), m.group(3)))
                elif items:  # a continuation line of the last item
                    indent, ordered, txt = items[-1]
                    items[-1] = (indent, ordered, f"{txt} {lines[i].strip()}")
                i += 1
            out.append(_list(items))
            continue
        para.append(line)
        i += 1
    flush()
    return "\n".join(out)


__all__ = ["to_html"]
