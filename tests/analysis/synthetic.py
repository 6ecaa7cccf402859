"""Synthetic run directories with known answers, for the tests and the benchmark (never for results).

Each algorithm gets a `Curve`: the reward follows the ScaleRL sigmoid R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)
of cumulative compute C plus Gaussian noise; the clip fractions are constants plus noise; the other metrics of the
vocabulary (analysis.runs.vocab) are smooth functions of the step. Runs can be made to collapse or fail.

Token samples (`token_samples.parquet`, what Figure 4b reads) are optional: `synthetic_token_samples` draws each
sequence's log-ratio mean_t(trainer_logp - engine_logp) from N(mu, sigma) and adds zero-mean token noise whose mean
over the sequence is removed, so every sequence's length-normalised log-ratio is exactly its draw (to float32).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.runs import vocab
from analysis.stats.fit import sigmoid


@dataclass(frozen=True)
class Curve:
    """Ground truth of one synthetic algorithm."""

    a: float = 0.8
    b: float = 1.5
    c_mid: float = 2e12
    r0: float = 0.1
    noise: float = 0.02
    clip_low: float = 0.01
    clip_high: float = 0.02
    collapse_step: int | None = None
    """Reward falls to ~0 from this step and the run stops there with status collapsed."""
    slot_mismatch: float = 0.1
    """Routing volatility: routing_slot_mismatch starts here and rises by 20% of it over the run (noise 5% of it)."""
    per_update: float | None = None
    """The per-update volatility, routing_slot_mismatch_mb2 (the change after one update), with the same drift and
    noise; None: equal to slot_mismatch (two minibatches per rollout batch, where the cumulative is that one update)."""
    load_imbalance: float = 1.3
    """expert_load_imbalance (mean over the run; engine: 0.05 above)."""
    router_entropy: float = 0.7
    """router_entropy, nats (mean over the run)."""
    mismatch: float = 0.01
    """Engine/trainer mismatch: mismatch_mean_abs is this plus up to a tenth of it (uniform)."""
    truncation: float = 0.05
    """truncation_rate rises linearly from 0 to this over the run (mean about half of it)."""


def synthetic_metrics(
    curve: Curve,
    *,
    n_steps: int,
    flops_per_step: float,
    rng: np.random.Generator,
    eval_every: int = 10,
    n_extra: int = 0,
) -> dict[str, np.ndarray]:
    """Columns of one run's metrics.parquet."""
    step = np.arange(1, n_steps + 1)
    compute = flops_per_step * step  # cumulative FLOPs
    reward = sigmoid(compute, r0=curve.r0, a=curve.a, b=curve.b, c_mid=curve.c_mid)
    reward = reward + curve.noise * rng.standard_normal(n_steps)
    if curve.collapse_step is not None:
        reward[step >= curve.collapse_step] = 0.01 * rng.random(int((step >= curve.collapse_step).sum()))
    low = np.abs(curve.clip_low * (1 + 0.05 * rng.standard_normal(n_steps)))
    high = np.abs(curve.clip_high * (1 + 0.05 * rng.standard_normal(n_steps)))
    evals = np.where(step % eval_every == 0, 1.0, np.nan)
    frac = step / n_steps
    cols: dict[str, np.ndarray] = {
        "step": step,
        "compute_flops": compute,
        "wall_s": 2.0 * step + rng.random(n_steps),
        vocab.REWARD: reward,
        "reward_std": 0.3 + 0.01 * rng.standard_normal(n_steps),
        vocab.EVAL_IN_DIST: evals * (0.9 * reward + 0.01 * rng.standard_normal(n_steps)),
        "eval_hard": evals * (0.5 * reward + 0.01 * rng.standard_normal(n_steps)),
        vocab.CLIP: low + high,
        vocab.CLIP_LOW: low,
        vocab.CLIP_HIGH: high,
        vocab.MISMATCH_MEAN_ABS: curve.mismatch + curve.mismatch / 10 * rng.random(n_steps),
        vocab.MISMATCH_MAX_ABS: 0.5 + 0.1 * rng.random(n_steps),
        vocab.MISMATCH_K3: 1e-4 * (1 + rng.random(n_steps)),
        vocab.MISMATCH_FRAC_GT2: 1e-3 * rng.random(n_steps),
        vocab.ROUTING_SLOT: curve.slot_mismatch * (1 + 0.2 * frac + 0.05 * rng.standard_normal(n_steps)),
        vocab.ROUTING_FLIP: 0.2 + 0.01 * rng.standard_normal(n_steps),
        vocab.ROUTING_ENGINE: 0.03 + 0.005 * rng.random(n_steps),
        vocab.RESPONSE_LEN: 100 + 50 * frac,
        vocab.TRUNCATION: curve.truncation * frac,
        vocab.TOKENS: np.full(n_steps, 4096.0),
    }
    for i in range(n_extra):
        cols[f"extra_{i}"] = rng.standard_normal(n_steps)
    aux = rng.spawn(1)[0]  # metrics added later draw from a child: the ones above keep their values
    cols["lr"] = np.full(n_steps, 1e-6)
    cols[vocab.EXPERT_LOAD] = curve.load_imbalance + 0.02 * aux.standard_normal(n_steps)
    cols[vocab.ENGINE_EXPERT_LOAD] = cols[vocab.EXPERT_LOAD] + 0.05
    cols[vocab.ROUTER_ENTROPY] = curve.router_entropy + 0.01 * aux.standard_normal(n_steps)
    cols["zero_var_group_frac"] = 0.2 + 0.4 * frac  # no-signal groups rise as problems get solved every time
    cols["zero_var_solved_frac"] = 0.1 + 0.3 * frac
    one = curve.slot_mismatch if curve.per_update is None else curve.per_update
    cols[f"{vocab.ROUTING_SLOT}_mb2"] = one * (1 + 0.2 * frac + 0.05 * aux.standard_normal(n_steps))
    return cols


