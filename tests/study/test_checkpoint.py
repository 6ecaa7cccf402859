"""The checkpoint's RNG states: every generator the run draws from is saved and restored, the GPUs' where CUDA is in
use (checked here with torch.cuda's getters and setters replaced: a CPU machine has no CUDA generator)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from study import checkpoint
from study.record import Progress


def _parts() -> SimpleNamespace:
    """A one-process run's parts as far as a checkpoint sees them."""
    policy = torch.nn.Linear(3, 2)
    return SimpleNamespace(
        mcfg=None, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()), scaler=None, trainer=None
    )


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.Tensor]]:
    """Two GPUs' generators as torch.cuda reports them; the calls of the setter, (device, state)."""
    generators = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    calls: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.clone() for g in generators])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((device, state)))
    return calls


def test_a_checkpoint_saves_and_restores_the_gpus_generators(tmp_path: Path, cuda: list) -> None:
    parts = _parts()
    checkpoint.save(tmp_path, parts, Progress(step=3))
    state = checkpoint.load(checkpoint.path_of(tmp_path))  # weights_only: the GPU states are plain tensors
    assert set(checkpoint.CHECKPOINT_KEYS) | {"cuda_rng"} == set(state)
    assert [g.tolist() for g in state["cuda_rng"]] == [list(range(8)), list(range(8, 16))]
    checkpoint.restore(state, parts, checkpoint.path_of(tmp_path))
    assert [(device, g.tolist()) for device, g in cuda] == [(0, list(range(8))), (1, list(range(8, 16)))]


def test_a_resume_on_fewer_gpus_restores_those_it_has(cuda: list, monkeypatch: pytest.MonkeyPatch) -> None:
    state = checkpoint.rng_state()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    checkpoint.set_rng_state(state)
    assert [device for device, _ in cuda] == [0]


def test_without_cuda_no_gpu_state_and_the_cpus_generators_round_trip(tmp_path: Path) -> None:
    parts = _parts()
    checkpoint.save(tmp_path, parts, Progress(step=1))
    state = checkpoint.load(checkpoint.path_of(tmp_path))
    assert set(state) == set(checkpoint.CHECKPOINT_KEYS)
    want = (torch.rand(3), random.random(), np.random.rand(3))  # the draws after the checkpoint
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    checkpoint.set_rng_state(state)
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])
