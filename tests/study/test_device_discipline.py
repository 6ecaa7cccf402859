"""Device discipline of the loop: the trainer's tensors live on the model's device (a GPU on CUDA), the batch and the
engines' outputs on the CPU, and the loop brings the trainer's results to the CPU before the two meet.

On the CPU the trainer's device is a fence: every tensor the policy computes is an `OnDevice` tensor, a subclass that
raises, as CUDA does, when an op mixes it with a plain CPU tensor of one or more dimensions (0-dim CPU tensors mix,
as they do with CUDA ones, and CPU indices may index it); `.cpu()` and `.to("cpu")` return a plain tensor. One tiny
run under the fence: GRPO with routing replay and the KL reference, two minibatches, the post-sync parity check at
every step, an evaluation and a checkpoint at every step, stopped after step 1 and resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

_TO_CPU = {torch.Tensor.cpu, torch.Tensor.to}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMix(RuntimeError):
    """An op mixed the trainer's device with the CPU."""


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _to_cpu(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on the trainer's device (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _TO_CPU and _to_cpu(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                return out.as_subclass(torch.Tensor)  # a new plain tensor, on the same autograd graph
        checked = [args[0], *_tensors(args[2:])] if func in _INDEXING else _tensors((args, kwargs))
        if any(isinstance(t, OnDevice) for t in checked):
            plain = [t for t in checked if not isinstance(t, OnDevice) and t.dim() > 0]
            if plain:
                raise DeviceMix(
                    f"{getattr(func, '__name__', func)} mixes the trainer's device with CPU tensors of "
                    f"shapes {[tuple(t.shape) for t in plain]}"
                )
        return super().__torch_function__(func, types, args, kwargs)


def test_the_fence_refuses_what_cuda_refuses() -> None:
    """The fence itself: mixing raises, a 0-dim CPU tensor and CPU indices do not, .cpu() leaves it."""
    x = torch.arange(6.0).as_subclass(OnDevice)
    with pytest.raises(DeviceMix):
        x - torch.ones(6)
    with pytest.raises(DeviceMix):
        torch.cat([x, torch.ones(2)])
    assert isinstance(x * torch.tensor(2.0), OnDevice) and isinstance(
        x[torch.tensor([True] * 3 + [False] * 3)], OnDevice
    )
    back = x.cpu()
    assert (
        type(back) is torch.Tensor
        and type(x.to("cpu")) is torch.Tensor
        and torch.equal(back - torch.ones(6), (x - 1).cpu())
    )


def _fenced(build):  # type: ignore[no-untyped-def]
    def build_policy(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = build(*args, **kwargs)
        model.register_forward_hook(lambda _module, _args, out: out.as_subclass(OnDevice))
        return model

    return build_policy


def test_a_run_keeps_the_trainers_tensors_apart_from_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    from study import parts, rl
    from study.run import rundir
    from study.run.config import load_config

    monkeypatch.setattr(parts, "build_policy", _fenced(parts.build_policy))  # the policy and the KL reference
    sets = [
        "coldstart=scratch",
        "algorithm=grpo_rr",
        "steps=2",
        "minibatches=2",
        "sync_check_every=1",
        "eval_every=1",
        "checkpoint_every=1",
        "kl_coef=0.1",
        "prompts_per_step=2",
        "group_size=4",
        "max_new_tokens=8",
        "eval_size=4",
        "eval_samples=1",
    ]
    cfg = load_config(preset="tiny", sets=sets)

    def stop(step: int, row: dict) -> None:
        if step == 1:
            raise rundir.Stopped("stopped after step 1 (test)")

    with pytest.raises(rundir.Stopped):
        rl.run(cfg, tmp_path, progress=False, on_eval=stop)
    run_dir = rl.run(cfg, tmp_path, progress=False)  # resumed from the step-1 checkpoint
    assert rundir.read_status(run_dir)["state"] == "completed"
    metrics = pd.read_parquet(run_dir / "metrics.parquet").set_index("step")
    assert metrics.loc[[1, 2], "sync_parity_max_abs"].lt(1e-3).all()  # fp32 on both sides: the sync is exact
    assert metrics.loc[[1, 2], "kl_ref"].notna().all() and metrics["eval_in_dist"].notna().all()


@pytest.mark.slow
def test_the_cold_start_keeps_the_trainers_tensors_apart_from_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cold start's SFT loss and its probe on the fence: the loss mask `collate` makes lives on the CPU (~20 s)."""
    from study.coldstart import resolve_settings
    from study.coldstart.sft import train_coldstart
    from study.policy import model as policy_model

    monkeypatch.setattr(policy_model, "build_policy", _fenced(policy_model.build_policy))
    settings = resolve_settings(
        "tiny", "chain_sum", max_steps=2, eval_every=2, eval_size=2, eval_samples=1, batch_size=4, max_new_tokens=8
    )
    record = train_coldstart(settings, tmp_path)
    assert record["steps_trained"] == 2 and len(record["loss_curve"]) == 2 and record["probe_logp"] < 0


def test_the_parity_tool_keeps_the_trainers_tensors_apart_from_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity tool's trainer log-probs (the model's device) against the hf engine's (the CPU)."""
    from study.tools import parity

    monkeypatch.setattr(parity, "build_policy", _fenced(parity.build_policy))
    deltas = parity.logp_deltas(["fp32", "bf16"], n_seqs=2, prompt_len=4, response_len=4)
    assert float(deltas["mismatch"]["fp32"].max()) < 1e-4 and float(deltas["trainer"]["bf16"].max()) > 0


def test_a_checkpoint_written_on_a_gpu_loads_on_a_cpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state.pt as a GPU run writes it (its storages tagged `cuda:0`, the bytes torch.save writes for CUDA
    tensors) is read on a machine without CUDA, its tensors on the CPU."""
    from torch import serialization

    from study import checkpoint

    def cuda_tag(obj: Any) -> str | None:  # what torch.save records for a storage on the first GPU
        return "cuda:0" if getattr(obj, "device", None) is not None and obj.device.type == "cpu" else None

    monkeypatch.setattr(serialization, "_package_registry", [(0, cuda_tag, None), *serialization._package_registry])
    state = {k: 0 for k in checkpoint.CHECKPOINT_KEYS} | {"model": {"w": torch.arange(4.0)}}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    monkeypatch.undo()
    assert b"cuda:0" in path.read_bytes()  # the file is tagged as a GPU's
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):  # what a load without a map location does on this host
            torch.load(path, weights_only=True)
    loaded = checkpoint.load(path)
    assert loaded["model"]["w"].device.type == "cpu" and torch.equal(loaded["model"]["w"], torch.arange(4.0))


# -- collectives: NCCL takes tensors on the GPU only ------------------------------------------------------------------
def _refusing(collective):  # type: ignore[no-untyped-def]
    """`collective` as NCCL runs it: every tensor it sends or fills must be on the GPU (here: the fence's)."""

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        plain = [t for t in _tensors((args, kwargs)) if not isinstance(t, OnDevice)]
        if plain:
            raise DeviceMix(
                f"{collective.__name__} of CPU tensors of shapes {[tuple(t.shape) for t in plain]}: "
                "NCCL takes tensors on the GPU only"
            )
        return collective(*args, **kwargs)

    return call


def _gather_on_two_ranks(rank: int, init: str, out: str) -> None:
    """One of two gloo ranks under the NCCL discipline: the communication device is the fence's, the collectives
    refuse CPU tensors; each rank all-gathers a CPU tensor (a megatron CPU Adam state) and its rows."""
    import json

    from study.policy import parallel

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        parallel._comm_device = lambda device: device  # gloo's: the CPU, standing for the GPU
        parallel._to_comm = lambda t: t.as_subclass(OnDevice) if not isinstance(t, OnDevice) else t  # onto it
        torch.distributed.all_gather = _refusing(torch.distributed.all_gather)
        state = torch.full((3,), float(rank))  # on the CPU, as megatron keeps the distributed optimizer's states
        gathered = parallel._all_gather(state, torch.distributed.group.WORLD)
        result = {"values": [t.tolist() for t in gathered], "plain": [type(t) is torch.Tensor for t in gathered]}
    except DeviceMix as e:
        result = {"error": str(e)}
    finally:
        torch.distributed.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_collectives_gather_cpu_tensors_through_the_communication_device(tmp_path: Path) -> None:
    """`_all_gather` (the full weights, gradients and Adam states at TP or EP > 1) under NCCL's rule, at world 2
    (two processes: ~15 s)."""
    import json

    torch.multiprocessing.spawn(
        _gather_on_two_ranks, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2
    )
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"values": [[0.0] * 3, [1.0] * 3], "plain": [True, True]}, result
