"""Bad and hostile input: each failure a new user met, and what happens now.

Config errors are checked on the config alone; the run-state cases share one tiny run (one RL step from random
weights) whose directory each test copies and damages."""

import contextlib
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from study import __main__ as study_main
from study import launch, record, rl
from study.coldstart import coldstart_main
from study.run import rundir
from study.run.config import FLOAT_RANGES, RunConfig, load_config

SCRATCH = ["coldstart=scratch", "eval_every=0", "checkpoint_every=1"]


def tiny(*sets: str) -> RunConfig:
    return load_config(preset="tiny", sets=[*SCRATCH, *sets])


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str], main=study_main.main) -> str:
    """Run a CLI in-process; it must exit 2 with exactly one `error: ...` line (plus an optional hint line)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("error: ") and "Traceback" not in "\n".join(err), err
    return err[0]


# -- config: every float finite and in range; eval_size within the pool; YAML and path errors -------------------------
def test_every_float_field_is_finite_and_in_its_range() -> None:
    floats = [name for name, hint in typing.get_type_hints(RunConfig).items() if hint is float]
    assert sorted(floats) == sorted(FLOAT_RANGES), "a float field of RunConfig without its range in FLOAT_RANGES"
    for name in floats:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"^{name} = {bad}: must be a finite number in "):
                RunConfig().replace(**{name: bad})
    for sets, field in (
        (["lr=inf"], "lr"),
        (["weight_decay=inf"], "weight_decay"),
        (["grad_clip=nan"], "grad_clip"),
        (["max_log_ratio=nan"], "max_log_ratio"),
        (["max_log_ratio=-1"], "max_log_ratio"),
        (["lr=0"], "lr"),
        (["reward_floor=2"], "reward_floor"),
    ):
        with pytest.raises(ValueError, match=rf"^{field} = "):
            load_config(preset="tiny", sets=sets)


def test_eval_size_beyond_the_held_out_pool_is_refused() -> None:
    with pytest.raises(ValueError, match=r"eval_size = 100000: the chain_sum held-out sets hold 128 problems; valid"):
        load_config(preset="tiny", sets=["eval_size=100000"])
    assert load_config(preset="tiny", sets=["eval_size=128"]).eval_size == 128


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["threads=100000"], "threads = 100000: this machine has"),
        (["coldstart=/missing"], "coldstart = '/missing': no such directory"),
    ],
)
def test_preflight_refuses_before_anything_is_written(tmp_path: Path, sets: list[str], message: str) -> None:
    cfg = load_config(preset="tiny", sets=sets)  # valid as a config: a sweep may run it on another machine
    with pytest.raises(ValueError, match=message):
        rl.run(cfg, tmp_path, progress=False)
    assert not list(tmp_path.iterdir()), "something was written before the refusal"


def test_cli_config_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: [1e-4\nseed: 1\n")
    results = ["--results", str(tmp_path / "results")]
    assert "--set 'lr=[1': the value is not valid YAML" in error_line(capsys, ["run", "--set", "lr=[1", *results])
    assert f"{bad_yaml}: not valid YAML" in error_line(capsys, ["run", str(bad_yaml), *results])
    assert f"{tmp_path}: is a directory" in error_line(capsys, ["run", str(tmp_path), *results])
    assert "no such file" in error_line(capsys, ["run", str(tmp_path / "none.yaml"), *results])
    # the launcher reads its config the same way
    assert f"{bad_yaml}: not valid YAML" in error_line(capsys, [str(bad_yaml)], main=launch.main)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("text", ["", "\n# only a comment\n", "---\n"])
def test_an_empty_config_file_is_refused_not_taken_as_the_defaults(tmp_path: Path, text: str) -> None:
    empty = tmp_path / "run.yaml"
    empty.write_text(text)
    with pytest.raises(ValueError, match=rf"^{empty}: empty \(no config fields\); give a YAML mapping"):
        load_config(empty)


def test_resume_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny()
    run_dir = tmp_path / "runs" / cfg.run_id
    assert "no such run directory" in error_line(capsys, ["resume", str(run_dir)])
    run_dir.mkdir(parents=True)
    assert "not a run directory (no config.yaml)" in error_line(capsys, ["resume", str(run_dir)])
    config = run_dir / "config.yaml"
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    config.write_text(text.replace("seed: 0", "seed: 7"))
    assert f"{config} was edited: it hashes to run" in error_line(capsys, ["resume", str(run_dir)])
    config.write_text(text[: len(text) // 3] + "\n  - [")
    assert f"{config}: cannot be read as this run's config" in error_line(capsys, ["resume", str(run_dir)])


# -- one process per run ----------------------------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from study.run import rundir
with rundir.run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_process_on_a_run_refuses_naming_the_holder(tmp_path: Path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "runs" / tiny().run_id
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        locked = rf"is being run by pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(rundir.RunLocked, match=locked), rundir.run_lock(run_dir):
            pass
        # a run refuses before it writes anything (issue 23 item 8: a single-rank run started as two processes)
        with pytest.raises(rundir.RunLocked, match=f"pid {holder.pid}"):
            rl.run(tiny(), tmp_path, progress=False)
        assert not (run_dir / "status.json").exists()
        argv = ["run", "--preset", "tiny", "--results", str(tmp_path)]
        for s in SCRATCH:
            argv += ["--set", s]
        assert f"pid {holder.pid}" in error_line(capsys, argv)
    finally:
        holder.kill()
        holder.wait()
    # killed: its lock file is left, naming it; on the same host its flock is gone, so the run is taken over
    assert json.loads((run_dir / rundir.LOCK_FILE).read_text())["pid"] == holder.pid
    with rundir.run_lock(run_dir):
        assert json.loads((run_dir / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"was left by pid {holder.pid}" in capsys.readouterr().err
    assert not (run_dir / rundir.LOCK_FILE).exists(), "released: the lock file is removed"
    # left by a process on another host: this host cannot check it, so it refuses, unless it is the same SLURM job
    other = {"pid": 4242, "host": "node-elsewhere", "job_id": "77", "since": "then"}
    (run_dir / rundir.LOCK_FILE).write_text(json.dumps(other))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    elsewhere = r"pid 4242 on host node-elsewhere, SLURM job 77.*delete .*run.lock"
    with pytest.raises(rundir.RunLocked, match=elsewhere), rundir.run_lock(run_dir):
        pass
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a requeue of the same job on another node
    with rundir.run_lock(run_dir):
        pass
    assert "the same SLURM job, requeued" in capsys.readouterr().err


# -- any exit is recorded ---------------------------------------------------------------------------------------------
class Panic(BaseException):
    """What a native library's panic looks like from Python (pyo3's PanicException is a BaseException)."""


@pytest.mark.parametrize(("raised", "state"), [(Panic, "failed"), (KeyboardInterrupt, "stopped")])
def test_any_exit_is_recorded(tmp_path: Path, monkeypatch, raised: type[BaseException], state: str) -> None:
    def setup(*args, **kwargs):
        raise raised("boom")

    monkeypatch.setattr(rl, "setup", setup)
    cfg = tiny()
    with pytest.raises(raised):
        rl.run(cfg, tmp_path, progress=False)
    run_dir = tmp_path / "runs" / cfg.run_id
    status = rundir.read_status(run_dir)
    assert status["state"] == state
    if state == "failed":
        assert status["error"] == "Panic: boom" and "Traceback" in status["traceback"]
        assert json.loads((run_dir / rundir.FAILURE_FILE).read_text())["error"] == "Panic: boom"
    assert not (run_dir / rundir.LOCK_FILE).exists()


# -- damaged run state ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step tiny run (checkpoint at step 1)."""
    return rl.run(tiny("steps=1"), tmp_path_factory.mktemp("one_step"), progress=False)


