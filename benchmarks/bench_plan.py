"""The planner's memory estimate of a CPU run against the run's measured peak (a script, not a test).

    .venv/bin/python benchmarks/bench_plan.py [--preset small] [--steps 2] [--prompts 4] [--group-size 4]

Runs `study.rl.run` (fp32, hf engine, coldstart scratch, one thread) in a fresh child process. The child imports
every module the run needs and touches the allocator once, reads its resident set size (the baseline: interpreter,
torch, megatron-core, transformers), then runs; the measured number is the peak RSS (`resource.getrusage`
ru_maxrss) minus that baseline. The estimate is `study.tools.plan.cpu_run_estimate` for the same shape, batch and
lengths (the prompt length is the longest prompt the run's task generates at its knobs). Prints both, per part, and the
relative error; exits 1 when it is above `--tolerance` (0.2).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys
import torch, transformers, megatron.core  # noqa: F401  (the baseline holds every library the run loads)
from study import rl
from study.rollout import hf  # noqa: F401
from study.run.config import RunConfig
torch.set_num_threads(1)
cfg = RunConfig.from_dict(json.loads(sys.argv[1]))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
base = rss()
base_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rl.run(cfg, sys.argv[2], progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": base, "baseline_max": base_max, "peak": peak}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=0.2)
    args = parser.parse_args()

    from study.core.model_config import resolve_model
    from study.data import tasks
    from study.data.tokenizer import build_tokenizer
    from study.tools.plan import GB, Workload, cpu_run_estimate

    config = {"model": args.preset, "coldstart": "scratch", "steps": args.steps, "prompts_per_step": args.prompts,
              "group_size": args.group_size, "minibatches": args.minibatches, "max_new_tokens": args.max_new_tokens,
              "eval_every": 0, "checkpoint_every": 0, "threads": 1, "rollout_engine": "hf"}  # fmt: skip
    cfg = resolve_model(args.preset)
    tok = build_tokenizer(cfg.vocab_size, n_per_task=200)
    items = tasks.make_task("chain_sum", seed=0, **tasks.DEFAULT_KNOBS["chain_sum"]).take(256)
    prompt_len = max(len(tok.encode_prompt(item.prompt)) for item in items)
    work = Workload(prompts=args.prompts, group_size=args.group_size, prompt_len=prompt_len,
                    response_len=args.max_new_tokens)  # fmt: skip
    est = cpu_run_estimate(cfg, work, minibatches=args.minibatches)
    with tempfile.TemporaryDirectory() as results:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config), results], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    delta = measured["peak"] - measured["baseline"]
    print(
        f"preset {args.preset}: {args.prompts} x {args.group_size} sequences of <= {prompt_len} + "
        f"{args.max_new_tokens} tokens, {args.minibatches} minibatches, {args.steps} steps, fp32, hf engine"
    )
    for key, value in est.items():
        print(f"  estimate {key:<15} {value / GB:8.3f} GB")
    print(
        f"  measured baseline RSS  {measured['baseline'] / GB:8.3f} GB (imports; ru_maxrss then "
        f"{measured['baseline_max'] / GB:.3f})"
    )
    print(f"  measured peak RSS      {measured['peak'] / GB:8.3f} GB")
    err = est["peak"] / delta - 1
    print(
        f"peak RSS - baseline {delta / GB:.3f} GB; estimate {est['peak'] / GB:.3f} GB; relative error {err:+.1%} "
        f"(tolerance {args.tolerance:.0%})"
    )
    return 0 if abs(err) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
