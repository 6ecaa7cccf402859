"""Ways to compute the rollout engine's MoE experts at decode sizes, per call (a script, not a test).

    .venv/bin/python benchmarks/bench_experts.py [--preset tiny default] [--tokens 32 64 256 1024] [--repeats 7]

The hf engine runs transformers' Qwen3-MoE experts module once per layer and decode step, on the step's tokens (one
per sequence: 32 at 8x4, 256 at 32x8). This times, on layer 0's experts of a preset's model (its initial weights),
with router-shaped inputs (top-k of a softmax, renormalised):
- grouped_mm: transformers' default path (sort by expert, gather, two `F.grouped_mm`, inverse permutation), what the
  engine runs;
- batched_mm: transformers' other built-in path (each routed row gathers its own expert's weights, then `bmm`);
- loop: one `F.linear` pair per expert over its tokens, `index_add_` into the output;
- dense: every expert on every token (two batched matmuls, E/k times the FLOPs), combined with the routing weights
  as a dense (tokens, experts) matrix: the fewest ops.
Each row gives the best of `--repeats` interleaved rounds (ms per call) and the largest absolute difference from
grouped_mm.
One torch thread, no autograd.

    .venv/bin/python benchmarks/bench_experts.py --policy [--preset routing small] [--dtype fp32 bf16]
        [--tokens 1536 12288] [--repeats 7]

`--policy` times the training side instead: one MoE layer's experts of the megatron policy, forward + backward, on
`--tokens` routed rows spread over the experts as a router spreads them (a softmax's top-k over random logits), per
path of study/policy/experts.py:
- megatron: megatron's SequentialMLP, one MLP module per expert (the reference);
- sequential: the path `experts = "sequential"` runs, the experts one after another in one autograd Function
  (`ExpertsFunction`) where it is exact (fp32), else SequentialMLP (bf16, whose routing probs stay fp32);
- grouped: `experts = "grouped"`, each projection of every expert one grouped GEMM (`GroupedExpertsFunction`, the
  weights read in place from their stacked buffer).
Each round times every path in turn (interleaved, so a slow phase of the shared machine hits all of them); a cell is
the best of `--repeats` rounds, and the ratio column the median over the rounds of sequential's time / grouped's
(above 1: grouped is faster). `--preset` takes the model presets and `routing`, the routing study's MoE
(sweeps/routing.yaml: 64 experts of width 1024, top-1, hidden 64). Rows: 1,536 are a 32-sequence minibatch of ~48
positions at top-1 (the routing study's M = 32), 12,288 its M = 4. The outputs and gradients of the three paths are
checked equal before timing (bit for bit on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F


def loop(experts: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        tok, pos = torch.where(idx == e)
        if tok.numel():
            gate, up = F.linear(x[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(gate) * up, experts.down_proj[e]) * w[tok, pos, None])
    return out


def dense(experts: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, I) each
    y = torch.matmul(F.silu(gate) * up, experts.down_proj.transpose(1, 2))  # (E, T, H)
    weights = torch.zeros(x.shape[0], experts.num_experts, dtype=w.dtype).scatter_(1, idx, w)  # (T, E)
    return torch.einsum("eth,te->th", y, weights)


def implementations() -> dict[str, Callable[..., torch.Tensor]]:
    import transformers.integrations.moe as moe

    return {
        "grouped_mm": moe.grouped_mm_experts_forward,
        "batched_mm": moe.batched_mm_experts_forward,
        "loop": loop,
        "dense": dense,
    }


def time_rounds(fns: dict[str, Callable[[], object]], repeats: int, block_s: float = 0.02) -> list[dict[str, float]]:
    """Seconds per call of each function in each of `repeats` rounds, each round timing every function in turn
    (interleaved, so a slow phase of the machine hits all of them) over enough calls to fill ~`block_s`."""
    calls = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up and calibration
            fn()
        calls[name] = max(1, min(200, round(block_s / ((time.perf_counter() - t0) / 3))))
    rounds = []
    for _ in range(repeats):
        secs = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            secs[name] = (time.perf_counter() - t0) / calls[name]
        rounds.append(secs)
    return rounds


def time_calls(fns: dict[str, Callable[[], torch.Tensor]], repeats: int, block_s: float = 0.02) -> dict[str, float]:
    """Seconds per call of each function: the best of `time_rounds`'s rounds."""
    rounds = time_rounds(fns, repeats, block_s)
    return {name: min(r[name] for r in rounds) for name in fns}


def bench(preset_name: str, tokens: list[int], repeats: int) -> None:
    from study.core.model_config import preset
    from study.rollout.hf import build_hf_model

    cfg = preset(preset_name)
    experts = build_hf_model(cfg).model.layers[0].mlp.experts
    fns = implementations()
    gen = torch.Generator().manual_seed(0)
    print(
        f"\npreset {preset_name}: {cfg.num_experts} experts, top-{cfg.moe_top_k}, hidden {cfg.hidden_size}, "
        f"expert width {cfg.moe_ffn_hidden_size}"
    )
    print(f"| tokens | {' | '.join(fns)} |")
    print(f"|---:|{'---:|' * len(fns)}")
    for t in tokens:
        x = torch.randn(t, cfg.hidden_size, generator=gen)
        probs = torch.randn(t, cfg.num_experts, generator=gen).softmax(-1)
        w, idx = torch.topk(probs, cfg.moe_top_k)
        w = w / w.sum(-1, keepdim=True)
        with torch.no_grad():
            ref = fns["grouped_mm"](experts, x, idx, w)
            diffs = {name: (fn(experts, x, idx, w) - ref).abs().max().item() for name, fn in fns.items()}
            secs = time_calls({name: functools.partial(fn, experts, x, idx, w) for name, fn in fns.items()}, repeats)
        cells = [f"{secs[n] * 1e3:.3f} ms" + (f" (diff {diffs[n]:.0e})" if diffs[n] else "") for n in fns]
        print(f"| {t} | {' | '.join(cells)} |")


