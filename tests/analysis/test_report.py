"""The report: files written, figures embedded, scorecard present, Markdown twin; the CLI; a real browser (slow)."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import figures
from analysis.claims import scorecard
from analysis.figures import claims_forest
from analysis.report import build as report
from analysis.report import evidence, headline, render, sections
from analysis.runs import names, results, tidy
from analysis.stats import gain
from analysis.stats.verdicts import VERDICTS, css_class
from tests.analysis import synthetic

C = synthetic.Curve
CURVES = {
    "grpo": C(a=0.5, c_mid=2e12, clip_low=0.0004, clip_high=0.0009, collapse_step=30),
    "grpo_rr": C(a=0.6, c_mid=2e12, clip_low=0.0005, clip_high=0.0008),
    "gspo": C(a=0.8, c_mid=2e12, clip_low=0.05, clip_high=0.1),
    "sapo": C(a=0.7, c_mid=2e12, clip_low=0.0, clip_high=0.0),
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, report.Report]:
    root = tmp_path_factory.mktemp("results")
    synthetic.make_study(root, CURVES, seeds=(0, 1, 2), n_steps=60, grid={"max_new_tokens": [256, 1024]}, fail=["sapo"])
    (root / "mystudy").mkdir()
    ids = sorted(p.name for p in (root / "runs").iterdir())
    (root / "mystudy" / "run_ids.txt").write_text("\n".join([*ids, "deadbeef0000"]) + "\n")
    with pytest.warns(UserWarning, match="deadbeef0000"):
        rep = report.report_from_results(root, study="mystudy")
    return root, rep


def test_report_files_and_embedded_figures(built) -> None:
    root, rep = built
    assert rep.html == root / "mystudy" / "report" / "index.html" and rep.html.is_file()
    assert rep.markdown.is_file() and rep.markdown.name == "index.md"
    page = rep.html.read_text()
    imgs = re.findall(r"<img [^>]*src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(imgs) == len(rep.figures) >= 4
    for name, png in rep.figures.items():
        assert base64.b64encode(png.read_bytes()).decode() in imgs, name
        assert f"id='{name}'" in page
    assert "src='figures/" not in page and '<img src="http' not in page  # self-contained
    assert set(rep.figures) | set(rep.skipped) == {
        *figures.FIGURES,
        claims_forest.NAME,
    }  # + the claims under the headline
    for why in rep.skipped.values():
        assert why.split(";")[0][:30] in page.replace("&#x27;", "'")


def test_report_scorecard_provenance_problems(built) -> None:
    _, rep = built
    page, md = rep.html.read_text(), rep.markdown.read_text()
    assert 'class="scorecard"' in page
    for claim in ("C1", "C2", "C3", "C4", "C5", "C6"):
        assert f"<td>{claim}</td>" in page and f"| {claim} |" in md
    assert "0" * 40 in page and "0" * 40 in md  # git sha from the manifests
    assert "deadbeef0000" in page and "missing" in md  # missing run listed
    assert "failed" in page and "synthetic failure" in md  # failed sapo runs with their error
    assert "collapsed" in md
    for name, png in rep.figures.items():
        assert f"]({png.relative_to(rep.markdown.parent).as_posix()})" in md, name
    assert not list(rep.html.parent.rglob(".*.tmp*"))  # atomic writes left no temporaries


def test_cli_rebuilds_report(built, tmp_path) -> None:
    root, _ = built
    out = tmp_path / "rep"
    res = subprocess.run(
        [sys.executable, "-m", "analysis", "report", str(root), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out / "index.html")
    assert (out / "index.html").is_file() and (out / "index.md").is_file()
    assert "data:image/png;base64," in (out / "index.html").read_text()


SCREEN = (1280, 900)
"""The first screen a reader sees (px): every verdict is on it."""


def dump_dom(page: str, on_load: str, tmp_path: Path) -> str:
    """The DOM headless Chromium holds once `page` has loaded in a SCREEN-sized window and run the JavaScript
    `on_load` (the slow tier: a skip where Chromium is missing, a failure where STUDY_REQUIRE names it)."""
    from tests.shared import chromium, require

    require("chromium")
    probe = tmp_path / "probe.html"
    script = f"<script>window.addEventListener('load',()=>{{{on_load}}});</script>"
    probe.write_text(page.replace("</body>", script + "</body>"))
    res = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={SCREEN[0]},{SCREEN[1]}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.slow
def test_report_renders_in_headless_chromium(built, tmp_path) -> None:
    _, rep = built
    loaded = "i.filter(x=>x.complete&&x.naturalWidth>0).length"
    count = f"const i=[...document.images];document.title='IMG:'+i.length+':'+{loaded};"
    m = re.search(r"<title>IMG:(\d+):(\d+)</title>", dump_dom(rep.html.read_text(), count, tmp_path))
    assert m
    assert int(m.group(1)) == len(rep.figures) and m.group(1) == m.group(2)


def test_report_links_pdf_svg_lists_runs_and_strata(built) -> None:
    _, rep = built
    out = rep.html.parent
    page, md = rep.html.read_text(), rep.markdown.read_text()
    for name in rep.figures:
        for ext in ("pdf", "svg"):
            assert (out / "figures" / f"{name}.{ext}").is_file()
            assert f"<a href='figures/{name}.{ext}'>{ext.upper()}</a>" in page
            assert f"[{ext.upper()}](figures/{name}.{ext})" in md
    # every run listed with its registry label; the scorecard is stratified by max_new_tokens
    assert "### Runs" in md and names.label("grpo_rr") in md
    assert (out / "tables" / "runs.csv").is_file() and (out / "tables" / "scorecard_strata.csv").is_file()
    assert "### Per-stratum verdicts" in md and "max_new_tokens=256" in md and "max_new_tokens=1024" in md
    assert "contradicted if the comparison is contradicted in any stratum with data" in page


def test_report_reuses_the_figures_output_of_the_same_runs(built, tmp_path) -> None:
    # `python -m analysis figures` then `report --figures`: the report copies that output's files and tables (the
    # study workflow's report rule), which a marker written into one PNG shows; with other runs it draws them again
    import matplotlib

    from analysis.__main__ import main

    matplotlib.use("Agg")
    root, fresh = built
    figs = tmp_path / "figures"
    assert main(["figures", str(root), "--study", "mystudy", "--out", str(figs)]) == 0
    name = next(iter(fresh.figures))
    marked = (figs / f"{name}.png").read_bytes() + b"reused"
    (figs / f"{name}.png").write_bytes(marked)
    out = tmp_path / "rep"
    rep = report.report_from_results(root, study="mystudy", out_dir=out, figures_dir=figs)
    assert set(rep.figures) == set(fresh.figures) and rep.skipped == fresh.skipped
    assert rep.figures[name].read_bytes() == marked
    assert base64.b64encode(marked).decode() in rep.html.read_text()
    fresh_tables = fresh.html.parent / "tables"
    for csv in fresh_tables.glob("figure*.csv"):  # the figures' tables: the same bytes as drawn for the report
        assert (out / "tables" / csv.name).read_bytes() == csv.read_bytes(), csv.name
    assert rep.html.read_text().count("<figure id=") == fresh.html.read_text().count("<figure id=")

    # other runs (one run directory removed from the study): drawn again, the marker is gone
    other = tmp_path / "other"
    shutil.copytree(root, other)
    gone = next(p for p in (other / "runs").iterdir())
    shutil.rmtree(gone)
    again = report.report_from_results(other, study="mystudy", out_dir=tmp_path / "rep2", figures_dir=figs)
    assert again.figures[name].read_bytes() != marked


def test_html_and_markdown_are_one_list_of_blocks(built) -> None:
    # the same headings, figures and tables in the same order in both files
    _, rep = built
    page, md = rep.html.read_text(), rep.markdown.read_text()
    heads_html = [
        (int(level), re.sub(r"<[^>]+>", "", text).replace("&#x27;", "'"))
        for level, text in re.findall(r"<h(\d)[^>]*>(.*?)</h\d>", page)
    ]
    heads_md = [
        (len(m.group(1)), re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)))
        for m in re.finditer(r"^(#+) (.*)$", md, flags=re.MULTILINE)
    ]
    assert heads_html == heads_md and len(heads_html) > 10
    assert re.findall(r"<figure id='([^']+)'", page) == re.findall(r"^!\[([^\]]+)\]", md, flags=re.MULTILINE)
    assert page.count("<table") == md.count("\n|---") + md.count("(none)\n")


def test_blocks_write_themselves_in_both_formats(tmp_path) -> None:
    head = render.Heading(4, ("fig.t", " (", render.Link("CSV", "tables/fig.t.csv"), ")"))
    assert head.html() == "<h4>fig.t (<a href='tables/fig.t.csv'>CSV</a>)</h4>"
    assert head.markdown() == "#### fig.t ([CSV](tables/fig.t.csv))\n"
    assert render.Heading(2, ("Study",), "study").html() == "<h2 id='study'>Study</h2>"
    para = render.Para(("a < b: see ", render.Link("the CSV", "t.csv"), "."))
    assert para.html() == "<p>a &lt; b: see <a href='t.csv'>the CSV</a>.</p>"
    assert para.markdown() == "a < b: see [the CSV](t.csv).\n"
    png = tmp_path / "f.png"
    png.write_bytes(b"\x89PNG")
    b64 = base64.b64encode(b"\x89PNG").decode()
    fig = render.Figure("f", png, "figures/f.png", "Figure 1.", (render.Link("PDF", "figures/f.pdf"),))
    assert fig.html() == (
        f"<figure id='f'><img alt='f' src='data:image/png;base64,{b64}'>"
        "<figcaption>Figure 1. <a href='figures/f.pdf'>PDF</a></figcaption></figure>"
    )
    assert fig.markdown() == "![f](figures/f.png)\n\nFigure 1. [PDF](figures/f.pdf)\n"


def headline_html(page: str) -> str:
    """The headline section of a report page: from its heading to the next section's."""
    return page.split("<h2 id='headline'>")[1].split("<h2")[0]


