"""Sweep files: schema errors, expansion, run ids; the Snakemake workflow: lint, dry runs, one real smoke study."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import algorithms
from sweeps.expand import Sweep, load_sweep
from sweeps.schema import SweepError, validate_sweep

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "sweeps").glob("*.yaml"))
SWEEP_FILES = [p for p in SHIPPED if p.name not in ("config.yaml", "config.schema.yaml")]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


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
    with pytest.raises(SweepError, match=r"axes.train_dtype\[1\] = 'fp8'; valid: fp32, bf16, fp16"):
        validate_sweep(sweep(axes={"train_dtype": ["fp32", "fp8"]}))
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
    dup = Sweep.from_dict(sweep(axes={"seed": [0, 0]})).expand()  # identical runs run once
    assert len(dup) == 1
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


def test_expand_cli_error_is_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(axes={"algorithm": ["nope"]})))
    proc = subprocess.run([sys.executable, "-m", "sweeps.expand", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "axes.algorithm[0] = 'nope'; valid:" in proc.stderr


def _snakemake(*args, cwd=ROOT, timeout=300):
    return subprocess.run([*SNAKEMAKE, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def test_snakemake_lint():
    proc = _snakemake("--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["default", "smoke"])
def test_snakemake_dry_run(name, tmp_path):
    args = ["-n", "--cores", "2", "--config", f"results={tmp_path}"]
    if name != "default":  # the default study is what a bare `snakemake` runs
        args.append(f"sweep=sweeps/{name}.yaml")
    proc = _snakemake(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_runs = len(load_sweep(ROOT / "sweeps" / f"{name}.yaml").expand())
    counts = dict(line.split() for line in proc.stdout.splitlines() if re.fullmatch(r"\w+\s+\d+", line.strip()))
    assert counts["run"] == str(n_runs), proc.stdout


def test_snakemake_rejects_a_bad_sweep_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(base={"train_dtype": "fp8"})))
    proc = _snakemake("-n", "--cores", "1", "--config", f"sweep={bad}", f"results={tmp_path}")
    assert proc.returncode != 0
    assert "base.train_dtype = 'fp8'; valid: fp32, bf16, fp16" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smoke_study_runs_then_reruns_nothing(tmp_path):
    """The real smoke study (a few minutes, most of it the tiny cold start), then a rerun that computes nothing."""
    results = tmp_path / "results"
    cached = ROOT / "results" / "coldstart"  # reuse a finished cold start if this checkout has one
    if cached.is_dir():
        shutil.copytree(cached, results / "coldstart", ignore=shutil.ignore_patterns(".*"))
    config = ["--config", "sweep=sweeps/smoke.yaml", f"results={results}"]
    proc = _snakemake("--cores", "2", *config, timeout=1100)
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

    rerun = _snakemake("--cores", "2", *config)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "Nothing to be done" in rerun.stdout + rerun.stderr
    assert {p: p.stat().st_mtime_ns for p in statuses} == before
