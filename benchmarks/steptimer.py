"""Timing helpers shared by the benchmarks (they run as scripts, so this directory is on sys.path): per-step wall and
CPU seconds of one `study.rl.run` (bench_trl.py, bench_replay.py) and the phases of one minibatch update
(bench_peak.py, profile_modules.py)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

LOCKSTEP_ENV = "BENCH_LOCKSTEP"
"""`DIR:SIDE:WARMUP:REPS` in a side's environment: time that side in lock-step with the other side (`Lockstep`)."""


class StopRun(BaseException):
    """Ends a lock-step side's run early: `rl.run` keeps the finished steps' metrics and re-raises it."""


class Lockstep:
    """Two benchmark processes timed over the same wall-clock window (bench_trl.py --concurrent).

    Each side runs its warm-up steps, waits at a barrier until the other side has too (files in DIR), restamps its
    clock and runs its REPS timed steps; then it keeps stepping (the load the other side sees stays the same) until
    the other side has finished its timed steps as well, and stops. So every timed step of either side ran while the
    other was computing: a change of the machine's speed during the window (a shared host) slows both sides alike.
    Without the environment variable every method is a no-op and the side runs its steps alone.
    """

    def __init__(self) -> None:
        spec = os.environ.get(LOCKSTEP_ENV)
        self.on = bool(spec)
        if self.on:
            where, self.side, warmup, reps = spec.split(":")
            self.dir, self.warmup, self.reps = Path(where), int(warmup), int(reps)

    def _wait(self, name: str, timeout: float = 900.0) -> None:
        (self.dir / f"{self.side}.{name}").touch()
        deadline = time.monotonic() + timeout
        while sum(1 for _ in self.dir.glob(f"*.{name}")) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lock-step: the other side never reached {name!r}")
            time.sleep(0.005)

    def after_step(self, stamps: list[tuple[float, float]]) -> bool:
        """Call after appending the stamp of a finished step (stamps[0] is the start); returns True to stop."""
        if not self.on:
            return False
        done = len(stamps) - 1
        if done == self.warmup:
            self._wait("ready")
            stamps[-1] = (time.perf_counter(), time.process_time())  # the barrier's wait is not a step
        elif done == self.warmup + self.reps:
            (self.dir / f"{self.side}.timed").touch()
        return done >= self.warmup + self.reps and sum(1 for _ in self.dir.glob("*.timed")) >= 2


def timed_run(cfg: Any, results: str | Path) -> tuple[Path, list[float], list[float]]:
    """Run `cfg` under `results`; returns (run directory, wall s per step, process CPU s per step).

    The clocks are read at every `rundir.set_status(..., "running")`: once before step 1 (run() marks the run as
    running) and once after each step's bookkeeping, so step i is the time between stamps i - 1 and i. In lock-step
    (`Lockstep`) the run may end before `cfg.steps`."""
    from study import rl
    from study.run import rundir

    stamps: list[tuple[float, float]] = []
    set_status = rundir.set_status
    lockstep = Lockstep()
    run_dir = Path(results) / "runs" / cfg.run_id

    def stamped(run_dir, state, **kw):  # type: ignore[no-untyped-def]
        if state == "running":
            stamps.append((time.perf_counter(), time.process_time()))
        set_status(run_dir, state, **kw)
        if state == "running" and lockstep.after_step(stamps):
            raise StopRun

    rundir.set_status = stamped
    try:
        rl.run(cfg, results, progress=False)
    except StopRun:
        pass
    finally:
        rundir.set_status = set_status
    wall = [b[0] - a[0] for a, b in itertools.pairwise(stamps)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(stamps)]
    return run_dir, wall, cpu


def minibatch_update(model: Any, opt: Any, ids: Any, *, positions: Any = None) -> dict[str, float]:
    """One minibatch update as study/rl.py does it on the (B, S + 1) token batch `ids`: `token_logp` forward (on the
    response `positions` (B, T) only, if given), a scalar loss, backward, global-norm clip, AdamW step. Returns the
    wall seconds of each phase: forward, backward, clip, adam."""
    from study.policy.model import token_logp
    from study.policy.optim import clip_grad_norm

    t0 = time.perf_counter()
    logp = token_logp(model, ids[:, :-1], ids[:, 1:], positions=positions)
    t1 = time.perf_counter()
    loss = -logp.mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "adam": t4 - t3}
