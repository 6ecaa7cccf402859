"""The machine's fp32 GEMM peak and the policy update's share of it (a script, not a test).

    .venv/bin/python benchmarks/bench_peak.py [--presets tiny,small] [--threads 1,2] [--batch 16] [--seq 64]

1. GEMM peak: the best GFLOP/s of `torch.mm` on square fp32 matrices (n = 1024, 2048, 4096; 2 n^3 FLOPs each),
   per thread count.
2. Update: one minibatch update exactly as study/rl.py does it - `token_logp` forward over a right-padded (B, S)
   batch, a scalar loss, backward, global-norm clip, AdamW step - timed per step (median of `--iters` after
   `--warmup`). FLOPs = 3 x study.run.metrics.forward_flops (6 x active parameters x tokens plus attention, the same
   estimate the run's `compute_flops` uses). Share of peak = achieved GFLOP/s / GEMM peak at the same thread
   count. Also reports the time of the AdamW step alone (it touches every parameter, all experts, not only the
   active ones, and is memory-bound) and the wall and CPU seconds (CPU seconds are robust to other jobs on the box).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import torch
from steptimer import minibatch_update  # benchmarks/ is on sys.path: this runs as a script

from study.core.model_config import preset
from study.policy.model import build_policy, count_parameters
from study.policy.optim import build_optimizer
from study.run.metrics import forward_flops


def gemm_peak(
    threads: int, sizes: tuple[int, ...] = (1024, 2048, 4096), reps: int = 5
) -> dict[int, tuple[float, float]]:
    """(wall, CPU-time) GFLOP/s, each the best of `reps`, of an n x n @ n x n fp32 matmul per n. The CPU-time
    figure is 2 n^3 / (process CPU seconds / threads): what the GEMM reaches when it is not preempted."""
    torch.set_num_threads(threads)
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        torch.mm(a, b, out=c)  # warm-up
        best, best_cpu = float("inf"), float("inf")
        for _ in range(reps if n < 4096 else 3):
            t, cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b, out=c)
            best = min(best, time.perf_counter() - t)
            best_cpu = min(best_cpu, (time.process_time() - cpu) / threads)
        out[n] = (2 * n**3 / best / 1e9, 2 * n**3 / best_cpu / 1e9)
    return out


def update(name: str, threads: int, *, batch: int, seq: int, iters: int, warmup: int) -> dict[str, float]:
    """Median wall/CPU seconds of one minibatch update (forward, backward, clip, AdamW) and of the AdamW step."""
    torch.set_num_threads(threads)
    cfg = preset(name)
    model = build_policy(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq + 1), generator=g)
    walls, cpus, adam = [], [], []
    for i in range(warmup + iters):
        t, c = time.perf_counter(), time.process_time()
        phases = minibatch_update(model, opt, ids)
        if i >= warmup:
            adam.append(phases["adam"])
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
    tokens = batch * seq
    flops = 3 * forward_flops(cfg, tokens, seq / 2)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {
        "params_m": count_parameters(model) / 1e6,
        "active_m": cfg.active_params_per_token / 1e6,
        "tokens": tokens,
        "gflop": flops / 1e9,
        "wall": wall,
        "cpu": cpu,
        "adam": statistics.median(adam),
        "gflops": flops / wall / 1e9,
        "gflops_cpu": flops / (cpu / threads) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=16, help="sequences per minibatch")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (prompt + response)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    threads = [int(t) for t in args.threads.split(",")]
    peak, peak_cpu = {}, {}
    for t in threads:
        res = gemm_peak(t)
        peak[t] = max(w for w, _ in res.values())
        peak_cpu[t] = max(c for _, c in res.values())
        sizes = "  ".join(f"n={n}: {w:5.1f} ({c:5.1f})" for n, (w, c) in res.items())
        print(
            f"GEMM fp32 threads={t}: {sizes} GFLOP/s wall (CPU time) -> peak {peak[t]:.1f} ({peak_cpu[t]:.1f})",
            flush=True,
        )
    print(
        f"{'preset':<6} {'thr':>3} {'params':>8} {'active':>7} {'B x S':>7} {'GFLOP':>7} {'wall s':>7} "
        f"{'cpu s':>7} {'adam s':>7} {'GFLOP/s':>8} {'% peak':>7} {'% peak(cpu)':>11}"
    )
    for name in args.presets.split(","):
        for t in threads:
            r = update(name, t, batch=args.batch, seq=args.seq, iters=args.iters, warmup=args.warmup)
            print(
                f"{name:<6} {t:>3} {r['params_m']:>7.2f}M {r['active_m']:>6.2f}M {args.batch:>3}x{args.seq:<3} "
                f"{r['gflop']:>7.2f} {r['wall']:>7.3f} {r['cpu']:>7.3f} {r['adam']:>7.3f} {r['gflops']:>8.1f} "
                f"{100 * r['gflops'] / peak[t]:>6.1f}% {100 * r['gflops_cpu'] / peak_cpu[t]:>10.1f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