def headline_rows(page: str) -> list[list[str]]:
    """The headline table's rows as text, one list of cells per row."""
    table = headline_html(page).split('<table class="headline">')[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>")[1])
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", r)] for r in rows]


def visible_words(section: str) -> int:
    """The words a reader sees in an HTML section: tags and images out, a collapsed <details> down to its summary."""
    shown = re.sub(r"<details>.*?<summary>(.*?)</summary>.*?</details>", r"\1", section, flags=re.DOTALL)
    shown = re.sub(r"<img[^>]*>", " ", shown)
    return len(html.unescape(re.sub(r"<[^>]+>", " ", shown)).split())


def test_report_leads_with_the_headline_and_figures_1_to_3(built) -> None:
    # the reader comes for the verdicts and Figures 1-3, not the study table, provenance, packages, the configuration
    # and the runs
    _, rep = built
    page, md = rep.html.read_text(), rep.markdown.read_text()
    order = [
        "id='headline'",
        '<table class="headline">',
        f"<figure id='{claims_forest.NAME}'",
        "<figure id='figure1_reward'",
        "<figure id='figure3_routing_replay'",
        "id='scorecard'",
        "id='problems'",
        "id='provenance'",
        "<h3>Runs</h3>",
    ]
    pos = [page.index(marker) for marker in order]
    assert pos == sorted(pos)
    assert md.index("## Headline") < md.index("## Scorecard") < md.index("## Study and provenance")
    assert '{"' not in page and '{"' not in md  # values as text, not JSON
    assert "<p>24 runs (completed 12, " in page  # under the title: 24 runs, their states as text


def test_the_headline_is_one_table_of_the_claims_in_at_most_250_words(built) -> None:
    # did the paper's claims hold here? a row per claim, its verdict a coloured label, read in seconds: the split,
    # pairing and role one click away (collapsed), never a bracket per line; the Markdown twin has the same table
    _, rep = built
    page, md = rep.html.read_text(), rep.markdown.read_text()
    section = headline_html(page)
    assert visible_words(section) <= 250
    assert section.count("<table") == 2 and section.count("<details>") == 1  # the claims; how each was read, collapsed
    rows = headline_rows(page)
    assert [r[0] for r in rows] == ["C1", "C2", "C3", "C4", "C5", "C6"]
    labels = re.findall(r'<span class="label ([\w-]+)">([^<]+)</span>', section)
    assert len(labels) == 6
    for (cls, verdict), row, card in zip(labels, rows, rep.scorecard, strict=True):
        assert verdict == card.verdict == row[headline.COLUMNS.index("verdict")] and cls == verdict.replace(" ", "-")
    by_claim = {r[0]: dict(zip(headline.COLUMNS, r, strict=True)) for r in rows}
    assert by_claim["C1"]["verdict"] == "supported" and " to " in by_claim["C1"]["this study: estimate [95% CI]"]
    assert by_claim["C2"]["paper"].startswith("~100x")
    assert (
        by_claim["C5"]["regime"] == "not in this study" and by_claim["C5"]["this study: estimate [95% CI]"] == "\u2014"
    )
    assert by_claim["C6"]["this study: estimate [95% CI]"].startswith("compute: ")  # a claim of two parts
    assert "split: train" not in re.sub(r"<details>.*?</details>", "", section, flags=re.DOTALL)
    assert section.count("split: train") == 6  # once per claim, collapsed
    problems = "1 of the 25 runs of the study (1 missing) are in no verdict, figure or table; 6 failed, in no verdict"
    assert f"Runs not read:</b> {problems}" in section
    # the Markdown twin: the same table, row for row
    md_head = md.split("## Headline")[1].split("\n## ")[0]
    assert "| " + " | ".join(headline.COLUMNS) + " |" in md_head
    for row in rows:
        assert "| " + " | ".join(row) + " |" in md_head
    assert f"![{claims_forest.NAME}](figures/{claims_forest.NAME}.png)" in md_head


def test_the_claims_forest_draws_each_verdicts_number_against_its_threshold(built) -> None:
    # the picture under the table: per claim the number each stratum's verdict was read off, and the thresholds
    _, rep = built
    cards = {c.claim: c for c in rep.scorecard}
    c1 = claims_forest.estimates(cards["C1"])
    assert [e.label for e in c1] == ["max_new_tokens=256", "max_new_tokens=1024"]
    assert all(e.name.startswith("reward(gspo) - reward(grpo_rr)") and e.low < e.estimate < e.high for e in c1)
    assert claims_forest.thresholds(cards["C1"]) == (0.0,) and claims_forest.thresholds(cards["C2"]) == (10.0,)
    assert claims_forest.thresholds(cards["C3"]) == (0.0, 0.5)
    assert claims_forest.estimates(cards["C5"]) == []  # not in this study: no number
    assert {e.part for e in claims_forest.estimates(cards["C6"])} == {"compute", "length"}
    assert rep.figures[claims_forest.NAME].read_bytes()[:4] == b"\x89PNG"


def test_reused_tables_read_back_exactly_without_deprecation_warnings(built, tmp_path) -> None:
    # read_csv's float_precision is deprecated in pandas 3 (Pandas4Warning); its default parser reads back exactly
    # the floats to_csv wrote, which is what the reused tables must hold
    import warnings

    import numpy as np
    import pandas as pd

    from analysis.runs import tidy

    root, _ = built
    st = tidy.load_study(root, warn_missing=False)
    src = tmp_path / "figs"
    (src / figures.TABLES).mkdir(parents=True)
    values = np.array([0.1 + 0.2, 1 / 3, 2.0 / 7e-300, 5e-324, np.pi * 1e17, -np.e, 1.0000000000000002])
    pd.DataFrame({"x": values, "n": np.arange(len(values))}).to_csv(src / figures.TABLES / "f.t.csv", index=False)
    (src / "f.png").write_bytes(b"png")
    entry = {"files": ["f.png"], "caption": "Figure f.", "tables": {"t": f"{figures.TABLES}/f.t.csv"}}
    index = {"data": figures.data_fingerprint(st), "figures": {"f": entry}, "skipped": {}}
    (src / figures.INDEX).write_text(json.dumps(index))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        reused = report.reuse_figures(st, src, tmp_path / "out")
    assert reused is not None
    table = reused[0].tables["f"]["t"]
    assert table["x"].to_numpy().tobytes() == values.tobytes()  # bit for bit


def test_the_heldout_gain_has_a_line_per_algorithm_over_its_table(built) -> None:
    _, rep = built
    md = rep.markdown.read_text()
    gain_md = md.split("### Held-out gain")[1].split("\n### ")[0]
    for alg in ("grpo", "grpo_rr", "gspo"):  # sapo failed: no gain
        assert f"**Held-out gain, {names.label(alg)}:** RL " in gain_md
    assert "over 2 configurations of max_new_tokens" in gain_md
    assert (rep.html.parent / "tables" / "heldout_gain.csv").is_file()
    assert gain.GAIN_RULE.format(metric="eval_in_dist")[1:40] in gain_md
    assert "Held-out gain" not in md.split("## Headline")[1].split("\n## ")[0]


def test_routing_volatility_figure_follows_figures_1_3_with_c3_c4_per_configuration(built) -> None:
    # max_new_tokens is a non-algorithm axis here: the routing-volatility figure is drawn, after Figures 1-3, with C3
    # per configuration beside it (no gspo_rr: no C4), and not repeated under "More figures"
    _, rep = built
    page, md = rep.html.read_text(), rep.markdown.read_text()
    assert "figure8_routing_volatility" in rep.figures
    routing = md.split("## Routing volatility")[1].split("\n## ")[0]
    assert "figure8_routing_volatility.png" in routing and "| configuration | C3 | C3 evidence |" in routing
    assert "max_new_tokens=256" in routing and "collapse_rate(grpo) - collapse_rate(grpo_rr)" in routing
    assert md.index("## Figures 1-3") < md.index("## Routing volatility") < md.index("## Scorecard")
    assert page.count("<figure id='figure8_routing_volatility'>") == 1


def test_older_runs_without_a_step0_row_still_report_and_say_the_gain_is_unknown(tmp_path) -> None:
    synthetic.make_study(tmp_path, {"gspo": C(a=0.8, c_mid=2e12)}, seeds=(0, 1), n_steps=20, start_eval=False)
    rep = report.report_from_results(tmp_path)
    md = rep.markdown.read_text()
    assert "**Held-out gain:** not available: no run has an evaluation of its starting policy" in md
    assert "Not available: no run has an evaluation of its starting policy" in md
    assert "figure8_routing_volatility" in rep.skipped and "swept axis other than algorithm" in md


def test_signal_table_splits_no_signal_groups_by_quarter(study):
    """The synthetic runs log zero_var_group_frac = 0.2 + 0.4 t and its solved part 0.1 + 0.3 t (t = step / steps):
    the table's first and last quarter and the solved share are those lines' means over the runs that went the
    whole way (a collapsed or failed run's quarters are of its own, shorter, length)."""
    table = sections.signal_table(study)
    assert len(table) == study.runs.groupby(study.group_cols, observed=True).ngroups
    full = table[table["algorithm"].isin([names.label(a) for a in ("gspo", "gspo_rr", "grpo_rr")])]
    assert len(full) == 12
    for _, row in full.iterrows():
        assert float(row["first quarter"]) == pytest.approx(0.2 + 0.4 * 0.125, abs=0.01)
        assert float(row["last quarter"]) == pytest.approx(0.2 + 0.4 * 0.875, abs=0.01)
        assert float(row["no-signal groups"]) == pytest.approx(0.4, abs=0.01)
        assert float(row["of which solved by every sample"]) == pytest.approx(0.25, abs=0.01)


def test_length_report_has_the_coldstart_budget_table_power_and_emulation_tables(built, tmp_path) -> None:
    root, _ = built
    (root / "mystudy" / "coldstart_budgets").mkdir(exist_ok=True)
    budgets = "\n".join(
        [
            "coldstart,task,knobs,max_new_tokens,pass_at_1,truncated,reference_fits,problems,samples,eval_s",
            'tiny-chain_sum-aaaa,chain_sum,"{""terms"": [2, 6]}",16,0.08,0.85,0.2,128,4,0.1',
            'tiny-chain_sum-aaaa,chain_sum,"{""terms"": [2, 6]}",48,0.41,0.02,1.0,128,4,0.2',
        ]
    )
    (root / "mystudy" / "coldstart_budgets" / "tiny-chain_sum-aaaa.csv").write_text(budgets + "\n")
    parity = "what,precision,p99 real,p99 emulated,p99 emulated/real\nmismatch,bf16,0.121,0.0586,0.485\n"
    (root / "mystudy" / "precision_parity.csv").write_text(parity)
    try:
        with pytest.warns(UserWarning, match="deadbeef0000"):  # the fixture's run list names a missing run
            rep = report.report_from_results(root, study="mystudy", out_dir=tmp_path / "rep")
    finally:
        shutil.rmtree(root / "mystudy" / "coldstart_budgets")
        (root / "mystudy" / "precision_parity.csv").unlink()
    page, md = rep.html.read_text(), rep.markdown.read_text()
    assert "Generation budget at the cold start" in md and "pass@1 rises with the budget (0.080 at 16 tokens" in md
    assert (tmp_path / "rep" / "tables" / "coldstart_budgets.csv").is_file()
    # C6's length part (max_new_tokens 1024 vs 256) gets a smallest detectable difference per stratum
    assert "Power: the smallest difference these seeds detect" in md and "length gain (max_new_tokens" in md
    power_rows = evidence.power_table(rep.scorecard)
    assert set(power_rows["claim"]) == {"C6"} and (power_rows["smallest detectable |difference|"] != "n/a").all()
    assert power_rows["seeds per group to detect 0.03"].str.isdigit().all()
    assert "bf16 cross-engine mismatch p99 0.0586 emulated vs 0.121 real (ratio 0.48)" in md
    assert md.index("Generation budget at the cold start") < md.index("## Scorecard") < md.index("Emulated against")
    assert "precision-parity" in page


def test_the_report_embeds_the_studys_notes_from_docs_studies(built, tmp_path) -> None:
    """How the study was set up: the sweep file's description, then docs/studies/<sweep stem>.md rendered (headings,
    lists, tables, code spans; HTML in the notes escaped), after the learning-signal table; the YAML's comments are
    not the notes. Without the doc the section says so."""
    root, _ = built
    (tmp_path / "sweeps").mkdir()
    sweep = tmp_path / "sweeps" / "mystudy.yaml"
    sweep.write_text("# a comment, not a note\nname: mystudy\ndescription: A study that learns.\naxes: {seed: [0]}\n")
    (tmp_path / "docs" / "studies").mkdir(parents=True)
    doc = "# Why G = 16\n\nMeasured **0.27** no-signal groups (`G = 8`).\n\n- lr 3e-4\n- <script>x</script>\n\n"
    doc += "| G | no-signal |\n|---|---|\n| 8 | 0.27 |\n"
    (tmp_path / "docs" / "studies" / "mystudy.md").write_text(doc)
    rep = report.report_from_results(
        root, study="mystudy", out_dir=tmp_path / "rep", sweep=sweep, figures_dir=no_figures(root, "mystudy")
    )
    md, page = rep.markdown.read_text(), rep.html.read_text()
    setup = page.split("<h2 id='setup'>")[1].split("<h2")[0]
    assert "From the sweep file mystudy.yaml: A study that learns." in setup
    assert "<h3>Why G = 16</h3>" in setup and "<strong>0.27</strong>" in setup and "<code>G = 8</code>" in setup
    assert "<li>lr 3e-4</li>" in setup and "<th>no-signal</th>" in setup and "<td>0.27</td>" in setup
    assert "<script>" not in setup and "&lt;script&gt;x&lt;/script&gt;" in setup
    assert "a comment" not in md and "### Why G = 16" in md and "| 8 | 0.27 |" in md
    assert md.index("### Learning signal") < md.index("## How the study was set up") < md.index("## Figure tables")
    # no doc for the study: the section says so, the report is still written
    bare = tmp_path / "sweeps" / "other.yaml"
    bare.write_text("name: other\naxes: {seed: [0]}\n")
    again = report.report_from_results(
        root, study="mystudy", out_dir=tmp_path / "rep2", sweep=bare, figures_dir=no_figures(root, "mystudy")
    )
    assert "No study notes: docs/studies/other.md does not exist." in again.markdown.read_text()


def no_figures(root: Path, study: str | None = None) -> Path:
    """A `figures` output of the runs under `root` that drew no figure: a report given it draws none either (fast)."""
    st = results.load(root, study, warn_missing=False)
    out = root / "no-figures"
    out.mkdir(exist_ok=True)
    index = {"data": figures.data_fingerprint(st), "figures": {}, "skipped": {}}
    (out / figures.INDEX).write_text(json.dumps(index))
    return out


def test_the_headline_says_c3_c4_were_not_tested_below_their_regime(tmp_path) -> None:
    # the routing moved 0.29% of expert slots since pi_old (router_lr_scale 1), far below the 5% C3 and C4 need: their
    # rows say so once, in the regime column, with the verdict in its own colour, and no claim is called
    # contradicted; with the threshold set below what was measured (--min-volatility), the normal verdicts come back
    from analysis.__main__ import main

    synthetic.make_routing_study(tmp_path, scales=(1.0,), seeds=(0, 1, 2, 3, 4), n_steps=30)
    rep = report.report_from_results(tmp_path, out_dir=tmp_path / "rep", figures_dir=no_figures(tmp_path))
    page, md = rep.html.read_text(), rep.markdown.read_text()
    rows = {r[0]: dict(zip(headline.COLUMNS, r, strict=True)) for r in headline_rows(page)}
    for claim in ("C3", "C4"):
        assert rows[claim]["verdict"] == "not tested in regime"
        assert rows[claim]["regime"] == "not in regime: 0.29% per update (needs 5%; paper ~10%)"
    assert rows["C3"]["this study: estimate [95% CI]"] == "0 [-0.434, 0.434] (n=5 vs 5)"  # evidence about this scale
    assert '<span class="label not-tested-in-regime">' in headline_html(page)
    assert "contradicted" not in headline_html(page)
    assert headline_html(page).count("0.29%") == 2  # said once per claim, not again in a line above the table
    assert ".not-tested-in-regime{background:#e3eef8}" in page  # its own colour, not the contradicted red
    assert '<tr class="not-tested-in-regime"><td>C3</td>' in page
    assert "| C3 | GRPO collapses without Routing Replay | not tested in regime |" in md
    assert "grpo collapsed in 0 of 5 runs and grpo_rr in 0 of 5: evidence about this scale" in md  # the scorecard
    st = tidy.load_study(tmp_path)
    rules = scorecard.Rules(min_volatility=0.001)
    table = headline.headline_table(scorecard.scorecard(st, rules), rules).df.set_index("claim")
    assert list(table.loc[["C1", "C2", "C3", "C4"], "verdict"]) == [
        "supported",
        "supported",
        "contradicted",
        "supported",
    ]
    assert table.loc["C3", "regime"] == "in regime: 0.29% per update (needs 0.1%; paper ~10%)"
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "rep3"), "--min-volatility", "-1"]) == 2


