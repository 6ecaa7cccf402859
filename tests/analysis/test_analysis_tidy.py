"""The tidy loader on synthetic run directories: every run kept and labelled, missing runs named, values exact."""

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import runfiles
from analysis.report import sections
from analysis.runs import tidy
from tests.analysis import synthetic


def _write(root, run_id, state, *, metrics=True, **status):
    cfg = {"algorithm": "gspo", "seed": len(run_id), "train": {"lr": 1e-6 if run_id != "c" else 2e-6}}
    cols = None
    if metrics:
        step = np.arange(1, 6)
        cols = {"step": step, "compute_flops": step * 1e12, "wall_s": step * 1.0, "reward_mean": step / 10}
        cols["eval_x"] = np.where(step % 2 == 0, step / 100, np.nan)
    return synthetic.write_run(
        root / "runs", run_id, config=cfg, status={"state": state, **status}, metrics=cols, config_format="yaml"
    )


def test_loader_keeps_failed_and_collapsed_and_reports_missing(tmp_path):
    _write(tmp_path, "a", "completed")
    _write(tmp_path, "b", "collapsed", step=4, reason="reward below floor")
    _write(tmp_path, "c", "failed", metrics=False, error={"type": "RuntimeError", "message": "boom"})
    with pytest.warns(UserWarning, match="zzz"):
        st = tidy.load_study(tmp_path, ["a", "b", "c", "zzz"])
    assert st.missing == ["zzz"]
    runs = st.runs.set_index("run_id")
    assert list(runs.index) == ["a", "b", "c"]
    assert runs.loc["a", "state"] == "completed" and pd.isna(runs.loc["a", "error"])
    assert runs.loc["b", "state"] == "collapsed"
    assert runs.loc["b", "collapse_step"] == 4 and runs.loc["b", "collapse_reason"] == "reward below floor"
    assert runs.loc["c", "state"] == "failed" and runs.loc["c", "error"] == "RuntimeError: boom"
    assert runs.loc["c", "n_steps"] == 0
    # The swept axis (train.lr differs) is a column; seed is not an axis.
    assert st.axes == ["train.lr"]
    assert set(st.long["run_id"].astype(str)) == {"a", "b"}
    # Values are exact, NaN (not logged) steps have no row.
    ev = st.metric("eval_x")
    assert sorted(ev["step"].tolist()) == [2, 2, 4, 4]
    rm = st.metric("reward_mean")
    a = rm[rm["run_id"] == "a"]
    np.testing.assert_allclose(a["value"], np.arange(1, 6) / 10)
    np.testing.assert_allclose(a["compute_flops"], np.arange(1, 6) * 1e12)
    assert set(st.long.columns) >= {
        "run_id",
        "algorithm",
        "train.lr",
        "seed",
        "step",
        "compute_flops",
        "wall_s",
        "metric",
        "value",
    }


def test_a_stopped_run_keeps_its_state_and_metrics(tmp_path):
    # a pruned tuning trial's run (sweeps/tune.py): stopped on purpose, neither failed nor still running
    _write(tmp_path, "p", "stopped", step=2, reason="pruned by ThresholdPruner at step 2 (tuning trial 0)")
    st = tidy.load_study(tmp_path)
    row = st.runs.set_index("run_id").loc["p"]
    assert row["state"] == "stopped" and row["n_steps"] > 0
    assert sections.problem_runs(st).empty  # stopping a trial is not a problem of the run


def test_a_failed_run_whose_status_a_workflow_deleted_is_read_from_its_failure_record(tmp_path):
    path = _write(tmp_path, "f", "failed", step=1, error="RuntimeError: boom")
    (path / runfiles.FAILURE).write_text((path / "status.json").read_text())
    (path / "status.json").unlink()  # Snakemake removes a failed job's declared output
    st = tidy.load_study(tmp_path)
    row = st.runs.set_index("run_id").loc["f"]
    assert row["state"] == "failed" and row["error"] == "RuntimeError: boom"
    assert sections.problem_runs(st)["run_id"].tolist() == ["f"]


def test_unreadable_files_are_reported_not_raised(tmp_path):
    path = _write(tmp_path, "a", "completed")
    (path / "status.json").write_text("{not json")
    st = tidy.load_study(tmp_path)
    row = st.runs.iloc[0]
    assert row["state"] == "unknown" and "status.json" in row["error"]


def test_write_and_read_back(study, tmp_path):
    paths = study.write(tmp_path / "tidy")
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    back = tidy.read_study(tmp_path / "tidy")
    assert len(back.long) == len(study.long) and back.axes == study.axes
    assert json.loads(paths["missing"].read_text())["missing"] == []
    assert pq.read_schema(paths["long"]).names[-2:] == ["metric", "value"]


def test_synthetic_study_shape(study, study_dir):
    _, ids = study_dir
    assert len(study.runs) == len(ids) == 5 * 4 * 3
    assert study.axes == ["max_new_tokens", "rollout_precision"]
    counts = study.runs["state"].value_counts().to_dict()
    assert counts == {"completed": 36, "collapsed": 12, "failed": 12}
    # Collapsed runs stop two steps after their collapse; the failed ones after a third of 200 steps.
    assert set(study.runs.loc[study.runs["state"] == "failed", "last_step"]) == {66}


def test_a_run_directory_without_a_config_yet_sweeps_no_axis(tmp_path):
    # loading every run while a study runs: a directory being created has no config.yaml (nor status.json) yet, and
    # made every config key a "swept axis" (each differs from its missing value), so figures split on steps, lr, ...
    for rid, lr in (("a", 1e-6), ("c", 2e-6)):
        cfg = {"algorithm": "gspo", "seed": 0, "steps": 5, "train": {"lr": lr}}
        synthetic.write_run(tmp_path / "runs", rid, config=cfg, status={"state": "completed"}, metrics=None)
    (tmp_path / "runs" / "new").mkdir()
    st = tidy.load_study(tmp_path)
    assert st.axes == ["train.lr"] and len(st.runs) == 3  # not "steps"
    assert st.runs.set_index("run_id").loc["new", "state"] == "unknown"


def test_a_key_that_varies_only_with_the_algorithm_is_not_an_axis():
    """A sweep's per-algorithm clip range is part of the algorithm; lr crossed with the algorithms is an axis, and so
    is a key that varies within one algorithm's runs."""
    configs = [
        {"algorithm": alg, "seed": seed, "lr": lr, **({"hparams.eps_low": 3e-3} if alg == "gspo" else {})}
        for alg in ("grpo", "gspo")
        for lr in (1e-4, 3e-4)
        for seed in (0, 1)
    ]
    assert tidy.infer_axes(configs) == ["lr"]
    one = [{"algorithm": "gspo", "hparams.eps_low": eps} for eps in (3e-4, 3e-3)]
    assert tidy.infer_axes(one) == ["hparams.eps_low"]
