"""`study status` while a run starts: a run directory is made, its lock taken, then its status.json written; and a
run records its exit before it releases its lock. Read at any moment, a starting or finishing run is `running` or
finished, never `unreadable` or `died`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from study.run import rundir
from study.run import status as S


def test_a_run_directory_whose_lock_is_held_before_its_status_is_written_is_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "grpo-000000000000"
    run_dir.mkdir(parents=True)
    with rundir.run_lock(run_dir):  # what a starting run holds before it writes status.json
        (line,) = S.collect(tmp_path)
    assert line.state == "running" and line.reason.startswith("starting"), line


def test_status_polled_through_a_runs_start_and_end_never_says_unreadable(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "study", "run", "--preset", "tiny", "--results", str(tmp_path), "--quiet"]
    sets = ["coldstart=scratch", "eval_every=0", "steps=1"]
    proc = subprocess.Popen(
        [*cmd, *(a for s in sets for a in ("--set", s))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    seen: Counter[str] = Counter()
    reasons = set()
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if (tmp_path / "runs").is_dir():
            for line in S.collect(tmp_path):
                seen[line.state] += 1
                if line.state not in ("running", "completed"):
                    reasons.add(line.reason)
    assert proc.wait(timeout=60) == 0
    (line,) = S.collect(tmp_path)
    assert line.state == "completed"
    assert seen["running"] > 0 and set(seen) <= {"running", "completed"}, (seen, reasons)
