"""Where the CPU time of an RL step goes (a script, not a test): cProfile on the thread's CPU clock.

    .venv/bin/python benchmarks/profile_step.py [--preset tiny] [--algorithm grpo] [--steps 6] [--set key=value ...]

Runs study.rl.run (coldstart=scratch, no evaluation, no checkpoints, one thread) with the preset's run shape
(study.run.config.PRESET_RUNS, then `--set` overrides) and profiles steps 2..N (step 1 and the setup are left out:
rundir.set_status is wrapped to switch the profiler on). The clock is `time.thread_time`, so other jobs on a shared
machine do not inflate it (cProfile's own overhead does, most for Python-heavy code). Prints CPU ms per step by phase
(cumulative time of the functions that make each phase) and by library (self time), then the top functions.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import tempfile
import time
import warnings
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
PHASES: dict[str, tuple[str, str]] = {
    # phase: (file suffix, function name), cumulative time
    "rollout: engine.generate": ("study/rollout/hf.py", "generate"),
    "rollout, all of it: _collect (generate + prompts, rewards, padding)": ("study/rl.py", "_collect"),
    "forward (pi_old + minibatches): token_logp": ("study/policy/model.py", "token_logp"),
    "backward": ("torch/_tensor.py", "backward"),
    "AdamW step": ("torch/optim/adam.py", "step"),
    "grad-norm clip": ("torch/nn/utils/clip_grad.py", "clip_grad_norm_"),
    "loss (algorithm)": ("algorithms/registry.py", "loss"),
    "routing metrics": ("study/policy/routing.py", "routing_volatility"),
    "weight sync: megatron_to_hf": ("study/core/weights.py", "megatron_to_hf"),
    "weight sync: engine.load_weights": ("study/rollout/hf.py", "load_weights"),
    "metrics.parquet write": ("study/record.py", "write_metrics"),
    "status.json write": ("study/run/rundir.py", "set_status"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", nargs="*", default=[], help="RunConfig overrides, key=value")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    from study import rl
    from study.run import rundir
    from study.run.config import PRESET_RUNS, RunConfig, parse_set

    data = {
        **PRESET_RUNS[args.preset],
        "algorithm": args.algorithm,
        "coldstart": "scratch",
        "steps": args.steps,
        "eval_every": 0,
        "checkpoint_every": 0,
        "threads": 1,
        **parse_set(args.set),
    }
    cfg = RunConfig.from_dict(data)
    prof = cProfile.Profile(time.thread_time)
    seen = [0]
    set_status = rundir.set_status

    def switch(run_dir, state, **kw):  # type: ignore[no-untyped-def]
        if state == "running":
            seen[0] += 1
            if seen[0] == 2:  # step 1 done
                prof.enable()
        return set_status(run_dir, state, **kw)

    rundir.set_status = switch
    with tempfile.TemporaryDirectory() as tmp:
        rl.run(cfg, tmp, progress=False)
    prof.disable()
    steps = cfg.steps - 1
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # self time of everything = profiled CPU
    print(
        f"preset={args.preset} algorithm={args.algorithm} P x G x T = {cfg.prompts_per_step} x {cfg.group_size} x "
        f"{cfg.max_new_tokens}, M={cfg.minibatches}, profiled steps={steps}, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"profiled CPU per step: {1e3 * total / steps:.1f} ms")
    print("by phase (cumulative CPU ms per step; _collect contains generate, backward contains nothing else):")
    for phase, (suffix, fn) in PHASES.items():
        cum = sum(v[3] for (f, _, name), v in stats.stats.items() if name == fn and f.endswith(suffix))
        print(f"  {1e3 * cum / steps:8.1f} ms  {100 * cum / total:5.1f}%  {phase}")
    by_lib: collections.Counter[str] = collections.Counter()
    for (f, _, _name), v in stats.stats.items():
        if f == "~":
            key = "C/C++ kernels and builtins (torch ops, autograd engine)"
        elif "site-packages/" in f:
            key = f.split("site-packages/")[-1].split("/")[0]
        elif "/study/" in f or "/algorithms/" in f:
            key = "this repository (study/, algorithms/)"
        else:
            key = "python stdlib"
        by_lib[key] += v[2]
    print("by library (self CPU ms per step):")
    for key, sec in by_lib.most_common():
        print(f"  {1e3 * sec / steps:8.1f} ms  {100 * sec / total:5.1f}%  {key}")
    print(f"top {args.top} functions by self time:")
    for (f, line, name), v in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]:
        where = f.split("site-packages/")[-1].removeprefix(ROOT)
        print(f"  {1e3 * v[2] / steps:8.1f} ms  {v[1]:>7d} calls  {where}:{line}({name})")


if __name__ == "__main__":
    main()
