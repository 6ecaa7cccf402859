"""Scores per second of study.data.tasks.score: through the verifier sandbox, and on the native grammars (a script).

    .venv/bin/python benchmarks/bench_sandbox.py [--n 300] [--reps 3]

Side by side with another checkout's code (the script itself needs nothing of this one's):

    PYTHONPATH=/path/to/other .venv/bin/python benchmarks/bench_sandbox.py

Sandboxed: reasoning-gym items of a few verifiers the native grammars do not cover (bitwise_arithmetic,
string_insertion, gcd, complex_arithmetic), one sandbox serving all of them started and warmed before the clock;
the scored responses alternate the reference answer and a wrong one. In process: the same scorers called in this
process, unsandboxed (for scale). Native: chain_sum items (the default study's verifier) scored the same way. Each
figure is the best of `--reps` timed passes of `--n` scores (the machine's other load only ever slows a pass), with
the median latency of one score in that pass; sandboxed passes also report the CPU time one score costs: this
process's, plus the sandbox process's, its live descendants' (the zygote and its scoring children) and every child
each reaped (/proc/<pid>/stat), which the machine's other load does not inflate as it does wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

SANDBOXED = ("bitwise_arithmetic", "string_insertion", "gcd", "complex_arithmetic")


def _cpu_s(pid: int | None) -> float:
    """CPU seconds of this process, plus those of process `pid`, of its live descendants (the zygote and the scoring
    children it forks, found through /proc/<pid>/task/*/children) and of every child each of them reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    pending = [] if pid is None else [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            children = [int(c) for task in (proc / "task").iterdir() for c in (task / "children").read_text().split()]
        except OSError:  # it ended between the listing and the read: its parent's cutime has it
            continue
        total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        pending += children
    return total


def _pass(items: list, n: int, pid: int | None = None, score: Any = None) -> tuple[float, float, float]:
    """(scores/s, median ms/score, CPU ms/score) of `n` scores by `score(item, response)` (tasks.score by default)."""
    from study.data import tasks

    score = score or tasks.score
    lat = []
    cpu = _cpu_s(pid)
    start = time.perf_counter()
    for i in range(n):
        item = items[i % len(items)]
        answer = item.answer if i % 2 == 0 else item.answer + "1"
        t = time.perf_counter()
        score(item, f"#### {answer}")
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return n / wall, statistics.median(lat) * 1e3, (_cpu_s(pid) - cpu) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300, help="scores per timed pass")
    ap.add_argument("--reps", type=int, default=3, help="timed passes; the best is reported")
    args = ap.parse_args()
    os.chdir("/")  # a sandbox worker started with `-m` must not pick up a checkout from the working directory

    import reasoning_gym
    from reasoning_gym.factory import get_score_answer_fn

    from study.data import sandbox, tasks

    print(f"code: {os.path.dirname(os.path.dirname(os.path.dirname(tasks.__file__)))}")
    items = []
    for name in SANDBOXED:
        for entry in reasoning_gym.create_dataset(name, seed=5, size=8):
            meta = {**entry["metadata"], "question": entry["question"]}
            items.append(
                tasks.TaskItem(
                    task="user", prompt="q\n", solution="", answer=entry["answer"], verifier=name, metadata=meta
                )
            )
    box = sandbox.start(SANDBOXED)
    for item in items:  # start the worker, check every item scores
        if tasks.score(item, f"#### {item.answer}") != 1.0:
            raise SystemExit(f"{item.verifier}: the reference answer {item.answer!r} does not score 1.0")
    failures = tasks.take_scorer_failures()
    pid = box._proc.pid if box._proc is not None else None
    passes = [_pass(items, args.n, pid) for _ in range(args.reps)]
    best = max(passes, key=lambda r: r[0])
    print(
        f"sandboxed ({box.level}): {best[0]:8.1f} scores/s  median {best[1]:7.3f} ms/score  "
        f"CPU {min(p[2] for p in passes):7.3f} ms/score  "
        f"failures {failures + tasks.take_scorer_failures()}"
    )
    box.close()
    scorers = {name: get_score_answer_fn(name) for name in SANDBOXED}  # the same scorers, unsandboxed, for scale

    def in_process(item: tasks.TaskItem, response: str) -> float:
        entry = {"question": item.metadata["question"], "answer": item.answer, "metadata": item.metadata}
        return scorers[item.verifier](tasks.extract_answer(response), entry)

    best = max((_pass(items, args.n * 10, score=in_process) for _ in range(args.reps)), key=lambda r: r[0])
    print(f"in process, unsandboxed: {best[0]:8.1f} scores/s  median {best[1]:7.3f} ms/score")
    native = tasks.make_task("chain_sum", seed=0, terms=(2, 3), digits=1).take(64)
    best = max((_pass(native, args.n * 10) for _ in range(args.reps)), key=lambda r: r[0])
    print(f"native chain_sum:   {best[0]:8.1f} scores/s  median {best[1]:7.3f} ms/score")


if __name__ == "__main__":
    main()
