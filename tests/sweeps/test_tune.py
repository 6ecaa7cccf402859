"""Optuna tuning (sweeps/tune.py): search spaces from the registry, equal budgets, pruning on held-out eval, parallel
workers on one storage, the tuned file and the sweeps that reference it, and errors that name the field. Real Optuna,
real runs on the tiny preset (random-init cold start except where a test needs a policy that can score)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import optuna
import pandas as pd
import pytest
import torch
import yaml
from optuna.trial import TrialState

from algorithms.registry import Range, register, unregister
from study.run.config import RunConfig
from sweeps import tune
from sweeps.expand import load_sweep, load_tuned
from sweeps.schema import SweepError, validate_tuned_file
from tests.shared import sharing_coldstart

ROOT = Path(__file__).resolve().parents[2]
FAST = {"coldstart": "scratch", "steps": 4, "eval_every": 2, "eval_size": 4, "eval_samples": 1, "checkpoint_every": 2}


def write_sweep(path: Path, *, base: dict | None = None, axes: dict | None = None, **tune_section) -> Path:
    data = {
        "name": path.stem,
        "preset": "tiny",
        "base": {**FAST, **(base or {})},
        "axes": axes or {"algorithm": ["grpo", "gspo"]},
        "tune": {"trials": 3, "pruner": {"name": "none"}, **tune_section},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def studies(p: tune.Plan) -> dict[str, list[optuna.trial.FrozenTrial]]:
    # through the workers' own lock: a reader opening SQLite unlocked creates its tables too, and one of two processes
    # doing so at once fails with `table ... already exists` (a starting worker would die of it)
    storage = tune.open_storage(p)
    return {a: optuna.load_study(study_name=p.study_name(a), storage=storage).get_trials() for a in p.starts}


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


# -- search space ---------------------------------------------------------------------------------------------------
def test_search_space_comes_from_the_registry(tmp_path: Path) -> None:
    def probe_loss(
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        beta: Annotated[float, Range(gt=0.0, le=1.0)] = 0.5,
        width: int = 3,
        off: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return (logp * 0).sum(), {}

    register("tune_probe", label="probe")(probe_loss)  # what a new file in algorithms/ does
    try:
        p = tune.plan(
            write_sweep(tmp_path / "space.yaml", axes={"algorithm": ["grpo", "gspo", "dr_grpo", "tune_probe"]})
        )
    finally:
        unregister("tune_probe")
    grpo, gspo, dr, probe = (p.spaces[a] for a in ("grpo", "gspo", "dr_grpo", "tune_probe"))
    # lr and the clip range around the starting values, x/÷ spread (10), log scale, inside the registry Range
    assert set(grpo) == set(gspo) == {"lr", "eps_low", "eps_high"}
    assert (grpo["lr"].low, grpo["lr"].high, grpo["lr"].log) == (1e-5, 1e-3, True)
    assert (gspo["eps_low"].low, gspo["eps_low"].high) == (3e-5, 3e-3)  # ScaleRL's 3e-3 is inside
    assert grpo["eps_low"].low == 0.02 and 0.99 < grpo["eps_low"].high < 1.0  # eps_low's Range is [0, 1)
    assert "norm_len" not in dr  # an integer at 0: nothing to scale
    # a variant the harness has never seen: its float hyper-parameters, clipped to its Range (beta <= 1); 0.0 skipped
    assert set(probe) == {"lr", "beta"} and (probe["beta"].low, probe["beta"].high) == (0.05, 1.0)


def test_space_overrides(tmp_path: Path) -> None:
    space = {
        "lr": {"low": "3e-5", "high": "3e-4"},
        "eps_low": "fixed",
        "norm_len": {"low": 0, "high": 64, "log": False},
    }
    p = tune.plan(write_sweep(tmp_path / "over.yaml", axes={"algorithm": ["grpo", "dr_grpo"]}, space=space))
    assert p.spaces["grpo"]["lr"].to_dict() == {"low": 3e-5, "high": 3e-4, "log": True}  # YAML 1.1 strings coerced
    assert "eps_low" not in p.spaces["grpo"] and "eps_low" not in p.spaces["dr_grpo"]
    assert p.spaces["dr_grpo"]["norm_len"].integer and "norm_len" not in p.spaces["grpo"]


# -- budget, runs, tuned file -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[tune.Plan, Path]:
    """A finished tuning of grpo and gspo (3 trials each, no pruner) and its tuned file."""
    tmp = tmp_path_factory.mktemp("tuned")
    p = tune.plan(write_sweep(tmp / "budget.yaml"), tmp / "results")
    ran = tune.work(p)
    assert ran == {"grpo": 3, "gspo": 3}
    return p, tune.write_best(p)


def test_equal_budget_and_trials_are_ordinary_runs(tuned: tuple[tune.Plan, Path]) -> None:
    p, _ = tuned
    trials = studies(p)
    assert {a: len(t) for a, t in trials.items()} == {"grpo": 3, "gspo": 3}
    for algorithm, ts in trials.items():
        assert [t.number for t in ts] == [0, 1, 2] and all(t.state == TrialState.COMPLETE for t in ts)
        start = tune._starting_values(p.starts[algorithm])
        assert ts[0].params == {k: start[k] for k in ("lr", "eps_low", "eps_high")}  # trial 0: the starting point
        for t in ts:
            run_dir = p.results / "runs" / t.user_attrs["run_id"]
            assert status(run_dir)["state"] == "completed"
            cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
            assert cfg["lr"] == t.params["lr"] and cfg["hparams"]["eps_high"] == t.params["eps_high"]
            evals = pd.read_parquet(run_dir / "metrics.parquet").dropna(subset=["eval_in_dist"]).query("step > 0")
            assert t.intermediate_values == dict(zip(evals["step"], evals["eval_in_dist"], strict=True))  # steps 2, 4
            assert t.value == evals["eval_in_dist"].iloc[-1] and list(t.intermediate_values) == [2, 4]
    # parameters differ between trials (per-trial sampler seeds), so every trial is its own run
    assert len({t.user_attrs["run_id"] for ts in trials.values() for t in ts}) == 6


def test_rerun_adds_no_trial_and_computes_nothing(tuned: tuple[tune.Plan, Path]) -> None:
    p, _ = tuned
    stamps = {d: (d / "status.json").stat().st_mtime_ns for d in (p.results / "runs").iterdir()}
    assert tune.work(p) == {"grpo": 0, "gspo": 0}
    assert {a: len(t) for a, t in studies(p).items()} == {"grpo": 3, "gspo": 3}
    assert {d: (d / "status.json").stat().st_mtime_ns for d in (p.results / "runs").iterdir()} == stamps


def test_best_file_schema_and_provenance(tuned: tuple[tune.Plan, Path]) -> None:
    p, best = tuned
    doc = yaml.safe_load(best.read_text())
    validate_tuned_file(doc)
    assert doc["budget"]["trials_per_algorithm"] == 3 and doc["objective"]["metric"] == "eval_in_dist"
    assert doc["storage"].startswith("sqlite:///") and doc["storage"].endswith("tune/budget/optuna.db")
    assert doc["provenance"]["optuna"] == optuna.__version__ and doc["provenance"]["git_sha"]
    trials = studies(p)
    for algorithm, entry in doc["algorithms"].items():
        complete = [t for t in trials[algorithm] if t.state == TrialState.COMPLETE]
        top = max(t.value for t in complete)
        chosen = trials[algorithm][entry["trial"]]
        assert entry["value"] == chosen.value == top and chosen.number == min(
            t.number for t in complete if t.value == top
        )
        assert entry["run_id"] == chosen.user_attrs["run_id"] and entry["trials"] == {"complete": 3}
        assert entry["config"]["lr"] == chosen.params["lr"]
        assert entry["hparams"] == {k: chosen.params[k] for k in ("eps_low", "eps_high")}
    csv = pd.read_csv(best.with_name("trials.csv"))
    assert len(csv) == 6 and set(csv["state"]) == {"complete"}


def test_a_sweep_referencing_the_tuned_file_runs_the_tuned_values(tuned: tuple[tune.Plan, Path], tmp_path) -> None:
    _, best = tuned
    doc = yaml.safe_load(best.read_text())
    compare = tmp_path / "compare.yaml"

    def comparison(axes: dict) -> dict[str, RunConfig]:
        """The runs of a sweep `compare` over `axes` that takes the tuned file."""
        data = {"name": "compare", "preset": "tiny", "base": FAST, "tuned": str(best), "axes": axes}
        compare.write_text(yaml.safe_dump(data))
        return load_sweep(compare).expand()

    runs = comparison({"algorithm": ["grpo", "gspo"], "seed": [0, 1]})
    assert len(runs) == 4
    for run_id, cfg in runs.items():
        entry = doc["algorithms"][cfg.algorithm]
        assert cfg.lr == entry["config"]["lr"] and cfg.hparams == entry["hparams"]
        if cfg.seed == 0:  # the best trial's own run, reused by the comparison
            assert run_id == entry["run_id"]
    # precedence: the axis values win over the tuned ones
    (cfg,) = comparison({"algorithm": ["grpo"], "lr": [5e-5]}).values()
    assert cfg.lr == 5e-5 and cfg.hparams == doc["algorithms"]["grpo"]["hparams"]


def test_shipped_comparison_sweep_reads_the_committed_tuned_file() -> None:
    doc = yaml.safe_load((ROOT / "sweeps" / "tuned" / "tune.yaml").read_text())
    validate_tuned_file(doc)
    assert doc["source"] == "sweeps/tune.yaml" and set(doc["algorithms"]) == {"grpo", "gspo"}
    shipped = tune.plan(ROOT / "sweeps" / "tune.yaml")
    assert doc["budget"]["trials_per_algorithm"] == shipped.trials
    for entry in doc["algorithms"].values():
        assert entry["trials"]["complete"] + entry["trials"].get("pruned", 0) == shipped.trials
    runs = load_sweep(ROOT / "sweeps" / "compare_tuned.yaml").expand()
    assert {c.algorithm for c in runs.values()} == {"grpo", "gspo"}
    for run_id, cfg in runs.items():
        assert cfg.hparams == doc["algorithms"][cfg.algorithm]["hparams"]
        assert cfg.lr == doc["algorithms"][cfg.algorithm]["config"]["lr"]
        assert (run_id == doc["algorithms"][cfg.algorithm]["run_id"]) == (cfg.seed == 0)  # the best trial's run


# -- pruning ------------------------------------------------------------------------------------------------------
def test_a_pruned_trial_is_recorded_pruned_and_its_run_is_resumable(tmp_path: Path) -> None:
    # From random weights every held-out eval is 0: a threshold at 0.5 prunes every trial at its first eval (step 2)
    p = tune.plan(
        write_sweep(
            tmp_path / "prune.yaml", axes={"algorithm": ["gspo"]}, trials=2, pruner={"name": "threshold", "lower": 0.5}
        ),
        tmp_path / "results",
    )
    assert tune.work(p) == {"gspo": 2}
    trials = studies(p)["gspo"]
    assert [t.state for t in trials] == [TrialState.PRUNED] * 2
    for t in trials:
        assert t.user_attrs["outcome"] == "pruned" and t.user_attrs["stopped_at_step"] == 2
        assert t.intermediate_values == {2: 0.0}
        run_dir = p.results / "runs" / t.user_attrs["run_id"]
        st = status(run_dir)
        assert st["state"] == "stopped" and st["step"] == 2, st  # stopped on purpose, not failed nor running
        assert st["reason"] == f"pruned by ThresholdPruner at step 2 (tuning trial {t.number})"
        assert pd.read_parquet(run_dir / "metrics.parquet")["step"].tolist() == [0, 1, 2]  # 0: the start's evaluation
        assert (run_dir / "checkpoint" / "state.pt").exists()
    with pytest.raises(tune.TuneError, match=r"prune.gspo: no trial completed \(2 pruned or collapsed\)"):
        tune.best_document(p)
    # the pruned run is an ordinary run: the same config resumes it from step 2 to the end
    from study import rl

    cfg = p.config("gspo", trials[0].params)
    rl.run(cfg, p.results, progress=False)
    assert status(p.results / "runs" / cfg.run_id)["state"] == "completed"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_median_pruner_prunes_a_destructive_learning_rate(tmp_path: Path, tiny_coldstart: Path) -> None:
    """A policy that scores (the tiny cold start): trial 0 at the paper's settings, trial 1 at lr 0.01, which wrecks the
    policy within two steps; the median pruner stops trial 1 at its first eval, below trial 0's."""
    results = sharing_coldstart(tiny_coldstart.parent.parent, tmp_path / "results")
    # max_log_ratio: lr 0.01 moves the policy's log-probs by ~20 within step 1, at the default guard (20), so the run
    # could record an exploding-ratio collapse before the pruner sees its first eval; the guard is raised here
    base = {
        "coldstart": "auto",
        "steps": 6,
        "eval_every": 2,
        "eval_size": 16,
        "eval_samples": 2,
        "max_log_ratio": 1000.0,
    }
    p = tune.plan(
        write_sweep(
            tmp_path / "median.yaml",
            base=base,
            axes={"algorithm": ["grpo"]},
            trials=2,
            space={"lr": {"low": 1e-5, "high": 0.5}, "eps_low": "fixed", "eps_high": "fixed"},
            pruner={"name": "median", "startup_trials": 1},
        ),
        results,
    )
    study = optuna.create_study(study_name=p.study_name("grpo"), storage=tune.open_storage(p), direction="maximize")
    study.enqueue_trial({"lr": 1e-4})
    study.enqueue_trial({"lr": 0.01})
    assert tune.work(p) == {"grpo": 2}
    good, bad = studies(p)["grpo"]
    assert good.state == TrialState.COMPLETE and good.intermediate_values[2] > 0
    assert bad.state == TrialState.PRUNED and bad.user_attrs["outcome"] == "pruned"
    assert bad.intermediate_values[2] < good.intermediate_values[2] and list(bad.intermediate_values) == [2]
    assert status(p.results / "runs" / bad.user_attrs["run_id"])["step"] == 2


