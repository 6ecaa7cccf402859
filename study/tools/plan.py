"""`python -m study plan --model qwen3-30b-a3b --gpus 16 --gpu-mem 80`: the candidate parallel layouts of a model on a
cluster, what one GPU holds for each and whether it fits. The arithmetic is study/run/plan.py's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from study.run.plan import (
    GB,
    Estimate,
    Layout,
    Precision,
    Workload,
    default_engine,
    estimate,
    fitting,
    param_counts,
    plan,
)

PUBLISHED: dict[str, tuple[int, Layout]] = {
    "verl GSPO (2x8)": (16, Layout(tp=4, ep=4, dp=4, sp=True, dist_opt=True, recompute=True, offload=True)),
    "NeMo-RL GRPO (8x8)": (64, Layout(tp=2, ep=8, dp=32, sp=True, dist_opt=True, recompute=False)),
}
"""The published layouts for Qwen3-30B-A3B (docs/references.md): GPUs and trainer layout (verl offloads
parameters and optimizer; counted here as the optimizer state off the GPU)."""


def format_table(estimates: Sequence[Estimate], gpu_mem_gb: float, *, limit: int | None = None) -> str:
    head = (
        f"{'layout':<45} {'params':>8} {'weights':>8} {'grads':>7} {'optim':>7} {'activ':>7} {'train':>7} "
        f"{'engine':>7} {'(kv)':>6} {'total':>7}  fits {gpu_mem_gb:g} GB"
    )
    rows = [head, "-" * len(head)]
    for e in list(estimates)[: limit or None]:
        rows.append(
            f"{e.layout.label():<45} {e.params / 1e9:>7.2f}B {e.weights / GB:>8.1f} {e.grads / GB:>7.1f} "
            f"{e.optimizer / GB:>7.1f} {e.activations / GB:>7.1f} {e.train / GB:>7.1f} {e.engine / GB:>7.1f} "
            f"{e.engine_kv / GB:>6.1f} {e.total / GB:>7.1f}  {'yes' if e.fits(gpu_mem_gb * GB) else 'no'}"
        )
    return "\n".join(rows)


def plan_main(argv: list[str] | None = None) -> int:
    """`python -m study plan`: print the candidate layouts of a model on a cluster."""
    import argparse
    import sys

    from study.core.model_config import resolve_model

    p = argparse.ArgumentParser(prog="python -m study plan", description=plan_main.__doc__)
    p.add_argument(
        "--model",
        default=None,
        help="a preset (qwen3-30b-a3b, small, ...), a model mapping or an HF "
        "checkpoint directory; default: the run config's",
    )
    p.add_argument("--config", help="a run config YAML (its model, batch, lengths and dtype)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="run config override")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all (nodes x GPUs per node)")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GB")
    p.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node")
    p.add_argument("--prompt-len", type=int, default=1024, help="longest prompt, tokens")
    p.add_argument("--response-len", type=int, default=None, help="max_new_tokens (default: the run's, else 8192)")
    p.add_argument("--prompts", type=int, default=None, help="P (default: the run's, else 64)")
    p.add_argument("--group-size", type=int, default=None, help="G (default: the run's, else 8)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per trainer rank")
    p.add_argument("--dtype", default=None, help="training dtype (default: the run's, else bf16)")
    p.add_argument("--engine-tp", type=int, default=None, help="vLLM TP per replica (default 1)")
    p.add_argument("--engine-ep", type=int, default=None, help="vLLM EP per replica (default: see default_engine)")
    p.add_argument("--reserve-gb", type=float, default=5.0, help="per GPU: CUDA context, buffers, fragmentation")
    p.add_argument("--all", action="store_true", help="print every candidate (default: the 20 best)")
    args = p.parse_args(argv)
    try:
        _check_plan_args(args)
        run = None
        if args.config or args.sets:
            from study.run.config import load_config

            run = load_config(args.config, sets=args.sets)
        model = args.model if args.model is not None else (run.model if run is not None else None)
        if model is None:
            raise ValueError("give --model or --config")
        from study.core.model_config import model_spec

        cfg = resolve_model(model_spec(_parse_model(model)))
        dtype = args.dtype or (run.train_dtype if run else "bf16")
        work = Workload(
            prompts=args.prompts or (run.prompts_per_step if run else 64),
            group_size=args.group_size or (run.group_size if run else 8),
            prompt_len=args.prompt_len,
            response_len=args.response_len or (run.max_new_tokens if run else 8192),
            micro_batch=args.micro_batch,
        )
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
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = param_counts(cfg)
    print(
        f"model: {param_counts(cfg).total / 1e9:.3f}B parameters ({counts.experts / 1e9:.3f}B in experts), "
        f"active per token {cfg.active_params_per_token / 1e9:.3f}B; {dtype} training; batch {work.prompts} x "
        f"{work.group_size} sequences of {work.prompt_len} + {work.response_len} tokens, micro-batch "
        f"{work.micro_batch}; engine TP {engine.tp} EP {engine.ep} ({engine.dtype}, colocated, sleeps during the "
        f"update); total = peak x 1.1 (allocator fragmentation) + {args.reserve_gb:g} GB reserve. "
        "GB per GPU:"
    )
    print(format_table(estimates, args.gpu_mem, limit=None if args.all else 20))
    n_fit = len(fitting(estimates, args.gpu_mem))
    print(f"{n_fit} of {len(estimates)} layouts fit on {args.gpus} GPU(s) of {args.gpu_mem:g} GB")
    from study.core.model_config import PRESETS

    if cfg == PRESETS["qwen3-30b-a3b"]:
        print("published layouts of this model (each on its own GPU count, this batch and engine):")
        published = [
            estimate(
                cfg,
                layout,
                work,
                precision=Precision.of(dtype),
                engine=default_engine(cfg, gpus),
                gpu_mem_gb=args.gpu_mem,
                reserve_gb=args.reserve_gb,
            )
            for gpus, layout in PUBLISHED.values()
        ]
        table = format_table(published, args.gpu_mem).splitlines()
        print("\n".join(table[:2] + [f"{row}  ({name})" for row, name in zip(table[2:], PUBLISHED, strict=True)]))
    return 0 if n_fit else 1


MAX_GPUS = 1 << 20
"""Most GPUs `study plan` accepts (more is a typo, and its layout search would not end)."""


def _check_plan_args(args: Any) -> None:
    """ValueError naming the option: GPU counts in 1..MAX_GPUS, memory finite and > 0, lengths and sizes >= 1."""
    import math

    for option, value, lo, hi in (("--gpus", args.gpus, 1, MAX_GPUS), ("--gpus-per-node", args.gpus_per_node, 1, 1024)):
        if not lo <= value <= hi:
            raise ValueError(f"{option} = {value}: valid: an integer in [{lo}, {hi}]")
    for option, value, lo in (("--gpu-mem", args.gpu_mem, 0.0), ("--reserve-gb", args.reserve_gb, -1e-300)):
        if not math.isfinite(value) or value <= lo:
            raise ValueError(f"{option} = {value}: valid: a finite number of GB {'> 0' if lo == 0 else '>= 0'}")
    for option in ("prompt_len", "response_len", "prompts", "group_size", "micro_batch", "engine_tp", "engine_ep"):
        value = getattr(args, option)
        if value is not None and not 1 <= value <= 1 << 30:
            raise ValueError(f"--{option.replace('_', '-')} = {value}: valid: an integer in [1, {1 << 30}]")


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
