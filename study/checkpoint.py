"""A run's checkpoint: `save` writes it, `read` reads it back with the metric rows up to it before any compute, and
`restore` applies it to the built parts (model, optimiser, loss scaler, every RNG).

checkpoint/state.pt holds tensors and plain values only (loaded with torch.load(weights_only=True)): the one-process
form (full weights, torch AdamW states by one-process index), the RNG states and the run's position. Under a parallel
layout every rank first writes its shards into megatron's distributed checkpoint checkpoint/dist-step{N} (model,
optimizer, each rank's RNG states), and state.pt names it; it carries the one-process form too when that fits rank
0's memory (`full_state_fits`), so `study export` and a one-process resume read it. A resume under another layout is
resharded by megatron (study/policy/parallel.py). Damaged or missing state raises rundir.RunStateError naming the
file and the restart.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from study import record
from study.policy import parallel as par
from study.policy.model import current_layout
from study.record import LAYERS, METRICS, TOKEN_SAMPLES, Progress
from study.run import rundir
from study.run.plan import param_counts

STATE = "state.pt"
CHECKPOINT_KEYS = (
    "model",
    "optimizer",
    "scaler",
    "torch_rng",
    "python_rng",
    "numpy_rng",
    "step",
    "data_pos",
    "mastered",
    "compute",
    "wall",
)
DISTRIBUTED_ONLY = (
    "{path}: holds the weights and optimizer only in megatron's distributed checkpoint {state[distributed]!r} (a "
    "layout run writes the one-process form only when 12 bytes x its parameters fit STUDY_FULL_STATE_MAX_GB, default "
    "8); valid: {valid}"
)
"""Why a state.pt without the one-process form cannot be read as one (a one-process resume, `study export`)."""
FULL_STATE_MAX_GB = 8.0
"""Largest one-process form (fp32 weights and both Adam moments, 12 bytes a parameter) rank 0 gathers into state.pt
at a layout; the environment variable STUDY_FULL_STATE_MAX_GB overrides it. Qwen3-30B-A3B's would be ~366 GB."""


class Trained(Protocol):
    """What a checkpoint saves and restores of a run's parts (study.parts.Parts)."""

    mcfg: Any
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any  # DynamicLossScaler | None
    trainer: par.ShardedTrainer | None


def path_of(run_dir: Path) -> Path:
    return run_dir / "checkpoint" / STATE


def full_state_fits(mcfg: Any) -> bool:
    """Whether a layout run's state.pt carries the one-process form: 12 bytes a parameter <= the limit."""
    limit = float(os.environ.get("STUDY_FULL_STATE_MAX_GB", FULL_STATE_MAX_GB))
    return 12 * param_counts(mcfg).total <= limit * 2**30


