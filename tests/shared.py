"""Helpers several test folders share: the smoke sweep's runs, a results dir sharing another's cold start, the real
SLURM cluster (scripts/slurm/start.sh) when its controller answers. The session fixtures live in tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from study.run.config import RunConfig
from sweeps.expand import load_sweep

ROOT = Path(__file__).resolve().parents[1]


def slurm_up() -> bool:
    """The controller of the cluster named by SLURM_CONF answers."""
    if not os.environ.get("SLURM_CONF") or shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_slurm = pytest.mark.skipif(not slurm_up(), reason="no SLURM controller answers (eval scripts/slurm/start.sh)")


def smoke_config(algorithm: str = "grpo", **changes) -> RunConfig:
    """A run of the smoke study (sweeps/smoke.yaml), with `changes`."""
    runs = load_sweep(ROOT / "sweeps" / "smoke.yaml").expand()
    cfg = next(c for c in runs.values() if c.algorithm == algorithm)
    return cfg.replace(**changes) if changes else cfg


def sharing_coldstart(results: Path, other: Path) -> Path:
    """A fresh results dir whose cold start is `results`' (symlinked), so the same run id can run there again."""
    (other / "coldstart").mkdir(parents=True)
    for src in (results / "coldstart").iterdir():
        os.symlink(src, other / "coldstart" / src.name)
    return other
