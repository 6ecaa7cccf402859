"""What a run records: where it stands (`Progress`: position, cumulative compute, the metric rows so far), the rows'
per-step summaries computed from the step's tensors, and the three tables they are written to (metrics.parquet,
routing_layers.parquet, token_samples.parquet; the vocabulary is study/run/metrics.py)."""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from runfiles import LAYERS, METRICS, TOKEN_SAMPLES
from study.run import rundir
from study.run.metrics import LAYER_METRICS, STEP_METRICS, TOKEN_SAMPLE_COLUMNS, k3

TOKEN_SAMPLE_SEQS = 64  # sequences per written step (step 1, every eval step, the last step)
CHECKPOINT_KEY = b"study.checkpoint"
"""metrics.parquet's key-value metadata: the step of the run's last complete checkpoint when it was written."""
METRICS_EVERY_S = 30.0  # the metric files are also rewritten at least this often (live monitoring)


@dataclass
class Progress:
    """Where a run stands: what a checkpoint saves and a resume restores, and the rows written so far."""

    step: int = 0
    data_pos: int = 0
    mastered: set[str] = field(default_factory=set)  # prompt_filter = mastered: prompts the stream skips
    compute: float = 0.0  # cumulative FLOPs estimate
    wall: float = 0.0  # cumulative seconds of the steps
    checkpoint: int = 0  # the step of the last complete checkpoint (0: none yet), recorded in metrics.parquet
    rows: list[dict[str, float]] = field(default_factory=list)
    layer_rows: list[dict[str, float]] = field(default_factory=list)
    token_frames: list[pd.DataFrame] = field(default_factory=list)  # trainer vs engine log-probs of sampled tokens