def test_a_declared_comparison_the_runs_do_not_match_is_flagged_first_in_the_report(tmp_path) -> None:
    import yaml

    c = synthetic.Curve
    synthetic.make_study(
        tmp_path, {"grpo": c(a=0.3, c_mid=2e12), "grpo_rr": c(a=0.8, c_mid=2e12)}, seeds=(0, 1, 2), n_steps=30
    )
    entry = {
        "name": "replay_cost_grpo",
        "role": "primary",
        "claim": "C3",
        "test": "difference",
        "metric": "eval_in_dist",
        "arms": {"axis": "algorithm", "treatment": "grpo", "control": "grpo_rr"},
        "window": "gain",
        "threshold": -0.1,
        "seeds": [0, 1, 2, 3],
        "power": 0.8,
        "assumed_sd": 0.05,
        "pairing": "seed",
    }
    sweep = tmp_path / "sweeps" / "confirm.yaml"
    sweep.parent.mkdir()
    sweep.write_text(yaml.safe_dump({"name": "confirm", "comparisons": [entry]}))
    rep = report.report_from_results(tmp_path, out_dir=tmp_path / "rep", figures_dir=no_figures(tmp_path), sweep=sweep)
    page, md = rep.html.read_text(), rep.markdown.read_text()
    section = headline_html(page)
    items = re.findall(r'<li class="([\w-]+)"><b>([^<]*)</b> ([^<]*)</li>', section.split('<ul class="lines">')[1])
    cls, head, text = items[0]
    assert (cls, head) == ("deviation", "Deviation from the declared comparison:")
    assert "C3 (replay_cost_grpo)" in text and "declared seed(s) [3] have no usable run" in text
    assert "ul.lines li.deviation{" in page and "deviates from the declaration:" in page
    assert md.split("## Headline")[1].split("\n\n")[2].startswith("- **Deviation from the declared comparison:**")
    rows = {r[0]: dict(zip(headline.COLUMNS, r, strict=True)) for r in headline_rows(page)}
    assert rows["C3"]["in a few words"].endswith("(declared replay_cost_grpo)")
    assert rows["C3"]["verdict"].startswith("exploratory: ") and rows["C1"]["verdict"] in VERDICTS
    assert "exploratory (the runs deviate from replay_cost_grpo)" in section  # how it was read, collapsed
    assert visible_words(section) <= 250


