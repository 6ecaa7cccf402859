"""Rollout throughput of each engine and dtype: response tokens per second for a few batch sizes.

Not a test. Every sample runs to max_new_tokens (no stop tokens), so tokens = prompts x n x max_new_tokens; the
timing covers `generate` only (engine built and warmed up first). For vLLM it also times one in-place weight
update (the bucketed sync into the engine's process; benchmarks/bench_sync.py compares it with an
in-process full-copy sync).

    .venv/bin/python benchmarks/bench_engines.py                       # tiny preset, all engines, fp32 and bf16
    .venv/bin/python benchmarks/bench_engines.py --preset default --engines hf --dtypes fp32
    .venv/bin/python benchmarks/bench_engines.py --engines hf --dtypes fp32 --batches 32x8 --max-new-tokens 64 \
        --ragged --hf-attention sdpa,study_decode,sdpa,study_decode     # the engine's decode attention vs sdpa
    .venv/bin/python benchmarks/bench_engines.py --engines hf --dtypes fp32 --batches 8x4,32x8 --ragged \
        --hf-decode native,fused,layers,native,fused,layers             # C decode, the fused step, the layers
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from study.core.model_config import preset
from study.rollout import get_engine
from study.rollout.hf import build_hf_model, unfuse_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batches", default="8x4,32x4,64x8", help="prompts x n, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument(
        "--ragged",
        action="store_true",
        help="prompt lengths drawn from [prompt-len / 2, prompt-len] (left padding, as in an RL batch) "
        "instead of all prompt-len",
    )
    ap.add_argument(
        "--hf-attention",
        default="study_decode",
        help="hf: transformers attention implementations to time in turn, comma-separated (the engine's "
        "own `study_decode`, or `sdpa`); the same weights and prompts for each",
    )
    ap.add_argument(
        "--hf-decode",
        default="native",
        help="hf: decode steps to time in turn, comma-separated: `native` (the sampling loop and decode "
        "steps in C, study/kernels/decode.py: the engine's default), `fused` (the fused torch step) or "
        "`layers` (transformers' decoder layers called directly: a no-op hook on the final norm "
        "disables both)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per point (the best is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM on CPU uses 1 anyway); 0: default")
    ap.add_argument(
        "--wrapped",
        action="store_true",
        help="hf: decode through the full transformers call (a no-op hook on the model disables the "
        "direct decoder-layer path), i.e. the engine before that speed-up",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = preset(args.preset)
    state = unfuse_experts(build_hf_model(cfg).state_dict(), cfg)  # random init, same for every engine
    g = torch.Generator().manual_seed(0)
    batches = [tuple(int(x) for x in b.split("x")) for b in args.batches.split(",")]
    print(
        f"preset={args.preset} threads={torch.get_num_threads()} cpus={os.cpu_count()} "
        f"cuda={torch.cuda.is_available()} prompt_len={args.prompt_len} "
        f"max_new_tokens={args.max_new_tokens} load={os.getloadavg()[0]:.2f}"
        f"{' ragged' if args.ragged else ''}{' hf=wrapped' if args.wrapped else ''}"
    )
    print(f"{'engine':<6} {'dtype':<5} {'prompts x n':>11} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    prompt_sets = {}
    for prompts_n, _n in batches:
        lens = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (prompts_n,), generator=g).tolist()
        prompt_sets[prompts_n] = [
            torch.randint(0, cfg.vocab_size, (k if args.ragged else args.prompt_len,), generator=g).tolist()
            for k in lens
        ]
    decodes = args.hf_decode.split(",")
    if set(decodes) - {"native", "fused", "layers"}:
        ap.error(f"--hf-decode: {args.hf_decode!r}; valid: native, fused, layers")
    runs = [
        (name, dtype, attn, decode)
        for name in args.engines.split(",")
        for dtype in args.dtypes.split(",")
        for attn in (args.hf_attention.split(",") if name == "hf" else [None])
        for decode in (decodes if name == "hf" else [None])
    ]
    for name, dtype, attn, decode in runs:
        t0 = time.perf_counter()
        kwargs = {"max_num_seqs": 512} if name == "vllm" else {"native_decode": decode == "native"}
        engine = get_engine(name, cfg, dtype=dtype, **kwargs)
        engine.load_weights(state)
        if name == "hf":
            if args.wrapped:
                engine.model.register_forward_pre_hook(lambda _m, _a: None)
            engine.model.config._attn_implementation = attn
            if decode == "layers":
                engine.model.model.norm.register_forward_hook(lambda _m, _a, _o: None)
        build = time.perf_counter() - t0
        try:
            engine.generate([[1, 2, 3]], 2, seed=0, max_new_tokens=4)  # warm-up
            for prompts_n, n in batches:
                prompts = prompt_sets[prompts_n]
                best = float("inf")
                for rep in range(args.repeats):
                    t = time.perf_counter()
                    r = engine.generate(prompts, n, seed=rep, max_new_tokens=args.max_new_tokens)
                    best = min(best, time.perf_counter() - t)
                print(
                    f"{name:<6} {dtype:<5} {f'{prompts_n}x{n}':>11} {r.num_tokens:>7} {best:>8.3f} "
                    f"{r.num_tokens / best:>9.0f}{f'  {attn} {decode}' if attn else ''}",
                    flush=True,
                )
            extra = ""
            if name == "vllm":
                t = time.perf_counter()
                engine.load_weights(state)
                extra = f", in-place weight update {time.perf_counter() - t:.3f} s"
            print(f"{name:<6} {dtype:<5} build {build:.1f} s{extra}", flush=True)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