# -- parallel workers -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["sqlite", pytest.param("journal", marks=pytest.mark.slow)])
def test_two_workers_on_one_storage_lose_no_trial(storage: str, tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path / "par.yaml", trials=4, storage=storage)
    results = tmp_path / "results"
    args = [str(sweep), "--results", str(results), "--no-best"]
    if storage == "sqlite":  # one command starting a second worker process
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "sweeps.tune", *args, "--workers", "2"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        ]
    else:  # two independent commands, as two cluster jobs would be
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "sweeps.tune", *args],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(o[-3000:] for o in outputs)
    p = tune.plan(sweep, results)
    trials = studies(p)
    assert {a: [t.number for t in ts] for a, ts in trials.items()} == {"grpo": [0, 1, 2, 3], "gspo": [0, 1, 2, 3]}
    assert all(t.state == TrialState.COMPLETE for ts in trials.values() for t in ts)
    assert len({t.user_attrs["pid"] for ts in trials.values() for t in ts}) == 2, "both workers ran trials"
    run_ids = {t.user_attrs["run_id"] for ts in trials.values() for t in ts}
    assert len(run_ids) == 8 and all(status(results / "runs" / r)["state"] == "completed" for r in run_ids)
    assert tune.main([str(sweep), "--results", str(results), "--best-only"]) == 0
    assert set(yaml.safe_load((results / "tune" / "par" / "best.yaml").read_text())["algorithms"]) == {"grpo", "gspo"}


