"""scripts/gpu_check.sh on a machine without a GPU: the CUDA parts are recorded `skip` with the reason, the result
file is written, the script exits 0 (the CPU-runnable parts are exercised by running the script by hand: they take
minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_skips_cuda_parts_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--parts", "install,r3_routes"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no NVIDIA GPU here" in proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = result["parts"]
    assert [parts[p]["status"] for p in ("install", "r3_routes")] == ["skip", "skip"]
    assert "no CUDA device" in parts["r3_routes"]["reason"] and result["install"]["torch"] == torch.__version__
    bad = subprocess.run([sys.executable, "-m", "study.tools.gpu_check", "--parts", "nosuch"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "valid: preflight, install, megatron" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_the_preflight_part_runs_in_seconds_and_the_qwen_layer_needs_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_PYTHON": sys.executable,
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--parts", "preflight,qwen_layer"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(verdicts) == 2 and verdicts[0].startswith("[  ok] preflight") and verdicts[1].startswith("[skip]")
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    pre = parts["preflight"]
    assert pre["seconds"] < 60 and pre["backend"] == "gloo" and pre["timeout_min"] == 120
    assert pre["shm_need_mb"] > 0 and pre["transformer_engine"] is False
    assert pre["alloc_conf"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert pre["engine_alloc_conf"] == {}  # the engine's process runs without expandable segments
    assert "no CUDA device" in parts["qwen_layer"]["reason"]


def test_the_environment_installs_as_a_step_of_its_own(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--install-only"], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "environment:" in proc.stdout and not (tmp_path / "gpu_check.json").exists()
