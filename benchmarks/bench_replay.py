"""What Routing Replay costs: RL step time and memory of grpo vs grpo_rr, and the bytes kept per token (a script).

    .venv/bin/python benchmarks/bench_replay.py [--presets tiny,default] [--reps 5] [--warmup 1]

Each (preset, algorithm) runs study.rl.run in its own subprocess (coldstart=scratch, no evaluation, no checkpoints,
one thread) with the preset's run shape (study.run.config.PRESET_RUNS). Both algorithms do the same work but for
the routing mode of the minibatch forwards: grpo records the free routes (for the volatility metrics), grpo_rr
replays the pi_old recompute's routes (and still computes the free top-k beside them). Timed per step, after
`--warmup` steps: wall from the end of one step's bookkeeping to the next (rundir.set_status is wrapped), process
CPU seconds, and the run's own time_update_s. Memory: the subprocess's peak RSS. Bytes per token: the routes kept
between the recompute and the updates (Routes, uint8 (B, S, L, k): L x k bytes), and the transient int64 copy one
minibatch replay hands megatron (8 L k bytes per minibatch token).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import warnings


def _side(preset: str, alg: str, steps: int) -> dict:
    import pandas as pd
    from steptimer import timed_run

    from study.core.model_config import route_index_dtype
    from study.run.config import PRESET_RUNS, RunConfig

    cfg = RunConfig.from_dict(
        {
            **PRESET_RUNS[preset],
            "algorithm": alg,
            "coldstart": "scratch",
            "steps": steps,
            "eval_every": 0,
            "checkpoint_every": 0,
            "threads": 1,
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, wall, cpu = timed_run(cfg, tmp)
        m = pd.read_parquet(run_dir / "metrics.parquet")
    mcfg = cfg.model_config()
    kept = mcfg.num_layers * mcfg.moe_top_k * torch_itemsize(route_index_dtype(mcfg.num_experts))
    return {
        "wall": wall,
        "cpu": cpu,
        "update": m["time_update_s"].tolist(),
        "old": m["time_old_logp_s"].tolist(),
        "tokens_total": m["tokens_total"].tolist(),
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "bytes_kept": kept,
        "bytes_replay": 8 * mcfg.num_layers * mcfg.moe_top_k,
        "shape": f"{cfg.prompts_per_step}x{cfg.group_size}x{cfg.max_new_tokens} M={cfg.minibatches}",
    }


def torch_itemsize(dtype) -> int:  # type: ignore[no-untyped-def]
    import torch

    return torch.empty((), dtype=dtype).element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,default")
    ap.add_argument("--algorithms", default="grpo,grpo_rr", help="baseline first, then the replay variant")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--side", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.side is not None:
        print(json.dumps(_side(args.side[0], args.side[1], args.steps)))
        return
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, threads=1, reps={args.reps} "
        f"(+{args.warmup} warm-up)"
    )
    print(
        f"{'preset':<8} {'P x G x T':<14} {'alg':<8} {'s/step':>7} {'cpu s':>7} {'update s':>8} {'old s':>6} "
        f"{'peak RSS':>9} {'B/token kept':>12} {'B/token replay':>14}  overhead"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for preset in args.presets.split(","):
        base = None
        for alg in args.algorithms.split(","):
            cmd = [sys.executable, __file__, "--side", preset, alg, "--steps", str(args.warmup + args.reps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.stderr.write(out.stdout[-4000:] + out.stderr[-8000:])
                raise SystemExit(f"{preset}/{alg} failed")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            k = slice(args.warmup, None)
            wall, cpu = statistics.median(r["wall"][k]), statistics.median(r["cpu"][k])
            upd, old = statistics.median(r["update"][k]), statistics.median(r["old"][k])
            over = ""
            if base is None:
                base = (wall, cpu)
            else:
                over = f"  wall {100 * (wall / base[0] - 1):+.1f}%, cpu {100 * (cpu / base[1] - 1):+.1f}%"
            print(
                f"{preset:<8} {r['shape']:<14} {alg:<8} {wall:>7.3f} {cpu:>7.3f} {upd:>8.3f} {old:>6.3f} "
                f"{r['rss_gib']:>7.2f}Gi {r['bytes_kept']:>12} {r['bytes_replay']:>14}{over}",
                flush=True,
            )


if __name__ == "__main__":
    main()