def test_a_killed_worker_loses_no_trial(tmp_path: Path) -> None:
    """SIGKILL a worker mid-trial: the next worker fails that trial, runs its parameters again (resuming the run) and
    the study still ends with exactly `trials` finished trials."""
    sweep = write_sweep(
        tmp_path / "kill.yaml", base={"steps": 8, "checkpoint_every": 1}, axes={"algorithm": ["grpo"]}, trials=2
    )
    results = tmp_path / "results"
    p = tune.plan(sweep, results)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sweeps.tune", str(sweep), "--results", str(results), "--no-best"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    # wait for a run's first checkpoint (a file, so polling does not touch the worker's database), then kill
    deadline = time.monotonic() + 300
    checkpoints: list[Path] = []
    while not checkpoints and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        checkpoints = list((results / "runs").glob("*/checkpoint/state.pt"))
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, f"the worker ended by itself before the kill:\n{log.read_text()[-3000:]}"
    assert checkpoints, f"no checkpoint after 300 s:\n{log.read_text()[-3000:]}"
    (killed,) = [t for t in studies(p)["grpo"] if t.state == TrialState.RUNNING]
    assert killed.user_attrs["pid"] == proc.pid
    assert status(results / "runs" / killed.user_attrs["run_id"])["state"] == "running"
    assert tune.work(p) == {"grpo": 2}
    trials = studies(p)["grpo"]
    states = [t.state for t in trials]
    assert states.count(TrialState.FAIL) == 1 and states.count(TrialState.COMPLETE) == 2, states
    failed = next(t for t in trials if t.state == TrialState.FAIL)
    assert failed.number == killed.number
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == failed.number)
    assert retry.params == failed.params and retry.state == TrialState.COMPLETE
    assert retry.user_attrs["run_id"] == killed.user_attrs["run_id"], "the retry resumes the killed run"
    assert status(results / "runs" / retry.user_attrs["run_id"])["state"] == "completed"


