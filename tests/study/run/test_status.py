"""`python -m study status` on a study whose run directories were written by real tiny runs: one completed, one
collapsed (reward floor), one failed (an error raised by the run's evaluation hook, recorded by the run's own failure
path), one that died (a `python -m study run` process killed with SIGKILL mid-run: status.json still says `running`,
but the kernel released its lock) and one not started (pending)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from study import rl
from study.__main__ import main as study_main
from study.run import status as S
from study.run.config import load_config
from sweeps.expand import write_config

BASE = ["coldstart=scratch", "steps=3", "eval_every=2", "checkpoint_every=0"]
RUNNING = ["coldstart=scratch", "steps=40", "eval_every=2", "checkpoint_every=1"]  # metric files at every step


def _raise(exc: BaseException, at: int):  # type: ignore[no-untyped-def]
    def hook(step: int, row: dict) -> None:
        if step == at:
            raise exc

    return hook


def _run_and_kill(results: Path, sets: list[str], run_dir: Path, at_step: int) -> None:
    """`python -m study run` in a child process, SIGKILLed once it has recorded `at_step` steps."""
    cmd = [sys.executable, "-m", "study", "run", "--preset", "tiny", "--results", str(results), "--quiet"]
    proc = subprocess.Popen(
        [*cmd, *(a for s in sets for a in ("--set", s))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads((run_dir / "status.json").read_text()).get("step", 0) >= at_step:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("status")
    cfgs = {
        "completed": load_config(preset="tiny", sets=[*BASE, "seed=0"]),
        "collapsed": load_config(preset="tiny", sets=[*BASE, "seed=1", "reward_floor=0.5", "collapse_window=2"]),
        "failed": load_config(preset="tiny", sets=[*BASE, "seed=2"]),
        "running": load_config(preset="tiny", sets=[*RUNNING, "seed=3"]),
        "pending": load_config(preset="tiny", sets=[*BASE, "seed=4"]),
    }
    for cfg in cfgs.values():  # what the workflow's resolve rule writes before any run starts
        write_config(cfg, root / "demo" / "configs" / f"{cfg.run_id}.yaml")
    rl.run(cfgs["completed"], root, progress=False)
    rl.run(cfgs["collapsed"], root, progress=False)
    with pytest.raises(RuntimeError):
        rl.run(cfgs["failed"], root, progress=False, on_eval=_raise(RuntimeError("evaluation server gone"), 2))
    _run_and_kill(root, [*RUNNING, "seed=3"], root / "runs" / cfgs["running"].run_id, at_step=2)
    (root / "ids.json").write_text(json.dumps({("died" if k == "running" else k): c.run_id for k, c in cfgs.items()}))
    return root


def test_status_lists_every_state_with_progress_and_reasons(results: Path, capsys: pytest.CaptureFixture) -> None:
    ids = json.loads((results / "ids.json").read_text())
    code = study_main(["status", str(results), "--study", "demo", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1  # a run failed
    runs = {r["run_id"]: r for r in doc["runs"]}
    assert {kind: runs[rid]["state"] for kind, rid in ids.items()} == {k: k for k in ids}
    assert doc["summary"] == {"completed": 1, "collapsed": 1, "failed": 1, "died": 1, "pending": 1}
    done, run, col, fail = (runs[ids[k]] for k in ("completed", "died", "collapsed", "failed"))
    assert (done["step"], done["steps"], done["eta_s"]) == (3, 3, None)
    assert done["eval_in_dist"] is not None and done["reward"] is not None and done["elapsed_s"] > 0
    assert 2 <= run["step"] < 40 and run["steps"] == 40
    assert (
        run["reason"].startswith("its process ended without recording an exit (killed")
        and "resumable" in (run["reason"])
    )
    assert col["reason"].startswith("reward collapse") and col["step"] == 2
    assert fail["reason"] == "RuntimeError: evaluation server gone"
    assert {r["axes"]["seed"] for r in doc["runs"]} == {"0", "1", "2", "3", "4"}  # the axis that varies
    assert set(col["axes"]) == {"seed", "reward_floor", "collapse_window", "steps"}  # checkpoint_every: no axis


def test_status_table_has_a_line_per_run_and_per_state(results: Path, capsys: pytest.CaptureFixture) -> None:
    ids = json.loads((results / "ids.json").read_text())
    assert study_main(["status", str(results), "--study", "demo"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["run", "algorithm", "axes", "state"]
    for kind, rid in ids.items():
        (line,) = [ln for ln in out if ln.startswith(rid)]
        assert f" {kind} " in line
    assert next(ln for ln in out if ln.startswith(ids["failed"])).endswith("RuntimeError: evaluation server gone")
    assert out[-5:] == ["completed: 1", "collapsed: 1", "failed: 1", "died: 1", "pending: 1"]
    # without --study: every run directory, so no pending one
    assert S.summary(S.collect(results)) == {"completed": 1, "collapsed": 1, "failed": 1, "died": 1}


def test_watch_redraws_and_bad_arguments_are_errors(results: Path, capsys: pytest.CaptureFixture) -> None:
    assert S.watch(results, "demo", interval=0.01, as_json=True, rounds=2) == 1
    assert len(capsys.readouterr().out.strip().splitlines()) == 2  # a pending run: it keeps redrawing
    assert study_main(["status", str(results), "--study", "typo"]) == 2
    err = capsys.readouterr().err
    assert "--study = 'typo'" in err and "valid: demo" in err
    assert study_main(["status", str(results), "--study", "../x"]) == 2
    assert "not a study name; valid: demo" in capsys.readouterr().err
    assert study_main(["status", str(results / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("damage", [b"\xff\xfe\x00garbage", b"a: [1\n", b"[" * 5000, b"- just a list\n"])
def test_one_unreadable_config_is_reported_and_the_others_listed(
    results: Path, tmp_path: Path, damage: bytes, capsys: pytest.CaptureFixture
) -> None:
    ids = json.loads((results / "ids.json").read_text())
    copy = tmp_path / "results"
    shutil.copytree(results / "runs", copy / "runs", ignore=shutil.ignore_patterns("checkpoint", "tensorboard"))
    config = copy / "runs" / ids["completed"] / "config.yaml"
    config.write_bytes(damage)
    assert study_main(["status", str(copy), "--json"]) == 1
    runs = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs[ids["completed"]]["state"] == "unreadable"
    assert runs[ids["completed"]]["reason"].startswith("config.yaml unreadable: ")
    assert {runs[ids[k]]["state"] for k in ("collapsed", "failed", "died")} == {"collapsed", "failed", "died"}