# -- RNG states -------------------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as tensors and plain values: torch's CPU generator, Python's, NumPy's and, where
    CUDA is in use, each visible GPU's generator (`cuda_rng`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    state = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": numpy}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`. The GPUs' generators are restored where CUDA is in use (as many as both the checkpoint
    and this process have); a checkpoint written without CUDA leaves them as seeded."""
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    numpy = state["numpy_rng"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    if torch.cuda.is_available() and state.get("cuda_rng") is not None:
        for device, generator in enumerate(state["cuda_rng"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(generator, device)


# -- write ------------------------------------------------------------------------------------------------------------
def save(run_dir: Path, parts: Trained, log: Progress) -> None:
    """state.pt: the model, optimiser, scaler, RNG states and position. Under a parallel layout every rank first
    writes its shards and RNG states into megatron's distributed checkpoint `dist-step{N}` (made under a .tmp name,
    renamed when complete), then rank 0 writes state.pt naming it, with the one-process form when it fits
    (`full_state_fits`), else with model and optimizer None; older distributed checkpoints are removed after."""
    position = {
        "step": log.step,
        "data_pos": log.data_pos,
        "mastered": sorted(log.mastered),
        "compute": log.compute,
        "wall": log.wall,
    }
    ckpt = run_dir / "checkpoint"
    if parts.trainer is None:
        state = {
            "model": parts.policy.state_dict(),
            "optimizer": parts.optimizer.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
            **rng_state(),
            **position,
        }
        rundir.atomic_write(ckpt / STATE, lambda tmp: torch.save(state, tmp))
        _mark_complete(run_dir, log)
        return
    name, rng = f"dist-step{log.step}", rng_state()
    par.save_distributed(parts.trainer, ckpt / f"{name}.tmp", rng=rng)  # collective
    full_form = full_state_fits(parts.mcfg)  # the same answer on every rank: the gathers are collectives
    full = par.full_state_dict(parts.policy) if full_form else {}  # collective
    adam = parts.trainer.full_optimizer_state() if full_form else {}  # collective
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(ckpt / name, ignore_errors=True)
        (ckpt / f"{name}.tmp").rename(ckpt / name)
        model = {n: full[n] for n in par.one_process_names(parts.policy)} if full_form else None
        optimizer = par.one_process_adam_state(adam, model, parts.trainer.hparams) if model is not None else None
        state = {
            **rng,
            "model": model,
            "optimizer": optimizer,
            "scaler": None,
            **position,
            "distributed": name,
            "world": torch.distributed.get_world_size(),
            "parallel": current_layout().to_dict(),
        }
        rundir.atomic_write(ckpt / STATE, lambda tmp: torch.save(state, tmp))
        _mark_complete(run_dir, log)
        for old in ckpt.glob("dist-step*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()


def _mark_complete(run_dir: Path, log: Progress) -> None:
    """Record the checkpoint as complete in metrics.parquet (rank 0, once state.pt is in place). The rows up to it
    were written before it (`record.Recorder.add`), so a kill at any point leaves a resumable run: before this, the
    metrics name the previous checkpoint (none: a fresh start); after it, this one."""
    log.checkpoint = log.step
    record.write_metrics(run_dir, log, metrics_only=True)


# -- read -------------------------------------------------------------------------------------------------------------
def load(path: Path) -> dict[str, Any]:
    """A run checkpoint, loaded with torch.load(weights_only=True): tensors and plain values only, so a file that
    holds anything else (a hostile pickle) is refused, never executed; its tensors onto the CPU (a file written on
    a GPU loads on a CPU host; restoring puts them on the model's device). Damage raises RunStateError naming the
    file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # a GPU's file on any host
    except Exception as err:
        if "Weights only load failed" in str(err):
            what = (
                "refused: it holds objects other than tensors and plain values (torch.load(weights_only=True)); "
                "a tampered or foreign file"
            )
        else:
            what = f"unreadable, cut short or not a checkpoint ({first_line(err)})"
        raise rundir.RunStateError(f"{path}: {what}; {rundir.RESTART}") from None
    if not isinstance(state, dict) or set(CHECKPOINT_KEYS) - set(state):
        raise rundir.RunStateError(
            f"{path}: not a run checkpoint (keys {', '.join(CHECKPOINT_KEYS)}); {rundir.RESTART}"
        )
    return state


def read(run_dir: Path, first_checkpoint: int) -> tuple[dict[str, Any] | None, Progress]:
    """The run's progress, read before any compute: fresh (no checkpoint), or its checkpoint's state (applied by
    `restore` once the parts are built) with the metric rows up to it; everything after the checkpoint is
    recomputed. `first_checkpoint`: the step of the run's first checkpoint (a checkpoint missing once the metrics
    reach it was lost)."""
    path = path_of(run_dir)
    if not path.exists():
        _check_no_lost_checkpoint(run_dir, path, first_checkpoint)
        return None, Progress()
    state = load(path)
    done = state["step"]

    def upto(name: str, required: bool) -> pd.DataFrame | None:
        """The file's rows up to the checkpoint; a missing optional file is a warning (its earlier rows are lost,
        the run goes on and writes the rows after the checkpoint)."""
        file = run_dir / name
        if not file.exists():
            if required:
                raise rundir.RunStateError(
                    f"{file}: missing, but {path} is at step {done}: the rows of steps 0-{done} "
                    f"are lost; {rundir.RESTART}"
                )
            print(
                f"warning: {file} is missing: its rows of steps up to the checkpoint (step {done}) are lost; the "
                "run continues and writes the rows after it (restart the run to have them all)",
                file=sys.stderr,
            )
            return None
        try:
            frame = pd.read_parquet(file)
            if "step" not in frame.columns:
                raise ValueError("no 'step' column")
        except Exception as err:  # pyarrow raises its own types for cut-short and garbage files
            if not required:  # a damaged optional file is a missing one: a warning, the checkpoint is intact
                print(
                    f"warning: {file} is unreadable ({first_line(err)}), treated as missing: its rows of steps up "
                    f"to the checkpoint (step {done}) are lost; the run continues and writes the rows after it",
                    file=sys.stderr,
                )
                return None
            raise rundir.RunStateError(
                f"{file}: unreadable, cut short or not this run's table ({first_line(err)}); {rundir.RESTART}"
            ) from None
        past = sorted(int(x) for x in frame["step"].unique() if x > done)
        if required and past:
            print(
                f"note: {file} has rows of steps {past[0]}-{past[-1]} past the checkpoint (step {done}): they are "
                "recomputed from it",
                file=sys.stderr,
            )
        frame = frame[frame["step"] <= done]
        if required and not set(range(1, done + 1)) <= set(frame["step"].astype(int)):
            raise rundir.RunStateError(f"{file}: lacks rows of steps 1-{done} that {path} has passed; {rundir.RESTART}")
        return frame

    rows = upto(METRICS, required=True)
    layers, tokens = upto(LAYERS, required=False), upto(TOKEN_SAMPLES, required=False)
    return state, Progress(
        step=done,
        data_pos=state["data_pos"],
        mastered=set(state["mastered"]),
        compute=state["compute"],
        wall=state["wall"],
        checkpoint=done,
        rows=[] if rows is None else rows.to_dict("records"),
        layer_rows=[] if layers is None else layers.to_dict("records"),
        token_frames=[] if tokens is None else [tokens],
    )


def _check_no_lost_checkpoint(run_dir: Path, path: Path, first_checkpoint: int) -> None:
    """No checkpoint: a fresh start, unless one was completed and is gone (then starting again at step 0 silently
    would throw its steps away). metrics.parquet records the last complete checkpoint (`record.write_metrics`): none
    (a kill, a stop or a full disk while the first was written) is a fresh start, with a note that the rows it holds
    are recomputed; one is an error. Metrics that record none and reach the first checkpoint's step count as one."""
    metrics = run_dir / METRICS
    if not metrics.exists():
        return
    try:
        reached = int(pd.read_parquet(metrics, columns=["step"])["step"].max())
    except Exception:
        return  # unreadable metrics without a checkpoint: nothing to continue from; rewritten from step 0
    completed = record.recorded_checkpoint(metrics)
    if completed == 0:
        if reached >= 1:
            print(
                f"note: {metrics} has rows of steps up to {reached}, but the run's first checkpoint (step "
                f"{first_checkpoint}) was never completed (the run ended while writing it): the run starts again "
                "from step 0 and recomputes them",
                file=sys.stderr,
            )
        return
    if completed is not None:
        raise rundir.RunStateError(
            f"{path}: missing, but {metrics} records that the checkpoint of step {completed} "
            f"was completed (its rows reach step {reached}); {rundir.RESTART}"
        )
    if reached >= first_checkpoint:
        raise rundir.RunStateError(
            f"{path}: missing, but {metrics} reaches step {reached} (the first checkpoint is "
            f"written at step {first_checkpoint}); {rundir.RESTART}"
        )


# -- restore ----------------------------------------------------------------------------------------------------------
def restore(state: dict[str, Any], parts: Trained, path: Path) -> None:
    """Apply a checkpoint's state: model, optimiser, scaler and every RNG. A one-process resume loads state.pt's
    one-process form (and refuses a state.pt without it); under a parallel layout a layout run's checkpoint is
    loaded from its distributed checkpoint (resharded by megatron when the layout changed), a one-process run's is
    sliced into the shards (study/policy/parallel.py)."""
    try:
        if parts.trainer is not None:
            if state.get("distributed") is not None:  # megatron's distributed checkpoint, resharded to this layout
                mine = torch.distributed.get_rank() < int(state["world"])
                rng = par.load_distributed(parts.trainer, path.parent / state["distributed"], rng=mine)
                state = {**state, **(rng or {})}  # a rank the saving world lacked: rank 0's RNG states
            else:  # a one-process run's: its full weights and Adam states sliced into this rank's shard
                par.load_full_state(parts.policy, state["model"])
                names = par.one_process_names(parts.policy)
                parts.trainer.load_full_optimizer_state(par.adam_state_by_name(state["optimizer"], names))
        else:
            if state["model"] is None:
                raise rundir.RunStateError(
                    DISTRIBUTED_ONLY.format(
                        path=path,
                        state=state,
                        valid=f"resume it at a parallel layout (it was saved at "
                        f"{state['parallel']!r}; another layout reshards)",
                    )
                )
            _load_model(parts.policy, state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
        if parts.scaler is not None:
            parts.scaler.load_state_dict(state["scaler"])
        set_rng_state(state)
    except rundir.RunStateError:
        raise
    except (KeyError, RuntimeError, TypeError, ValueError, FileNotFoundError) as err:
        raise rundir.RunStateError(
            f"{path}: not a checkpoint of this run ({first_line(err)}); {rundir.RESTART}"
        ) from None


def _load_model(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A one-process state dict into the one-process model; a layout run's state.pt holds the weights alone (no
    megatron `_extra_state` entries)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.endswith("._extra_state")] + list(unexpected)
    if bad:
        raise KeyError(f"the checkpoint's model does not match the policy: {sorted(bad)[:4]}")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"
