"""`python -m study plan --model qwen3-30b-a3b --gpus 16 --gpu-mem 80`: the candidate parallel layouts of a model on a
cluster, what one GPU holds for each and whether it fits, and the planned seconds per step, tokens/s/GPU and
GPU-hours of each; `--sweep sweeps/paper.yaml`: the GPUs, hours and GPU-hours of every run of a sweep and their sum.
The arithmetic is study/run/plan.py's (memory) and study/run/timing.py's (time): a plan, not a measurement."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from study.run import timing
from study.run.plan import (
    GB,
    EngineLayout,
    Estimate,
    Layout,
    Precision,
    Workload,
    default_engine,
    estimate,
    fitting,
    param_counts,
    place_run,
    plan,
)

PUBLISHED: dict[str, tuple[int, Layout]] = {
    "verl GSPO (2x8)": (16, Layout(tp=4, ep=4, dp=4, sp=True, dist_opt=True, recompute=True, offload=True)),
    "NeMo-RL GRPO (8x8)": (64, Layout(tp=2, ep=8, dp=32, sp=True, dist_opt=True, recompute=False)),
}
"""The published layouts for Qwen3-30B-A3B (docs/references.md): GPUs and trainer layout (verl offloads
parameters and optimizer; counted here as the optimizer state off the GPU)."""


PUBLISHED_THROUGHPUT = {
    "name": "NeMo-RL v0.6 GRPO (4x8 H100)",
    "tokens_per_s_per_gpu": 1102.0,
    "s_per_step": 192.0,
    "gpus": 32,
    "layout": Layout(tp=1, ep=8, dp=32, dist_opt=True),
    "engine": EngineLayout(tp=2, ep=1, gpu_memory=0.6),
    "work": Workload(prompts=64, group_size=32, prompt_len=512, response_len=3584, micro_batch=1),
    "minibatches": 4,
    "source": "docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html: GRPO, bf16, Megatron TP 1 / EP 8, "
    "vLLM TP 2, 4k max length, 32 H100, on-policy, 2,048 samples a step in training batches of 512",
}
"""The one published RL throughput for Qwen3-30B-A3B (docs/gpu.md), and its shape as the plan prices it: 64 prompts
x 32 samples, 4,096 tokens at most (taken as 512 + 3,584), 4 updates of 512, vLLM at 0.6 of a GPU (assumed: the
summary does not give it). NeMo-RL counts the tokens the step generated; the plan counts every sequence at its
maximum length."""


def format_table(
    estimates: Sequence[Estimate],
    gpu_mem_gb: float,
    *,
    limit: int | None = None,
    times: Sequence[timing.RunTime] | None = None,
) -> str:
    """One row per layout: GB per GPU by term and whether it fits; with `times` (one per estimate), the planned
    seconds per step, tokens/s/GPU and the run's GPU-hours."""
    head = (
        f"{'layout':<45} {'params':>8} {'weights':>8} {'grads':>7} {'optim':>7} {'activ':>7} {'train':>7} "
        f"{'engine':>7} {'(kv)':>6} {'total':>7}  fits {gpu_mem_gb:g} GB"
    )
    fits_w = len(f"fits {gpu_mem_gb:g} GB")
    if times is not None:
        head += f"  {'s/step':>7} {'tok/s/GPU':>9} {'GPU-h':>8}"
    rows = [head, "-" * len(head)]
    for i, e in enumerate(list(estimates)[: limit or None]):
        row = (
            f"{e.layout.label():<45} {e.params / 1e9:>7.2f}B {e.weights / GB:>8.1f} {e.grads / GB:>7.1f} "
            f"{e.optimizer / GB:>7.1f} {e.activations / GB:>7.1f} {e.train / GB:>7.1f} {e.engine / GB:>7.1f} "
            f"{e.engine_kv / GB:>6.1f} {e.total / GB:>7.1f}  {'yes' if e.fits(gpu_mem_gb * GB) else 'no':<{fits_w}}"
        )
        if times is not None:
            t = times[i]
            row += f"  {t.step.total:>7.1f} {t.step.tokens_per_s_per_gpu:>9,.0f} {t.gpu_hours:>8,.1f}"
        rows.append(row)
    return "\n".join(rows)


