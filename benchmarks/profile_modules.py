"""Where the wall time of a rollout and of an update goes, per module (a script, not a test).

    .venv/bin/python benchmarks/profile_modules.py [--preset tiny] [--rollout 32x8x64] [--update 64x81x64]

torch.profiler's per-op shares overstate small elementwise ops by up to 10x on this VM (docs/performance.md,
section 6, fourth round), so this measures with wall-clock hooks instead:
- rollout: the hf engine's `generate` of P x G samples of T new tokens (ragged prompts of 8-16 tokens, every sample
  runs to T), with forward pre/post hooks on the transformers modules of each decoder layer and timers around the
  engine's decode attention, the RoPE, the KV-cache append and the sampler; the fastest of `--repeats` calls. The
  hooks make the engine decode through those modules, not its fused step (study/rollout/hf.py `_FusedDecoder`,
  which calls none of them): this breaks down the module path; `bench_engines.py --hf-decode` times the two;
- update: one minibatch update as study/rl.py does it (`token_logp` over B x S positions, log-probs on the last T,
  backward, grad-norm clip, AdamW), forward time per megatron module (hooks; backward hooks do not work on megatron's
  custom autograd Functions), totals for forward, backward and optimizer; medians of `--repeats` after 2 warm-ups.
Module times are summed over the layers (`#` stands for the layer index) and over a call's nested children, so a
parent's row includes its children's. One torch thread.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch


def _hook_modules(named: dict[str, torch.nn.Module], acc: dict[str, float]) -> None:
    """Forward pre/post hooks adding each module's wall time to acc[name] (names may repeat: summed)."""
    started: dict[torch.nn.Module, float] = {}
    for name, mod in named.items():

        def pre(m, _a):  # type: ignore[no-untyped-def]
            started[m] = time.perf_counter()

        def post(m, _a, _o, name=name):  # type: ignore[no-untyped-def]
            acc[name] += time.perf_counter() - started[m]

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)


def _timed(fn: Callable, acc: dict[str, float], name: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t

    return wrapper


def rollout(preset_name: str, p: int, g: int, t: int, repeats: int) -> tuple[float, dict[str, float]]:
    from transformers import AttentionInterface
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    import study.rollout.hf as hf
    from study.core.model_config import preset

    cfg = preset(preset_name)
    engine = hf.HFEngine(cfg, dtype="fp32")
    engine.load_weights(hf.unfuse_experts(hf.build_hf_model(cfg).state_dict(), cfg))
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 17, (p,), generator=gen).tolist()
    prompts = [torch.randint(3, cfg.vocab_size, (k,), generator=gen).tolist() for k in lens]
    acc: dict[str, float] = collections.defaultdict(float)
    body = engine.model.model
    _hook_modules(
        {
            "embed": body.embed_tokens,
            "rotary": body.rotary_emb,
            "final norm": body.norm,
            "lm_head": engine.model.lm_head,
        },
        acc,
    )
    for layer in body.layers:  # every layer's modules under the same names: summed over the layers
        attn, mlp = layer.self_attn, layer.mlp
        _hook_modules(
            {
                "L#": layer,
                "L#.self_attn": attn,
                "L#.mlp": mlp,
                "L#.mlp.gate": mlp.gate,
                "L#.mlp.experts": mlp.experts,
                "L#.input_layernorm": layer.input_layernorm,
                "L#.post_attention_layernorm": layer.post_attention_layernorm,
                **{
                    f"L#.self_attn.{q}": getattr(attn, q)
                    for q in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
                },
            },
            acc,
        )
    AttentionInterface.register(hf.DECODE_ATTENTION, _timed(hf.decode_attention, acc, "decode attention (function)"))
    modeling_qwen3_moe.apply_rotary_pos_emb = _timed(modeling_qwen3_moe.apply_rotary_pos_emb, acc, "apply RoPE")
    layer_cls = hf._growing_layer()
    layer_cls.update = _timed(layer_cls.update, acc, "KV-cache append")
    hf.sample = _timed(hf.sample, acc, "sample")
    engine._decode = _timed(engine._decode, acc, "decode steps (all)")

    engine.generate(prompts, g, seed=0, max_new_tokens=t)  # warm-up
    best: tuple[float, dict[str, float]] | None = None
    for rep in range(repeats):
        acc.clear()
        t0 = time.perf_counter()
        engine.generate(prompts, g, seed=rep + 1, max_new_tokens=t)
        total = time.perf_counter() - t0
        if best is None or total < best[0]:
            best = (total, dict(acc))
    assert best is not None
    return best


def update(preset_name: str, b: int, s: int, t: int, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    from steptimer import minibatch_update  # benchmarks/ is on sys.path: this runs as a script

    from study.core.model_config import preset
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    cfg = preset(preset_name)
    model = build_policy(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (b, s + 1), generator=gen)
    positions = torch.arange(s - t, s).expand(b, t).contiguous()
    acc: dict[str, float] = collections.defaultdict(float)
    for name, mod in model.named_modules():  # down to layers.N.mlp.experts; layer indices as '#': summed
        parts = name.split(".")
        if name and len(parts) <= 5:
            _hook_modules({".".join("#" if x.isdigit() else x for x in parts): mod}, acc)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "clip + AdamW": []}
    per_module: list[dict[str, float]] = []
    for i in range(2 + repeats):
        acc.clear()
        took = minibatch_update(model, opt, ids, positions=positions)
        if i >= 2:
            for k, v in zip(phases, (took["forward"], took["backward"], took["clip"] + took["adam"]), strict=True):
                phases[k].append(v)
            per_module.append(dict(acc))
    totals = {k: statistics.median(v) for k, v in phases.items()}
    modules = {k: statistics.median(m.get(k, 0.0) for m in per_module) for k in per_module[0]}
    return totals, modules


def _table(rows: dict[str, float], total: float, top: int) -> None:
    for name, sec in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {name:<44} {sec * 1e3:9.2f} ms  {100 * sec / total:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rollout", default="32x8x64", help="prompts x samples x new tokens ('' to skip)")
    ap.add_argument("--update", default="64x81x64", help="sequences x positions x response positions ('' to skip)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=24, help="rows per table")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from study.core.model_config import preset

    try:
        preset(args.preset)
        shapes = [tuple(int(x) for x in v.split("x")) if v else None for v in (args.rollout, args.update)]
    except ValueError as e:
        raise SystemExit(f"bad argument: {e}") from None
    if any(sh is not None and (len(sh) != 3 or min(sh) < 1) for sh in shapes):
        raise SystemExit("--rollout and --update take three positive integers AxBxC")
    if shapes[1] and shapes[1][2] > shapes[1][1]:
        raise SystemExit(f"--update: {shapes[1][2]} response positions > {shapes[1][1]} positions")
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
        f"preset={args.preset}"
    )
    if shapes[0]:
        p, g, t = shapes[0]
        total, rows = rollout(args.preset, p, g, t, args.repeats)
        print(f"rollout {p}x{g}x{t}: generate {total * 1e3:.1f} ms (fastest of {args.repeats})")
        _table(rows, total, args.top)
    if shapes[1]:
        b, s, t = shapes[1]
        totals, modules = update(args.preset, b, s, t, args.repeats)
        whole = sum(totals.values())
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in totals.items())
        print(f"update {b}x{s} (log-probs on the last {t}): {parts} (medians of {args.repeats})")
        print("  forward, per module:")
        _table(modules, whole, args.top)


if __name__ == "__main__":
    main()
