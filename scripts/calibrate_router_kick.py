"""Calibrate the routing-volatility dial (RunConfig.router_kick, study/policy/kick.py): for each kick, short runs of a
study's algorithms, and per run the expert-slot mismatch one update leaves (the paper's "about 10% of the experts
change after one update") and the held-out pass@1 on the validation split.

    .venv/bin/python scripts/calibrate_router_kick.py [--sweep sweeps/regime.yaml] [--sigmas 0 0.04 0.08 0.16 0.32]
        [--algorithms grpo grpo_rr] [--seed 0] [--steps 60] [--results results/calibrate_router_kick] [--set K=V ...]

Each run is the sweep's run of that algorithm (its preset, base and per_algorithm fields; the first of its runs on the
other axes), with router_kick = sigma, `--seed`, `--steps` steps, held-out evaluations at the start and the end only,
no checkpoint between, then the `--set` overrides. It keeps the sweep's test split, so it starts from the study's own
cold start (whose SFT stream holds that split out: a run without it would train another cold start); the calibration
reads the validation split only. The runs go one after another in this process
(study.rl.run: each under `--results`/runs/{run_id}, so a rerun reads a finished run back). Printed, one Markdown
row per run:
- per update: routing_slot_mismatch_mb2, minibatch 2's update forward against pi_old after one update (and one
  kick), the mean over the steps; after M-1: the same at the last minibatch (routing_slot_mismatch_mb{M});
- held-out start and end: eval_in_dist (mean pass@1 on the validation split) at step 0 and at the last step;
- reward: the mean training reward of the last 10 steps; steps s: the steps' wall seconds as the run recorded them
  (wall_s); run s: the whole run in this process (setup, steps and both evaluations; ~0 for a run read back).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from study import rl  # noqa: E402  (the repository's packages, wherever this script is run from)
from study.run.config import RunConfig, parse_set  # noqa: E402
from sweeps.expand import load_sweep  # noqa: E402

HEADER = (
    "| router_kick | algorithm | per update | after M-1 | held-out start | held-out end | reward (last 10) "
    "| steps s | run s |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
)


def calibration_runs(
    sweep: str | Path, sigmas: list[float], algorithms: list[str], *, seed: int, steps: int, sets: list[str] = ()
) -> list[RunConfig]:
    """The runs of the calibration, sigma by sigma, in the order of `algorithms` (module docstring)."""
    runs = list(load_sweep(sweep).expand().values())
    out = []
    for sigma in sigmas:
        for algorithm in algorithms:
            cfg = next((c for c in runs if c.algorithm == algorithm), None)
            if cfg is None:
                found = sorted({c.algorithm for c in runs})
                raise ValueError(f"--algorithms {algorithm}: {sweep} runs none; valid: {', '.join(found)}")
            changes = {"router_kick": sigma, "seed": seed, "steps": steps, "eval_every": steps}
            changes.update(checkpoint_every=0)
            out.append(cfg.replace(**changes, **parse_set(list(sets))))
    return out


def row(cfg: RunConfig, metrics: pd.DataFrame, seconds: float) -> str:
    """The run's Markdown row (module docstring)."""
    last = f"routing_slot_mismatch_mb{cfg.minibatches}"
    held = metrics.set_index("step")["eval_in_dist"].dropna()
    cells = [
        f"{cfg.router_kick:g}",
        cfg.algorithm,
        f"{metrics['routing_slot_mismatch_mb2'].mean():.1%}",
        f"{metrics[last].mean():.1%}",
        f"{held.get(0, float('nan')):.3f}",
        f"{held.get(cfg.steps, float('nan')):.3f}",
        f"{metrics['reward_mean'].tail(10).mean():.3f}",
        f"{metrics['wall_s'].iloc[-1]:.0f}",
        f"{seconds:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default=str(ROOT / "sweeps" / "regime.yaml"), help="the study whose runs to take")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.04, 0.08, 0.16, 0.32])
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "grpo_rr"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--results", default="results/calibrate_router_kick")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V", help="RunConfig override")
    args = parser.parse_args(argv)
    runs = calibration_runs(args.sweep, args.sigmas, args.algorithms, seed=args.seed, steps=args.steps, sets=args.sets)
    print(*HEADER, sep="\n", flush=True)
    for cfg in runs:
        start = time.perf_counter()
        run_dir = rl.run(cfg, args.results, progress=False)
        print(row(cfg, pd.read_parquet(run_dir / "metrics.parquet"), time.perf_counter() - start), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