def with_start_row(cols: Mapping[str, np.ndarray], curve: Curve, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`cols` with the row the run loop writes at step 0 when it evaluates (eval_every > 0): the starting policy's
    evaluation (eval metrics at the curve's R0, as at the eval steps), lr, compute_flops = wall_s = 0, every other
    metric NaN."""
    start = dict.fromkeys(cols, np.nan)
    start.update(step=0, compute_flops=0.0, wall_s=0.0)
    start[vocab.EVAL_IN_DIST] = 0.9 * curve.r0 + 0.01 * rng.standard_normal()
    start["eval_hard"] = 0.5 * curve.r0 + 0.01 * rng.standard_normal()
    if "lr" in cols:
        start["lr"] = float(cols["lr"][0])
    return {k: np.concatenate([np.asarray([start[k]], dtype=np.asarray(v).dtype), v]) for k, v in cols.items()}


TOKEN_SEQS = 64
"""Sequences per written step, as the run loop writes them."""


def token_steps(n_steps: int, eval_every: int) -> list[int]:
    """The steps the run loop writes token samples at: step 1, every eval step and the last step."""
    steps = {1, n_steps} | (set(range(eval_every, n_steps + 1, eval_every)) if eval_every else set())
    return sorted(s for s in steps if 1 <= s <= n_steps)


def synthetic_token_samples(
    steps: Sequence[int],
    *,
    mu: float,
    sigma: float,
    rng: np.random.Generator,
    n_seq: int = TOKEN_SEQS,
    length: tuple[int, int] = (4, 40),
    token_noise: float = 0.05,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Columns of a token_samples.parquet and the true per-sequence log-ratios, in (step, sample) order.

    Per sequence: |y| uniform in `length`, engine log-probs -Exponential(1), delta ~ N(mu, sigma), and
    trainer = engine + delta + e - mean(e) with e ~ N(0, token_noise): mean_t(trainer - engine) = delta.
    """
    steps = np.asarray(steps, np.int64)
    n_rows = len(steps) * n_seq
    lens = rng.integers(length[0], length[1] + 1, n_rows)  # (S,) tokens per sequence, (step, sample) order
    delta = mu + sigma * rng.standard_normal(n_rows)  # (S,) the per-sequence log-ratio
    seq = np.repeat(np.arange(n_rows), lens)  # (N,) sequence index of each token
    starts = np.r_[0, np.cumsum(lens)[:-1]]
    engine = -rng.exponential(1.0, seq.size)
    e = token_noise * rng.standard_normal(seq.size)
    e -= (np.bincount(seq, weights=e) / lens)[seq]  # zero mean within each sequence
    cols = {
        "step": np.repeat(np.repeat(steps, n_seq), lens),
        "sample": np.repeat(np.tile(np.arange(n_seq, dtype=np.int64), len(steps)), lens),
        "pos": np.arange(seq.size, dtype=np.int64) - starts[seq],
        vocab.TRAINER_LOGP: (engine + delta[seq] + e).astype(np.float32),
        vocab.ENGINE_LOGP: engine.astype(np.float32),
    }
    return cols, delta


def write_run(
    runs_dir: str | os.PathLike[str],
    run_id: str,
    *,
    config: Mapping[str, Any],
    status: Mapping[str, Any],
    metrics: Mapping[str, np.ndarray] | None,
    manifest: Mapping[str, Any] | None = None,
    layers: Mapping[str, np.ndarray] | None = None,
    tokens: Mapping[str, np.ndarray] | None = None,
    config_format: str = "json",
) -> Path:
    """Write one run directory of the contract (status.json, manifest.json, config, metrics/layers/token parquet)."""
    path = Path(runs_dir) / run_id
    path.mkdir(parents=True, exist_ok=True)
    if config_format == "json":
        (path / "config.json").write_text(json.dumps(config, indent=1))
    else:
        import yaml

        (path / "config.yaml").write_text(yaml.safe_dump(dict(config)))
    (path / "status.json").write_text(json.dumps(status))
    if manifest is None:
        manifest = {"run_id": run_id, "git_sha": "0" * 40, "seed": config.get("seed")}
        labels = [v for k, v in config.items() if k.endswith("_precision") and isinstance(v, str) and v]
        if labels:  # as study.core.precision.labels writes it
            manifest["precision_emulated"] = any(v.endswith("-emulated") for v in labels)
    (path / "manifest.json").write_text(json.dumps(manifest))
    if metrics is not None:
        pq.write_table(pa.table(dict(metrics)), path / "metrics.parquet")
    if layers is not None:
        pq.write_table(pa.table(dict(layers)), path / "routing_layers.parquet")
    if tokens is not None:
        pq.write_table(pa.table(dict(tokens)), path / "token_samples.parquet")
    return path


def make_study(
    root: str | os.PathLike[str],
    curves: Mapping[str, Curve],
    *,
    seeds: Sequence[int] = (0, 1, 2),
    grid: Mapping[str, Sequence[Any]] | None = None,
    n_steps: int = 200,
    flops_per_step: float = 1e11,
    n_layers: int = 2,
    n_extra: int = 0,
    fail: Sequence[str] = (),
    config_format: str = "json",
    token_mismatch: Callable[[Mapping[str, Any]], tuple[float, float]] | None = None,
    eval_every: int = 10,
    start_eval: bool = True,
) -> list[str]:
    """Write runs algorithm x grid x seed under `root/runs`; returns the run ids in write order.

    `grid` maps dotted config keys to the values swept (the cartesian product is written). Algorithms listed in
    `fail` get status failed after a third of their steps (metrics up to there kept). `token_mismatch(config)` ->
    (mu, sigma), when given, writes token_samples.parquet (64 sequences at step 1, every eval step and the last
    logged step) whose per-sequence log-ratios are N(mu, sigma) draws. `start_eval` (with eval_every > 0) writes the
    step-0 row of the starting policy's evaluation, as the run loop does (`with_start_row`); False writes runs as they
    were before the loop evaluated its start.
    """
    runs = Path(root) / "runs"
    grid = dict(grid or {})
    keys = list(grid)
    ids = []
    for alg, curve in curves.items():
        for combo in itertools.product(*(grid[k] for k in keys)):
            for seed in seeds:
                config: dict[str, Any] = {"algorithm": alg, "seed": seed, "model": {"preset": "tiny"}}
                for key, value in zip(keys, combo, strict=True):
                    node = config
                    *parents, leaf = key.split(".")
                    for p in parents:
                        node = node.setdefault(p, {})
                    node[leaf] = value
                digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
                run_id = digest[:12]  # content-addressed, like the real run ids
                rng = np.random.default_rng(int(digest[:8], 16))
                cols = synthetic_metrics(
                    curve,
                    n_steps=n_steps,
                    flops_per_step=flops_per_step,
                    rng=rng,
                    n_extra=n_extra,
                    eval_every=eval_every,
                )
                status: dict[str, Any] = {"state": "completed", "step": n_steps}
                if curve.collapse_step is not None and curve.collapse_step <= n_steps:
                    stop = curve.collapse_step + 2
                    cols = {k: v[:stop] for k, v in cols.items()}
                    status = {"state": "collapsed", "step": stop, "reason": "reward below floor"}
                if alg in fail:
                    stop = n_steps // 3
                    cols = {k: v[:stop] for k, v in cols.items()}
                    status = {"state": "failed", "step": stop, "error": "RuntimeError: synthetic failure"}
                steps = cols["step"]
                rows = len(steps) * n_layers
                layers = {
                    "step": np.repeat(steps, n_layers),
                    "layer": np.tile(np.arange(n_layers), len(steps)),
                    vocab.LAYER_SLOT: np.tile(0.05 * (1 + np.arange(n_layers)), len(steps))
                    + 0.002 * rng.standard_normal(rows),
                }
                aux = rng.spawn(1)[0]  # what was added later draws from a child: the draws above keep their values
                layers[vocab.EXPERT_LOAD] = curve.load_imbalance + 0.03 * aux.standard_normal(rows)
                layers[vocab.ROUTER_ENTROPY] = curve.router_entropy + 0.02 * aux.standard_normal(rows)
                tokens = None
                if token_mismatch is not None:
                    mu, sigma = token_mismatch(config)
                    at = token_steps(int(steps[-1]), eval_every)
                    tokens = synthetic_token_samples(at, mu=mu, sigma=sigma, rng=rng)[0]
                if start_eval and eval_every:
                    cols = with_start_row(cols, curve, aux)
                write_run(
                    runs,
                    run_id,
                    config=config,
                    status=status,
                    metrics=cols,
                    layers=layers,
                    tokens=tokens,
                    config_format=config_format,
                )
                ids.append(run_id)
    return ids


ROUTER_LR_SCALES = (1.0, 30.0, 100.0, 300.0)
"""Router learning-rate scales of a synthetic routing study (the knob `router_lr_scale`)."""


def routing_truth(scale: float) -> dict[str, Curve]:
    """The known answer of `make_routing_study` at one router learning-rate scale: the slot mismatch grows with the
    scale (0.26% at 1, as measured, to 2.1% at 300); GRPO's asymptote falls by 12 x the mismatch, and at a mismatch
    above 2% its runs collapse at step 40, while GRPO + Routing Replay, GSPO and GSPO + Routing Replay do not move;
    expert load imbalance rises and router entropy falls with the mismatch (a little more without replay)."""
    slot = 0.0026 * scale**0.37
    base = {"grpo": 0.6 - 12 * slot, "grpo_rr": 0.6, "gspo": 0.65, "gspo_rr": 0.65}
    out = {}
    for alg, a in base.items():
        free = not alg.endswith("_rr")
        out[alg] = Curve(
            a=a,
            c_mid=2e12,
            clip_low=0.05 if alg.startswith("gspo") else 0.0005,
            clip_high=0.1 if alg.startswith("gspo") else 0.0008,
            slot_mismatch=slot,
            load_imbalance=1.2 + 20 * slot + (0.03 if free else 0.0),
            router_entropy=1.3 - 20 * slot - (0.02 if free else 0.0),
            collapse_step=40 if alg == "grpo" and slot > 0.02 else None,
        )
    return out


def make_routing_study(
    root: str | os.PathLike[str],
    *,
    scales: Sequence[float] = ROUTER_LR_SCALES,
    seeds: Sequence[int] = (0, 1, 2),
    n_steps: int = 60,
    start_eval: bool = True,
    **kwargs: Any,
) -> list[str]:
    """The routing-volatility study with known answers (`routing_truth`): GRPO, GRPO + Routing Replay, GSPO and GSPO +
    Routing Replay x `router_lr_scale` x seeds, every step metric of the vocabulary including expert_load_imbalance
    and router_entropy (and their per-layer columns), the step-0 evaluation when `start_eval`."""
    ids = []
    for scale in scales:
        ids += make_study(
            root,
            routing_truth(scale),
            seeds=seeds,
            n_steps=n_steps,
            grid={"router_lr_scale": [scale]},
            start_eval=start_eval,
            **kwargs,
        )
    return ids


OFFPOLICY_MINIBATCHES = (1, 4, 16, 64)
"""Minibatches per rollout batch (M) of a synthetic off-policy study (the routing study's axis)."""
OFFPOLICY_VOLATILITY = {1: float("nan"), 4: 0.01, 16: 0.03, 64: 0.07}
"""The MoE's routing_slot_mismatch at the start of a run, per M (its mean over the run is 1.1 x this); NaN at M = 1,
where no minibatch follows an update. The dense control's is 0 (one expert: nothing to route)."""
OFFPOLICY_PER_UPDATE = {1: float("nan"), 4: 0.004, 16: 0.012, 64: 0.055}
"""The MoE's routing_slot_mismatch_mb2 (the change after one update) at the start of a run, per M: below the
cumulative one, and at or above 5% at M = 64 only."""
MOE_SHAPE = {"model.num_layers": 4, "model.num_experts": 32, "model.moe_top_k": 8}
DENSE_SHAPE = {"model.num_layers": 4, "model.num_experts": 1, "model.moe_top_k": 1, "model.moe_ffn_hidden_size": 1024}
"""The routing study's MoE and its dense control, as flattened config keys."""
OFFPOLICY_STEPS, OFFPOLICY_EVERY = 40, 10
"""Steps and evaluation interval of a synthetic off-policy study's runs."""
OFFPOLICY_COLLAPSE = 30
"""The step from which GRPO without replay collapses at the highest volatility when Figure 3 is reproduced."""


def offpolicy_truth(m: int, *, reproduced: bool) -> dict[str, dict[str, Curve]]:
    """The known answer of `make_offpolicy_study` at M = `m`: {"MoE": {algorithm: Curve}, "dense": {"grpo": Curve}}.

    Every arm starts at R0 = 0.1 and loses 0.03 of its asymptote per factor 4 of M (the off-policy loss in general,
    the dense control's too). At M = 64, the one M whose volatility (7.7%) is at or above 5%: with `reproduced`, GRPO
    without replay collapses at step 30 (Figure 3) while GRPO + Routing Replay, GSPO and the dense control keep the
    general loss only; without it, every arm falls below its start (asymptote 0.03-0.05: off-policy damage in
    general, the dense control's too, so no stratum tests the claim)."""
    steps = np.log(m) / np.log(4)  # factors of 4 over M = 1
    slot = OFFPOLICY_VOLATILITY[m]
    high = slot >= 0.05
    moe = {}
    for alg, a in (("grpo", 0.6), ("grpo_rr", 0.6), ("gspo", 0.65), ("gspo_rr", 0.65)):
        asym = a - 0.03 * steps
        if high and not reproduced:
            asym = 0.05
        collapse = OFFPOLICY_COLLAPSE if (high and reproduced and alg == "grpo") else None
        moe[alg] = Curve(
            a=asym, r0=0.1, c_mid=2e12, slot_mismatch=slot, per_update=OFFPOLICY_PER_UPDATE[m], collapse_step=collapse
        )
    dense_a = 0.03 if (high and not reproduced) else 0.6 - 0.03 * steps
    dense = {"grpo": Curve(a=dense_a, r0=0.1, c_mid=2e12, slot_mismatch=0.0 if m > 1 else slot)}
    return {"MoE": moe, "dense": dense}


def expected_gain(curve: Curve, *, n_steps: int, flops_per_step: float, eval_every: int) -> float:
    """The expectation of a synthetic run's held-out gain: 0.9 x (the reward at its last evaluation - R0); a collapsed
    run's last evaluation is the last one it logged (reward ~U(0, 0.01), mean 0.005, from the collapse)."""
    last = n_steps if curve.collapse_step is None else min(n_steps, curve.collapse_step + 2)
    step = last - last % eval_every
    reward = float(sigmoid(flops_per_step * step, r0=curve.r0, a=curve.a, b=curve.b, c_mid=curve.c_mid))
    if curve.collapse_step is not None and step >= curve.collapse_step:
        reward = 0.005
    return 0.9 * (reward - curve.r0)


def expected_final_reward(curve: Curve, *, n_steps: int, flops_per_step: float, frac: float = 0.1) -> float:
    """The expectation of a synthetic run's final reward: the mean over its last `frac` of compute
    (analysis.stats.curves.compute_window: the steps whose compute is at least (1 - frac) x the run's last)."""
    last = n_steps if curve.collapse_step is None else min(n_steps, curve.collapse_step + 2)
    step = np.arange(1, last + 1)
    reward = sigmoid(flops_per_step * step, r0=curve.r0, a=curve.a, b=curve.b, c_mid=curve.c_mid)
    if curve.collapse_step is not None:
        reward = np.where(step >= curve.collapse_step, 0.005, reward)
    inside = flops_per_step * step >= (1 - frac) * (flops_per_step * last)
    return float(np.mean(reward[inside]))


def make_offpolicy_study(
    root: str | os.PathLike[str],
    *,
    reproduced: bool = True,
    minibatches: Sequence[int] = OFFPOLICY_MINIBATCHES,
    seeds: Sequence[int] = (0, 1, 2),
    **kwargs: Any,
) -> list[str]:
    """The routing study along off-policy updates with known answers (`offpolicy_truth`): GRPO, GRPO + Routing Replay,
    GSPO and GSPO + Routing Replay on the MoE (MOE_SHAPE) and GRPO on its dense control (DENSE_SHAPE) x `minibatches`
    x seeds, the replay arms left out at M = 1 as the routing study leaves them out; OFFPOLICY_STEPS steps, an
    evaluation every OFFPOLICY_EVERY and at step 0. `reproduced` switches whether the high-volatility stratum
    reproduces Figure 3 (outcome i) or breaks every arm, the dense control included (outcome ii)."""
    ids = []
    for m in minibatches:
        truth = offpolicy_truth(m, reproduced=reproduced)
        for family, shape in (("MoE", MOE_SHAPE), ("dense", DENSE_SHAPE)):
            curves = {a: c for a, c in truth[family].items() if not (m == 1 and a.endswith("_rr"))}
            grid = {**{k: [v] for k, v in shape.items()}, "minibatches": [m]}
            ids += make_study(
                root, curves, seeds=seeds, grid=grid, n_steps=OFFPOLICY_STEPS, eval_every=OFFPOLICY_EVERY, **kwargs
            )
    return ids


COMPARISON = {
    "name": "replay_cost",
    "role": "primary",
    "claim": "C3",
    "arms": {"axis": "algorithm", "treatment": "grpo", "control": "grpo_rr"},
    "metric": "eval_in_dist",
    "window": "gain",
    "test": "difference",
    "threshold": 0.1,
    "seeds": [0, 1, 2],
    "power": 0.8,
    "assumed_sd": 0.05,
    "pairing": "seed",
}
"""A sweep file's declared comparison (a `comparisons:` entry, sweeps.schema.COMPARISON_FIELDS) of synthetic runs:
GRPO's held-out gain minus GRPO + Routing Replay's, paired by seed over seeds 0-2."""
