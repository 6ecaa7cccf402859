"""The planner's memory estimate of a CPU run against the run's measured peak RSS, per rank (a script; the test
tests/study/tools/test_plan_measured.py runs it at one cheap shape).

    .venv/bin/python benchmarks/bench_plan.py [--preset default] [--parallel expert=2,data=2] [--steps 2]
        [--prompts 4] [--group-size 4] [--minibatches 2] [--max-new-tokens 64] [--json]

Runs `study.rl.run` (fp32, hf engine, coldstart scratch, one thread per rank) in fresh child processes: one, or one
per rank of `--parallel` (gloo, on this machine). Each child imports the libraries every run loads, reads its
resident set size (the `process` baseline), runs, and reports its peak RSS (`resource.getrusage` ru_maxrss). The
plan is `study.tools.plan.cpu_run_estimate` for the same shape, layout, batch and lengths (the prompt length is the
longest prompt the run's task generates at its knobs), per rank. Prints both, the plan by term, and the relative
error of the peak and of the peak above the process baseline; exits 1 when either is above `--tolerance` (0.2) on
any rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's study, as the children (run from ROOT) import it

CHILD = r"""
import json, resource, sys
import torch, transformers, megatron.core  # noqa: F401  (the baseline holds every library the run imports)
from study import rl
from study.rollout import hf  # noqa: F401
from study.run.config import RunConfig
torch.set_num_threads(1)
cfg = RunConfig.from_dict(json.loads(sys.argv[1]))
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
rl.run(cfg, sys.argv[2], progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": base, "peak": peak}))
"""


def parse_parallel(text: str) -> dict[str, int]:
    """`expert=2,data=2` -> {"expert": 2, "data": 2} (the run config's `parallel` section)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value)
    return out


def measure(config: dict, world: int) -> list[dict[str, int]]:
    """Run `config` in `world` fresh processes (gloo ranks when world > 1); each rank's baseline and peak RSS."""
    with tempfile.TemporaryDirectory() as results:
        procs = []
        port = _free_port()
        for rank in range(world):
            env = dict(os.environ)
            if world > 1:
                env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, json.dumps(config), results],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a rank failed ({p.returncode}):\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--parallel", default="", help="the run's parallel section, e.g. expert=2,data=2")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=0.2)
    parser.add_argument("--json", action="store_true", help="one JSON line per rank instead of the table")
    args = parser.parse_args(argv)

    from study.core.model_config import ParallelLayout, resolve_model
    from study.data import tasks
    from study.data.tokenizer import build_tokenizer
    from study.tools.plan import GB, Workload, cpu_run_estimate

    parallel = parse_parallel(args.parallel)
    layout = ParallelLayout.from_mapping(parallel)
    config = {
        "model": args.preset,
        "coldstart": "scratch",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "minibatches": args.minibatches,
        "max_new_tokens": args.max_new_tokens,
        "eval_every": 0,
        "checkpoint_every": 0,
        "threads": 1,
        "rollout_engine": "hf",
        "parallel": parallel,
    }
    cfg = resolve_model(args.preset)
    tok = build_tokenizer(cfg.vocab_size, ["chain_sum"], n_per_task=400)
    items = tasks.make_task("chain_sum", seed=0, **tasks.DEFAULT_KNOBS["chain_sum"]).take(256)
    prompt_len = max(len(tok.encode_prompt(item.prompt)) for item in items)
    work = Workload(
        prompts=args.prompts, group_size=args.group_size, prompt_len=prompt_len, response_len=args.max_new_tokens
    )
    measured = measure(config, layout.world_size)
    worst = 0.0
    if not args.json:
        print(
            f"preset {args.preset}, {layout.world_size} rank(s) {parallel or ''}: {args.prompts} x "
            f"{args.group_size} sequences of <= {prompt_len} + {args.max_new_tokens} tokens, {args.minibatches} "
            f"minibatches, {args.steps} steps, fp32, hf engine"
        )
    for rank, m in enumerate(measured):
        est = cpu_run_estimate(cfg, work, minibatches=args.minibatches, parallel=layout, rank=rank)
        err = est["peak"] / m["peak"] - 1
        above = (est["peak"] - est["process"]) / (m["peak"] - m["baseline"]) - 1
        worst = max(worst, abs(err), abs(above))
        if args.json:
            print(
                json.dumps(
                    {
                        "preset": args.preset,
                        "parallel": parallel,
                        "rank": rank,
                        "plan": est,
                        **m,
                        "error": err,
                        "error_above_process": above,
                    }
                )
            )
            continue
        print(f" rank {rank}: " + ", ".join(f"{k} {v / GB:.3f}" for k, v in est.items()) + " GB")
        print(
            f"   measured: process {m['baseline'] / GB:.3f}, peak {m['peak'] / GB:.3f} GB; planned peak "
            f"{est['peak'] / GB:.3f} GB, error {err:+.1%}; above the process {above:+.1%}"
        )
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