def interrupted(one_step: Path, tmp_path: Path) -> Path:
    """A copy of the one-step run as the first step of a two-step run that was killed after its checkpoint."""
    cfg = tiny("steps=2")
    run_dir = tmp_path / "runs" / cfg.run_id
    shutil.copytree(one_step, run_dir)
    rundir.write_yaml(run_dir / "config.yaml", cfg.to_dict())
    rundir.set_status(run_dir, "running", step=1)
    return run_dir


def test_checkpoints_hold_only_tensors_and_plain_values(one_step: Path) -> None:
    state = torch.load(one_step / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 1 and isinstance(state["numpy_rng"]["keys"], torch.Tensor)


class Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {Path(os.environ['PWNED'])}",))


@pytest.mark.parametrize(
    "damage",
    [
        "hostile",
        "truncated",
        "garbage",
        "no_checkpoint",
        "metrics_truncated",
        "metrics_garbage",
        "metrics_deleted",
        "status_garbage",
    ],
)
def test_damaged_state_is_one_line_naming_the_file(
    one_step: Path, tmp_path: Path, damage: str, monkeypatch, capsys
) -> None:
    run_dir = interrupted(one_step, tmp_path)
    state, metrics = run_dir / "checkpoint" / "state.pt", run_dir / "metrics.parquet"
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(pwned))
    target = metrics if damage.startswith("metrics") else state
    if damage == "hostile":
        torch.save({"model": Hostile()}, state)
    elif damage.endswith("truncated"):
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage.endswith("garbage"):
        target = run_dir / "status.json" if damage == "status_garbage" else target
        target.write_bytes(os.urandom(2000))
    else:
        target.unlink()
    line = error_line(capsys, ["resume", str(run_dir), "--quiet"])
    assert str(target) in line and "move its directory away" in line, line
    if damage == "hostile":
        assert "refused" in line and not pwned.exists(), "the pickle's code ran"
    if damage != "status_garbage":
        assert rundir.read_status(run_dir)["state"] == "failed"