def plan_main(argv: list[str] | None = None) -> int:
    """`python -m study plan`: print the candidate layouts of a model on a cluster, their memory per GPU and their
    planned time and cost; or, with --sweep, the planned GPUs and GPU-hours of every run of a sweep."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m study plan", description=plan_main.__doc__)
    p.add_argument(
        "--model",
        default=None,
        help="a preset (qwen3-30b-a3b, small, ...), a model mapping or an HF "
        "checkpoint directory; default: the run config's",
    )
    p.add_argument("--config", help="a run config YAML (its model, batch, lengths and dtype)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="run config override")
    p.add_argument("--sweep", help="a sweep file: plan every run of it (GPUs from the planner, time, GPU-hours)")
    p.add_argument(
        "--gpus", type=int, default=None, help="GPUs in all (nodes x GPUs per node); required without --sweep"
    )
    p.add_argument(
        "--gpu", default="h100", help=f"GPU kind whose published peaks price the time: {', '.join(GPU_KINDS)}"
    )
    p.add_argument("--gpu-mem", type=float, default=None, help="memory per GPU, GB (default: the GPU kind's)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node")
    p.add_argument("--prompt-len", type=int, default=1024, help="longest prompt, tokens")
    p.add_argument("--response-len", type=int, default=None, help="max_new_tokens (default: the run's, else 8192)")
    p.add_argument("--prompts", type=int, default=None, help="P (default: the run's, else 64)")
    p.add_argument("--group-size", type=int, default=None, help="G (default: the run's, else 8)")
    p.add_argument("--minibatches", type=int, default=None, help="M, updates per step (default: the run's, else 4)")
    p.add_argument(
        "--steps", type=int, default=None, help="steps of the run priced in GPU-hours (default: the run's, else 500)"
    )
    p.add_argument(
        "--experts",
        default=None,
        help="the trainer's experts: auto, grouped, sequential (default: the run's, else auto)",
    )
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per trainer rank")
    p.add_argument("--dtype", default=None, help="training dtype (default: the run's, else bf16)")
    p.add_argument("--engine-tp", type=int, default=None, help="vLLM TP per replica (default 1)")
    p.add_argument("--engine-ep", type=int, default=None, help="vLLM EP per replica (default: see default_engine)")
    p.add_argument("--reserve-gb", type=float, default=5.0, help="per GPU: CUDA context, buffers, fragmentation")
    p.add_argument("--all", action="store_true", help="print every candidate (default: the 20 best)")
    args = p.parse_args(argv)
    try:
        dev = gpu_kind(args.gpu)
        args.gpu_mem = dev.mem_gb if args.gpu_mem is None else args.gpu_mem
        _check_plan_args(args)
        if args.sweep:
            return _plan_sweep(args, dev)
        if args.gpus is None:
            raise ValueError("give --gpus (or --sweep)")
        run = None
        if args.config or args.sets:
            from study.run.config import load_config

            run = load_config(args.config, sets=args.sets)
        model = args.model if args.model is not None else (run.model if run is not None else None)
        if model is None:
            raise ValueError("give --model or --config")
        from study.core.model_config import model_spec, resolve_model

        cfg = resolve_model(model_spec(_parse_model(model)))
        dtype = args.dtype or (run.train_dtype if run else "bf16")
        work = Workload(
            prompts=args.prompts or (run.prompts_per_step if run else 64),
            group_size=args.group_size or (run.group_size if run else 8),
            prompt_len=args.prompt_len,
            response_len=args.response_len or (run.max_new_tokens if run else 8192),
            micro_batch=args.micro_batch,
        )
        cadence = _cadence(args, run)
        engine = default_engine(cfg, args.gpus)
        engine = dataclasses.replace(engine, tp=args.engine_tp or engine.tp, ep=args.engine_ep or engine.ep)
        estimates = plan(
            cfg,
            args.gpus,
            args.gpu_mem,
            work,
            dtype=dtype,
            gpus_per_node=args.gpus_per_node,
            engine=engine,
            reserve_gb=args.reserve_gb,
        )
        precision = Precision.of(dtype)
        times = {
            e.layout: timing.run_time(
                cfg,
                e.layout,
                work,
                cadence,
                dev=dev,
                precision=precision,
                engine=engine,
                gpus_per_node=args.gpus_per_node,
                est=e,
            )
            for e in estimates
        }
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    budget = args.gpu_mem * GB
    estimates.sort(key=lambda e: (not e.fits(budget), times[e.layout].step.total if e.fits(budget) else e.total))
    counts = param_counts(cfg)
    print(
        f"model: {param_counts(cfg).total / 1e9:.3f}B parameters ({counts.experts / 1e9:.3f}B in experts), "
        f"active per token {cfg.active_params_per_token / 1e9:.3f}B; {dtype} training; batch {work.prompts} x "
        f"{work.group_size} sequences of {work.prompt_len} + {work.response_len} tokens, micro-batch "
        f"{work.micro_batch}; engine TP {engine.tp} EP {engine.ep} ({engine.dtype}, colocated, sleeps during the "
        f"update); total = peak x 1.1 (allocator fragmentation) + {args.reserve_gb:g} GB reserve. "
        "GB per GPU:"
    )
    print(
        f"time: PLANNED on {dev.name} (study/run/timing.py: published peaks x stated efficiencies, a model, not a "
        f"measurement), every response at {work.response_len} tokens, {cadence.minibatches} updates a step, "
        f"GPU-hours of {cadence.steps} steps; fitting layouts fastest first"
    )
    print(
        format_table(
            estimates, args.gpu_mem, limit=None if args.all else 20, times=[times[e.layout] for e in estimates]
        )
    )
    fit = fitting(estimates, args.gpu_mem)
    print(f"{len(fit)} of {len(estimates)} layouts fit on {args.gpus} GPU(s) of {args.gpu_mem:g} GB")
    if fit:
        print(_headline("planned", fit[0].layout, times[fit[0].layout]))
    from study.core.model_config import PRESETS

    if cfg == PRESETS["qwen3-30b-a3b"]:
        _print_published(cfg, work, dtype, dev, cadence, args)
    return 0 if fit else 1


GPU_KINDS = tuple(name for name, dev in timing.DEVICES.items() if not dev.cpu)
"""The GPU kinds `--gpu` accepts (study/run/timing.py DEVICES; the `cpu` device prices CPU runs)."""


def gpu_kind(name: str) -> timing.Device:
    """The GPU kind `name`; ValueError naming the valid ones."""
    if name not in GPU_KINDS:
        raise ValueError(f"--gpu = {name!r}: unknown GPU kind; valid: {', '.join(GPU_KINDS)}")
    return timing.device(name)


@dataclasses.dataclass(frozen=True)
class _Cadence:
    """What a run's time plan reads of a RunConfig, for a plan without one: no evaluation, one checkpoint."""

    steps: int
    minibatches: int
    experts: str
    eval_every: int = 0
    eval_size: int = 0
    eval_samples: int = 0
    eval_test_size: int = 0
    eval_test_samples: int = 0
    checkpoint_every: int = 0