@pytest.mark.slow
def test_every_verdict_is_on_the_first_screen_in_chromium(built, tmp_path) -> None:
    # a reader opening the report on a 1280 x 900 screen sees every claim's verdict without scrolling: headless
    # Chromium lays the page out at that size and writes each verdict label's bottom edge into the page it dumps
    _, rep = built
    labels = "[...document.querySelectorAll('table.headline span.label')].map(e=>e.getBoundingClientRect().bottom)"
    measure = (
        "const p=document.createElement('pre');p.id='probe';"
        f"p.textContent=JSON.stringify({{height:window.innerHeight,bottoms:{labels}}});document.body.appendChild(p);"
    )
    m = re.search(r'<pre id="probe">(.*?)</pre>', dump_dom(rep.html.read_text(), measure, tmp_path))
    assert m
    seen = json.loads(html.unescape(m.group(1)))
    assert seen["height"] <= SCREEN[1] and len(seen["bottoms"]) == 6
    assert all(0 < b <= SCREEN[1] for b in seen["bottoms"]), seen


def test_the_claims_page_holds_each_studys_headline_and_names_the_studies_it_could_not_read(built, tmp_path) -> None:
    from analysis.report import claims_page

    root, rep = built
    results_dir = tmp_path / "results"
    shutil.copytree(root / "mystudy", results_dir / "mystudy")
    (results_dir / "later").mkdir()  # a study whose runs are listed but whose report is not built yet
    (results_dir / "later" / "run_ids.txt").write_text("# study later: 0 run(s)\n")
    done = subprocess.run(
        [sys.executable, "-m", "analysis", "claims", str(results_dir)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "1 studies: mystudy" in done.stdout and "later: not on the page" in done.stdout
    page = (results_dir / "claims.md").read_text()
    want = headline.headline_table(rep.scorecard).df
    for _, row in want.iterrows():  # every claim's verdict, estimate and regime as the study's report gives them
        line = next(ln for ln in page.splitlines() if ln.startswith(f"| {row['claim']} |"))
        assert "| mystudy |" in line and f"| {row['verdict']} |" in line
        assert render.md_escape(row["this study: estimate [95% CI]"]) in line
        assert claims_page.regime_kind(row["regime"]) in line
    assert "later" in page and "not built by this version" in page
    shown = (results_dir / "claims.html").read_text()
    for card in rep.scorecard:  # each verdict a label coloured by the verdict, as in the report's headline
        label = f'<span class="label {css_class(card.verdict)}">{html.escape(headline.verdict_text(card))}</span>'
        assert label in shown, card.claim


@pytest.mark.parametrize(
    ("regime", "kind"),
    [
        ("\u2014", "\u2014"),
        ("not in this study", "not in this study"),
        ("partly not in this study", "partly not in this study"),
        ("not in regime: 0.26% per update (needs 5%; paper ~10%)", "not reached"),
        ("in regime: 8.1% per update (needs 5%)", "natural"),
        ("emulated regime: 10.9% per update (needs 5%; paper ~10%)", "emulated"),
    ],
)
def test_the_claims_page_names_the_regime_a_study_reached(regime, kind) -> None:
    from analysis.report import claims_page

    assert claims_page.regime_kind(regime) == kind


def test_the_claims_page_refuses_a_results_folder_that_is_not_one(tmp_path) -> None:
    from analysis.report import claims_page

    with pytest.raises(ValueError, match="not a directory; valid: a results folder"):
        claims_page.write_claims_page(tmp_path / "nowhere")


def test_the_provenance_says_how_the_verifier_was_sandboxed() -> None:
    """The manifest's scoring_sandbox (the sandbox's level, null for the native grammars) counted like the host; runs
    whose manifest predates it are left out of the count."""
    import pandas as pd

    manifests = {
        "a": {"scoring_sandbox": "seccomp+ipc-ns+keyring"},
        "b": {"scoring_sandbox": "seccomp+ipc-ns+keyring"},
        "c": {"scoring_sandbox": "seccomp"},
        "d": {"scoring_sandbox": None},
        "e": {},
    }
    empty = pd.DataFrame()
    study = tidy.Study(long=empty, runs=empty, layers=empty, axes=[], missing=[], manifests=manifests)
    seen = sections.provenance(study)["scoring_sandbox"]
    assert seen == {"seccomp+ipc-ns+keyring": 2, "seccomp": 1, "none (native grammars)": 1}
    assert render.counted(seen).startswith("seccomp+ipc-ns+keyring (2 runs), seccomp (1 run), none (native")
