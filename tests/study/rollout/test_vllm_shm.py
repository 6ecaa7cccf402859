"""The vllm engine's shared memory (the sync bucket; on CUDA the routed experts) is checked against the space free
in /dev/shm before any process starts, with a message naming the size, the space and the fixes. The space is the
real statvfs of a directory with its free blocks set low (a container's 64 MiB /dev/shm)."""

from __future__ import annotations

import os

import pytest

from study.core.model_config import PRESETS
from study.rollout import vllm_engine
from study.run.rollout_runtime import EngineSettings

MIB = 1 << 20


def _small_shm(monkeypatch, directory: str, free_bytes: int) -> None:
    real = os.statvfs

    def statvfs(path):  # type: ignore[no-untyped-def]
        st = real(path)
        if os.path.realpath(path) != os.path.realpath(directory):
            return st
        blocks = free_bytes // st.f_frsize
        return os.statvfs_result((st.f_bsize, st.f_frsize, blocks, blocks, blocks, *tuple(st)[5:]))

    monkeypatch.setattr(vllm_engine.os, "statvfs", statvfs)


def test_the_engine_refuses_to_start_on_a_small_shm(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(vllm_engine, "SHM_DIR", str(tmp_path))
    _small_shm(monkeypatch, str(tmp_path), 64 * MIB)
    started = []
    monkeypatch.setattr(vllm_engine._Replica, "__init__", lambda self, env, **kw: started.append(env))
    with pytest.raises(RuntimeError) as err:
        vllm_engine.VLLMEngine(PRESETS["tiny"], runtime={"bucket_mb": 256})
    msg = str(err.value)
    assert "needs 320 MiB" in msg and "sync bucket 256 MiB" in msg and "64 MiB are free" in msg, msg
    assert "--shm-size" in msg and "rollout_runtime.bucket_mb" in msg and "\n" not in msg
    assert not started  # before any server process


def test_a_smaller_bucket_fits() -> None:
    need = vllm_engine.shared_memory_need(
        PRESETS["tiny"], EngineSettings.parse({"bucket_mb": 1}), "fp32", max_num_seqs=4, routes=False
    )
    assert need["sync bucket"] >= 1 * MIB and "routed experts" not in need


def test_the_routed_experts_are_counted_on_cuda(tmp_path, monkeypatch) -> None:
    """Qwen3-30B-A3B's shape (48 layers, top-8 of 128): a byte per layer and slot of every full-length sequence; the
    bucket is at least the largest tensor (the embedding, 594 MiB in bf16)."""
    cfg = PRESETS["qwen3-30b-a3b"].replace(max_seq_len=9216)
    need = vllm_engine.shared_memory_need(cfg, EngineSettings(), "bf16", max_num_seqs=256, routes=True)
    assert need["routed experts"] == 256 * 9216 * 48 * 8
    _small_shm(monkeypatch, str(tmp_path), 1024 * MIB)
    with pytest.raises(
        RuntimeError, match=r"needs 1522 MiB .*sync bucket 594 MiB, routed experts 864 MiB.*1024 MiB are free"
    ):
        vllm_engine.check_shared_memory(need, directory=str(tmp_path))
    _small_shm(monkeypatch, str(tmp_path), 2048 * MIB)
    vllm_engine.check_shared_memory(need, directory=str(tmp_path))


def test_a_sleeping_engine_runs_without_expandable_segments() -> None:
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "OTHER": "1",
    }
    assert vllm_engine.server_env(env, sleeps=True) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
        "OTHER": "1",
    }
    assert vllm_engine.server_env(env, sleeps=False) == env  # an engine that stays awake keeps them


def test_the_server_process_gets_the_cleaned_environment(monkeypatch) -> None:
    seen = {}

    class Popen:
        def __init__(self, cmd, env, pass_fds):  # type: ignore[no-untyped-def]
            seen.update(env)

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(vllm_engine.subprocess, "Popen", Popen)
    vllm_engine._Replica({"CUDA_VISIBLE_DEVICES": "0"}, sleeps=True).conn.close()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen and seen["CUDA_VISIBLE_DEVICES"] == "0"


def test_before_a_colocated_engine_wakes_the_trainers_cache_goes_and_its_share_is_checked(monkeypatch) -> None:
    """CUDA's answers patched: 80 GB, the trainer's 50 GB resident; empty_cache runs before the free memory is read."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or (30e9, 80e9))
    got = vllm_engine.release_for_engine(EngineSettings.parse({"gpu_memory": 0.3}))
    assert calls == ["empty_cache", "mem_get_info"] and got == {"free_gb": 30.0, "need_gb": 24.0}
    with pytest.raises(RuntimeError, match=r"gpu_memory = 0.5 needs 40.0 GB free on the GPU, 30.0 GB are free"):
        vllm_engine.release_for_engine(EngineSettings.parse({"gpu_memory": 0.5}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_engine.release_for_engine(EngineSettings()) == {}