def _cadence(args: Any, run: Any) -> Any:
    """The run config with the command line's --steps, --minibatches and --experts over it, or a `_Cadence`."""
    steps = args.steps or (run.steps if run else 500)
    minibatches = args.minibatches or (run.minibatches if run else 4)
    experts = args.experts or (run.experts if run else "auto")
    if run is None:
        return _Cadence(steps=steps, minibatches=minibatches, experts=experts)
    return run.replace(steps=steps, minibatches=minibatches, experts=experts)


def _headline(what: str, layout: Layout, t: timing.RunTime) -> str:
    s = t.step
    return (
        f"{what}: {layout.label()}: {s.total:,.1f} s/step (rollout {s.rollout:,.1f}, pi_old {s.pi_old:,.1f}, update "
        f"{s.update:,.1f}, weight sync {s.sync:,.1f}), {s.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"{t.seconds / 3600:,.1f} h and {t.gpu_hours:,.1f} GPU-hours for {t.steps} steps on {s.gpus} GPUs"
    )


def _print_published(cfg: Any, work: Workload, dtype: str, dev: timing.Device, cadence: Any, args: Any) -> None:
    """The published layouts of Qwen3-30B-A3B at this batch, and the published throughput beside this plan's."""
    print("published layouts of this model (each on its own GPU count, this batch and engine):")
    precision = Precision.of(dtype)
    published, times = [], []
    for gpus, layout in PUBLISHED.values():
        engine = default_engine(cfg, gpus)
        est = estimate(
            cfg, layout, work, precision=precision, engine=engine, gpu_mem_gb=args.gpu_mem, reserve_gb=args.reserve_gb
        )
        published.append(est)
        times.append(timing.run_time(cfg, layout, work, cadence, dev=dev, precision=precision, engine=engine, est=est))
    table = format_table(published, args.gpu_mem, times=times).splitlines()
    print("\n".join(table[:2] + [f"{row}  ({name})" for row, name in zip(table[2:], PUBLISHED, strict=True)]))
    ref = PUBLISHED_THROUGHPUT
    est = estimate(cfg, ref["layout"], ref["work"], precision=precision, engine=ref["engine"], gpu_mem_gb=args.gpu_mem)
    mine = timing.step_time(
        cfg,
        ref["layout"],
        ref["work"],
        dev=dev,
        minibatches=ref["minibatches"],
        precision=precision,
        engine=ref["engine"],
        est=est,
    )
    print(
        f"published throughput: {ref['name']}: {ref['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
        f"{ref['s_per_step']:g} s/step ({ref['source']}); this plan at that shape ({ref['layout'].label()}, vLLM TP "
        f"{ref['engine'].tp}, {ref['work'].prompts} x {ref['work'].group_size} x {ref['work'].seq_len} tokens) on "
        f"{dev.name}: {mine.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {mine.total:,.1f} s/step (every sequence at its "
        "maximum length; NeMo-RL counts the tokens generated)"
    )


