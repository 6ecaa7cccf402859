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

    .venv/bin/python benchmarks/bench_experts.py --policy [--tokens 800 3000 10368]

`--policy` times the training side instead: layer 0's experts of the megatron policy (megatron's SequentialMLP: a
loop of per-expert MLPs over the permuted rows), forward + backward, against torch's grouped GEMM over the same
weights (stacked per call, so the gradients reach each expert's own parameters) and against `ExpertsFunction`
(study/policy/experts.py, what the policy runs), the same per-expert GEMMs in one autograd
Function with a hand-written backward (no module calls, no per-op autograd nodes: the least Python the loop can
have), on `--tokens` routed rows split over the experts. Rows: routed rows per layer (an 8-sequence minibatch of ~50
positions at top-2: ~800). The GFLOP/s column is SequentialMLP's rate: 3 x the forward's 2 x rows x 3 x hidden x
expert width.
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


def time_calls(fns: dict[str, Callable[[], torch.Tensor]], repeats: int, block_s: float = 0.02) -> dict[str, float]:
    """Seconds per call of each function: the best of `repeats` rounds, each round timing every function in turn
    (interleaved, so a slow phase of the machine hits all of them) over enough calls to fill ~`block_s`."""
    calls = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up and calibration
            fn()
        calls[name] = max(1, min(200, round(block_s / ((time.perf_counter() - t0) / 3))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls[name])
    return best


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


def policy_bench(preset_name: str, rows_list: list[int], repeats: int) -> None:
    from study.core.model_config import preset
    from study.policy.experts import ExpertsFunction
    from study.policy.model import build_policy

    cfg = preset(preset_name)
    experts = build_policy(cfg, seed=0, layers="megatron").decoder.layers[0].mlp.experts
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm

    def grouped(x: torch.Tensor, per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        local = experts.local_experts
        fc1 = torch.stack([e.linear_fc1.weight for e in local]).transpose(1, 2)  # (E, H, 2F)
        fc2 = torch.stack([e.linear_fc2.weight for e in local]).transpose(1, 2)  # (E, F, H)
        offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
        gate, up = grouped_mm(x, fc1, offs=offs).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up * probs[:, None], fc2, offs=offs)

    def sequential(x: torch.Tensor, per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return experts(x, per_expert, probs)[0]

    local = experts.local_experts
    weights = [e.linear_fc1.weight for e in local] + [e.linear_fc2.weight for e in local]

    def function(x: torch.Tensor, per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return ExpertsFunction.apply(x, probs, per_expert.tolist(), *weights)

    print(
        f"\npolicy experts, preset {preset_name}: megatron {type(experts).__name__} vs grouped_mm and one Function, "
        f"forward + backward, ms per call (best of {repeats}); {cfg.num_experts} experts, hidden {cfg.hidden_size}, "
        f"expert width {cfg.moe_ffn_hidden_size}"
    )
    print(
        "| routed rows | SequentialMLP | GFLOP/s | grouped_mm | one Function | max difference: grouped_mm forward; "
        "Function forward, input grad, weight grads, probs grad |\n|---:|---:|---:|---:|---:|---|"
    )
    gen = torch.Generator().manual_seed(0)
    for rows in rows_list:
        x = torch.randn(rows, cfg.hidden_size, generator=gen, requires_grad=True)
        per_expert = torch.full((cfg.num_experts,), rows // cfg.num_experts)
        per_expert[0] += rows - int(per_expert.sum())
        probs = torch.rand(rows, generator=gen, requires_grad=True)  # the router's gates: trained through
        grad = torch.randn(rows, cfg.hidden_size, generator=gen)
        diff = (sequential(x, per_expert, probs) - grouped(x, per_expert, probs)).abs().max().item()
        grads = {}
        for name, f in (("sequential", sequential), ("function", function)):
            for t in (x, probs, *weights):
                t.grad = None
            y = f(x, per_expert, probs)
            y.backward(grad)
            grads[name] = [y.detach(), x.grad, torch.cat([w.grad.flatten() for w in weights]), probs.grad]
        fn_diff = ", ".join(f"{(a - b).abs().max().item():.0e}" for a, b in zip(*grads.values(), strict=True))
        calls = {
            k: functools.partial(_forward_backward, f, (x, per_expert, probs), grad)
            for k, f in (("sequential", sequential), ("grouped", grouped), ("function", function))
        }
        secs = time_calls(calls, repeats)
        gflop = 3 * 2 * rows * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size / 1e9
        print(
            f"| {rows} | {secs['sequential'] * 1e3:.3f} | {gflop / secs['sequential']:.1f} | "
            f"{secs['grouped'] * 1e3:.3f} | {secs['function'] * 1e3:.3f} | {diff:.0e}; {fn_diff} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["tiny", "default"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[32, 64, 256, 1024], help="tokens per call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--policy", action="store_true", help="the megatron policy's experts, forward + backward")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from study.core.model_config import preset

    try:
        for name in args.preset:
            preset(name)
    except ValueError as e:
        raise SystemExit(f"--preset: {e}") from None
    if min(args.tokens) < 1 or args.repeats < 1:
        raise SystemExit("--tokens and --repeats take positive integers")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for name in args.preset:
        if args.policy:
            policy_bench(name, args.tokens, args.repeats)
        else:
            bench(name, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
