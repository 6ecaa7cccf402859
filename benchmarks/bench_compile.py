"""What `torch.compile` (inductor, CPU) gives the two halves of an RL step (a script that prints numbers, not a test).

    .venv/bin/python benchmarks/bench_compile.py                          # both parts, tiny, 8x4x32 and 8 x 47-52
    .venv/bin/python benchmarks/bench_compile.py --part rollout --batch 32x8x64
    .venv/bin/python benchmarks/bench_compile.py --part update --compile decoder,layers
    .venv/bin/python benchmarks/bench_compile.py --part update --update-batch 64x81x64 --repeats 5 --rounds 4

Neither is used by the harness; this measures whether it would pay, with the compile time it costs every process.

- rollout: the hf engine's `generate` with its fused decode step (study/rollout/hf.py `_FusedDecoder.step`) eager,
  then compiled with `dynamic=True` (one graph for every cache length), alternating eager and compiled rounds in one
  process, best of `--repeats` `generate` calls per round. torch's fp32 `grouped_mm` has no fake-tensor kernel on CPU
  (its meta function asks for bf16), so in both modes it is wrapped in an opaque custom op: the compiled graph calls
  the same eager kernel, and the eager mode pays the wrapper's dispatch too. Routes are not returned (the step's
  list appends would guard the graph on their lengths).
- update: one minibatch update of the megatron policy (`--update-batch` rows x positions x log-prob positions; the
  default 8x50x32 is an 8x4x32 step's minibatch, 64x81x64 a 32x8x64 step's): token_logp on the last positions,
  loss, backward, grad clip, fused AdamW. Lengths cycle through positions -3, +0, +2 (an RL run pads to a new length
  every step). `torch.compile(dynamic=True)` goes on the whole decoder block (`decoder`) or on each layer's
  self-attention and experts modules (`layers`), each mode in a fresh process (its first calls give the compile
  time), which then alternates eager and compiled rounds on the same weights (`--rounds`, median of `--repeats`
  updates each), so that the machine's drift falls on both alike.

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
    from study.core.model_config import preset
    from study.rollout import get_engine
    from study.rollout.hf import _FusedDecoder, build_hf_model, unfuse_experts

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


def update(preset_name: str, mode: str, shape: str, repeats: int, rounds: int) -> None:
    from study.core.model_config import preset
    from study.policy.model import build_policy, token_logp
    from study.policy.optim import build_optimizer

    b, s0, t = (int(x) for x in shape.split("x"))
    cfg = preset(preset_name)
    model = build_policy(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-4)  # the run's AdamW (fused)
    params = [q for q in model.parameters() if q.requires_grad]
    lengths = (s0 - 3, s0, s0 + 2)

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

    eager = {"decoder": model.decoder, "layers": [(m.self_attention, m.mlp.experts) for m in model.decoder.layers]}
    if mode == "decoder":
        compiled = torch.compile(model.decoder, dynamic=True)

        def use(on: bool) -> None:
            model.decoder = compiled if on else eager["decoder"]
    else:
        compiled = [(torch.compile(a, dynamic=True), torch.compile(e, dynamic=True)) for a, e in eager["layers"]]

        def use(on: bool) -> None:
            for layer, plain, comp in zip(model.decoder.layers, eager["layers"], compiled, strict=True):
                layer.self_attention, layer.mlp.experts = comp if on else plain

    use(True)
    t0 = time.perf_counter()
    for s in lengths:
        step(s)
    print(f"{mode}: first call at each of {len(lengths)} lengths (compilation): {time.perf_counter() - t0:.1f} s")
    use(False)
    for s in lengths:
        step(s)  # eager warm-up
    for r in range(rounds):
        med = {}
        for on in (False, True):
            use(on)
            med[on] = statistics.median(step(lengths[k % len(lengths)]) for k in range(repeats))
        e, c = med[False] * 1e3, med[True] * 1e3
        print(
            f"update {preset_name} {b} x {s0 - 3}..{s0 + 2}, {mode:<7} round {r + 1}: eager {e:6.1f} ms  compiled"
            f" {c:6.1f} ms  compiled / eager {c / e:.2f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--part", choices=("rollout", "update", "both"), default="both")
    ap.add_argument("--batch", default="8x4x32", help="rollout: prompts x samples x new tokens")
    ap.add_argument("--compile", default="decoder,layers", help="update: what to compile, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--update-batch", default="8x50x32", help="update: rows x positions x log-prob positions")
    ap.add_argument("--rounds", type=int, default=3, help="alternating eager / compiled rounds")
    ap.add_argument("--_update-mode", dest="update_mode", help=argparse.SUPPRESS)  # one fresh process per mode
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from study.core.model_config import preset

    try:
        preset(args.preset)
    except ValueError as e:
        raise SystemExit(f"--preset: {e}") from None
    modes = args.compile.split(",")
    if set(modes) - {"decoder", "layers"}:
        raise SystemExit(f"--compile: {args.compile!r}; valid: decoder, layers")
    for flag, value, fields in (
        ("--batch", args.batch, "prompts x samples x new tokens, e.g. 8x4x32"),
        ("--update-batch", args.update_batch, "rows x positions x log-prob positions, e.g. 8x50x32"),
    ):
        parts = value.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise SystemExit(f"{flag}: {value!r}; valid: three positive ints, {fields}")
    b, s0, t = (int(x) for x in args.update_batch.split("x"))
    if t > s0 - 3:
        raise SystemExit(f"--update-batch: {args.update_batch!r}; the log-prob positions must be <= positions - 3")
    if args.update_mode:
        update(args.preset, args.update_mode, args.update_batch, args.repeats, args.rounds)
        return
    print(f"torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    if args.part in ("rollout", "both"):
        rollout(args.preset, args.batch, args.repeats, args.rounds)
    if args.part in ("update", "both"):
        print(
            f"\nupdate: {args.preset}, one minibatch of {b} sequences, forward + backward + clip + AdamW, median "
            f"of {args.repeats} per round"
        )
        for mode in modes:
            cmd = [
                sys.executable,
                __file__,
                "--preset",
                args.preset,
                "--repeats",
                str(args.repeats),
                "--rounds",
                str(args.rounds),
                "--update-batch",
                args.update_batch,
                "--_update-mode",
                mode,
            ]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
