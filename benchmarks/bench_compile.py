"""What `torch.compile` (inductor, CPU) gives the two halves of an RL step (a script that prints numbers, not a test).

    .venv/bin/python benchmarks/bench_compile.py                          # both parts, tiny, 8x4x32 and 8 x 47-52
    .venv/bin/python benchmarks/bench_compile.py --part rollout --batch 32x8x64
    .venv/bin/python benchmarks/bench_compile.py --part update --compile decoder,layers

Neither is used by the harness; this measures whether it would pay, with the compile time it costs every process.

- rollout: the hf engine's `generate` with its fused decode step (study/engines/hf.py `_FusedDecoder.step`) eager,
  then compiled with `dynamic=True` (one graph for every cache length), alternating eager and compiled rounds in one
  process, best of `--repeats` `generate` calls per round. torch's fp32 `grouped_mm` has no fake-tensor kernel on CPU
  (its meta function asks for bf16), so in both modes it is wrapped in an opaque custom op: the compiled graph calls
  the same eager kernel, and the eager mode pays the wrapper's dispatch too. Routes are not returned (the step's
  list appends would guard the graph on their lengths).
- update: one 8-sequence minibatch update of the megatron policy (token_logp on the last 32 positions, loss,
  backward, grad clip, fused AdamW), median of `--repeats` after one call, at three sequence lengths (an RL run pads
  to a new length every step), eager and then with `torch.compile(dynamic=True)` on the whole decoder block
  (`decoder`) or on each layer's self-attention and experts modules (`layers`), each in a fresh process.

One torch thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch


def _opaque(grouped_mm):  # type: ignore[no-untyped-def]
    """The engine's grouped GEMM as a custom op with a fake kernel, so that dynamo can trace around it in fp32."""

    @torch.library.custom_op("study_bench::grouped_mm", mutates_args=())
    def op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_mm(a, b, offs=offs)

    @op.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0], b.shape[-1])

    return lambda a, b, offs: op(a, b, offs)


def rollout(preset_name: str, batch: str, repeats: int, rounds: int) -> None:
    from study.config import preset
    from study.engines import get_engine
    from study.engines.hf import _FusedDecoder, build_hf_model, unfuse_experts

    p, g, t = (int(x) for x in batch.split("x"))
    cfg = preset(preset_name)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 17, (p,), generator=gen).tolist()  # ragged, as an RL batch's prompts
    prompts = [torch.randint(0, cfg.vocab_size, (k,), generator=gen).tolist() for k in lens]
    engine = get_engine("hf", cfg, dtype="fp32")
    engine.load_weights(unfuse_experts(build_hf_model(cfg).state_dict(), cfg))
    kernel = _FusedDecoder._grouped_mm(engine.model.model.layers[0].mlp.experts)  # what the fused step would call
    if kernel is None:
        raise SystemExit("the engine's experts do not run torch's grouped_mm here; nothing to wrap")
    opaque = _opaque(kernel)
    _FusedDecoder._grouped_mm = staticmethod(lambda _experts: opaque)
    eager = _FusedDecoder.step
    compiled = torch.compile(eager, dynamic=True)

    def best() -> float:
        secs = []
        for r in range(repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, g, seed=r, max_new_tokens=t)
            secs.append(time.perf_counter() - t0)
        return min(secs)

    print(f"\nrollout: {preset_name}, {batch} (prompts x samples x new tokens), generate s, best of {repeats}")
    best()  # warm-up, eager
    _FusedDecoder.step = compiled
    t0 = time.perf_counter()
    engine.generate(prompts, g, seed=0, max_new_tokens=t)
    print(f"first compiled generate (compilation included): {time.perf_counter() - t0:.1f} s")
    for k in range(rounds):
        _FusedDecoder.step = eager
        e = best()
        _FusedDecoder.step = compiled
        c = best()
        print(f"round {k + 1}: eager {e:.4f}  compiled {c:.4f}  compiled / eager {c / e:.2f}")


def update(preset_name: str, mode: str, repeats: int) -> None:
    from study.config import preset
    from study.model import build_optimizer, build_policy, token_logp

    cfg = preset(preset_name)
    model = build_policy(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-4)  # the run's AdamW (fused)
    params = [q for q in model.parameters() if q.requires_grad]
    b, t = 8, 32

    def step(s: int) -> float:
        gen = torch.Generator().manual_seed(s)
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[: b // 2, : s // 10] = 0  # some padding, as a ragged batch has
        pos = torch.arange(s - t, s)[None].expand(b, -1).contiguous()
        t0 = time.perf_counter()
        loss = -token_logp(model, ids, targets, attention_mask=mask, positions=pos).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    if mode == "decoder":
        model.decoder = torch.compile(model.decoder, dynamic=True)
    elif mode == "layers":
        for layer in model.decoder.layers:
            layer.self_attention = torch.compile(layer.self_attention, dynamic=True)
            layer.mlp.experts = torch.compile(layer.mlp.experts, dynamic=True)
    for s in (50, 47, 52):
        first = step(s)
        secs = statistics.median(step(s) for _ in range(repeats))
        print(f"update {preset_name} 8 x {s}, {mode:<7}: first call {first:7.2f} s, then median {secs * 1e3:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--part", choices=("rollout", "update", "both"), default="both")
    ap.add_argument("--batch", default="8x4x32", help="rollout: prompts x samples x new tokens")
    ap.add_argument("--compile", default="decoder,layers", help="update: what to compile, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="rollout: alternating eager / compiled rounds")
    ap.add_argument("--_update-mode", dest="update_mode", help=argparse.SUPPRESS)  # one fresh process per mode
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from study.config import preset

    try:
        preset(args.preset)
    except ValueError as e:
        raise SystemExit(f"--preset: {e}") from None
    modes = args.compile.split(",")
    if set(modes) - {"decoder", "layers"}:
        raise SystemExit(f"--compile: {args.compile!r}; valid: decoder, layers")
    if args.update_mode:
        update(args.preset, args.update_mode, args.repeats)
        return
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    if args.part in ("rollout", "both"):
        rollout(args.preset, args.batch, args.repeats, args.rounds)
    if args.part in ("update", "both"):
        print(f"\nupdate: {args.preset}, one minibatch of 8 sequences, forward + backward + clip + AdamW")
        for mode in ["eager", *modes]:
            cmd = [sys.executable, __file__, "--preset", args.preset, "--repeats", str(args.repeats),
                   "--_update-mode", mode]  # fmt: skip
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
