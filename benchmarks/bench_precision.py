"""Precision: matmul GFLOP/s per dtype on this CPU, and how closely emulated low precision reproduces real CPU
low-precision log-probs of the tiny model (study/core/precision.py).

    .venv/bin/python benchmarks/bench_precision.py [--size 1024] [--threads 1] [--seqs 32]

Prints (1) torch.mm GFLOP/s for fp32 / bf16 / fp16 at size^2 (fp16 is timed at a smaller size when slow);
(2) for the trainer (megatron) and the hf engine, the distribution of |logp_prec - logp_fp32| over response tokens
(mean, median, p99, max) for real and emulated bf16 / fp16 / bf16_fp32head, with the two-sample KS statistic between
the emulated and the real |delta| distributions; (3) the cross-engine mismatch |logp_trainer - logp_engine| per
precision (what the RL run logs as mismatch_mean_abs, here at fixed weights).
"""

from __future__ import annotations

import argparse
import time

import torch

from study.core.precision import PRECISION_NAMES
from study.tools.parity import ks_statistic, logp_deltas, summarize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_gflops(dtype: torch.dtype, n: int, *, min_seconds: float = 1.0) -> float:
    """GFLOP/s of torch.mm on (n, n) x (n, n) in `dtype` (2 n^3 FLOPs per product), best of repeated timings."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best, spent = float("inf"), 0.0
    while spent < min_seconds:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 2 * n**3 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="matmul size n (n x n)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=32, help="sequences of 16 + 48 tokens for the log-prob check")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"torch.mm GFLOP/s, {args.threads} thread(s)")
    for name, dtype in DTYPES.items():
        n = args.size if name != "fp16" else min(args.size, 256)  # fp16 has no fast CPU kernel: keep it short
        print(f"  {name:5s} n={n:5d}: {matmul_gflops(dtype, n):8.1f}")

    specs = [f"{n}{m}" for n in PRECISION_NAMES[1:] for m in ("", "-emulated")]
    t0 = time.perf_counter()
    deltas = logp_deltas(specs, n_seqs=args.seqs)
    print(
        f"\n|delta| of token log-probs against fp32 (tiny model, init_std 0.1, {args.seqs} x 48 response tokens; "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    for where in ("trainer", "engine"):
        print(f"  {where}:")
        for name in PRECISION_NAMES[1:]:
            real, emu = deltas[where][name], deltas[where][f"{name}-emulated"]
            for label, d in ((name, real), (f"{name}-emulated", emu)):
                s = summarize(d)
                print(
                    f"    {label:24s} mean {s['mean']:.2e}  median {s['median']:.2e}  p99 {s['p99']:.2e}  "
                    f"max {s['max']:.2e}"
                )
            print(f"    {'KS(emulated, real)':24s} {ks_statistic(emu, real):.3f}")
    print("  cross-engine mismatch |logp_trainer - logp_engine| (same precision in both engines):")
    for label, d in deltas["mismatch"].items():
        s = summarize(d)
        print(f"    {label:24s} mean {s['mean']:.2e}  median {s['median']:.2e}  p99 {s['p99']:.2e}  max {s['max']:.2e}")


if __name__ == "__main__":
    main()
