"""A minibatch update with 4 KiB pages and with the heap's malloc tunables, side by side (a script, not a test).

    .venv/bin/python benchmarks/bench_hugepages.py [--iters 10] [--warmup 3] [--batch 32] [--seq 48]

The routing study's shape (`tiny` with 4 layers, 64 experts, top-1, expert width 1024: 48M parameters): one
minibatch update exactly as study/rl.py does it (benchmarks/steptimer.py `minibatch_update`: forward, backward,
global-norm clip, AdamW), one thread. The two sides are two child processes started together, one with
the GLIBC_TUNABLES the entry points set (study/core/hugepages.py: huge pages, freed memory kept) and one with
STUDY_HUGEPAGES=0 and no tunable, so a change of the machine's speed during the window slows both alike. Each prints
the median seconds of each phase over `--iters` updates after `--warmup`, the AnonHugePages its process holds, and
a hash of its parameters after the updates: the two hashes are equal, the page size changes no number.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path


def side(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from steptimer import minibatch_update  # benchmarks/ is on sys.path: this runs as a script

    from study.core import hugepages
    from study.core.model_config import preset
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cfg = dataclasses.replace(preset("tiny"), num_layers=4, num_experts=64, moe_top_k=1, moe_ffn_hidden_size=1024)
    model = build_policy(cfg, seed=0)
    opt = build_optimizer(model, lr=2e-4)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for i in range(args.warmup + args.iters):
        phases = minibatch_update(model, opt, ids)
        if i >= args.warmup:
            rows.append(phases)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    huge_kb = next(
        int(line.split()[1])
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
        if line.startswith("AnonHugePages:")
    )
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "pages": hugepages.describe(),
        "anon_huge_mb": huge_kb / 1024,
        **median,
        "update": sum(median.values()),
        "params_sha256": digest.hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="sequences per minibatch (the routing study's: 32)")
    ap.add_argument("--seq", type=int, default=48, help="tokens per sequence")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args)))
        return
    from study.core import hugepages

    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "STUDY_HUGEPAGES")}
    envs = {
        "4 KiB pages": {**base, "STUDY_HUGEPAGES": "0"},
        "huge pages": {**base, "GLIBC_TUNABLES": hugepages.tunables({})},
    }
    cmd = [sys.executable, __file__, "--side", *sys.argv[1:]]
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for name, env in envs.items()}
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"{name}: side failed with exit {proc.returncode}")
        results[name] = json.loads(out.splitlines()[-1])
    print(f"one minibatch update, {args.batch} x {args.seq} tokens, median of {args.iters}, seconds (both at once):")
    print(f"{'':12s} {'forward':>8s} {'backward':>8s} {'clip':>8s} {'adam':>8s} {'update':>8s}  AnonHuge  params")
    for name, r in results.items():
        print(
            f"{name:12s} {r['forward']:8.3f} {r['backward']:8.3f} {r['clip']:8.3f} {r['adam']:8.3f} "
            f"{r['update']:8.3f}  {r['anon_huge_mb']:6.0f}MB  {r['params_sha256']}"
        )
    small, huge = results["4 KiB pages"], results["huge pages"]
    print(
        f"speed-up of the update: {small['update'] / huge['update']:.2f}x; parameters equal: "
        f"{small['params_sha256'] == huge['params_sha256']}"
    )


if __name__ == "__main__":
    main()
