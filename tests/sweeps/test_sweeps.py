"""Sweep files: schema errors, expansion, run ids; the Snakemake workflow: lint, dry runs (coldstart -> run ->
collect -> figures -> report), `python -m analysis collect`, one real smoke study and `snakemake --report` on it."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pytest
import yaml

import algorithms
from analysis.__main__ import main as analysis_main
from analysis.__main__ import rst_escape
from analysis.figures import claims_forest
from sweeps.expand import Sweep, load_sweep
from sweeps.schema import SweepError, validate_sweep
from tests.shared import ROOT, sharing_coldstart
from tests.sweeps.helpers import (
    SNAKEMAKE,
    SWEEP_FILES,
    coldstart_dir,
    expected_coldstarts,
    job_counts,
    planned_without_torch,
    snakemake,
)


def sweep(**overrides):
    data = {"name": "t", "preset": "tiny", "base": {"steps": 2}, "axes": {"algorithm": ["grpo"], "seed": [0]}}
    data.update(overrides)
    return data


def test_unknown_field_is_named_with_the_valid_ones():
    with pytest.raises(SweepError, match=r"base: unknown field\(s\) \['stepz'\]; valid: algorithm, hparams"):
        validate_sweep(sweep(base={"stepz": 3}))
    with pytest.raises(SweepError, match=r"unknown field\(s\) \['axis'\]; valid: name"):
        validate_sweep({**sweep(), "axis": {}})


def test_bad_algorithm_lists_the_registered_ones():
    with pytest.raises(SweepError) as err:
        validate_sweep(sweep(axes={"algorithm": ["grpo", "gpso"]}))
    msg = str(err.value)
    assert "axes.algorithm[1] = 'gpso'" in msg
    assert ", ".join(algorithms.names()) in msg
    with pytest.raises(SweepError, match=r"axes.algorithm = 'any'; valid: `all` or a list of"):
        validate_sweep(sweep(axes={"algorithm": "any"}))


def test_bad_axis_values():
    with pytest.raises(SweepError, match=r"axes.train_precision\[1\] = 'fp8'; valid: fp32, bf16, fp16"):
        validate_sweep(sweep(axes={"train_precision": ["fp32", "fp8"]}))
    with pytest.raises(
        SweepError, match=r"unknown field\(s\) \['train_dtype'\]; train_dtype is replaced by train_precision"
    ):
        validate_sweep(sweep(base={"train_dtype": "bf16"}))
    with pytest.raises(SweepError, match=r"axes.seed\[0\] = 'zero': must be integer"):
        validate_sweep(sweep(axes={"seed": ["zero"]}))
    with pytest.raises(SweepError, match=r"axes.seed: an axis needs at least one value"):
        validate_sweep(sweep(axes={"seed": []}))
    with pytest.raises(SweepError, match=r"mode = 'cross'; valid: grid, zip"):
        validate_sweep(sweep(mode="cross"))


def test_cross_field_errors_come_from_runconfig_naming_the_run():
    with pytest.raises(SweepError, match=r"run \{'minibatches': 3\}.*minibatches = 3 must divide"):
        Sweep.from_dict(sweep(axes={"minibatches": [3]})).expand()


def test_all_expands_to_every_registered_algorithm():
    runs = Sweep.from_dict(sweep(axes={"algorithm": "all"})).expand()
    assert sorted(cfg.algorithm for cfg in runs.values()) == sorted(algorithms.names())


def test_grid_and_zip_counts():
    axes = {"algorithm": ["grpo", "gspo"], "seed": [0, 1], "lr": [1e-4, 2e-4]}
    assert len(Sweep.from_dict(sweep(axes=axes, mode="grid")).expand()) == 8
    zipped = Sweep.from_dict(sweep(axes=axes, mode="zip")).expand()
    assert [(c.algorithm, c.seed, c.lr) for c in zipped.values()] == [("grpo", 0, 1e-4), ("gspo", 1, 2e-4)]
    with pytest.raises(SweepError, match=r"mode = 'zip' needs axes of equal length; got algorithm: 2, seed: 3"):
        Sweep.from_dict(sweep(axes={"algorithm": ["grpo", "gspo"], "seed": [0, 1, 2]}, mode="zip"))


def test_run_ids_are_stable_and_shared_across_studies():
    a = Sweep.from_dict(sweep(name="a", axes={"algorithm": ["grpo", "gspo"], "seed": [0, 1]})).expand()
    b = Sweep.from_dict(sweep(name="b", axes={"seed": [1], "algorithm": ["gspo"]})).expand()
    assert set(b) <= set(a)  # the same run in another study (axes in another order) has the same id
    assert list(a) == list(
        Sweep.from_dict(sweep(name="a", axes={"algorithm": ["grpo", "gspo"], "seed": [0, 1]})).expand()
    )
    with pytest.raises(SweepError, match=r"axes\.seed lists 0 twice"):  # a value listed twice is a typo
        Sweep.from_dict(sweep(axes={"seed": [0, 0]}))
    same = Sweep.from_dict(sweep(axes={"model": ["tiny", {"preset": "tiny"}]})).expand()  # identical runs run once
    assert len(same) == 1
    assert all(run_id.startswith(cfg.algorithm + "-") for run_id, cfg in a.items())


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.name)
def test_every_shipped_sweep_validates(path):
    runs = load_sweep(path).expand()
    assert runs
    assert load_sweep(path).name == path.stem


def test_default_and_smoke_studies():
    default = load_sweep(ROOT / "sweeps" / "default.yaml").expand()
    assert {c.algorithm for c in default.values()} == {"grpo", "grpo_rr", "gspo", "gspo_rr"}
    assert len({c.seed for c in default.values()}) >= 2
    smoke = load_sweep(ROOT / "sweeps" / "smoke.yaml").expand()
    assert len(smoke) == 2 and all(c.model == "tiny" for c in smoke.values())


# --- model shapes as an axis ----------------------------------------------------------------------------------------
SHAPES = [{"preset": "tiny", "num_experts": 8, "moe_top_k": 4}, "tiny"]


def test_model_shapes_validate_with_the_field_named():
    validate_sweep(sweep(base={"model": {"preset": "tiny", "num_layers": 3}}, axes={"model": SHAPES}))
    validate_sweep(sweep(axes={"model.num_experts": [4, 8], "hparams.eps_high": [0.3], "task_knobs.terms": [3]}))
    with pytest.raises(
        SweepError, match=r"axes.model\[1\] = 'huge'; valid: tiny, default, small, qwen3-30b-a3b, a local"
    ):
        validate_sweep(sweep(axes={"model": ["tiny", "huge"]}))
    with pytest.raises(SweepError, match=r"base.model: unknown field\(s\) \['experts'\]; valid: preset, num_layers"):
        validate_sweep(sweep(base={"model": {"preset": "tiny", "experts": 8}}))
    with pytest.raises(
        SweepError, match=r"axes.model\[0\].preset = 'huge'; valid: tiny, default, small, qwen3-30b-a3b"
    ):
        validate_sweep(sweep(axes={"model": [{"preset": "huge"}]}))
    with pytest.raises(SweepError, match=r"axes.model.num_experts\[1\] = 0: minimum is 1"):
        validate_sweep(sweep(axes={"model.num_experts": [4, 0]}))
    with pytest.raises(
        SweepError, match=r"base.model = 3: must be a preset name \(tiny, default, small, qwen3-30b-a3b\), a"
    ):
        validate_sweep(sweep(base={"model": 3}))
    with pytest.raises(SweepError, match=r"axes: unknown field\(s\) \['model.experts'\]; valid: .*model.num_experts"):
        validate_sweep(sweep(axes={"model.experts": [8]}))
    # the ranges across fields are the model's own, named per run before any job
    with pytest.raises(SweepError, match=r"run \{'model.moe_top_k': 8\}.*model.moe_top_k = 8: valid range is \[1, 4\]"):
        Sweep.from_dict(sweep(axes={"model.moe_top_k": [8]})).expand()


def test_a_sweep_crosses_shapes_with_algorithms():
    """Two shapes x two algorithms: four runs, each shape its own run ids and its own cold start; the plain preset's
    runs keep the ids they have without any shape axis; a dotted axis spells the same shapes."""
    runs = Sweep.from_dict(sweep(axes={"model": SHAPES, "algorithm": ["grpo", "gspo"]})).expand()
    assert len(runs) == 4
    assert [(c.model, c.algorithm) for c in runs.values()] == [(m, a) for m in SHAPES for a in ("grpo", "gspo")]
    assert {c.model_config().num_experts for c in runs.values()} == {4, 8}
    plain = Sweep.from_dict(sweep(axes={"algorithm": ["grpo", "gspo"]})).expand()
    assert set(plain) < set(runs)
    names = {c.model_config().num_experts: coldstart_dir(c) for c in runs.values()}
    assert names[8].startswith("tiny_e8_k4-chain_sum-") and names[4].startswith("tiny-chain_sum-")
    dotted = Sweep.from_dict(sweep(axes={"model.num_experts": [8, 4], "model.moe_top_k": [4, 2]}, mode="zip"))
    assert [c.model for c in dotted.expand().values()] == SHAPES
    # a whole shape (a name) replaces base's shape, then the dotted axis changes one field of it, whatever the order
    axes = {"model.num_experts": [16], "model": ["tiny", "default"]}
    layered = Sweep.from_dict(sweep(base={"steps": 2, "model": {"num_layers": 3}}, axes=axes)).expand()
    assert [c.model for c in layered.values()] == [
        {"preset": "tiny", "num_experts": 16},
        {"preset": "default", "num_experts": 16},
    ]
    base_only = Sweep.from_dict(sweep(base={"steps": 2, "model": {"num_layers": 3}})).expand()
    assert [c.model for c in base_only.values()] == [{"preset": "tiny", "num_layers": 3}]


def test_snakemake_dry_run_crosses_shapes_with_algorithms(tmp_path):
    """One cold-start job per distinct shape x task, each run waiting on its own shape's cold start, the shape passed
    to `python -m study.launch --coldstart` as a JSON mapping."""
    sweep_file = tmp_path / "shapes.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep(name="shapes", axes={"model": SHAPES, "algorithm": ["grpo", "gspo"]})))
    proc = snakemake("-n", "-p", "--cores", "2", "--config", f"sweep={sweep_file}", f"results={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = job_counts(proc.stdout)
    assert counts["coldstart"] == 2 and counts["run"] == 4, proc.stdout
    runs = load_sweep(sweep_file).expand()
    for run_id, cfg in runs.items():
        name = coldstart_dir(cfg)
        inputs = [line for line in proc.stdout.splitlines() if f"configs/{run_id}.yaml" in line and "input:" in line]
        assert inputs and f"coldstart/{name}/coldstart.json" in inputs[0], (run_id, inputs)
    assert """--coldstart '{"preset":"tiny","num_experts":8,"moe_top_k":4}' chain_sum""" in proc.stdout
    assert "--coldstart tiny chain_sum" in proc.stdout


def test_expand_cli_error_is_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(axes={"algorithm": ["nope"]})))
    proc = subprocess.run([sys.executable, "-m", "sweeps.expand", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "axes.algorithm[0] = 'nope'; valid:" in proc.stderr


@pytest.mark.parametrize("sweep_file", [None, "sweeps/smoke.yaml"], ids=["default", "smoke"])
def test_snakemake_lint(sweep_file):
    proc = snakemake("--lint", *(["--config", f"sweep={sweep_file}"] if sweep_file else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "name, profile", [("default", False), ("smoke", False), ("smoke", True)], ids=["default", "smoke", "smoke-slurm"]
)
def test_snakemake_dry_run(name, profile, tmp_path):
    """The whole chain is planned: one cold start per distinct checkpoint, every run, then collect, figures and report
    once; the runs depend on the cold start; with `--profile slurm` as typed too, every run and the cold start go
    through the slurm launcher (without a profile: in-process)."""
    args = ["-n", "-p", *(["--profile", "slurm"] if profile else ["--cores", "2"]), "--config", f"results={tmp_path}"]
    if name != "default":  # the default study is what a bare `snakemake` runs
        args.append(f"sweep=sweeps/{name}.yaml")
    proc = snakemake(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert planned_without_torch(proc), proc.stderr[-2000:]
    sweep_path = ROOT / "sweeps" / f"{name}.yaml"
    coldstarts = expected_coldstarts(sweep_path)
    counts = job_counts(proc.stdout)
    expected = {"resolve": 1, "coldstart": len(coldstarts), "run": len(load_sweep(sweep_path).expand())}
    expected.update(collect=1, figures=1, report=1, all=1)
    assert counts == expected, proc.stdout
    for cs in coldstarts:
        assert f"{tmp_path}/coldstart/{cs}/coldstart.json" in proc.stdout
    run_inputs = [line for line in proc.stdout.splitlines() if line.strip().startswith("input:") and ".yaml" in line]
    assert run_inputs and all("/coldstart.json" in line for line in run_inputs), run_inputs
    assert f"--out {tmp_path}/{name}/figures" in proc.stdout  # python -m analysis figures
    launches = [line for line in proc.stdout.splitlines() if "-m study.launch" in line]
    assert len(launches) == len(coldstarts) + expected["run"], proc.stdout
    launcher = "--launcher slurm" if profile else "--launcher in-process"
    assert all(launcher in line for line in launches), proc.stdout
    if profile:
        assert "concurrent_runs=1" in proc.stdout and sum("--coldstart tiny chain_sum" in x for x in launches) == 1


@pytest.mark.parametrize(
    "name, profile, extra",
    [
        ("length_laptop", False, "coldstart_budgets"),
        ("precision_laptop", False, "precision_parity"),
        ("length", True, "coldstart_budgets"),
        ("precision", True, None),
    ],
)
def test_length_and_precision_studies_plan_their_extra_tables(name, profile, extra, tmp_path):
    """The laptop studies and their GPU versions (under --profile slurm as typed) resolve; a study sweeping
    max_new_tokens gets the cold start's budget table, a study emulating low precision the emulated-vs-real table,
    each read by the report rule."""
    args = ["-n", "-p", *(["--profile", "slurm"] if profile else ["--cores", "2"])]
    proc = snakemake(*args, "--config", f"results={tmp_path}", f"sweep=sweeps/{name}.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert planned_without_torch(proc), proc.stderr[-2000:]
    counts = job_counts(proc.stdout)
    assert counts["run"] == len(load_sweep(ROOT / "sweeps" / f"{name}.yaml").expand())
    for rule in ("coldstart_budgets", "precision_parity"):
        assert counts.get(rule, 0) == (rule == extra), (rule, counts)
    if extra == "coldstart_budgets":
        assert "--budgets 32 64" in proc.stdout or "--budgets 128 256 512" in proc.stdout
    if extra == "precision_parity":
        assert "--precisions bf16 --seqs" in proc.stdout


def test_the_gpu_precision_study_shares_the_laptop_studys_fp32_runs():
    gpu = load_sweep(ROOT / "sweeps" / "precision.yaml").expand()
    laptop = load_sweep(ROOT / "sweeps" / "precision_laptop.yaml").expand()
    shared = set(gpu) & set(laptop)
    assert shared == {r for r, c in laptop.items() if c.train_precision == "fp32"} and len(shared) == 28
    assert {c.train_precision for c in gpu.values()} == {"fp32", "bf16", "fp16", "bf16_fp32head"}  # real, not emulated


def test_no_coldstart_job_for_runs_given_a_checkpoint(tmp_path):
    sweep_file = tmp_path / "scratch.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep(name="scratch", base={"steps": 2, "coldstart": "scratch"})))
    proc = snakemake("-n", "--cores", "1", "--config", f"sweep={sweep_file}", f"results={tmp_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = job_counts(proc.stdout)
    assert counts.get("coldstart", 0) == 0 and counts["run"] == 1, proc.stdout


def test_collect_lists_the_runs_it_is_given(tmp_path, capsys):
    runs = tmp_path / "runs"
    statuses = []
    for run_id, state in [("gspo-bbbbbbbbbbbb", "completed"), ("grpo-aaaaaaaaaaaa", "collapsed")]:
        (runs / run_id).mkdir(parents=True)
        (runs / run_id / "status.json").write_text(json.dumps({"state": state, "step": 2}))
        statuses.append(str(runs / run_id / "status.json"))
    out = tmp_path / "t" / "run_ids.txt"
    assert analysis_main(["collect", *statuses, "--study", "t", "--out", str(out)]) == 0
    assert out.read_text().splitlines() == ["# study t: 2 run(s)", "gspo-bbbbbbbbbbbb", "grpo-aaaaaaaaaaaa"]
    assert "2 run id(s) of study t (1 collapsed, 1 completed)" in capsys.readouterr().out
    markers = [str(runs / "grpo-aaaaaaaaaaaa" / "workflow.done")]  # the workflow's marker: its run's status read
    assert analysis_main(["collect", *markers, "--study", "t", "--out", str(out)]) == 0
    assert "1 run id(s) of study t (1 collapsed)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"not a run's status\.json or workflow\.done"):
        analysis_main(["collect", str(runs), "--study", "t", "--out", str(out)])


def test_figure_captions_render_verbatim_in_rst():
    """`snakemake --report` renders each caption file as reStructuredText: no character may turn into markup."""
    from docutils.core import publish_parts

    caption = "1. GRPO* and `GSPO` (runs: {'a': 1}) | eps_low_ [C1] \\ 95% -- *not* emphasis <b>"
    body = publish_parts(rst_escape(caption), writer="html")["body"]
    assert "system-message" not in body and "<em>" not in body, body
    assert html.unescape(re.sub(r"<[^>]+>", "", body)).strip() == caption


def test_snakemake_rejects_a_bad_sweep_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(base={"train_precision": "fp8"})))
    proc = snakemake("-n", "--cores", "1", "--config", f"sweep={bad}", f"results={tmp_path}")
    assert proc.returncode != 0
    assert "base.train_precision = 'fp8'; valid: fp32, bf16, fp16" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smoke_study_runs_then_reruns_nothing(tmp_path, tiny_coldstart):
    """The real smoke study on the session's tiny cold start (its coldstart job finds it done), then `snakemake
    --report` on it (its figures, their captions, the study's report), then a rerun that computes nothing."""
    results = sharing_coldstart(tiny_coldstart.parent.parent, tmp_path / "results")
    copied = {p.parent.name for p in (results / "coldstart").glob("*/coldstart.json")}
    config = ["--config", "sweep=sweeps/smoke.yaml", f"results={results}"]
    proc = snakemake("--cores", "2", *config, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = results / "smoke" / "report" / "index.html"
    assert report.is_file()
    assert f"report: {report}" in proc.stdout + proc.stderr
    figures = {p.name for p in (results / "smoke" / "report" / "figures").glob("*.png")}
    assert {"figure1_reward.png", "figure2_clipping.png"} <= figures, figures  # drawn from the real runs
    statuses = sorted((results / "runs").glob("*/status.json"))
    assert len(statuses) == 2
    assert all(yaml.safe_load(p.read_text())["state"] in ("completed", "collapsed") for p in statuses)
    before = {p: p.stat().st_mtime_ns for p in statuses}
    # The coldstart rule made (or found) exactly the cold start the runs used: the runs made no other.
    coldstarts = expected_coldstarts(ROOT / "sweeps" / "smoke.yaml")
    made = {p.parent.name for p in (results / "coldstart").glob("*/coldstart.json")}
    assert coldstarts <= made and made - copied <= coldstarts, (made, copied, coldstarts)
    run_ids = (results / "smoke" / "run_ids.txt").read_text().split()
    assert run_ids[-2:] == list(load_sweep(ROOT / "sweeps" / "smoke.yaml").expand())  # collect: what ran

    # `snakemake --report`: every figure the figures rule drew, with its caption, and the study's own report.
    index = json.loads((results / "smoke" / "figures" / "figures.json").read_text())
    headline = f"{claims_forest.NAME}.png"  # the headline's picture, drawn by the report from its scorecard
    assert headline in figures and {f"{name}.png" for name in index["figures"]} == figures - {headline}
    snake_report = tmp_path / "snakemake-report.html"
    rep = snakemake(*config, "--report", str(snake_report))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    page = snake_report.read_text()
    for name, fig in index["figures"].items():
        assert f"Adding {name}.png" in rep.stdout + rep.stderr
        words = re.findall(r"[A-Za-z0-9]+", fig["caption"])[:6]
        assert re.search(r"\W+".join(words), page), (name, words)  # the figure's own caption, rendered
    assert "Adding index.html" in rep.stdout + rep.stderr and "Adding scorecard.csv" in rep.stdout + rep.stderr
    assert "System Message" not in page  # every caption is valid reStructuredText

    rerun = snakemake("--cores", "2", *config)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "Nothing to be done" in rerun.stdout + rerun.stderr
    assert {p: p.stat().st_mtime_ns for p in statuses} == before


@pytest.mark.parametrize("name", ["..", "runs", "coldstart", "all", ".hidden", "a/b"])
def test_reserved_and_path_like_study_names_are_refused(name):
    with pytest.raises(SweepError, match=re.escape(f"name = {name!r}: a study's folder under the results root")):
        Sweep.from_dict(sweep(name=name))


def test_analysis_report_refuses_a_bad_study_or_results_dir(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "run_ids.txt").write_text("# study smoke\n")
    for argv, message in (
        (["report", str(tmp_path), "--study", "typo"], "--study 'typo': no such study in"),
        (["report", str(tmp_path), "--study", "../x"], "--study '../x': a study name, not a path"),
        (["report", str(tmp_path / "missing"), "--study", "smoke"], "no such directory"),
        (["figures", str(tmp_path), "--study", "typo", "--out", str(tmp_path / "f")], "valid: smoke"),
    ):
        assert analysis_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "smoke"], "something was written"


@pytest.mark.slow
def test_a_run_failing_under_snakemake_keeps_its_record_and_the_report_lists_it(tmp_path):
    """A failed run keeps its status.json and failure.json (the run rule's output is the workflow's marker, which it
    never gets), the workflow names the run, and the report of the study so far lists it as failed with its error.
    The run fails at its first line of compute: a cold start of another shape (one that is not there, or lacks its
    tokenizer, is refused before the run directory is written)."""
    import torch

    from study.data.tokenizer import build_tokenizer

    broken = tmp_path / "another-shape"
    broken.mkdir()
    sweep_file = tmp_path / "failing.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep(name="failing", base={"steps": 1, "coldstart": str(broken)})))
    ((run_id, cfg),) = load_sweep(sweep_file).expand().items()
    build_tokenizer(cfg.model_config().vocab_size, [cfg.task], n_per_task=50).save(broken)
    torch.save({"embedding.word_embeddings.weight": torch.zeros(3, 3)}, broken / "policy.pt")
    results = tmp_path / "results"
    proc = snakemake("--cores", "1", "--config", f"sweep={sweep_file}", f"results={results}")
    assert proc.returncode != 0
    run_dir = results / "runs" / run_id
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"  # kept: no marker, no deletion
    assert not (run_dir / "workflow.done").exists()  # so the next invocation runs it again
    record = json.loads((run_dir / "failure.json").read_text())
    assert record["state"] == "failed" and "Error(s) in loading state_dict" in record["error"]
    assert "Traceback" in record["traceback"]
    out = proc.stdout + proc.stderr
    assert f"run {run_id} failed: " in out and "with the failed run(s): " in out, out[-3000:]
    report = (results / "failing" / "report" / "index.md").read_text()
    assert run_id in report and "failed" in report


@pytest.mark.slow
def test_a_run_refused_by_its_preflight_under_snakemake_is_named_and_reported(tmp_path):
    """One run of two is refused by its preflight (its named cold start is not there), which writes no run state;
    the workflow's run directory (made for run.log) gets config.yaml and failure.json with the reason, so the
    workflow names the run and the report of the study so far lists it as failed with why, beside the run that
    finished."""
    missing = tmp_path / "no-such-coldstart"
    sweep_file = tmp_path / "refused.yaml"
    body = sweep(name="refused", base={"steps": 1, "coldstart": "scratch", "eval_every": 0})
    body["axes"] = {"coldstart": ["scratch", str(missing)]}
    sweep_file.write_text(yaml.safe_dump(body))
    runs = load_sweep(sweep_file).expand()
    refused = next(run_id for run_id, cfg in runs.items() if cfg.coldstart == str(missing))
    results = tmp_path / "results"
    proc = snakemake(
        "--cores", "1", "--keep-going", "--config", f"sweep={sweep_file}", f"results={results}", timeout=600
    )
    assert proc.returncode != 0
    record = json.loads((results / "runs" / refused / "failure.json").read_text())
    assert record["state"] == "failed" and record["error"].startswith("refused before it started: coldstart = ")
    out = proc.stdout + proc.stderr
    assert f"run {refused} failed: refused before it started: coldstart = " in out, out[-3000:]
    assert "with the failed run(s): " in out and "not written" not in out, out[-3000:]
    report = (results / "refused" / "report" / "index.md").read_text()
    assert refused in report and "no such directory" in report, report[:3000]
    (done,) = set(runs) - {refused}
    assert json.loads((results / "runs" / done / "status.json").read_text())["state"] == "completed"


def test_sweep_vars_default_and_override(tmp_path):
    """A sweep's `vars:` default fills `{name}` in base and axes; the command line (`--var`, Snakemake's
    `--config checkpoint=...`) overrides it; values for names the sweep does not declare are ignored."""
    paper = ROOT / "sweeps" / "paper.yaml"
    runs = load_sweep(paper).expand()
    assert {c.coldstart for c in runs.values()} == {"checkpoints/Qwen3-30B-A3B-Base"}
    assert {c.model for c in runs.values()} == {"qwen3-30b-a3b"}
    given = load_sweep(paper, {"checkpoint": str(tmp_path / "ckpt"), "other": "x"}).expand()
    assert {c.coldstart for c in given.values()} == {str(tmp_path / "ckpt")} and set(given).isdisjoint(runs)
    assert load_sweep(ROOT / "sweeps" / "smoke.yaml", {"checkpoint": "/x"}).expand()  # no vars: ignored
    with pytest.raises(SweepError, match=r"vars.checkpoint = '': must be a non-empty string"):
        load_sweep(paper, {"checkpoint": ""})
    with pytest.raises(SweepError, match=r"vars"):
        validate_sweep(sweep(vars={"checkpoint": 3}))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_study_killed_mid_run_resumes_that_run_on_the_next_invocation(tmp_path, tiny_coldstart):
    """SIGTERM to the whole workflow (a closed terminal, a scheduler's cancel) while a run trains: the run records
    `stopped` (resumable) with its status.json in place, and the next `snakemake` resumes it to its last step rather
    than counting the stopped run as done."""
    import os
    import signal
    import time

    results = sharing_coldstart(tiny_coldstart.parent.parent, tmp_path / "results")
    sweep_file = tmp_path / "killed.yaml"
    base = {"steps": 40, "eval_every": 0, "checkpoint_every": 2}
    sweep_file.write_text(yaml.safe_dump(sweep(name="killed", base=base)))
    ((run_id, _),) = load_sweep(sweep_file).expand().items()
    status = results / "runs" / run_id / "status.json"
    config = ["--cores", "1", "--config", f"sweep={sweep_file}", f"results={results}"]
    proc = subprocess.Popen(
        [*SNAKEMAKE, *config], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:  # until the run has a checkpoint to resume from
        if status.is_file() and json.loads(status.read_text()).get("step", 0) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the study ended before it could be killed: " + proc.stdout.read()[-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=300)
    record = json.loads(status.read_text())
    assert record["state"] == "stopped" and 3 <= record["step"] < 40, record

    rerun = snakemake(*config, timeout=1100)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    record = json.loads(status.read_text())
    assert record["state"] == "completed" and record["step"] == 40, record
    import pandas as pd

    steps = pd.read_parquet(results / "runs" / run_id / "metrics.parquet")["step"].tolist()
    assert steps == list(range(1, 41)), steps  # every step once: resumed from the checkpoint, no step lost or doubled