def test_resume_without_token_samples_warns_and_keeps_its_step(
    one_step: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    run_dir = interrupted(one_step, tmp_path)
    (run_dir / record.TOKEN_SAMPLES).unlink()
    leftovers = [run_dir / "checkpoint" / ".state.pt.x1.tmp", run_dir / ".metrics.parquet.x2.tmp"]
    for tmp in leftovers:  # what a kill during a write leaves
        tmp.write_bytes(b"partial")
    statuses = []
    set_status = rundir.set_status
    monkeypatch.setattr(
        rundir, "set_status", lambda d, state, **f: statuses.append((state, f.get("step"))) or set_status(d, state, **f)
    )
    assert study_main.main(["resume", str(run_dir), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {run_dir / record.TOKEN_SAMPLES} is missing" in err
    assert not any(t.exists() for t in leftovers), "leftover temporary files"
    assert ("running", 0) not in statuses and statuses[0] == ("running", 1), statuses  # never back to step 0
    assert rundir.read_status(run_dir)["state"] == "completed"
    assert pd.read_parquet(run_dir / "metrics.parquet")["step"].tolist() == [1, 2]
    assert sorted(pd.read_parquet(run_dir / record.TOKEN_SAMPLES)["step"].unique()) == [2]


def test_a_garbage_trackers_json_is_an_error_never_replaced(one_step: Path, tmp_path: Path, capsys) -> None:
    run_dir = interrupted(one_step, tmp_path)
    garbage = b'{"study": "mystudy", "tags": {"lr": "1e-4"'  # cut short: its study and tags must not be lost
    (run_dir / "trackers.json").write_bytes(garbage)
    line = error_line(capsys, ["resume", str(run_dir), "--quiet"])
    assert line.startswith(f"error: {run_dir / 'trackers.json'}: not valid JSON at line 1") and "restore it" in line
    assert (run_dir / "trackers.json").read_bytes() == garbage
    assert rundir.read_status(run_dir) == {**rundir.read_status(run_dir), "state": "running", "step": 1}


def test_the_collapsing_step_keeps_its_row(tmp_path: Path) -> None:
    # a ratio bound no update can meet: the second minibatch of step 1 (off-policy after one update) trips it; from
    # random weights every reward is 0 (no gradient), so weight decay is what moves the weights
    run_dir = rl.run(tiny("steps=2", "max_log_ratio=1e-9", "weight_decay=0.5"), tmp_path, progress=False)
    status = rundir.read_status(run_dir)
    assert status["state"] == "collapsed" and "exploding ratio" in status["reason"]
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert metrics["step"].tolist() == [status["step"]] == [1]
    assert metrics["reward_mean"].notna().all()


def test_result_files_take_the_umasks_mode(one_step: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in one_step.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"status.json", "metrics.parquet", "state.pt", "config.yaml", "manifest.json"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}


# -- untrusted files, every exit recorded, damaged optional files ----------------------------------------------------
def test_a_planted_lock_link_writes_nothing_outside(one_step: Path, tmp_path: Path, capsys) -> None:
    run_dir = interrupted(one_step, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run_dir / rundir.LOCK_FILE).symlink_to(victim)
    line = error_line(capsys, ["resume", str(run_dir), "--quiet"])
    assert f"{run_dir / rundir.LOCK_FILE}: a symbolic link (to {victim})" in line
    assert victim.read_text() == "precious\n"
    assert rundir.read_status(run_dir)["state"] == "running"  # refused before the run wrote anything


def _study_run(results: Path, *sets: str, script: str = "", **popen: typing.Any) -> subprocess.Popen[str]:
    """`python -m study run` of the tiny scratch config with `sets` (or `script`, given the same arguments)."""
    entry = ["-c", script] if script else ["-m", "study"]
    cmd = [sys.executable, *entry, "run", "--preset", "tiny", "--results", str(results), "--quiet"]
    return subprocess.Popen(
        [*cmd, *(a for s in [*SCRATCH, *sets] for a in ("--set", s))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _sigterm_after_the_first_step(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """SIGTERM to `proc` once `run_dir` has recorded a step: it exits 128 + SIGTERM with one line naming how to resume
    the run, no traceback."""
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            if rundir.read_status(run_dir)["step"] >= 1:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and f"stopped (SIGTERM received): {run_dir}; resume with" in err, err


def test_sigterm_is_recorded_stopped_resumable_without_a_traceback(tmp_path: Path) -> None:
    cfg = tiny("steps=30")
    run_dir = tmp_path / "runs" / cfg.run_id
    proc = _study_run(tmp_path, "steps=30")
    _sigterm_after_the_first_step(proc, run_dir)
    status = rundir.read_status(run_dir)
    assert status["state"] == "stopped" and status["reason"] == "Terminated: SIGTERM received"
    assert not (run_dir / rundir.LOCK_FILE).exists() and not (run_dir / rundir.CRASH_FILE).exists()


@contextlib.contextmanager
def _tmpfs(path: Path, options: str, unable: str) -> typing.Iterator[Path]:
    """A tmpfs mounted (`-o options`) on the directory `path` and unmounted after; the test is skipped with `unable`
    where mounting is not allowed."""
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip(unable)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> typing.Iterator[Path]:
    """A 1 MiB tmpfs: room for a tiny run's small files, not for its 3.6 MB checkpoint (needs root, else skipped)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    with _tmpfs(mount, "size=1m", "cannot mount a tmpfs here (needs root)"):
        yield mount


def test_a_full_disk_is_recorded_naming_the_file(small_disk: Path, capsys) -> None:
    cfg = tiny("steps=2")
    with pytest.raises(rundir.WriteError, match=r"state\.pt: could not be written.* bytes free on its filesystem"):
        rl.run(cfg, small_disk, progress=False)
    run_dir = small_disk / "runs" / cfg.run_id
    status = rundir.read_status(run_dir)
    assert (
        status["state"] == "failed"
        and f"{run_dir / 'checkpoint' / 'state.pt'}: could not be written" in (status["error"])
    )
    assert json.loads((run_dir / rundir.FAILURE_FILE).read_text())["error"] == status["error"]
    assert not list((run_dir / "checkpoint").glob(".*.tmp")), "the failed temporary checkpoint was left"
    # the disk full at the first checkpoint: once there is room, the run resumes (from step 0: no checkpoint was made)
    assert subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)]).returncode == 0
    capsys.readouterr()
    assert study_main.main(["resume", str(run_dir), "--quiet"]) == 0, capsys.readouterr().err
    assert "first checkpoint (step 1) was never completed" in capsys.readouterr().err
    assert rundir.read_status(run_dir)["state"] == "completed"
    assert pd.read_parquet(run_dir / "metrics.parquet")["step"].tolist() == [1, 2]


def test_a_file_size_limit_is_named_and_the_run_resumes_without_it(tmp_path: Path) -> None:
    cfg = tiny("steps=2")
    run_dir = tmp_path / "runs" / cfg.run_id
    limit = 1 << 20  # room for the small files, not for the 3.6 MB checkpoint

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _study_run(tmp_path, "steps=2", preexec_fn=limited)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    line = err.strip().splitlines()[-2 if "(the run failed" in err else -1]
    assert f"error: {run_dir / 'checkpoint' / 'state.pt'}: could not be written" in line, err
    assert f"the file size limit (ulimit -f) is {limit} bytes" in line and "bytes free" not in line, line
    assert rundir.read_status(run_dir)["state"] == "failed"
    resumed = subprocess.run(
        [sys.executable, "-m", "study", "resume", str(run_dir), "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert rundir.read_status(run_dir)["state"] == "completed"


SLOW_CHECKPOINT = """
import sys, time, torch
from study import __main__ as study_main
save = torch.save
def save_then_wait(obj, f, *args, **kwargs):  # a run checkpoint written to its temporary file, not yet renamed
    save(obj, f, *args, **kwargs)
    if isinstance(obj, dict) and "data_pos" in obj:
        print("writing the checkpoint", flush=True)
        time.sleep(600)
torch.save = save_then_wait
sys.exit(study_main.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_kill_while_the_first_checkpoint_is_written_is_resumable(tmp_path: Path, signum: int, capsys) -> None:
    from study.run import status as run_status

    sets = ["steps=2", "checkpoint_every=2"]  # the first checkpoint at step 2, after the metrics of steps 1 and 2
    run_dir = tmp_path / "runs" / tiny(*sets).run_id
    proc = _study_run(tmp_path, *sets, script=SLOW_CHECKPOINT)
    assert proc.stdout.readline().strip() == "writing the checkpoint", proc.communicate(timeout=60)
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum), err
    assert pd.read_parquet(run_dir / "metrics.parquet")["step"].max() == 2
    assert not (run_dir / "checkpoint" / "state.pt").exists()
    (line,) = run_status.collect(tmp_path)
    assert line.state == ("died" if signum == signal.SIGKILL else "stopped"), line
    assert study_main.main(["resume", str(run_dir), "--quiet"]) == 0, capsys.readouterr().err
    assert "first checkpoint (step 2) was never completed" in capsys.readouterr().err
    assert rundir.read_status(run_dir)["state"] == "completed"
    assert pd.read_parquet(run_dir / "metrics.parquet")["step"].tolist() == [1, 2]
    assert record.recorded_checkpoint(run_dir / "metrics.parquet") == 2


def test_a_lost_checkpoint_is_still_an_error_after_the_first_completed(one_step: Path, tmp_path: Path, capsys):
    run_dir = interrupted(one_step, tmp_path)
    assert record.recorded_checkpoint(run_dir / "metrics.parquet") == 1  # written once state.pt was in place
    shutil.rmtree(run_dir / "checkpoint")
    line = error_line(capsys, ["resume", str(run_dir), "--quiet"])
    assert "records that the checkpoint of step 1 was completed" in line, line


@pytest.mark.parametrize("name", ["routing_layers.parquet", record.TOKEN_SAMPLES])
def test_resume_with_a_truncated_optional_table_warns_and_goes_on(
    one_step: Path, tmp_path: Path, name: str, capsys
) -> None:
    run_dir = interrupted(one_step, tmp_path)
    table = run_dir / name
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    assert study_main.main(["resume", str(run_dir), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {table} is unreadable" in err and "treated as missing" in err and "move its directory" not in err
    assert rundir.read_status(run_dir)["state"] == "completed"
    assert sorted(pd.read_parquet(table)["step"].unique()) == [2]


# -- sizes are checked before anything is written ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["model.num_experts=1000000000"], "model.num_experts = 1000000000"),
        (["prompts_per_step=100000000"], "prompts_per_step = 100000000"),
        (["model.max_seq_len=1000000000"], "model.max_seq_len = 1000000000"),
        (["model.vocab_size=1000000000"], "model.vocab_size = 1000000000"),
        (["eval_every=1", "eval_samples=1000000"], "eval_samples = 1000000"),  # the evaluation's one generate
        (["eval_every=1", "eval_test_size=512", "eval_test_samples=100000"], "eval_test_samples = 100000"),  # tests
    ],
)
def test_a_run_too_big_for_the_machine_is_refused_naming_the_field(
    tmp_path: Path, sets: list[str], field: str, capsys
) -> None:
    argv = ["run", "--preset", "tiny", "--results", str(tmp_path), "--quiet"]
    line = error_line(capsys, [*argv, *(a for s in [*SCRATCH, *sets] for a in ("--set", s))])
    assert line.startswith(f"error: {field}: the run needs about ") and "planner's estimate" in line, line
    assert "more than this machine's" in line
    assert not list(tmp_path.iterdir()), "something was written before the refusal"


def test_yaml_nested_too_deep_is_refused_everywhere(tmp_path: Path, capsys) -> None:
    from sweeps import expand

    deep = tmp_path / "deep.yaml"
    deep.write_text("lr: " + "[" * 5000 + "]" * 5000 + "\n")
    nested = "nested deeper than 64 levels"
    assert nested in error_line(capsys, ["run", str(deep), "--results", str(tmp_path / "r")])
    assert nested in error_line(capsys, ["plan", "--config", str(deep), "--gpus", "8", "--gpu-mem", "80"])
    assert expand.main([str(deep)]) == 2 and nested in capsys.readouterr().err
    assert nested in error_line(capsys, ["run", "--set", "lr=" + "[" * 5000, "--results", str(tmp_path / "r")])


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--gpu-mem", "inf", "--gpu-mem = inf: valid: a finite number of GB > 0"),
        ("--gpu-mem", "nan", "--gpu-mem = nan: valid"),
        ("--gpu-mem", "-80", "--gpu-mem = -80.0: valid"),
        ("--prompt-len", "-5", "--prompt-len = -5: valid: an integer in [1, "),
        ("--response-len", "0", "--response-len = 0: valid"),
        ("--gpus", "100000000000", "--gpus = 100000000000: valid: an integer in [1, 1048576]"),
        ("--gpus", "0", "--gpus = 0: valid"),
        ("--gpu", "a100", "--gpu = 'a100': unknown GPU kind; valid: h100, h200"),
        ("--experts", "bogus", "--experts = 'bogus': valid: auto, grouped, sequential"),
    ],
)
def test_plan_refuses_absurd_options(option: str, value: str, message: str, capsys) -> None:
    argv = ["plan", "--model", "tiny", "--gpus", "8", "--gpu-mem", "80", option, value]
    assert message in error_line(capsys, argv)


def test_a_huge_value_is_not_echoed_whole(tmp_path: Path, capsys) -> None:
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", "lr=" + "x" * 5_000_000, "--results", str(tmp_path)])
    assert (
        line == "error: --set lr=...: a value of 5000000 characters; valid: at most 65536 (put a long value in a "
        "config file)"
    )
    big = tmp_path / "big.yaml"
    big.write_text(f"lr: {'x' * 100_000}\n")
    line = error_line(capsys, ["run", str(big), "--results", str(tmp_path)])
    assert line.startswith("error: ") and "characters left out" in line and len(line) < 3000


# -- the rest of the table: export's disk, SLURM missing, cold-start folders, JSON positions, prompt lengths ----------
@pytest.fixture
def read_only_dir(tmp_path: Path) -> typing.Iterator[Path]:
    """A directory nothing can be written in: a read-only tmpfs for root (whom modes do not stop; skipped where
    mounting is not allowed), else mode 0555."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    with _tmpfs(path, "ro,size=1m", "cannot mount a read-only tmpfs here"):
        yield path


@pytest.mark.parametrize("disk", ["read_only", "full"])
def test_export_to_a_read_only_or_full_disk_is_one_line(one_step: Path, request, disk: str, capsys) -> None:
    parent = request.getfixturevalue("read_only_dir" if disk == "read_only" else "small_disk")
    out = parent / "hf"
    line = error_line(capsys, ["export", str(one_step), "--hf", str(out)])
    full = f"{out / 'model.safetensors'} could not be written (No space left on device); the partial export was removed"
    why = f"cannot write in {parent} (" if disk == "read_only" else full  # read-only file system, or permission
    assert why in line and line.startswith(f"error: --hf = '{out}': "), line
    assert not out.exists() and not list(parent.iterdir()), "a partial export was left"


def test_an_export_takes_the_umasks_modes(one_step: Path, tmp_path: Path) -> None:
    # the folder and model.safetensors (written by export_hf, as a cold start's is) readable as the umask says
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "study", "export", str(one_step), "--hf", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(0o027),
    )
    assert done.returncode == 0, done.stderr
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o640)}, modes


def test_the_slurm_launcher_without_slurm_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    config = tmp_path / "run.yaml"
    rundir.write_yaml(config, tiny().to_dict())
    argv = [str(config), "--results", str(tmp_path / "results"), "--launcher", "slurm"]
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch, srun or sinfo
    line = error_line(capsys, argv, main=launch.main)
    assert line.startswith("error: --launcher slurm: no SLURM on this machine (sbatch, srun, sinfo not on PATH)")
    assert "--launcher local / in-process" in line, line
    monkeypatch.undo()
    if shutil.which("sinfo") is None:
        pytest.skip("SLURM's client commands are not installed: the unreachable controller is not tried")
    conf = tmp_path / "slurm.conf"  # a controller no one listens for
    conf.write_text(
        "ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=2\n"
        "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=localhost Default=YES\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    line = error_line(capsys, argv, main=launch.main)
    assert line.startswith("error: --launcher slurm: the SLURM controller does not answer (`sinfo`: "), line
    assert not (tmp_path / "results").exists(), "something was written before the refusal"


def coldstart_folder(path: Path, *, state: typing.Any, tokenizer: bool = True) -> Path:
    """A cold-start folder: policy.pt holding `state`, and (with `tokenizer`) the tokenizer of a scratch run."""
    from study.data.tokenizer import build_tokenizer

    path.mkdir()
    torch.save(state, path / "policy.pt")
    if tokenizer:
        build_tokenizer(1024, ["chain_sum"], n_per_task=50).save(path)
    return path


def test_a_hostile_pickle_in_a_coldstart_folder_is_refused_unrun(tmp_path: Path, monkeypatch, capsys) -> None:
    from study import parts

    pwned = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(pwned))
    folder = coldstart_folder(tmp_path / "hostile", state={"decoder.weight": Hostile()})
    refused = f"{folder / 'policy.pt'}: refused, not loaded: it holds objects other than tensors"
    results = tmp_path / "results"
    argv = ["run", "--preset", "tiny", "--results", str(results), "--set", f"coldstart={folder}", "--quiet"]
    line = error_line(capsys, argv)  # the run's preflight: before anything is written
    assert refused in line and "weights_only" not in line, line
    assert not results.exists() and not pwned.exists()
    with pytest.raises(ValueError, match=refused):  # the loader a run's own cold start goes through
        parts.initial_policy(tiny(f"coldstart={folder}"), results)
    assert coldstart_main(["--init", str(folder), "--results", str(results), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert refused in err and "Traceback" not in err and "weights_only" not in err, err
    assert not pwned.exists(), "the pickle's code ran"


def test_a_coldstart_folder_without_its_tokenizer_fails_the_preflight(tmp_path: Path) -> None:
    folder = coldstart_folder(tmp_path / "start", state={}, tokenizer=False)
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer.json'} is missing; the run encodes with"):
        rl.run(tiny(f"coldstart={folder}"), tmp_path / "results", progress=False)
    assert not (tmp_path / "results").exists(), "something was written before the refusal"


def test_json_errors_name_the_file_or_option_and_the_position(one_step: Path, tmp_path: Path, capsys) -> None:
    run_dir = interrupted(one_step, tmp_path)
    manifest = run_dir / "manifest.json"
    manifest.write_text('{"git_sha": "abc",\n "seed": 0,,\n}\n')
    line = error_line(capsys, ["resume", str(run_dir), "--quiet"])
    assert f"{manifest}: not valid JSON at line 2, column 12 (Expecting property name" in line, line
    assert "restore it, or to start the run again" in line
    assert rundir.read_status(run_dir)["state"] == "running", "refused after the run wrote its status"
    line = error_line(capsys, ["export", str(run_dir), "--hf", str(tmp_path / "hf")])
    assert f"{manifest}: not valid JSON at line 2, column 12" in line and not (tmp_path / "hf").exists()
    config = tmp_path / "run.yaml"
    rundir.write_yaml(config, tiny().to_dict())
    line = error_line(capsys, [str(config), "--rollout-runtime", '{"tp": 2,}'], main=launch.main)
    assert line.startswith("error: --rollout-runtime = '{\"tp\": 2,}': not valid JSON at line 1, column 10"), line
    line = error_line(
        capsys, ["--coldstart", "tiny", "chain_sum", "--coldstart-settings", '{"band": [0.1 0.5]}'], main=launch.main
    )
    assert "error: --coldstart-settings = '{\"band\": [0.1 0.5]}': not valid JSON at line 1, column 15" in line, line


def test_an_over_long_prompt_is_refused_naming_the_file_and_row(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{i} + 1 =\n", "answer": str(i + 1)} for i in range(12)]
    rows[7]["prompt"] = "Add: " + " + ".join(str(d) for d in range(10)) * 40 + "\n"  # single-digit tokens: > 256
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny("task=user", f"data={data}", "verifier=exact", "eval_size=2")
    cut = rf"data = '{data}': {data}:8: the prompt is \d+ tokens, and with max_new_tokens = 48 a sequence needs"
    with pytest.raises(ValueError, match=cut):
        rl.run(cfg, tmp_path / "results", progress=False)
    assert not (tmp_path / "results").exists(), "something was written before the refusal"


# -- what `study status` and `analysis report` read of a run directory -----------------------------------------------
def test_a_fifo_or_outsized_status_json_is_reported_never_read(one_step: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / one_step.name
    shutil.copytree(one_step, run_dir)
    status = run_dir / "status.json"
    status.unlink()
    os.mkfifo(status)  # opened for reading, a FIFO waits for a writer forever

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=240)

    shown = cli("study", "status", str(tmp_path))
    assert "unreadable" in shown.stdout and "not a regular file (a FIFO)" in shown.stdout, shown
    report = cli("analysis", "report", str(tmp_path), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    assert f"run {one_step.name} not read: status.json: not a regular file (a FIFO)" in report.stderr, report.stderr
    status.unlink()
    with open(status, "wb") as fh:  # 64 MiB (sparse): a status.json is a few KB
        fh.truncate(64 << 20)
    shown = cli("study", "status", str(tmp_path))
    assert "unreadable" in shown.stdout and f"larger than {1 << 20} bytes" in shown.stdout, shown


# -- the launcher: its resources checked, SIGTERM in-process one line ------------------------------------------------
@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--time-min", "0", "time_min = 0: must be an integer >= 1"),
        ("--mem-gb", "nan", "mem_gb = nan: must be a finite number > 0"),
        ("--gpu-mem-gb", "nan", "gpu_mem_gb = nan: must be a finite number >= 0"),
        ("--cpus", "-2", "cpus = -2: must be an integer >= 1"),
    ],
)
def test_the_launcher_refuses_absurd_resources(tmp_path: Path, option: str, value: str, message: str, capsys) -> None:
    config = tmp_path / "run.yaml"
    rundir.write_yaml(config, tiny("steps=1").to_dict())
    argv = [str(config), "--results", str(tmp_path / "results"), "--launcher", "in-process", option, value]
    assert message in error_line(capsys, argv, main=launch.main)
    assert not (tmp_path / "results").exists()


def test_sigterm_to_the_in_process_launcher_is_one_line_and_143(tmp_path: Path) -> None:
    cfg = tiny("steps=30")
    config, run_dir = tmp_path / "run.yaml", tmp_path / "runs" / cfg.run_id
    rundir.write_yaml(config, cfg.to_dict())
    proc = subprocess.Popen(
        [sys.executable, "-m", "study.launch", str(config), "--results", str(tmp_path), "--launcher", "in-process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _sigterm_after_the_first_step(proc, run_dir)
    assert rundir.read_status(run_dir)["state"] == "stopped"
