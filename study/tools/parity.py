"""Cross-engine parity: the same weights and tokens through the training engine and the rollout engine, compared.

How far each precision moves a token's log-prob from fp32, per engine, and how far the two engines disagree (the
training-inference mismatch of the paper's section 5.4, claim C5), at fixed weights; and the distribution
statistics used to compare emulated with real low precision (tests/study/core/test_precision.py,
benchmarks/bench_precision.py). An orchestrating module: it builds a policy and an engine, as study/rl.py does.
"""

from __future__ import annotations

import torch

from study.core.model_config import PRESETS
from study.core.precision import Precision, apply_precision
from study.core.weights import megatron_to_hf
from study.policy.model import build_policy, token_logp
from study.rollout.hf import HFEngine


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic sup_x |F_a(x) - F_b(x)| of two 1-D samples."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / a.numel()
    fb = torch.searchsorted(b, grid, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def summarize(x: torch.Tensor) -> dict[str, float]:
    """mean, median, p99 and max of a 1-D sample (|delta| of token log-probs)."""
    x = x.flatten().double()
    return {"mean": float(x.mean()), "median": float(x.median()), "p99": float(x.quantile(0.99)), "max": float(x.max())}


def logp_deltas(
    specs: list[str],
    *,
    n_seqs: int = 16,
    prompt_len: int = 16,
    response_len: int = 48,
    seed: int = 0,
    init_std: float = 0.1,
) -> dict[str, dict[str, torch.Tensor]]:
    """Token log-probs of the tiny model in each precision of `specs`, for the trainer (megatron token_logp) and the
    hf engine (teacher-forced score), on the same random weights and tokens.

    Returns {"trainer" | "engine" | "mismatch": {label: (N,) tensor}}: |logp_prec - logp_fp32| for the trainer and
    the engine (N = n_seqs x response_len response tokens), and the cross-engine mismatch |logp_trainer -
    logp_engine| of each precision (the run's mismatch_mean_abs at fixed weights). `init_std` 0.1 (not the
    preset's 0.02) gives a random model peaked log-probs, as a trained one has.
    """

    cfg = PRESETS["tiny"].replace(init_std=init_std)
    ref = build_policy(cfg, seed=seed, dtype="fp32")
    state, hf_state = ref.state_dict(), megatron_to_hf(ref, cfg)
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(1, cfg.vocab_size, (n_seqs, prompt_len + response_len), generator=gen)  # (N, P + T)
    prompts = [s[:prompt_len].tolist() for s in seqs]
    responses = [s[prompt_len:].tolist() for s in seqs]

    def trainer(spec: str) -> torch.Tensor:
        prec = Precision.parse(spec)
        model = build_policy(cfg, seed=seed, dtype=prec.storage_dtype)
        model.load_state_dict(state, strict=False)
        apply_precision(model, prec)
        with torch.no_grad():
            lp = token_logp(model, seqs[:, :-1], seqs[:, 1:])  # (N, P + T - 1)
        return lp[:, prompt_len - 1 :].flatten().cpu()  # response tokens, (N * T,), beside the engine's

    def engine(spec: str) -> torch.Tensor:
        prec = Precision.parse(spec)
        eng = HFEngine(cfg, dtype=prec.dtype, precision=prec.label)
        eng.load_weights(hf_state)
        return torch.cat(eng.score(prompts, responses)[0])  # (N * T,)

    base_t, base_e = trainer("fp32"), engine("fp32")
    out: dict[str, dict[str, torch.Tensor]] = {"trainer": {}, "engine": {}, "mismatch": {}}
    for spec in specs:
        label = Precision.parse(spec).label
        t, e = trainer(spec), engine(spec)
        out["trainer"][label] = (t - base_t).abs()
        out["engine"][label] = (e - base_e).abs()
        out["mismatch"][label] = (t - e).abs()
    return out


def emulation_table(names: list[str], *, n_seqs: int = 16, seed: int = 0) -> list[dict[str, object]]:
    """Rows comparing emulated with real low precision on this CPU for each format of `names` (bf16, fp16, ...):
    per engine (trainer, engine) and for the cross-engine mismatch, the |delta| distribution of the real and the
    emulated mode (mean, median, p99, max), the ratio emulated / real of each, and the KS statistic between them."""
    specs = [f"{n}{m}" for n in names for m in ("", "-emulated")]
    deltas = logp_deltas(specs, n_seqs=n_seqs, seed=seed)
    rows: list[dict[str, object]] = []
    for where in ("trainer", "engine", "mismatch"):
        for name in names:
            real, emu = deltas[where][Precision.parse(name).label], deltas[where][f"{name}-emulated"]
            r, e = summarize(real), summarize(emu)
            row: dict[str, object] = {"what": where, "precision": name, "tokens": int(real.numel())}
            for k in ("mean", "median", "p99", "max"):
                row[f"{k} real"], row[f"{k} emulated"] = r[k], e[k]
                row[f"{k} emulated/real"] = e[k] / r[k] if r[k] > 0 else float("nan")
            row["KS(emulated, real)"] = ks_statistic(emu, real)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m study.tools.parity --precisions bf16 --out CSV`: the emulation_table as a CSV (atomically)."""
    import argparse
    from pathlib import Path

    import pandas as pd

    from study.run.rundir import atomic_write

    parser = argparse.ArgumentParser(prog="python -m study.tools.parity", description=emulation_table.__doc__)
    parser.add_argument("--precisions", nargs="+", required=True, help="formats: bf16, fp16, bf16_fp32head")
    parser.add_argument("--seqs", type=int, default=16, help="sequences of 16 + 48 tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    bad = [n for n in args.precisions if n not in ("bf16", "fp16", "bf16_fp32head")]
    if bad:
        parser.error(f"--precisions {bad}: valid: bf16, fp16, bf16_fp32head")
    torch.set_num_threads(args.threads)
    table = pd.DataFrame(emulation_table(args.precisions, n_seqs=args.seqs))
    atomic_write(Path(args.out), lambda tmp: table.to_csv(tmp, index=False))
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
