"""The time planner's CPU form (study/run/timing.py, device `cpu`) against measured steps of real runs, per stage.

    nice -n 10 .venv/bin/python benchmarks/bench_step_time.py [--shapes tiny,default,...] [--steps 3] [--json]

Shapes (`SHAPES`; default: all): tiny, tiny-32x8x64, default, routing (the routing study's MoE), small, and dense
(the routing study's dense control, held out: not used to choose the `cpu` device's constants).

Each shape is one `python -m study run` (fp32, hf engine, coldstart scratch, no evaluation, one thread) in a fresh
process under the malloc tunables `python -m study` sets, its timers reading the process's CPU seconds
(time.perf_counter is time.process_time there: on a shared machine other jobs stretch wall seconds, not these); the
measurement is the median over steps 2..N (step 1 warms up) of the metrics time_rollout_s, time_old_logp_s,
time_update_s and time_sync_s. The plan is `timing.step_time` at the same shape, batch and
minibatches, with the lengths the run had: its longest response (response_len_max) and its mean prompt (from
tokens_total and response_len_mean). Prints measured and planned seconds per stage and the relative error
(planned / measured - 1); the step ratios to the first shape, measured and planned, are what a loaded machine keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROUTING_MOE = {"preset": "tiny", "num_layers": 4, "num_experts": 64, "moe_top_k": 1, "moe_ffn_hidden_size": 1024}
DENSE = {"preset": "tiny", "num_layers": 4, "num_experts": 1, "moe_top_k": 1, "moe_ffn_hidden_size": 1024}
SHAPES: dict[str, dict] = {
    # name: the run's fields (P x G x T, M, model)
    "tiny": {"model": "tiny", "prompts_per_step": 8, "group_size": 4, "max_new_tokens": 32, "minibatches": 4},
    "tiny-32x8x64": {"model": "tiny", "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 64, "minibatches": 4},
    "default": {"model": "default", "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 48, "minibatches": 4},
    "routing": {"model": ROUTING_MOE, "prompts_per_step": 64, "group_size": 16, "max_new_tokens": 32, "minibatches": 4},
    "small": {"model": "small", "prompts_per_step": 8, "group_size": 4, "max_new_tokens": 64, "minibatches": 4},
    # held out: the routing study's dense control (one expert of width 1024), not used to choose the CPU constants
    "dense": {"model": DENSE, "prompts_per_step": 32, "group_size": 16, "max_new_tokens": 32, "minibatches": 4},
}
CHILD = r"""
import sys, time
time.perf_counter = time.process_time  # the stage timers in CPU seconds, which other jobs do not inflate
from study.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
STAGES = {"rollout": "time_rollout_s", "pi_old": "time_old_logp_s", "update": "time_update_s", "sync": "time_sync_s"}


def measure(fields: dict, steps: int) -> dict[str, float]:
    """Median seconds per stage over steps 2..steps of one fresh run, and its lengths."""
    import pandas as pd

    sets = {
        **fields,
        "coldstart": "scratch",
        "steps": steps,
        "eval_every": 0,
        "checkpoint_every": 0,
        "threads": 1,
    }
    flat = {f"{k}.{kk}" if isinstance(v, dict) else k: vv for k, v in sets.items() for kk, vv in _items(v)}
    args = [f"--set={k}={v}" for k, v in flat.items()]
    from study.core import hugepages

    with tempfile.TemporaryDirectory() as results:
        cmd = [sys.executable, "-c", CHILD, "run", *args, "--results", results, "--quiet"]
        env = hugepages.environment(os.environ)  # the malloc tunables `python -m study` runs under
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        (path,) = Path(results, "runs").glob("*/metrics.parquet")
        rows = pd.read_parquet(path).iloc[1:]
    out = {stage: statistics.median(rows[col]) for stage, col in STAGES.items()}
    sequences = fields["prompts_per_step"] * fields["group_size"]
    out["response_len"] = float(rows["response_len_max"].max())
    mean_seq = float(rows["tokens_total"].mean()) / sequences + 1
    out["prompt_len"] = mean_seq - float(rows["response_len_mean"].mean())
    return out


def _items(value: object) -> list[tuple[str | None, object]]:
    """A field's (subkey, value) pairs: a mapping's items (`--set model.num_experts=64`), else (None, value)."""
    return list(value.items()) if isinstance(value, dict) else [(None, value)]


def plan(fields: dict, measured: dict[str, float]) -> dict[str, float]:
    """The CPU plan of the same shape at the run's lengths."""
    from study.core.model_config import model_spec, resolve_model
    from study.run import timing
    from study.run.plan import EngineLayout, Layout, Precision, Workload

    cfg = resolve_model(model_spec(fields["model"]))
    work = Workload(
        prompts=fields["prompts_per_step"],
        group_size=fields["group_size"],
        prompt_len=max(1, round(measured["prompt_len"])),
        response_len=max(1, round(measured["response_len"])),
        micro_batch=0,
    )
    step = timing.step_time(
        cfg,
        Layout(),
        work,
        dev=timing.device("cpu"),
        minibatches=fields["minibatches"],
        precision=Precision.of("fp32"),
        engine=EngineLayout(dtype="fp32", kv_dtype="fp32", dp=1),
    )
    return {"rollout": step.rollout, "pi_old": step.pi_old, "update": step.update, "sync": step.sync}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is a warm-up)")
    p.add_argument("--json", action="store_true", help="one JSON line per shape")
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; valid: {', '.join(SHAPES)}")
        fields = SHAPES[name]
        measured = measure(fields, args.steps)
        planned = plan(fields, measured)
        rows.append({"shape": name, "fields": fields, "measured": measured, "planned": planned})
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args.json:
        return
    head = "| shape | P x G x T, M | " + " | ".join(f"{s} s (plan, error)" for s in [*STAGES, "step"])
    print(head + " | step / first, measured (plan) |")
    print("|" + "---|" * (len(STAGES) + 4))
    first = None
    for row in rows:
        m, pl, f = row["measured"], row["planned"], row["fields"]
        m_step, p_step = sum(m[s] for s in STAGES), sum(pl[s] for s in STAGES)
        first = first or (m_step, p_step)
        cells = [f"{m[s]:.3f} ({pl[s]:.3f}, {pl[s] / m[s] - 1:+.0%})" for s in STAGES]
        shape = f"{f['prompts_per_step']} x {f['group_size']} x {f['max_new_tokens']}, {f['minibatches']}"
        print(
            f"| {row['shape']} | {shape} | "
            + " | ".join(cells)
            + f" | {m_step:.3f} ({p_step:.3f}, {p_step / m_step - 1:+.0%}) | "
            f"{m_step / first[0]:.1f}x ({p_step / first[1]:.1f}x) |"
        )


if __name__ == "__main__":
    main()