@torch.no_grad()
def mismatch(train_old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The training-inference mismatch of the step's response tokens: delta = logp_train_old - logp_rollout."""
    m = mask.bool()
    d = (train_old - rollout_logp)[m]
    if d.numel() == 0:
        return {}
    return {
        "mismatch_mean_abs": float(d.abs().mean()),
        "mismatch_max_abs": float(d.abs().max()),
        "mismatch_k3": float(k3(d).mean()),
        "mismatch_frac_gt2": float((d.abs() > math.log(2.0)).float().mean()),
    }


@torch.no_grad()
def token_samples(step: int, train_old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> pd.DataFrame:
    """The first TOKEN_SAMPLE_SEQS sequences' response tokens: trainer (pi_old recompute) vs engine log-probs."""
    m = mask[:TOKEN_SAMPLE_SEQS].bool()
    sample, pos = m.nonzero(as_tuple=True)
    frame = pd.DataFrame(
        {
            "step": np.full(len(sample), step, dtype=np.int64),
            "sample": sample.numpy().astype(np.int64),
            "pos": pos.numpy().astype(np.int64),
            "trainer_logp": train_old[:TOKEN_SAMPLE_SEQS][m].float().numpy().astype(np.float32),
            "engine_logp": rollout_logp[:TOKEN_SAMPLE_SEQS][m].float().numpy().astype(np.float32),
        }
    )
    return frame[list(TOKEN_SAMPLE_COLUMNS)]


def mean_volatility(volatility: list[dict[str, float]]) -> dict[str, float]:
    """The step's routing volatility, old vs new policy after each update: the mean over the minibatches that follow
    at least one update (the off-policy minibatches 2..M; the first one's forward is pi_old's own, a structural zero
    that would dilute the mean by (M-1)/M). NaN with one minibatch: no update precedes any forward of the rollouts."""
    names = ("slot_mismatch", "set_flip_rate", "token_flip_rate")
    if not volatility:
        return {f"routing_{m}": math.nan for m in names}
    return {f"routing_{m}": float(np.mean([v[m] for v in volatility])) for m in names}


def layer_rows(step: int, volatility: list[dict[str, float]], load: dict[str, float], num_layers: int) -> list[dict]:
    """routing_layers.parquet's rows of the step: per layer, the minibatches' mean slot mismatch and set-flip rate,
    then the pi_old pass's expert load and router entropy and the engine's expert load (NaN without its routes)."""
    moved = volatility[0] if volatility else {}  # no update-minibatch (one minibatch): NaN volatility
    return [
        {
            "step": step,
            "layer": layer,
            **{
                m: float(np.mean([v[f"{m}_l{layer}"] for v in volatility]))
                if f"{m}_l{layer}" in moved
                else load.get(f"{m}_l{layer}", math.nan)
                for m in LAYER_METRICS
            },
        }
        for layer in range(num_layers)
    ]


def write_metrics(run_dir: Path, log: Progress, *, metrics_only: bool = False) -> None:
    """The three tables, each written atomically (the rows so far); metrics.parquet records the step of the last
    complete checkpoint (`log.checkpoint`, `CHECKPOINT_KEY` in its key-value metadata), which tells a resume a
    checkpoint that was never completed (a kill or a full disk while the first was written: the run starts again)
    from one that was lost (an error). `metrics_only`: metrics.parquet alone."""
    if not log.rows:
        return
    frame = pd.DataFrame(
        log.rows, columns=list(STEP_METRICS) + sorted({k for r in log.rows for k in r} - set(STEP_METRICS))
    )
    frame["step"] = frame["step"].astype("int64")
    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata({**table.schema.metadata, CHECKPOINT_KEY: str(log.checkpoint).encode()})
    rundir.atomic_write(run_dir / METRICS, lambda tmp: pq.write_table(table, tmp))
    if metrics_only:
        return
    if log.layer_rows:
        layers = pd.DataFrame(log.layer_rows)
        rundir.atomic_write(run_dir / LAYERS, lambda tmp: layers.to_parquet(tmp, index=False))
    if log.token_frames:
        tokens = pd.concat(log.token_frames, ignore_index=True)
        rundir.atomic_write(run_dir / TOKEN_SAMPLES, lambda tmp: tokens.to_parquet(tmp, index=False))


def recorded_checkpoint(path: Path) -> int | None:
    """The step of the last complete checkpoint metrics.parquet at `path` records (0: none was completed), or None
    when it records none or cannot be read."""
    try:
        value = (pq.read_schema(path).metadata or {}).get(CHECKPOINT_KEY)
        return None if value is None else int(value)
    except (OSError, ValueError, pa.ArrowException):
        return None


class Recorder:
    """Where a run's rows go: its Progress (`log`, what a checkpoint saves), the live trackers, and, where `writes`
    (rank 0), the metric files. `add` writes them when `due` (every checkpoint step, before the checkpoint: resume
    keeps the rows up to it; the last step) and otherwise at most every METRICS_EVERY_S seconds for live monitoring
    (rewriting the whole table every step cost 9% of a tiny step); the trackers flush with them."""

    def __init__(self, run_dir: Path, log: Progress, tracker: Any, *, writes: bool) -> None:
        self.run_dir, self.log, self.tracker, self.writes = run_dir, log, tracker, writes
        self.last_write = time.monotonic()

    def keep(self, row: dict[str, float]) -> None:
        """The row into the Progress and to the trackers."""
        self.log.rows.append(row)
        self.tracker.log(row)

    def add(self, row: dict[str, float], *, due: bool) -> None:
        """`keep` the row, then write the files if `due` or if METRICS_EVERY_S have passed since the last write."""
        self.keep(row)
        if self.writes and (due or time.monotonic() - self.last_write >= METRICS_EVERY_S):
            self.write()
            self.tracker.flush()
            self.last_write = time.monotonic()

    def write(self) -> None:
        """The metric files now (rank 0)."""
        if self.writes:
            write_metrics(self.run_dir, self.log)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class ProgressBar:
    """The run's tqdm bar on stderr (nothing when disabled)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="rl", unit="step", file=sys.stderr, dynamic_ncols=True)

    def tick(self, row: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", clip=f"{row['clip_frac']:.2g}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoTracker:
    """The trackers of a rank other than 0 (rank 0 alone logs): nothing."""

    def log(self, row: dict[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, outcome: str) -> None:
        pass
