"""The study notes' Markdown renderer: what the notes use becomes HTML, and nothing in a note runs or injects markup."""

from analysis.report.markdown_html import to_html


def test_headings_paragraphs_lists_tables_and_code() -> None:
    md = (
        "# Title\n\nOne *short* paragraph\nover two lines, **bold** and `x < 1`.\n\n"
        "- a\n- b\n  - b1\n1. one\n\n| k | v |\n|---|--:|\n| G | 16 |\n\n```\nif a < b:\n```\n\n---\n> quoted"
    )
    out = to_html(md, shift=2)
    assert "<h3>Title</h3>" in out
    assert "<p>One <em>short</em> paragraph over two lines, <strong>bold</strong> and <code>x &lt; 1</code>.</p>" in out
    assert "<ul><li>a</li><li>b<ul><li>b1</li></ul></li></ul><ol><li>one</li></ol>" in out
    assert "<thead><tr><th>k</th><th>v</th></tr></thead><tbody><tr><td>G</td><td>16</td></tr></tbody>" in out
    assert "<pre><code>if a &lt; b:</code></pre>" in out and "<hr>" in out
    assert "<blockquote><p>quoted</p></blockquote>" in out


def test_html_in_a_note_is_escaped_and_only_safe_links_are_kept() -> None:
    md = (
        '<img src=x onerror="alert(1)"> <script>alert(1)</script>\n\n[ok](../runs.md) [web](https://arxiv.org) '
        '[bad](javascript:alert(1)) [q](x"onmouseover="y)\n\n`<b>` **<i>**'
    )
    out = to_html(md)
    assert "<img" not in out and "<script" not in out and "&lt;script&gt;" in out
    assert '<a href="../runs.md">ok</a>' in out and '<a href="https://arxiv.org">web</a>' in out
    assert "javascript:" not in out.split("bad")[0] and '<a href="javascript' not in out
    assert 'onmouseover="' not in out and "<code>&lt;b&gt;</code>" in out and "<strong>&lt;i&gt;</strong>" in out
