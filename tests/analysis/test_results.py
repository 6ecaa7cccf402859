"""The analysis never hides a missing run: every run `python -m analysis figures|report` could not read is listed with
the reason and counted in the headline, and the report is always written (the workflow's order: figures, then the
report reusing them)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analysis.__main__ import main
from analysis.report import build
from analysis.runs import results
from tests.analysis import synthetic

C = synthetic.Curve
CURVES = {"grpo": C(a=0.5, c_mid=2e12), "gspo": C(a=0.8, c_mid=2e12)}


def _study(root: Path, **kwargs) -> list[str]:
    ids = synthetic.make_study(root, CURVES, seeds=(0, 1), n_steps=20, config_format="yaml", **kwargs)
    (root / "s").mkdir()
    (root / "s" / "run_ids.txt").write_text("\n".join(ids) + "\n")
    return ids


def _figures_then_report(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict, str]:
    """`figures` then `report --figures` as the workflow runs them: (index.md, figures.json, stderr of both)."""
    assert main(["figures", str(root), "--study", "s", "--out", str(root / "s" / "figures")]) == 0
    assert main(["report", str(root), "--study", "s", "--figures", str(root / "s" / "figures")]) == 0
    err = capsys.readouterr().err
    index = json.loads((root / "s" / "figures" / "figures.json").read_text())
    return (root / "s" / "report" / "index.md").read_text(), index, err


def test_a_truncated_metrics_file_is_listed_counted_and_left_out_of_the_verdicts(tmp_path, capsys) -> None:
    # before: exit 0, "4 runs (completed 4; none missing)", the run counted as completed with no rows (C1 on n = 2 vs
    # 1 here) and named nowhere
    ids = _study(tmp_path)
    path = tmp_path / "runs" / ids[0] / "metrics.parquet"
    path.write_bytes(path.read_bytes()[:200])
    md, index, err = _figures_then_report(tmp_path, capsys)
    lead = md.split("## Headline")[0]
    assert "3 runs (completed 3; 1 unreadable)" in lead and "none missing" not in md
    headline = md.split("## Headline")[1].split("\n## ")[0]
    assert "- **Runs not read:** 1 of the 4 runs of the study (1 unreadable) are in no verdict" in headline
    problems = md.split("## Failed, collapsed, unreadable and missing runs")[1].split("\n## ")[0]
    assert f"| {ids[0]} | grpo | 0 | unreadable |" in problems and "| metrics.parquet: " in problems
    assert "(n=2 vs 1)" in headline  # C1 compares the runs that were read: gspo 2, grpo 1
    assert f"run {ids[0]} not read: metrics.parquet:" in err
    assert list(index["unreadable"]) == [ids[0]] and index["unreadable"][ids[0]].startswith("metrics.parquet:")


def test_a_study_that_never_evaluates_gets_its_figures_and_report(tmp_path, capsys) -> None:
    # eval_every: 0 writes the eval columns NaN at every step and no step-0 row; before: `figures` and `report`
    # crashed in Figure 1 ("no finite (positive, for a log grid) x values"), so no report of the study was written
    _study(tmp_path, eval_every=10**9, start_eval=False)
    md, index, _ = _figures_then_report(tmp_path, capsys)
    assert {"figure1_reward", "figure2_clipping"} <= set(index["figures"])
    assert "**Held-out gain:** not available: eval_in_dist not logged" in md
    assert "4 runs (completed 4; none unreadable or missing)" in md


def test_a_run_with_an_invalid_config_is_listed_as_unreadable_not_a_crash(tmp_path, capsys) -> None:
    # algorithm 'nan' (a YAML value gone wrong): before, both commands died with UnknownAlgorithmError: 'nan'
    ids = _study(tmp_path)
    cfg = tmp_path / "runs" / ids[1] / "config.yaml"
    cfg.write_text(cfg.read_text().replace("algorithm: grpo", "algorithm: nan"))
    md, index, err = _figures_then_report(tmp_path, capsys)
    problems = md.split("## Failed, collapsed, unreadable and missing runs")[1].split("\n## ")[0]
    assert f"| {ids[1]} | nan |" in problems and "algorithm 'nan' in the config is not a registered algorithm" in md
    assert "- **Runs not read:** 1 of the 4 runs" in md and f"run {ids[1]} not read: algorithm 'nan'" in err
    assert ids[1] in index["unreadable"] and len(index["figures"]) >= 3


def test_every_kind_of_unreadable_run_says_why(tmp_path) -> None:
    ids = synthetic.make_study(tmp_path, CURVES, seeds=(0, 1, 2), n_steps=10, config_format="yaml")
    runs = tmp_path / "runs"
    (runs / ids[0] / "config.yaml").write_text("algorithm: [unclosed\n")
    (runs / ids[1] / "config.yaml").write_text("seed: 1\n")
    (runs / ids[2] / "status.json").write_text("{not json")
    (runs / ids[3] / "metrics.parquet").unlink()  # a completed run without its metrics
    t = pq.read_table(runs / ids[4] / "metrics.parquet")
    pq.write_table(t.drop(["step"]), runs / ids[4] / "metrics.parquet")
    (runs / ids[5] / "routing_layers.parquet").write_bytes(b"PAR1")  # optional file damaged: still read
    st = results.load(tmp_path)
    why = dict(zip(st.unreadable["run_id"], st.unreadable["reason"], strict=True))
    assert set(why) == set(ids[:5]) and list(st.runs["run_id"]) == [ids[5]]
    assert why[ids[0]].startswith("config.yaml:") and why[ids[1]] == "the config names no algorithm"
    assert why[ids[2]].startswith("status.json:") and why[ids[3]] == "metrics.parquet: missing"
    assert why[ids[4]] == "metrics.parquet: no 'step' column"
    assert st.runs["error"].iloc[0].startswith("routing_layers.parquet:")


def test_a_copied_run_and_a_non_integer_seed_are_set_aside_and_names_stay_text(tmp_path, capsys) -> None:
    # before: the copy counted as one more seed of its configuration, the seed 1.5 was read as seed 1 of a completed
    # run, and index.md carried the algorithm name's <script> raw (index.html escaped it)
    import shutil

    import yaml

    ids = _study(tmp_path)
    runs = tmp_path / "runs"
    copy = f"{ids[0]}-copy"
    shutil.copytree(runs / ids[0], runs / copy)
    for run_id, field, value in ((ids[1], "seed", 1.5), (ids[2], "algorithm", "<script>alert(1)</script>")):
        path = runs / run_id / "config.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), field: value}))
    (tmp_path / "s" / "run_ids.txt").write_text("\n".join([*ids, copy]) + "\n")
    md, index, err = _figures_then_report(tmp_path, capsys)
    why = index["unreadable"]
    assert set(why) == {copy, ids[1], ids[2]}, why
    assert why[copy].startswith(f"manifest.json names run {ids[0]}, not {copy}: a copy of another run's directory")
    assert why[ids[1]] == "seed 1.5 is not an integer"
    assert "<script>" not in md.replace("\\<", "") and "\\<script>alert(1)\\</script>" in md
    assert f"run {copy} not read: manifest.json names run {ids[0]}" in err


@pytest.mark.parametrize(
    ("comparisons", "why"),
    [
        ("\n  - name: c\n", "comparisons[0]: KeyError 'arms'"),
        (" 5\n", "comparisons: 'int' object is not iterable; valid: a list of comparisons"),
        ("\n  - 7\n", "comparisons[0]: TypeError"),
    ],
)
def test_a_malformed_comparison_is_one_line_before_any_figure(tmp_path, capsys, comparisons: str, why: str) -> None:
    # before: the report drew every figure, then died with a traceback
    _study(tmp_path)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"description: d\ncomparisons:{comparisons}")
    assert main(["report", str(tmp_path), "--study", "s", "--sweep", str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: sweep file {sweep}: ") and why in err[0], err
    assert not (tmp_path / "s" / "report").exists()


def test_a_copied_run_with_its_manifest_renamed_counts_once_with_a_note(tmp_path, capsys) -> None:
    # before: the copy, its manifest's run id edited to its new name, counted as one more seed of its configuration
    import shutil

    ids = _study(tmp_path)
    runs = tmp_path / "runs"
    copy = f"{ids[0]}-copy"
    shutil.copytree(runs / ids[0], runs / copy)
    manifest = runs / copy / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "run_id": copy}))
    (tmp_path / "s" / "run_ids.txt").write_text("\n".join([*ids, copy]) + "\n")
    md, index, err = _figures_then_report(tmp_path, capsys)
    note = f"the same run as {ids[0]} (the same seed, config, status and metrics): one run under a second name"
    assert list(index["unreadable"]) == [copy] and index["unreadable"][copy].startswith(note), index["unreadable"]
    assert f"run {copy} not read: {note}" in err
    assert "4 runs (completed 4; 1 unreadable)" in md.split("## Headline")[0]
    assert sorted(results.load(tmp_path, "s").runs["run_id"]) == sorted(ids)


def test_the_markdown_twin_keeps_html_in_names_as_text() -> None:
    import pandas as pd

    from analysis.report import render

    name = "<img src=x onerror=alert(1)>"
    blocks = [
        render.h(2, name),
        render.p("run ", name, " and \\", name),
        render.Table(pd.DataFrame({"run": [name]})),
        render.Bullets((("c", name, f"{name}, a < b"),)),
    ]
    page, md = render.page(name, blocks)
    assert "<img" not in page and "<img" not in md.replace("\\<", ""), md
    assert md.count("\\<img src=x onerror=alert(1)>") == 7 and "and \\\\\\<img" in md and "a < b" in md


@pytest.mark.parametrize("key", ["data", "figures", "skipped"])
def test_a_figures_index_without_a_key_it_always_has_is_drawn_again_saying_which(tmp_path, capsys, key) -> None:
    from analysis import figures
    from analysis.runs import tidy

    _study(tmp_path)
    st = tidy.load_study(tmp_path)
    src = tmp_path / "figs"
    src.mkdir()
    index = {"data": figures.data_fingerprint(st), "figures": {}, "skipped": {}}
    (src / figures.INDEX).write_text(json.dumps({k: v for k, v in index.items() if k != key}))
    assert build.reuse_figures(st, src, tmp_path / "out") is None
    assert f"figures in {src} not reused (figures.json has no '{key}'): drawing them" in capsys.readouterr().out
    (src / figures.INDEX).write_text(json.dumps(index))
    assert build.reuse_figures(st, src, tmp_path / "out") is not None
