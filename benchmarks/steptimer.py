"""Per-step wall and CPU seconds of one `study.rl.run`, shared by the step benchmarks (bench_trl.py, bench_replay.py;
both run as scripts, so this directory is on sys.path)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any


def timed_run(cfg: Any, results: str | Path) -> tuple[Path, list[float], list[float]]:
    """Run `cfg` under `results`; returns (run directory, wall s per step, process CPU s per step).

    The clocks are read at every `rundir.set_status(..., "running")`: once before step 1 (run() marks the run as
    running) and once after each step's bookkeeping, so step i is the time between stamps i - 1 and i."""
    from study import rl, rundir

    stamps: list[tuple[float, float]] = []
    set_status = rundir.set_status

    def stamped(run_dir, state, **kw):  # type: ignore[no-untyped-def]
        if state == "running":
            stamps.append((time.perf_counter(), time.process_time()))
        return set_status(run_dir, state, **kw)

    rundir.set_status = stamped
    try:
        run_dir = rl.run(cfg, results, progress=False)
    finally:
        rundir.set_status = set_status
    wall = [b[0] - a[0] for a, b in itertools.pairwise(stamps)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(stamps)]
    return run_dir, wall, cpu