def _plan_sweep(args: Any, dev: timing.Device) -> int:
    """`--sweep FILE`: each run's GPUs (the fewest it fits on, as the workflow places it), planned seconds per step,
    tokens/s/GPU, hours and GPU-hours, and the sweep's total GPU-hours."""
    from sweeps.expand import load_sweep
    from sweeps.schema import SweepError

    try:
        runs = load_sweep(args.sweep).expand()
    except SweepError as err:
        raise ValueError(str(err)) from None
    print(
        f"sweep {args.sweep}: {len(runs)} runs, time PLANNED on {dev.name} GPUs of {args.gpu_mem:g} GB, "
        f"{args.gpus_per_node} per node (study/run/timing.py: a model, not a measurement)"
    )
    head = f"{'run':<28} {'GPUs':>5} {'s/step':>8} {'tok/s/GPU':>9} {'steps':>6} {'hours':>7} {'GPU-h':>9}"
    print(head + "\n" + "-" * len(head))
    total = 0.0
    for run_id, run in runs.items():
        nodes, per_node = place_run(run, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem)
        gpus = nodes * per_node
        t = timing.plan_run(run, dev=dev, gpus=gpus, gpu_mem_gb=args.gpu_mem, gpus_per_node=args.gpus_per_node)
        total += t.gpu_hours
        print(
            f"{run_id:<28} {gpus:>5} {t.step.total:>8,.1f} {t.step.tokens_per_s_per_gpu:>9,.0f} {t.steps:>6} "
            f"{t.seconds / 3600:>7,.1f} {t.gpu_hours:>9,.1f}"
        )
    print(f"sweep total: {total:,.0f} GPU-hours (planned)")
    return 0


MAX_GPUS = 1 << 20
"""Most GPUs `study plan` accepts (more is a typo, and its layout search would not end)."""


def _check_plan_args(args: Any) -> None:
    """ValueError naming the option: GPU counts in 1..MAX_GPUS, memory finite and > 0, lengths and sizes >= 1, a
    known experts path."""
    import math

    for option, value, lo, hi in (("--gpus", args.gpus, 1, MAX_GPUS), ("--gpus-per-node", args.gpus_per_node, 1, 1024)):
        if value is not None and not lo <= value <= hi:
            raise ValueError(f"{option} = {value}: valid: an integer in [{lo}, {hi}]")
    for option, value, lo in (("--gpu-mem", args.gpu_mem, 0.0), ("--reserve-gb", args.reserve_gb, -1e-300)):
        if not math.isfinite(value) or value <= lo:
            raise ValueError(f"{option} = {value}: valid: a finite number of GB {'> 0' if lo == 0 else '>= 0'}")
    options = ("prompt_len", "response_len", "prompts", "group_size", "minibatches", "steps", "micro_batch")
    for option in (*options, "engine_tp", "engine_ep"):
        value = getattr(args, option)
        if value is not None and not 1 <= value <= 1 << 30:
            raise ValueError(f"--{option.replace('_', '-')} = {value}: valid: an integer in [1, {1 << 30}]")
    if args.experts not in (None, "auto", "grouped", "sequential"):
        raise ValueError(f"--experts = {args.experts!r}: valid: auto, grouped, sequential")


def _parse_model(text: Any) -> Any:
    """A --model argument: a preset name, a path, or a YAML mapping."""
    if not isinstance(text, str) or not text.lstrip().startswith("{"):
        return text
    import yaml

    from runfiles.bounded import load_yaml

    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} characters)"
        raise ValueError(f"--model = {shown}: not a YAML mapping ({' '.join(str(err).split())[:300]})") from None