# -- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"trials": 0}, r"tune.trials = 0: minimum is 1"),
        ({"objective": "reward"}, r"tune.objective = 'reward'; valid: eval_in_dist, eval_hard"),
        ({"pruner": {"name": "hyper"}}, r"tune.pruner.name = 'hyper'; valid: median, percentile, threshold, none"),
        ({"sampler": {"name": "cma"}}, r"tune.sampler.name = 'cma'; valid: tpe, random"),
        ({"space": {"lr": "fix"}}, r"tune.space.lr = 'fix'; valid: `fixed`, or \{low: X, high: Y\}"),
        ({"space": {"eps_lo": "fixed"}}, r"tune.space: unknown name\(s\) \['eps_lo'\]; valid: eps_high, eps_low, "),
        (
            {"space": {"eps_low": {"low": 0.1, "high": 1.5}}},
            r"tune.space.eps_low.high: grpo.eps_low = 1.5: valid range is \[0.0, 1.0\)",
        ),
        ({"space": {"lr": {"low": 0.0, "high": 1e-3}}}, r"tune.space.lr.low = 0.0: a log-scale interval needs low > 0"),
        ({"space": {"lr": {"low": 1e-3, "high": 1e-4}}}, r"tune.space.lr: low = 0.001 must be < high = 0.0001"),
        ({"spread": 1}, r"tune.spread = 1.0: must be > 1"),
        ({"pruner": {"name": "threshold"}}, r"tune.pruner.name = 'threshold' needs tune.pruner.lower"),
        ({"strage": "sqlite"}, r"tune: unknown field\(s\) \['strage'\]; valid: trials, objective"),
    ],
)
def test_bad_tune_section_names_field_and_valid_values(change: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=message):
        tune.plan(write_sweep(tmp_path / "bad.yaml", axes={"algorithm": ["grpo"]}, **change))


