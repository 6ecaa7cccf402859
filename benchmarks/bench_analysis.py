"""How long analysis takes for 1,000 runs x 1,000 steps of synthetic metrics (a script, not a test).

    .venv/bin/python benchmarks/bench_analysis.py [--runs 1000] [--steps 1000] [--extra 10] [--keep DIR]

Writes the synthetic run directories to a temporary folder first (not timed), then times, separately:
load (every run directory -> the tidy long and per-run tables), aggregate (final-window summary with t intervals
per configuration, curves on a common compute grid with t bands for reward and clip fraction, the average
clip-fraction table), write (the tidy tables as parquet), and fit (ScaleRL fits per algorithm with a seed bootstrap).
Target: load + aggregate under 20 s on 2 cores (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the synthetic runs are the tests' (tests/analysis)

from analysis.runs import tidy
from analysis.stats import fit
from tests.analysis import synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="runs (4 algorithms x 5 lengths x 2 lrs x seeds)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--extra", type=int, default=10, help="extra metric columns beyond the vocabulary's 20")
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them")
    args = ap.parse_args()

    curves = {
        "grpo": synthetic.Curve(a=0.6, clip_low=5e-4, clip_high=8e-4),
        "grpo_rr": synthetic.Curve(a=0.7, clip_low=5e-4, clip_high=8e-4),
        "gspo": synthetic.Curve(a=0.8, clip_low=0.05, clip_high=0.1),
        "gspo_rr": synthetic.Curve(a=0.78, clip_low=0.05, clip_high=0.1),
    }
    grid = {"max_new_tokens": [128, 256, 512, 1024, 2048], "lr": [1e-6, 2e-6]}
    per_seed = len(curves) * 5 * 2
    seeds = range(max(1, args.runs // per_seed))
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_analysis_"))
    t = time.perf_counter()
    ids = synthetic.make_study(root, curves, seeds=seeds, grid=grid, n_steps=args.steps, n_extra=args.extra)
    print(f"generated {len(ids)} runs x {args.steps} steps in {time.perf_counter() - t:.1f} s (not timed) at {root}")

    timings: dict[str, float] = {}
    t = time.perf_counter()
    study = tidy.load_study(root)
    timings["load"] = time.perf_counter() - t

    t = time.perf_counter()
    curves.final_summary(study.long, "reward_mean", runs=study.runs)
    for metric in ("reward_mean", "clip_frac"):
        curves.aggregate_curves(study.long, metric, n_grid=100)
    for metric in ("clip_frac", "clip_frac_low", "clip_frac_high"):
        curves.summarize(curves.run_mean(study.long, metric), by=["algorithm"])
    timings["aggregate"] = time.perf_counter() - t

    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        study.write(out)
        timings["write parquet"] = time.perf_counter() - t

    t = time.perf_counter()
    fit.fit_study(study.long, runs=study.runs, n_boot=200)
    timings["fit (4 algorithms, 200 bootstrap)"] = time.perf_counter() - t

    print(f"{len(study.long):,} long rows, {len(study.metrics)} metrics, axes {study.axes}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    for name, sec in timings.items():
        print(f"  {name:<36s} {sec:6.2f} s")
    total = timings["load"] + timings["aggregate"]
    print(f"load + aggregate: {total:.2f} s (goal < 20 s)")
    if args.keep is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
