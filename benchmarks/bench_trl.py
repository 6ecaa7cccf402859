"""One RL step of this harness vs TRL's GRPOTrainer, side by side (a script, not a test).

    make bench-trl                                   # creates .venv-bench (TRL lives only there), runs this
    .venv-bench/bin/python benchmarks/bench_trl.py [--batches 8x4x32,32x8x64] [--algorithms grpo,gspo] [--reps 5]
    .venv-bench/bin/python benchmarks/bench_trl.py --concurrent --rounds 2   # both sides at once, one CPU each

Both sides, per (prompts x samples x new tokens) batch and algorithm, each in its own subprocess (megatron's
process group and accelerate's state stay apart), one torch thread, fp32:
- the same network: a preset's Qwen3-MoE (study.core.model_config; `--preset`, default `tiny`), built for TRL as
  transformers' Qwen3MoeForCausalLM from study.core.weights.hf_config, loaded with the very weights our Megatron policy
  starts from;
- the same prompts (the chain_sum task stream, seed 0), tokenizer (the task BPE, saved as a PreTrainedTokenizerFast)
  and reward: the chain_sum verifier (study.data.tasks.score) on the decoded response. A random-init model never solves
  a problem, so every reward is 0: no model quality is involved and both sides do the full work anyway;
- the same algorithm and update structure: one rollout batch of P x G completions (temperature 1, stop at <eos>),
  the pi_old log-prob recompute, then M = 4 minibatch AdamW updates (lr 1e-4, clip 1.0, no KL, beta = 0). GRPO is
  TRL's loss_type="grpo" with importance_sampling_level="token"; GSPO is importance_sampling_level="sequence" with
  loss_type="grpo"; the clip ranges are our registry's defaults. TRL: per_device_train_batch_size = P G / 4,
  steps_per_generation = 4 (so it recomputes pi_old), use_cpu, no bf16, no gradient checkpointing, optim
  adamw_torch (ours is torch.optim.AdamW too).

What is timed, per RL step (one rollout batch), after `--warmup` discarded steps:
- ours: study.rl.run (coldstart=scratch, no evaluation, no checkpoints) from the end of one step's bookkeeping to
  the next (rundir.set_status is wrapped to stamp the time): rollout (hf engine) + rewards + pi_old recompute +
  4 updates + weight sync to the engine + the metrics row and its parquet write;
- TRL: GRPOTrainer.train(), the time between every 4th `on_step_end` callback: generation
  (transformers' generate) + rewards + pi_old + 4 optimizer steps + TRL's own bookkeeping.
Reported: median wall s/step, median CPU s/step (process CPU time; robust to other jobs on the machine),
completion tokens/s (the step's generated tokens, <eos> included, / median wall), and TRL / ours. Then, per batch,
the step's work in FLOPs and each side's rate against the machine's fp32 GEMM peak (1 thread, measured at the
start): the rollout (prefill + decode steps), one pi_old forward and 4 minibatch updates (3 forwards' worth) over
the teacher-forcing batch, each by study.run.metrics.forward_flops (2 x active parameters + attention, per token) on
the prompts' token lengths and the completions both sides generated. Both sides do this work (ours reuses the first
minibatch's forward for a quarter of pi_old, so it does a little less); the line shows what share of the GEMM peak
each side runs at over the whole step, and what share 2x TRL's throughput would need.

By default the sides run one after the other (`--rounds N`: N alternations, each side's fastest round kept). On a
machine whose speed drifts by tens of percent within minutes (a shared VM host) that ratio moves with the drift.
`--concurrent` runs both sides at the same time, each pinned to its own CPUs (swapped every round), timed in
lock-step over the same window (steptimer.Lockstep), and reports the median of the rounds' paired ratios: drift
slows both sides alike. Both sides are slower than alone (they share the L3 cache and memory bandwidth).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from steptimer import LOCKSTEP_ENV  # benchmarks/ is on sys.path: this runs as a script

TASK = "chain_sum"
MINIBATCHES = 4


def _parse_batch(text: str) -> tuple[int, int, int]:
    p, g, t = (int(x) for x in text.split("x"))
    return p, g, t


def step_work(cfg, n: int, lp: float, completion_tokens: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """FLOPs of one RL step's rollout, pi_old and 4 updates over `n` sequences whose prompts are `lp` tokens long
    on average, with `completion_tokens` generated in all (module docstring)."""
    from study.run.metrics import forward_flops

    tc = completion_tokens / n
    prefill = forward_flops(cfg, round(n * lp), lp / 2)  # causal: a prompt token attends to half the prompt
    decode = forward_flops(cfg, round(n * tc), lp + tc / 2)
    forward = forward_flops(cfg, round(n * (lp + tc)), (lp + tc) / 2)  # teacher forcing over prompt + completion
    return {"rollout": prefill + decode, "pi_old": forward, "updates": 3 * forward}


def _task_inputs(vocab: int, prompts: int) -> tuple:
    """The tokenizer and the first `prompts` task items that both sides use (what study.rl takes with
    coldstart=scratch and seed 0)."""
    from study.data import tasks
    from study.data.tokenizer import build_tokenizer

    return build_tokenizer(vocab, [TASK], n_per_task=400), tasks.make_task(TASK, seed=0).take(prompts, start=0)


def _prompt_len(p: int, steps: int, vocab: int) -> float:
    """Mean token length of the prompts both sides take in `steps` RL steps of `p` prompts."""
    tok, items = _task_inputs(vocab, p * steps)
    return statistics.mean(len(tok.encode_prompt(it.prompt)) for it in items)


def _side_ours(preset: str, alg: str, batch: str, steps: int, threads: int, wrapped: bool = False) -> dict:
    import torch
    from steptimer import timed_run

    from study.rollout.hf import HFEngine
    from study.run.config import RunConfig

    if wrapped:  # the hf engine before its direct decode path: a no-op hook forces the full transformers call
        init = HFEngine.__init__

        def init_wrapped(self, *a, **k):  # type: ignore[no-untyped-def]
            init(self, *a, **k)
            self.model.register_forward_pre_hook(lambda _m, _a: None)

        HFEngine.__init__ = init_wrapped

    p, g, t = _parse_batch(batch)
    cfg = RunConfig.from_dict(
        {
            "algorithm": alg,
            "model": preset,
            "task": TASK,
            "coldstart": "scratch",
            "steps": steps,
            "prompts_per_step": p,
            "group_size": g,
            "minibatches": MINIBATCHES,
            "max_new_tokens": t,
            "eval_every": 0,
            "checkpoint_every": 0,
            "threads": threads,
            "seed": 0,
            "lr": 1e-4,
            "grad_clip": 1.0,
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, wall, cpu = timed_run(cfg, tmp)
        import pandas as pd

        m = pd.read_parquet(run_dir / "metrics.parquet")
    parts = {k: m[f"time_{k}_s"].tolist() for k in ("rollout", "old_logp", "update", "sync")}
    return {
        "wall": wall,
        "cpu": cpu,
        "tokens": m["tokens"].tolist(),
        "parts": parts,
        "threads": torch.get_num_threads(),
    }


def _side_trl(preset_name: str, alg: str, batch: str, steps: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from steptimer import Lockstep
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import algorithms
    from study.core.model_config import preset
    from study.core.weights import hf_config, megatron_to_hf
    from study.data import tasks
    from study.parts import derive_seed
    from study.policy.model import build_policy
    from study.rollout.hf import fuse_experts

    torch.set_num_threads(threads)
    p, g, t = _parse_batch(batch)
    mcfg = preset(preset_name)
    hp = algorithms.get(alg).check_hparams({})
    tmp = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    tok, items = _task_inputs(mcfg.vocab_size, p * steps)
    tok.save(tmp / "tok")
    hf_tok = AutoTokenizer.from_pretrained(tmp / "tok")

    kwargs = {k: v for k, v in hf_config(mcfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs))
    policy = build_policy(mcfg, seed=derive_seed("init", 0))  # the weights our side starts from
    model.load_state_dict(fuse_experts(megatron_to_hf(policy, mcfg), mcfg), strict=True)
    del policy
    model.train()

    data = Dataset.from_dict({"prompt": [it.prompt for it in items], "idx": list(range(len(items)))})
    completion_tokens: list[int] = []

    def reward(prompts, completions, completion_ids, idx, **_):  # type: ignore[no-untyped-def]
        completion_tokens.append(sum(len(c) for c in completion_ids))
        return [tasks.score(items[i], text) for i, text in zip(idx, completions, strict=True)]

    args = GRPOConfig(
        output_dir=str(tmp / "out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        beta=0.0,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        warmup_steps=0,
        per_device_train_batch_size=p * g // MINIBATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=MINIBATCHES,
        num_generations=g,
        max_completion_length=t,
        temperature=1.0,
        top_p=1.0,
        loss_type="grpo",
        epsilon=hp["eps_low"],
        epsilon_high=hp["eps_high"],
        importance_sampling_level="sequence" if alg == "gspo" else "token",
        num_iterations=1,
        max_steps=steps * MINIBATCHES,
        shuffle_dataset=False,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    stamps: list[tuple[float, float]] = []
    lockstep = Lockstep()

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **k):  # type: ignore[no-untyped-def]
            stamps.append((time.perf_counter(), time.process_time()))
            control.should_training_stop = lockstep.after_step(stamps)

        def on_step_end(self, args, state, control, **k):  # type: ignore[no-untyped-def]
            if state.global_step % MINIBATCHES == 0:
                stamps.append((time.perf_counter(), time.process_time()))
                control.should_training_stop = lockstep.after_step(stamps)

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=hf_tok, callbacks=[Stamp()]
    )
    gen_s: list[float] = []  # transformers' generate inside TRL's rollout: TRL's rollout phase
    generate = trainer.model.generate

    def timed_generate(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t0)

    trainer.model.generate = timed_generate
    torch.set_num_threads(threads)
    trainer.train()
    wall = [b[0] - a[0] for a, b in itertools.pairwise(stamps)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(stamps)]
    return {
        "wall": wall,
        "cpu": cpu,
        "tokens": completion_tokens,
        "threads": torch.get_num_threads(),
        "gen": gen_s,
        "params": sum(q.numel() for q in model.parameters()),
    }


def _start_side(
    preset: str,
    side: str,
    alg: str,
    batch: str,
    steps: int,
    threads: int,
    wrapped: bool,
    lockstep: str | None = None,
    cpus: set[int] | None = None,
) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        **({LOCKSTEP_ENV: lockstep} if lockstep else {}),
    }
    cmd = [
        sys.executable,
        __file__,
        "--preset",
        preset,
        "--side",
        side,
        "--algorithms",
        alg,
        "--batches",
        batch,
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        *(["--wrapped-decode"] if wrapped else []),
    ]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin)


def _result(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        sys.stderr.write(out[-4000:] + err[-8000:])
        raise SystemExit(f"{what} failed")
    return json.loads(out.strip().splitlines()[-1])


def _run_side(preset: str, side: str, alg: str, batch: str, steps: int, threads: int, wrapped: bool) -> dict:
    return _result(_start_side(preset, side, alg, batch, steps, threads, wrapped), f"{side} side ({alg}, {batch})")


def _run_concurrent(
    preset: str,
    sides: list[str],
    alg: str,
    batch: str,
    warmup: int,
    reps: int,
    threads: int,
    wrapped: bool,
    round_: int,
) -> dict[str, dict]:
    """Both sides at once, each pinned to its own `threads` CPUs (swapped every round), timed in lock-step."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < len(sides) * threads:
        raise SystemExit(
            f"--concurrent needs {len(sides) * threads} CPUs ({threads} per side), this process has {len(cpus)}"
        )
    order = sides if round_ % 2 == 0 else sides[::-1]
    with tempfile.TemporaryDirectory(prefix="bench_lockstep_") as where:
        procs = {
            side: _start_side(
                preset,
                side,
                alg,
                batch,
                warmup + 3 * reps,
                threads,
                wrapped,
                f"{where}:{side}:{warmup}:{reps}",
                set(cpus[order.index(side) * threads : (order.index(side) + 1) * threads]),
            )
            for side in sides
        }
        return {side: _result(p, f"{side} side ({alg}, {batch}, concurrent)") for side, p in procs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="the model preset both sides build (study.core.model_config)")
    ap.add_argument("--batches", default="8x4x32,32x8x64", help="prompts x samples x new tokens, comma-separated")
    ap.add_argument("--algorithms", default="grpo,gspo")
    ap.add_argument("--reps", type=int, default=5, help="timed RL steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="discarded first steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the sides alternately this many times and keep each side's fastest round (a shared or noisy "
        "machine slows whole runs down, not single steps)",
    )
    ap.add_argument("--sides", default="ours,trl")
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="run the two sides at the same time, each pinned to its own CPUs, timed over the same window "
        "(steptimer.Lockstep): a machine whose speed drifts slows both alike; needs 2 x threads CPUs",
    )
    ap.add_argument(
        "--wrapped-decode",
        action="store_true",
        help="ours: the hf engine decoding through the full transformers call (the slow path)",
    )
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: run one side, print JSON
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.side is not None:
        if args.side == "ours":
            out = _side_ours(args.preset, args.algorithms, args.batches, args.steps, args.threads, args.wrapped_decode)
        else:
            out = _side_trl(args.preset, args.algorithms, args.batches, args.steps, args.threads)
        print(json.dumps(out))
        return

    import torch
    import transformers

    from study.core.model_config import preset

    try:
        preset(args.preset)  # an unknown name fails here, before either side starts
    except ValueError as e:
        raise SystemExit(f"--preset: {e}") from None
    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}, "
        f"threads={args.threads}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
        f"preset={args.preset}, task={TASK}, M={MINIBATCHES}, reps={args.reps} (+{args.warmup} warm-up)"
        f"{', concurrent (lock-step, pinned)' if args.concurrent else ''}"
        f"{', ours: wrapped decode' if args.wrapped_decode else ''}"
    )
    sides = args.sides.split(",")
    if "trl" in sides and trl_version is None:
        raise SystemExit("TRL is not installed here: run `make bench-trl` (it uses .venv-bench)")
    from bench_peak import gemm_peak

    peak = gemm_peak(1, sizes=(1024,))[1024][0]  # GFLOP/s, wall, best of 5
    print(f"fp32 GEMM peak, 1 thread: {peak:.1f} GFLOP/s (torch.mm 1024 x 1024, best of 5)")
    cfg = preset(args.preset)
    print(
        f"{'batch PxGxT':<12} {'alg':<5} {'side':<5} {'s/step':>7} {'cpu s':>7} {'tokens':>7} {'tok/s':>7} "
        f"{'rollout':>7} {'old':>6} {'update':>7} {'sync':>6}  TRL/ours"
    )
    for batch in args.batches.split(","):
        p, g, _t = _parse_batch(batch)
        prompt_len = _prompt_len(p, args.warmup + args.reps, cfg.vocab_size)
        for alg in args.algorithms.split(","):
            res: dict[str, float] = {}
            work: dict[str, tuple[dict[str, float], float]] = {}
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for round_ in range(args.rounds):
                if args.concurrent:
                    both = _run_concurrent(
                        args.preset,
                        sides,
                        alg,
                        batch,
                        args.warmup,
                        args.reps,
                        args.threads,
                        args.wrapped_decode,
                        round_,
                    )
                    for side in sides:
                        runs[side].append(both[side])
                    continue
                for side in sides:
                    runs[side].append(
                        _run_side(
                            args.preset, side, alg, batch, args.warmup + args.reps, args.threads, args.wrapped_decode
                        )
                    )
            keep = slice(args.warmup, args.warmup + args.reps)  # lock-step sides run on past their timed steps
            for side in sides:
                r = min(runs[side], key=lambda x: statistics.median(x["wall"][keep]))  # the fastest round
                wall, cpu = statistics.median(r["wall"][keep]), statistics.median(r["cpu"][keep])
                tokens = statistics.mean(r["tokens"][keep])
                res[side] = wall
                work[side] = (step_work(cfg, p * g, prompt_len, tokens), wall)
                parts = ""
                if r.get("gen"):  # TRL: its rollout phase (generate); the rest is not split
                    parts = f"{statistics.median(r['gen'][keep]):>7.3f}"
                if "parts" in r:
                    parts = " ".join(
                        f"{statistics.median(v[keep]):>{w}.3f}"
                        for v, w in zip(r["parts"].values(), (7, 6, 7, 6), strict=True)
                    )
                ratio = f"  {res['trl'] / res['ours']:.2f}x" if side == sides[-1] and len(res) == 2 else ""
                if ratio and args.concurrent:  # rounds are paired (the same window): the median of their ratios
                    paired = [
                        statistics.median(t["wall"][keep]) / statistics.median(o["wall"][keep])
                        for o, t in zip(runs["ours"], runs["trl"], strict=True)
                    ]
                    ratio = f"  {statistics.median(paired):.2f}x paired (" + "/".join(f"{x:.2f}" for x in paired) + ")"
                spread = ""
                if args.rounds > 1:
                    spread = "  rounds " + "/".join(f"{statistics.median(x['wall'][keep]):.3f}" for x in runs[side])
                print(
                    f"{batch:<12} {alg:<5} {side:<5} {wall:>7.3f} {cpu:>7.3f} {tokens:>7.0f} {tokens / wall:>7.0f} "
                    f"{parts:<30}{ratio}{spread}",
                    flush=True,
                )
            cells = []
            for side, (w, wall) in work.items():
                total, parts = sum(w.values()), " / ".join(f"{v / 1e9:.2f}" for v in w.values())
                rate = total / wall / 1e9
                cells.append(
                    f"{side} {total / 1e9:.2f} GFLOP ({parts}) in {wall:.3f} s = {rate:.1f} GFLOP/s, {rate / peak:.0%}"
                )
            if "trl" in work:
                w, wall = work["trl"]
                cells.append(f"2x TRL: {2 * sum(w.values()) / wall / 1e9 / peak:.0%}")
            print(
                f"{'':<12} {alg:<5} work (rollout / pi_old / updates) and share of GEMM peak: " + "; ".join(cells),
                flush=True,
            )


if __name__ == "__main__":
    main()