def test_bad_tuning_sweeps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SweepError, match=r"grpo has several \(differing in seed\); valid: axes.algorithm only"):
        tune.plan(write_sweep(tmp_path / "a.yaml", axes={"algorithm": ["grpo"], "seed": [0, 1]}))
    with pytest.raises(SweepError, match=r"base.eval_every = 0: trials are scored and pruned on held-out eval"):
        tune.plan(write_sweep(tmp_path / "b.yaml", base={"eval_every": 0}))
    with pytest.raises(SweepError, match=r"smoke.yaml: no `tune:` section"):
        tune.plan(ROOT / "sweeps" / "smoke.yaml")
    # the command line: exit 2 and the message, before any trial
    assert tune.main([str(write_sweep(tmp_path / "c.yaml")), "--storage", "redis", "--results", str(tmp_path)]) == 2
    assert "storage = 'redis'; valid: sqlite, journal, journal:PATH, or an RDB URL" in capsys.readouterr().err
    assert tune.main([str(write_sweep(tmp_path / "d.yaml")), "--algorithm", "dapo", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--algorithm = 'dapo': not tuned by" in err and "valid: grpo, gspo" in err
    assert not (tmp_path / "tune").exists() and not (tmp_path / "runs").exists()  # nothing ran


def tuned_sweep(tmp_path: Path, tuned: str, algorithms_: list[str] | None = None) -> Path:
    path = tmp_path / "cmp.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": "cmp", "preset": "tiny", "tuned": tuned, "axes": {"algorithm": algorithms_ or ["grpo"]}}
        )
    )
    return path


