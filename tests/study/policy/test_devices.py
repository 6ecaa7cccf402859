"""Which GPU a rank takes and which backend its process group uses, on a CPU machine: CUDA's answers patched in a
subprocess (a GPU's `set_device` refuses an index past the visible count, as CUDA does), the process group gloo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.shared import free_port

ONE_GPU_PER_TASK = r"""
import json, os, sys
import torch

os.environ.update(LOCAL_RANK="3", WORLD_SIZE="1")
picked = []


def set_device(index):
    if not 0 <= int(index) < torch.cuda.device_count():
        raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
    picked.append(int(index))


torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1  # the scheduler gave this task one GPU (CUDA_VISIBLE_DEVICES)
torch.cuda.set_device = set_device
init = torch.distributed.init_process_group
backends = []


def init_process_group(backend, **kwargs):
    backends.append(backend)
    return init("gloo", **kwargs)  # the CPU stands in for NCCL


torch.distributed.init_process_group = init_process_group
from study.core.model_config import ParallelLayout
from study.policy import model

model.init_distributed(ParallelLayout())
print(json.dumps({"picked": picked, "backends": backends}))
"""


def test_a_task_that_sees_one_gpu_takes_it_whatever_its_local_rank():
    out = subprocess.run([sys.executable, "-c", ONE_GPU_PER_TASK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"picked": [0], "backends": ["nccl"]}


@pytest.mark.parametrize(("local", "count", "index"), [("0", 8, 0), ("3", 8, 3), ("3", 1, 0), ("5", 4, 1)])
def test_local_device_index(monkeypatch, local, count, index):
    from study.policy.model import local_device_index

    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert local_device_index() == index


@pytest.mark.parametrize(("local", "count", "error"), [("x", 1, "LOCAL_RANK = 'x'"), ("0", 0, "no CUDA device")])
def test_local_device_index_errors(monkeypatch, local, count, error):
    from study.policy.model import local_device_index

    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=error):
        local_device_index()


def test_the_backend_choice(monkeypatch):
    from study.policy.model import dist_backend

    assert dist_backend() == "gloo" and dist_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        dist_backend("nccl")
    with pytest.raises(ValueError, match="valid: auto, gloo, nccl"):
        dist_backend("mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dist_backend() == "nccl" and dist_backend("nccl") == "nccl" and dist_backend("gloo") == "gloo"


RANK_CHECK = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
from study.launch import RankCheck

try:
    view = RankCheck(backend=sys.argv[1])()
    print(json.dumps({"backend": view["backend"], "sum": view["sum"]}))
except ValueError as err:
    print(json.dumps({"error": str(err)}))
"""


@pytest.mark.parametrize(
    ("backend", "want"),
    [
        ("auto", {"backend": "gloo", "sum": 1.0}),  # no CUDA here: what a run's ranks would join
        ("gloo", {"backend": "gloo", "sum": 1.0}),
        ("nccl", {"error": "backend = 'nccl' needs CUDA, and none is available here; valid here: auto, gloo"}),
    ],
)
def test_the_rank_check_joins_the_backend_asked_for(backend, want):
    out = subprocess.run(
        [sys.executable, "-c", RANK_CHECK, backend, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_the_launcher_takes_the_rank_check_backend(tmp_path, capsys):
    from study.launch import main

    assert (
        main(["--rank-check", "--rank-check-backend", "nccl", "--launcher", "in-process", "--results", str(tmp_path)])
        == 2
    )
    assert "valid: local, slurm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rank-check", "--rank-check-backend", "mpi", "--launcher", "local", "--results", str(tmp_path)])


def test_cuda_takes_megatrons_fast_moe_paths_and_the_cpu_keeps_its_own(monkeypatch):
    from study.core.model_config import PRESETS
    from study.policy.model import device_paths, transformer_config

    cpu = transformer_config(PRESETS["tiny"], dtype="bf16")
    assert (cpu.moe_token_dispatcher_type, cpu.use_cpu_initialization, cpu.moe_grouped_gemm) == (
        "allgather",
        True,
        False,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = transformer_config(PRESETS["tiny"], dtype="bf16")
    assert (gpu.moe_token_dispatcher_type, gpu.use_cpu_initialization) == ("alltoall", False)
    assert not gpu.moe_grouped_gemm  # the local spec's GroupedMLP renames the expert weights (device_paths' doc)
    assert device_paths(cuda=True)["dispatcher"] == "alltoall" and device_paths(cuda=False)["cpu_init"]
