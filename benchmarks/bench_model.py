"""Forward+backward+AdamW-step time of the Megatron MoE policy on CPU (a script, not a test).

    .venv/bin/python benchmarks/bench_model.py [--threads 1] [--tokens 512] [--iters 10]

Prints one row per (preset, dtype[, routing replay]): ms per step and trained tokens/s. Low precision runs for
`tiny` only (add rows to ROWS for more): bf16 speed depends on the CPU's ISA (AVX-512 BF16 / AMX make it faster than
fp32, without them it is several times slower), and fp16 has no fast CPU GEMM at all (tens of times slower).
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import torch

from study.core.model_config import preset
from study.policy.model import build_policy, count_parameters, token_logp
from study.policy.optim import build_optimizer
from study.policy.routing import RoutingController

ROWS: tuple[tuple[str, str, bool], ...] = (
    ("tiny", "fp32", False),
    ("tiny", "fp32", True),
    ("tiny", "bf16", False),
    ("tiny", "fp16", False),
    ("small", "fp32", False),
)


def bench(name: str, dtype: str, replay: bool, *, tokens: int, iters: int, warmup: int) -> dict[str, float]:
    """Mean ms of one forward+backward+step over a (B, S) batch of about `tokens` tokens."""
    cfg = preset(name)
    seq = min(256, cfg.max_seq_len)
    batch = max(1, tokens // seq)
    model = build_policy(cfg, seed=0, dtype=dtype)
    opt = build_optimizer(model, lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))  # (B, S+1)
    ctl = RoutingController(model)
    if replay:
        with torch.no_grad(), ctl.recording():
            token_logp(model, ids[:, :-1], ids[:, 1:])
        ctl.replay(ctl.routes())
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = -token_logp(model, ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    ctl.free()
    ms = 1e3 * sum(times) / len(times)
    return {
        "ms": ms,
        "tokens_per_s": batch * seq / (ms / 1e3),
        "batch": batch,
        "seq": seq,
        "params_m": count_parameters(model) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step (B x S, S = 256)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={args.threads}")
    print(f"{'preset':<7} {'dtype':<5} {'replay':<6} {'params':>8} {'B x S':>8} {'ms/step':>9} {'tokens/s':>9}")
    bench("tiny", "fp32", False, tokens=args.tokens, iters=2, warmup=2)  # process warm-up (imports, jit), discarded
    for name, dtype, replay in ROWS:
        iters = args.iters if (name, dtype) in (("tiny", "fp32"), ("tiny", "bf16")) else max(2, args.iters // 3)
        r = bench(name, dtype, replay, tokens=args.tokens, iters=iters, warmup=args.warmup)
        shape = f"{r['batch']}x{r['seq']}"
        print(
            f"{name:<7} {dtype:<5} {('yes' if replay else 'no'):<6} {r['params_m']:>7.2f}M {shape:>8} "
            f"{r['ms']:>9.1f} {r['tokens_per_s']:>9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