def test_missing_or_bad_tuned_file_fails_naming_the_field(tmp_path: Path) -> None:
    missing = f"{tmp_path}/tune/tune/best.yaml"  # what `python -m sweeps.tune sweeps/tune.yaml --results TMP` writes
    with pytest.raises(SweepError) as err:
        load_sweep(tuned_sweep(tmp_path, missing))
    assert (
        f"tuned = '{missing}': no such file; write it with `python -m sweeps.tune sweeps/tune.yaml --results "
        f"{tmp_path}`" in str(err.value)
    )
    assert "snakemake tune --cores all --config sweep=sweeps/tune.yaml" in str(err.value)
    with pytest.raises(SweepError, match=r"tuned = 'x.json': must match"):
        load_sweep(tuned_sweep(tmp_path, "x.json"))
    good = {"format": 1, "algorithms": {"grpo": {"config": {"lr": 2e-4}, "hparams": {"eps_low": 0.1}}}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(good))
    (cfg,) = load_sweep(tuned_sweep(tmp_path, str(path))).expand().values()
    assert cfg.lr == 2e-4 and cfg.hparams == {"eps_low": 0.1}
    with pytest.raises(SweepError, match=r"has no tuned values for algorithm 'gspo' \(tuned: grpo\); valid: tune it"):
        load_sweep(tuned_sweep(tmp_path, str(path), ["grpo", "gspo"])).expand()
    bad = {
        "algorithms.grpo.hparams: grpo.eps_low = 2.0: valid range is [0.0, 1.0)": {"eps_low": 2.0},
        "algorithms.grpo.hparams: algorithm 'grpo' has no hyper-parameter 'tau'; valid: eps_low, eps_high": {"tau": 1},
    }
    for message, hparams in bad.items():
        path.write_text(yaml.safe_dump({**good, "algorithms": {"grpo": {"config": {}, "hparams": hparams}}}))
        with pytest.raises(SweepError) as err:
            load_tuned(path)
        assert message in str(err.value)
    path.write_text(yaml.safe_dump({"format": 2, "algorithms": {"gpso": {"config": {"lr": "x"}, "hparams": {}}}}))
    with pytest.raises(SweepError) as err:
        load_tuned(path)
    assert "format = 2; valid: 1" in str(err.value) and "algorithms = 'gpso'; valid: " in str(err.value)


def test_snakemake_tune_rules(tmp_path: Path) -> None:
    def snakemake(*config: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "tune",
            "--cores",
            "2",
            "--config",
            *config,
            f"results={tmp_path}",
        ]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)

    proc = snakemake("sweep=sweeps/tune.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(
        line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2 and line.split()[1].isdigit()
    )
    assert counts["tune_algorithm"] == "2" and counts["tune"] == "1"
    assert counts["coldstart"] == "1"  # made once, before the trials (each tune_algorithm job takes it as input)
    proc = snakemake()  # the default study has no tune: section
    assert proc.returncode != 0 and "sweeps/default.yaml: no `tune:` section" in proc.stdout + proc.stderr
    missing = f"{tmp_path}/tune/tune/best.yaml"
    proc = snakemake(f"sweep={tuned_sweep(tmp_path, missing)}")  # fails while parsing the workflow: no job starts
    assert proc.returncode != 0 and f"tuned = '{missing}': no such file" in proc.stdout + proc.stderr


def test_on_eval_hook_sees_every_held_out_eval(tmp_path: Path) -> None:
    """The RL loop's tuning hook: called once per eval step, after the step is recorded, with the eval columns."""
    from study import rl
    from study.run.config import RunConfig

    cfg = RunConfig.from_dict(
        {
            **FAST,
            "steps": 5,
            "model": "tiny",
            "prompts_per_step": 2,
            "group_size": 2,
            "minibatches": 1,
            "max_new_tokens": 16,
        }
    )
    seen = []
    rl.run(cfg, tmp_path, progress=False, on_eval=lambda step, row: seen.append((step, row["eval_in_dist"])))
    assert [s for s, _ in seen] == [2, 4, 5] and all(0 <= v <= 1 for _, v in seen)
