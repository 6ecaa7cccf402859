"""The run directory's own guarantees: no write through a planted link, every exit of a run's work recorded (a signal,
a failed write on a full disk, a native crash), and `lock_held` telling a live holder from a dead one."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from study.run import rundir


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    return run_dir


@pytest.mark.parametrize("name", [rundir.LOCK_FILE, "status.json", "checkpoint", "metrics.parquet"])
def test_a_planted_link_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    run_dir = _run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run_dir / name).symlink_to(victim)
    link = rf"{run_dir / name}: a symbolic link \(to {victim}\).*remove"
    with pytest.raises(rundir.RunStateError, match=link), rundir.run_lock(run_dir):
        pass
    assert victim.read_text() == "precious\n"


def test_the_lock_file_is_opened_without_following_a_link(tmp_path: Path) -> None:
    """Even a link planted after the directory check (a race) is not followed."""
    run_dir = _run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run_dir / rundir.LOCK_FILE).symlink_to(victim)
    with pytest.raises(rundir.RunStateError, match="symbolic link"):
        rundir._open_nofollow(run_dir / rundir.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    assert victim.read_text() == "precious\n"


def test_a_failed_write_frees_its_space_and_names_the_file(tmp_path: Path) -> None:
    """A writer that fails mid-file (a full disk) and whose handle outlives the failure: the space is given back."""
    handles = []

    def write(tmp: Path) -> None:
        fh = tmp.open("wb")
        handles.append(fh)  # kept open, as torch's writer is by the exception's traceback
        fh.write(b"x" * (1 << 20))
        fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "checkpoint" / "state.pt"
    with pytest.raises(rundir.WriteError, match=rf"{target}: could not be written \(.*No space left"):
        rundir.atomic_write(target, write)
    assert os.fstat(handles[0].fileno()).st_size == 0, "the failed temporary file still holds its bytes"
    assert not list(target.parent.iterdir()) and not target.exists()
    handles[0].close()


def test_a_failure_is_recorded_naming_the_file_after_the_temporaries_are_gone(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    leftover = run_dir / ".metrics.parquet.x.tmp"

    def write(tmp: Path) -> None:
        leftover.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(rundir.WriteError), rundir.recorded(run_dir, lambda: 3):
        rundir.atomic_write(run_dir / "checkpoint" / "state.pt", write)
    failure = json.loads((run_dir / rundir.FAILURE_FILE).read_text())
    assert failure["state"] == "failed" and failure["step"] == 3
    assert f"{run_dir / 'checkpoint' / 'state.pt'}: could not be written" in failure["error"]
    assert not leftover.exists() and not (run_dir / rundir.CRASH_FILE).exists()


SIGNALLED = """
import sys, time
from pathlib import Path
from study.run import rundir
run_dir = Path(sys.argv[1])
with rundir.run_lock(run_dir), rundir.recorded(run_dir, lambda: 5):
    rundir.set_status(run_dir, "running", step=5)
    print("working", flush=True)
    {body}
"""


def _child(run_dir: Path, body: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED.format(body=body), str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "working"
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_termination_signal_is_recorded_stopped(tmp_path: Path, signum: int) -> None:
    run_dir = _run_dir(tmp_path)
    proc = _child(run_dir, "time.sleep(60)")
    assert rundir.lock_held(run_dir) is True
    proc.send_signal(signum)
    proc.wait(timeout=30)
    status = rundir.read_status(run_dir)
    assert status["state"] == "stopped" and status["step"] == 5
    assert status["reason"] == f"Terminated: {signal.Signals(signum).name} received"
    assert not (run_dir / rundir.LOCK_FILE).exists() and rundir.lock_held(run_dir) is False


def test_a_native_crash_leaves_its_stack_and_a_released_lock(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    proc = _child(run_dir, "import os; os.abort()")
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGABRT
    assert rundir.read_status(run_dir)["state"] == "running"  # nothing Python could record...
    assert "Fatal Python error: Aborted" in (run_dir / rundir.CRASH_FILE).read_text()  # ...but the stack
    assert rundir.lock_held(run_dir) is False  # and the kernel released the lock: `status` says died
    # the next process records the crash as the attempt's failure before it goes on
    with rundir.run_lock(run_dir), rundir.recorded(run_dir, lambda: 5):
        failure = json.loads((run_dir / rundir.FAILURE_FILE).read_text())
        assert failure["error"].startswith("died in a native crash") and "Aborted" in failure["traceback"]
        assert rundir.read_status(run_dir)["state"] == "running"
    assert not (run_dir / rundir.CRASH_FILE).exists()


def test_lock_held_tells_live_dead_and_unknown_holders(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    assert rundir.lock_held(run_dir) is False  # no lock file
    proc = _child(run_dir, "time.sleep(60)")
    try:
        assert rundir.lock_held(run_dir) is True
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((run_dir / rundir.LOCK_FILE).read_text())["pid"] == proc.pid  # left behind by SIGKILL
    assert rundir.lock_held(run_dir) is False
    (run_dir / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "since": time.ctime()}))
    assert rundir.lock_held(run_dir) is None  # another host's process: this host cannot tell
