"""What the RL step's rollout collection costs besides `generate` (a script that prints numbers, not a test).

    .venv/bin/python benchmarks/bench_collect.py [--batches 8x4x32 32x8x64] [--repeats 9]

`study.rl._collect` takes the step's prompts from the task stream, tokenizes them, has the engine generate, then
decodes and scores every completion and lays the samples out as padded teacher-forcing tensors (`study.batch.pad`).
This times those parts on the default study's task (chain_sum, the tiny preset's tokenizer from a scratch cold start)
for P x G x T batches, with completions drawn as the engine returns them: random token ids of T/2..T tokens, their
log-probs and per-token routes (2 layers, top-2). Best of `--repeats`, ms per step. One torch thread.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", default=["8x4x32", "32x8x64"], help="prompts x samples x new tokens")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    shapes = []
    for b in args.batches:
        parts = b.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise SystemExit(f"--batches: {b!r}; valid: P x G x T as three positive ints, e.g. 8x4x32")
        shapes.append(tuple(int(x) for x in parts))
    if args.repeats < 1:
        raise SystemExit(f"--repeats: {args.repeats}; valid: a positive int")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    from study import batch, parts
    from study.data import tasks
    from study.run.config import PRESET_RUNS, RunConfig

    cfg = RunConfig.from_dict({**PRESET_RUNS["tiny"], "coldstart": "scratch"})
    tok, _ = parts.initial_policy(cfg, results=None)  # the scratch cold start's tokenizer (nothing is written)
    stream, _ = cfg.task_data()
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.2f}; task {cfg.task}")
    print(f"{'batch':>10} {'take':>8} {'encode':>8} {'decode':>8} {'score':>8} {'pad':>8}  (ms per step)")
    rng = random.Random(0)

    def timed(best: dict[str, float], name: str, fn, *fn_args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = fn(*fn_args)
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        return out

    def encode(items):  # type: ignore[no-untyped-def]
        return [tok.encode_prompt(it.prompt) for it in items]

    def decode(responses):  # type: ignore[no-untyped-def]
        return [tok.decode_response(x)[0] for x in responses]

    def score(items, texts, g):  # type: ignore[no-untyped-def]
        return [tasks.score(items[i // g], x) for i, x in enumerate(texts)]

    for p, g, t in shapes:
        best: dict[str, float] = {}
        for r in range(args.repeats):
            items = timed(best, "take", stream.take, p, r * p)
            prompts = timed(best, "encode", encode, items)
            responses = [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(t // 2, t))] for _ in range(p * g)]
            texts = timed(best, "decode", decode, responses)
            timed(best, "score", score, items, texts, g)
            samples = [
                {
                    "prompt": prompts[i // g],
                    "response": x,
                    "logp": torch.randn(len(x)),
                    "adv": 0.0,
                    "routes": torch.randint(0, 4, (len(prompts[i // g]) + len(x) - 1, 2, 2), dtype=torch.uint8),
                }
                for i, x in enumerate(responses)
            ]
            timed(best, "pad", batch.pad, samples, t)
        row = " ".join(f"{1e3 * best[k]:8.2f}" for k in ("take", "encode", "decode", "score", "pad"))
        print(f"{p}x{g}x{t:<5} {row}")


if __name__ == "__main__":
    main()