def _forward_backward(fn: Callable[..., torch.Tensor], args: tuple, grad: torch.Tensor) -> None:
    fn(*args).backward(grad)


def policy_model(name: str):  # type: ignore[no-untyped-def]
    """The ModelConfig `--preset` names: a preset, or `routing` (the MoE model of sweeps/routing.yaml's runs)."""
    from study.core.model_config import preset

    if name != "routing":
        return preset(name)
    from pathlib import Path

    from sweeps.expand import load_sweep

    runs = load_sweep(Path(__file__).resolve().parents[1] / "sweeps" / "routing.yaml").expand().values()
    return next(c.model_config() for c in runs if c.model_config().num_experts > 1)


def _experts_modules(cfg, dtype: str) -> dict[str, torch.nn.Module]:  # type: ignore[no-untyped-def]
    """Layer 0's experts of a one-layer policy of `cfg`'s shape, per path, with the same weights."""
    from study.policy.model import build_policy

    one = cfg.replace(num_layers=1)
    paths = {
        "megatron": {"layers": "megatron"},
        "sequential": {"experts": "sequential"},
        "grouped": {"experts": "grouped"},
    }
    return {k: build_policy(one, seed=0, dtype=dtype, **kw).decoder.layers[0].mlp.experts for k, kw in paths.items()}


def _routed(cfg, rows: int, dtype: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """`rows` routed rows of a router's spread: tokens_per_expert from the top-k of a softmax over random logits,
    the permuted rows (N, H), their gates (N,) in fp32 (megatron's router dtype in bf16) and an output grad."""
    from study.core.model_config import TORCH_DTYPES

    tokens = rows // cfg.moe_top_k
    chosen = torch.randn(tokens, cfg.num_experts, generator=gen).topk(cfg.moe_top_k).indices.flatten()
    per_expert = torch.bincount(chosen, minlength=cfg.num_experts)
    per_expert[0] += rows - int(per_expert.sum())
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to(TORCH_DTYPES[dtype])
    probs = torch.rand(rows, generator=gen)
    grad = torch.randn(rows, cfg.hidden_size, generator=gen).to(TORCH_DTYPES[dtype])
    return per_expert, x, probs, grad


def _experts_call(module: torch.nn.Module, x: torch.Tensor, per_expert, probs, grad) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Forward + backward of one call: [output, input grad, probs grad, every weight's grad]."""
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x, per_expert, probs)[0]
    out.backward(grad)
    return [out.detach(), x.grad, probs.grad, *(p.grad for p in module.parameters())]


def policy_bench(name: str, dtypes: list[str], rows_list: list[int], repeats: int) -> None:
    import statistics

    cfg = policy_model(name)
    print(
        f"\npolicy experts, {name}: {cfg.num_experts} experts top-{cfg.moe_top_k}, hidden {cfg.hidden_size}, expert "
        f"width {cfg.moe_ffn_hidden_size}; forward + backward of one layer, ms per call (best of {repeats} interleaved "
        "rounds)"
    )
    print("| dtype | routed rows | megatron | sequential | grouped | sequential / grouped (median of rounds) |")
    print("|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        modules = _experts_modules(cfg, dtype)
        for rows in rows_list:
            per_expert, x, probs, grad = _routed(cfg, rows, dtype, gen)
            results = {k: _experts_call(m, x, per_expert, probs, grad) for k, m in modules.items()}
            for k, got in results.items():
                if not all(torch.equal(a, b) for a, b in zip(got, results["megatron"], strict=True)):
                    raise SystemExit(f"{name} {dtype} {rows} rows: the {k} path differs from megatron's")
            calls = {k: functools.partial(_experts_call, m, x, per_expert, probs, grad) for k, m in modules.items()}
            rounds = time_rounds(calls, repeats)
            best = {k: min(r[k] for r in rounds) for k in calls}
            ratio = statistics.median(r["sequential"] / r["grouped"] for r in rounds)
            print(
                f"| {dtype} | {rows} | {best['megatron'] * 1e3:.1f} | {best['sequential'] * 1e3:.1f} | "
                f"{best['grouped'] * 1e3:.1f} | {ratio:.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", help="model presets (and, with --policy, routing); default: tiny default")
    ap.add_argument("--tokens", nargs="+", type=int, help="tokens (--policy: routed rows) per call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--policy", action="store_true", help="the megatron policy's experts, forward + backward")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="--policy only")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    presets = args.preset or (["routing", "small"] if args.policy else ["tiny", "default"])
    tokens = args.tokens or ([1536, 12288] if args.policy else [32, 64, 256, 1024])
    from study.core.model_config import preset

    try:
        for name in presets:
            (policy_model if args.policy else preset)(name)
    except ValueError as e:
        raise SystemExit(f"--preset: {e}") from None
    if min(tokens) < 1 or args.repeats < 1:
        raise SystemExit("--tokens and --repeats take positive integers")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for name in presets:
        if args.policy:
            policy_bench(name, args.dtype, tokens, args.repeats)
        else:
            bench(name, tokens, args.repeats)


if __name__ == "__main__":
    main()
