"""The RL run: one algorithm on one configuration, from a cold-start checkpoint to a run directory analysis trusts.

Per step (GSPO paper, section 5.1; the three places where the algorithm matters are marked ALGO):
 1. P prompts from the task stream -> G samples each from the rollout engine, with the engine's own log-probs;
 2. rewards from the task's verifier (truncated responses scored as they stand); ALGO reward shaping (DAPO);
 3. ALGO advantages `alg.advantages(rewards, G)`; zero-variance groups dropped and refilled if the algorithm asks;
 4. pi_old log-probs recomputed by the training engine with routing RECORDed (or R3: the engine's routes replayed);
    `old_logp_source: rollout` uses the engine's log-probs as pi_old instead (section 5.4);
 5. the batch split into M minibatches; for each: forward with the routing the algorithm asks for (free / replay /
    rollout_replay), ALGO `alg.loss`, backward, clip, AdamW step;
 6. weights pushed to the rollout engine; metrics row kept (files written at checkpoints); evaluation and checkpoint
    every N steps.
Optional (kl_coef > 0, off by default as in the paper): a frozen copy of the initial policy gives reference log-probs
(its own, free routing) and the loss adds kl_coef x k3 KL(pi_theta || pi_ref), weighted per token as the algorithm
aggregates its own tokens (`aggregation_weights`). task = "user" trains on a user's rows (study.data.tasks.UserTask) and
coldstart may name a local HF checkpoint (study/coldstart/hf_import.py).
All randomness is derived from (seed, step), so a resumed run is bit-identical to an uninterrupted one on CPU at a
fixed thread count.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import random
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import algorithms
from study.core import precision as precision_mod
from study.core.model_config import ParallelLayout
from study.core.weights import iter_hf_weights
from study.data import tasks
from study.data.tokenizer import TaskTokenizer
from study.policy import parallel as par
from study.policy.model import build_policy, current_layout, token_logp
from study.policy.optim import DynamicLossScaler, build_optimizer
from study.policy.routing import Routes, RoutingController, expert_load, routing_volatility
from study.rollout import engine_class, get_engine
from study.run import machine, rundir
from study.run.config import RunConfig
from study.run.metrics import LAYER_METRICS, STEP_METRICS, TOKEN_SAMPLE_COLUMNS, forward_flops
from study.run.trackers import RunLogger, Tracking, parse_trackers, saved_tracking
from study.tools.plan import param_counts

MULTI_RANK = True
"""study.launch's check: a run may span several ranks (its `parallel` layout; study/policy/parallel.py)."""
TOKEN_SAMPLES = "token_samples.parquet"
TOKEN_SAMPLE_SEQS = 64  # sequences per written step (step 1, every eval step, the last step)
METRICS_EVERY_S = 30.0  # the metric files are also rewritten at least this often (live monitoring)


class Collapse(Exception):
    """The run diverged or collapsed: a result to record, not a crash."""


def derive_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def run(
    cfg: RunConfig,
    results: str | Path,
    *,
    progress: bool = True,
    on_eval: Callable[[int, dict[str, float]], None] | None = None,
    tracking: Tracking | None = None,
) -> Path:
    """Run (or resume, or skip if finished) `cfg` under `results/runs/{run_id}/`; returns the run directory.

    `on_eval(step, row)` (tuning hook, sweeps/tune.py) is called after each held-out evaluation, once the step is
    recorded; it may stop the run by raising a rundir.Stopped, which leaves the run resumable ("stopped").
    `tracking`: the live trackers, the study and its axis values (study/run/trackers.py); None: the trackers the
    STUDY_TRACKERS variable names (else TensorBoard alone), and the study and tags the run directory recorded.

    One process per run: a second one raises rundir.RunLocked naming the holder (rundir.run_lock). Any exit is
    recorded: a deliberate stop (rundir.Stopped, KeyboardInterrupt, SystemExit) as `stopped`, every other exception,
    BaseExceptions such as a native library's panic included, as `failed` with its traceback (status.json and
    failure.json). Damaged state raises rundir.RunStateError naming the file and the restart."""
    run_dir = Path(results) / "runs" / cfg.run_id
    status = rundir.read_status(run_dir)
    if status is not None and status["state"] in ("completed", "collapsed"):
        return run_dir
    _check_layout(cfg, run_dir, results)
    preflight(cfg)  # before anything is written
    if not _rank0():  # a parallel layout: every rank trains; rank 0 alone holds the lock, writes the run directory
        _train(cfg, run_dir, Path(results), progress=False, on_eval=None)  # and logs to the trackers
        return run_dir
    if tracking is None:  # a tracker that is named but not installed: refused before anything is written
        tracking = saved_tracking(run_dir, parse_trackers(None))
    run_dir.mkdir(parents=True, exist_ok=True)
    with rundir.run_lock(run_dir):
        status = rundir.read_status(run_dir)  # another process may have finished it before we took the lock
        if status is not None and status["state"] in ("completed", "collapsed"):
            return run_dir
        rundir.write_yaml(run_dir / "config.yaml", cfg.to_dict())
        if not (run_dir / "manifest.json").exists():
            # precision hook: every result says which engine ran emulated (study/core/precision.py)
            manifest = {**rundir.manifest(cfg.seed, cfg.threads), **precision_mod.labels(*cfg.precisions)}
            manifest["native_kernels"] = _kernels_available()
            manifest["parallel"] = cfg.layout.to_dict()  # a runtime choice, not in the run id (RunConfig.parallel)
            rundir.write_json(run_dir / "manifest.json", manifest)
        # the step it had reached (a resume restores its checkpoint's step next, `_train`), not back to 0
        rundir.set_status(run_dir, "running", step=(status or {}).get("step", 0))
        with rundir.recorded(run_dir, lambda: _last_step(run_dir)):  # every exit recorded, SIGTERM = stopped
            _train(cfg, run_dir, Path(results), progress=progress, on_eval=on_eval, tracking=tracking)
        (run_dir / rundir.FAILURE_FILE).unlink(missing_ok=True)  # finished: an earlier attempt's failure is history
    return run_dir


def _last_step(run_dir: Path) -> int:
    try:
        return int((rundir.read_status(run_dir) or {}).get("step", 0))
    except (rundir.RunStateError, TypeError, ValueError):
        return 0


def preflight(cfg: RunConfig) -> None:
    """What a config cannot say about itself, checked on the machine that runs it before anything is written
    (ValueError naming the field): the thread count against this machine's CPUs, and a named cold start's files
    (a sweep may name one that a job before it makes, so RunConfig.validate leaves them to here)."""
    cpus = os.cpu_count() or 1
    if cfg.threads > cpus:
        raise ValueError(f"threads = {cfg.threads}: this machine has {cpus} CPUs; valid: 1..{cpus}")
    machine.check_fits(cfg)  # the planner's memory estimate against this machine, naming the field
    if cfg.coldstart not in ("auto", "scratch"):
        from study.coldstart import hf_import

        directory = Path(cfg.coldstart)
        if not directory.is_dir():
            raise ValueError(f"coldstart = {cfg.coldstart!r}: no such directory; valid: 'auto', 'scratch', a "
                             "cold-start directory (policy.pt) or an HF checkpoint directory")  # fmt: skip
        if not (directory / "policy.pt").is_file() and not hf_import.is_hf_checkpoint(directory):
            raise ValueError(f"coldstart = {cfg.coldstart!r}: neither a cold-start directory (policy.pt; "
                             "`python -m study coldstart` makes one) nor an HF checkpoint (config.json + "
                             "*.safetensors)")  # fmt: skip


def _rank0() -> bool:
    """Whether this process writes the run directory: rank 0 of a launcher's world, or the one process."""
    return int(os.environ.get("RANK", "0")) == 0


def _check_layout(cfg: RunConfig, run_dir: Path, results: str | Path) -> None:
    """Before any compute: what the loop runs under a layout, the world the launcher started, and the layout the
    run's manifest records (a resume keeps it)."""
    layout = cfg.layout
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout.world_size != world:
        raise ValueError(f"parallel = {cfg.parallel} needs {layout.world_size} ranks, the launcher started {world} "
                         "(torchrun --nproc_per_node, or the launcher's tasks_per_node)")  # fmt: skip
    if layout != ParallelLayout():
        alg = algorithms.get(cfg.algorithm)
        rows = cfg.prompts_per_step * cfg.group_size // cfg.minibatches
        why = (
            f"{cfg.algorithm} drops groups (dynamic sampling): the minibatches' sizes vary" if alg.dynamic_sampling
            else f"a minibatch of {rows} sequences does not split evenly over parallel.data = {layout.data}"
            if rows % layout.data
            else "router_lr_scale != 1 (one optimizer group)" if cfg.router_lr_scale != 1.0
            else "fp16 (loss scaling)" if cfg.train_dtype == "fp16"
            else "emulated precision" if cfg.precisions[0].emulated
            else "coldstart = 'scratch' and parallel.expert > 1 (megatron draws each rank's experts from one RNG "
            "stream: not the one-process run's initial weights)" if cfg.coldstart == "scratch" and layout.expert > 1
            else ""
        )  # fmt: skip
        if why:
            raise ValueError(f"parallel = {cfg.parallel}: the RL loop does not run this layout with {why}")
        if cfg.coldstart == "auto":
            from study.coldstart import is_complete, resolve_settings
            from study.coldstart.store import run_coldstart

            settings = resolve_settings(cfg.model, cfg.task, **run_coldstart(cfg))
            if not is_complete(Path(results) / "coldstart" / settings.dirname):
                raise ValueError(f"parallel = {cfg.parallel}: the cold start is trained by one process; make it "
                                 "first (python -m study coldstart, or the same run with parallel = {})")  # fmt: skip
    recorded = _recorded_layout(run_dir)
    if recorded is not None and recorded != layout:  # resharded on resume (_restore), unless it cannot be
        legacy = _legacy_rank_files(run_dir)
        if legacy:
            raise ValueError(
                f"{run_dir}: started with parallel = {recorded.to_dict()}, resumed with parallel = "
                f"{layout.to_dict()}; its checkpoint ({legacy[0].name}) holds per-rank optimizer shards of that "
                "layout, written before checkpoints were resharded: resume with the recorded parallel layout"
            )


def _recorded_layout(run_dir: Path) -> ParallelLayout | None:
    """The layout the run's manifest records as its latest (None: a fresh run)."""
    path = run_dir / "manifest.json"
    if not path.exists():
        return None
    manifest = rundir.read_json(path)
    resumed = manifest.get("parallel_resumed") or []
    recorded = resumed[-1]["parallel"] if resumed else manifest.get("parallel")
    return None if recorded is None else ParallelLayout.from_mapping(recorded)


def _legacy_rank_files(run_dir: Path) -> list[Path]:
    """Per-rank optimizer files of a layout's checkpoint from before distributed checkpoints (torch AdamW shards):
    they load only at their own layout, and not into megatron's optimizer."""
    return sorted((run_dir / "checkpoint").glob("rank*-step*.pt"))


def resume(run_dir: str | Path, *, progress: bool = True, tracking: Tracking | None = None) -> Path:
    """Continue a killed run from its last checkpoint (its directory names everything, its trackers included:
    `tracking` None continues those recorded in trackers.json, or those STUDY_TRACKERS names when it is set)."""
    import yaml

    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise rundir.RunStateError(f"{run_dir}: no such run directory (RESULTS/runs/RUN_ID)")
    if not path.is_file():
        raise rundir.RunStateError(f"{run_dir}: not a run directory (no config.yaml); give RESULTS/runs/RUN_ID")
    try:
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a mapping of config fields")
        cfg = RunConfig.from_dict(data, where=str(path))
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise rundir.RunStateError(f"{path}: cannot be read as this run's config ({err}); restore it, or "
                                   f"{rundir.RESTART}") from None  # fmt: skip
    if cfg.run_id != run_dir.name:
        raise rundir.RunStateError(
            f"{path} was edited: it hashes to run {cfg.run_id}, not to {run_dir.name}; restore it, or run the edited "
            f"config as a new run (`python -m study run {path} --results {run_dir.parent.parent}`)"
        )
    if tracking is None:
        from study.run.trackers import ENV

        tracking = saved_tracking(run_dir, parse_trackers(None) if os.environ.get(ENV) else None)
    return run(cfg, run_dir.parent.parent, progress=progress, tracking=tracking)


def initial_policy(cfg: RunConfig, results: Path) -> tuple[TaskTokenizer, Any]:
    """Tokenizer and weights of the cold start: a Megatron state dict (policy.pt), an HF checkpoint read lazily
    (study.coldstart.hf_import.HFCheckpoint: streamed into the policy by `load_initial`), or None (random init from
    the cold-start seed)."""
    mcfg = cfg.model_config()
    if cfg.coldstart == "scratch":
        from study.data.tokenizer import build_tokenizer, train_tokenizer

        if cfg.task == "user":  # user data hook: a tokenizer of the user's training text
            train, _ = cfg.user_split()
            return train_tokenizer([it.prompt + it.solution for it in train], vocab_size=mcfg.vocab_size), None
        return build_tokenizer(mcfg.vocab_size, [cfg.task], n_per_task=400), None
    if cfg.coldstart == "auto":
        from study.coldstart import ensure_coldstart
        from study.coldstart.store import run_coldstart

        directory = ensure_coldstart(cfg.model, cfg.task, results, **run_coldstart(cfg))
    else:
        directory = Path(cfg.coldstart)
    if not (directory / "policy.pt").is_file():
        from study.coldstart import hf_import

        if hf_import.is_hf_checkpoint(directory):  # HF hook: a local Qwen3-MoE checkpoint
            hf_import.check_checkpoint(directory, cfg.model)
            return hf_import.load_checkpoint(directory, mcfg)
        raise FileNotFoundError(
            f"coldstart = {directory}: no policy.pt (run `python -m study coldstart`) and no HF checkpoint "
            "(config.json + *.safetensors)"
        )
    return TaskTokenizer.load(directory), torch.load(directory / "policy.pt", weights_only=True)


def task_data(cfg: RunConfig) -> tuple[Any, dict[str, list[tasks.TaskItem]]]:
    """(training stream with `take(n, start)`, held-out sets by split: `in_dist` drawn with the training knobs,
    `hard` with HARD_KNOBS). task = "user": the user's training rows cycled in a seed-dependent order per epoch, and
    their held-out split (or eval_data) as `in_dist`."""
    if cfg.task == "user":
        train, held = cfg.user_split()
        return tasks.UserTask(tuple(train), cfg.seed), {"in_dist": held}
    stream = tasks.make_task(cfg.task, seed=cfg.seed, **cfg.task_knobs)
    # in_dist follows the training knobs (the task's defaults when none are set); hard keeps HARD_KNOBS
    return stream, {split: tasks.eval_set(cfg.task, split, size=cfg.eval_size,
                                          knobs=cfg.task_knobs if split == "in_dist" else None)
                    for split in tasks.EVAL_SPLITS}  # fmt: skip


def load_initial(model: torch.nn.Module, init_state: Any) -> None:
    """Load `initial_policy`'s weights into `model`: a state dict whole, an HF checkpoint tensor by tensor."""
    if init_state is None:
        return
    if isinstance(init_state, dict):
        model.load_state_dict(init_state, strict=False)
    else:
        init_state.load_into(model)


def reference_policy(cfg: RunConfig, init_state: Any, train_prec: Any) -> tuple[torch.nn.Module, Any]:
    """KL hook: a frozen copy of the initial policy (same seed, same cold-start weights, same precision as the
    trainer) and its precision handle (keep it alive: it owns the emulation hooks)."""
    parallel = cfg.layout if cfg.layout != ParallelLayout() else None
    ref = build_policy(cfg.model_config(), seed=derive_seed("init", cfg.seed), dtype=train_prec.storage_dtype,
                       parallel=parallel)  # fmt: skip
    _load_full(ref, init_state, parallel is not None)
    handle = precision_mod.apply_precision(ref, train_prec)
    ref.requires_grad_(False)
    return ref, handle


def aggregation_weights(alg: Any, mask: torch.Tensor, hparams: dict[str, Any]) -> torch.Tensor:
    """(B, T) weight of each response token in the algorithm's loss aggregation: -d loss / d logp at ratio 1 with
    advantage 1, where no clip, gate or correction is active, so the gradient is the aggregation itself
    (seq-mean-token-mean: 1 / (B |y_i|); token-mean: 1 / sum |y_i|; Dr. GRPO: 1 / (B L))."""
    probe = torch.zeros(mask.shape, requires_grad=True)
    old = torch.zeros(mask.shape)
    extra = {"rollout_logp": old} if alg.needs_rollout_logp else {}
    loss, _ = alg.loss(probe, old, torch.ones(mask.shape[0]), mask, **hparams, **extra)
    (grad,) = torch.autograd.grad(loss, probe)
    return torch.where(mask.bool(), -grad, 0.0).clamp_min(0.0)


def kl_to_reference(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) on the sampled response tokens (Schulman's k3, as in DeepSeekMath's
    GRPO): e^r - 1 - r with r = logp_ref - logp_theta, >= 0 per token, unbiased for samples from pi_theta (the
    batch is from pi_old, the usual approximation), summed with the algorithm's aggregation `weights`."""
    r = torch.where(mask.bool(), ref_logp.float() - logp.float(), 0.0)
    return (weights * (r.exp() - 1.0 - r)).sum()


@dataclass
class Batch:
    """The step's kept samples as right-padded teacher-forcing tensors (prompt + response, S = longest - 1)."""

    input_ids: torch.Tensor  # (B, S) long: sequence[:-1], 0 after its end
    targets: torch.Tensor  # (B, S) long: sequence[1:], 0 after its end
    attn_mask: torch.Tensor  # (B, S) long: 1 on real inputs
    pos: torch.Tensor  # (B, T) long: index into targets of response token t (T = max_new_tokens)
    mask: torch.Tensor  # (B, T) float: 1 on response tokens
    rollout_logp: torch.Tensor  # (B, T) fp32: the engine's log-probs of the sampled tokens, 0 after the end
    advantages: torch.Tensor  # (B,) the algorithm's advantages
    engine_routes: Routes | None = None  # (B, S, L, k) the engine's routes of input_ids, where it returned them
    temperature: float = 1.0  # the engine sampled from softmax(logits / T): pi_old, pi_theta and the reference too

    @property
    def n(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class Collected:
    """What `_collect` gathered and measured for one step."""

    batch: Batch | None  # None: every group had zero variance and dynamic sampling dropped them all
    data_pos: int  # the task stream's position after the prompts taken
    mastered: list[str]  # prompt_filter = mastered: prompts whose every response got the full reward this step
    metrics: dict[str, float]  # reward, length, truncation and zero-variance statistics, rollout seconds
    flops: float  # the rollout's forward FLOPs estimate


@dataclass
class Parts:
    """What a run is made of, built once at its start (`_setup`)."""

    alg: Any
    hparams: dict[str, Any]
    mcfg: Any
    tok: TaskTokenizer
    policy: torch.nn.Module
    prec: Any  # the trainer's precision handle (study/core/precision.py): re-rounds emulated parameters after a step
    optimizer: torch.optim.Optimizer
    scaler: DynamicLossScaler | None  # fp16 loss scaling
    params: list[torch.nn.Parameter]  # walked after every backward: listed once here, not a module walk each time
    routing: RoutingController
    engine: Any
    stream: Any
    evals: dict[str, list[tasks.TaskItem]]
    ref: torch.nn.Module | None  # KL hook: the frozen initial policy
    ref_prec: Any  # keep alive with `ref`: it owns the reference's emulation hooks
    emulated: bool  # precision hook: whether either engine runs emulated (a label on every row)
    trainer: par.ShardedTrainer | None = None  # a parallel layout: megatron's DDP and the optimizer over the shards


@dataclass
class Progress:
    """Where a run stands: what a checkpoint saves and a resume restores, and the rows written so far."""

    step: int = 0
    data_pos: int = 0
    mastered: set[str] = field(default_factory=set)  # prompt_filter = mastered: prompts the stream skips
    compute: float = 0.0  # cumulative FLOPs estimate
    wall: float = 0.0  # cumulative seconds of the steps
    rows: list[dict[str, float]] = field(default_factory=list)
    layer_rows: list[dict[str, float]] = field(default_factory=list)
    token_frames: list[pd.DataFrame] = field(default_factory=list)  # trainer vs engine log-probs of sampled tokens


def _setup(cfg: RunConfig, results: Path) -> Parts:
    """Build the run's parts: tokenizer and cold-start weights, policy, optimiser, routing controller, rollout
    engine, task data and (KL hook) the reference policy."""
    alg = algorithms.get(cfg.algorithm)
    if alg.routing == "rollout_replay" and not engine_class(cfg.rollout_engine).supports_routes():  # before compute
        raise NotImplementedError(
            f"algorithm {cfg.algorithm} replays the rollout engine's routes (R3), which rollout_engine = "
            f"{cfg.rollout_engine!r} cannot return here (vLLM returns routed experts on CUDA only); valid: "
            "rollout_engine = 'hf', or a GPU"
        )
    mcfg = cfg.model_config()
    tok, init_state = initial_policy(cfg, results)
    if tok.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids, model.vocab_size is {mcfg.vocab_size}")
    train_prec, rollout_prec = cfg.precisions  # precision hook: real or emulated, per engine (study/core/precision.py)
    parallel = cfg.layout if cfg.layout != ParallelLayout() else None
    policy = build_policy(mcfg, seed=derive_seed("init", cfg.seed), dtype=train_prec.storage_dtype, parallel=parallel)
    _load_full(policy, init_state, parallel is not None)
    prec = precision_mod.apply_precision(policy, train_prec)  # rounds the loaded weights when emulated
    eps = precision_mod.adam_eps(train_prec)
    trainer = None
    if parallel is not None:  # the shards' optimizer (study/policy/parallel.py); checks in _check_layout
        trainer = par.ShardedTrainer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=eps,
                                     grad_clip=cfg.grad_clip)  # fmt: skip
        optimizer = trainer.optimizer
    else:
        optimizer = build_optimizer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=eps,
                                    router_lr_scale=cfg.router_lr_scale)  # fmt: skip
    engine_kw = precision_mod.engine_kwargs(rollout_prec)
    if cfg.rollout_engine == "vllm":  # its own process(es), run as rollout_runtime says (study/run/rollout_runtime.py)
        engine_kw.update(runtime=cfg.rollout_runtime, threads=cfg.threads)
    device = next(policy.parameters()).device  # the hf engine on the policy's device (CUDA: this rank's GPU)
    if cfg.rollout_engine == "hf" and device.type != "cpu":
        engine_kw["device"] = device
    # one engine, on rank 0: it rolls out the global batch and broadcasts it (_broadcast)
    engine = get_engine(cfg.rollout_engine, mcfg, dtype=cfg.rollout_dtype, **engine_kw) if _rank0() else None
    stream, evals = task_data(cfg)
    ref, ref_prec = reference_policy(cfg, init_state, train_prec) if cfg.kl_coef > 0 else (None, None)
    return Parts(
        alg=alg, hparams=alg.check_hparams(cfg.hparams), mcfg=mcfg, tok=tok, policy=policy, prec=prec,
        optimizer=optimizer, scaler=DynamicLossScaler() if cfg.train_dtype == "fp16" else None,
        params=list(policy.parameters()), routing=RoutingController(policy), engine=engine, stream=stream,
        evals=evals, ref=ref, ref_prec=ref_prec, emulated=train_prec.emulated or rollout_prec.emulated,
        trainer=trainer,
    )  # fmt: skip


class _NoTracker:
    """The trackers of a rank other than 0 (rank 0 alone logs): nothing."""

    def log(self, row: dict[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, outcome: str) -> None:
        pass


def _load_full(model: torch.nn.Module, init_state: Any, parallel: bool) -> None:
    """Load the cold start's weights: `load_initial`, or under a parallel layout sliced into this rank's shard (a
    state dict whole; an HF checkpoint streamed tensor by tensor, each rank keeping its slice)."""
    if not parallel or init_state is None:
        load_initial(model, init_state)
    elif isinstance(init_state, dict):
        par.load_full_state(model, init_state, strict=False)
    else:
        par.load_streamed(model, init_state.tensors())


def _sync_engine(parts: Parts) -> None:
    """The policy's weights to the rollout engine: every rank takes part in gathering the full tensors (a parallel
    layout), rank 0's engine loads them."""
    if parts.trainer is None:
        parts.engine.load_weights(iter_hf_weights(parts.policy, parts.mcfg))  # streamed: no copy of the model
        return
    weights = par.full_hf_weights(parts.policy)  # collective: every rank iterates it to the end
    if parts.engine is not None:
        parts.engine.load_weights(weights)
    else:
        for _ in weights:
            pass


def _broadcast(obj: Any, parts: Parts) -> Any:
    """rank 0's `obj` on every rank (a parallel layout), else `obj`."""
    if parts.trainer is None:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _read_progress(run_dir: Path, cfg: RunConfig) -> tuple[dict[str, Any] | None, Progress]:
    """The run's progress, read before any compute: fresh (no checkpoint), or its checkpoint's state (applied by
    `_restore` once the parts are built) with the metric rows up to it; everything after the checkpoint is
    recomputed. Damaged or missing state raises rundir.RunStateError naming the file and the restart."""
    path = run_dir / "checkpoint" / "state.pt"
    if not path.exists():
        _check_no_lost_checkpoint(run_dir, path, cfg.checkpoint_every or cfg.steps)
        return None, Progress()
    state = load_checkpoint(path)
    done = state["step"]

    def upto(name: str, required: bool) -> pd.DataFrame | None:
        """The file's rows up to the checkpoint; a missing optional file is a warning (its earlier rows are lost,
        the run goes on and writes the rows after the checkpoint)."""
        file = run_dir / name
        if not file.exists():
            if required:
                raise rundir.RunStateError(f"{file}: missing, but {path} is at step {done}: the rows of steps 0-{done} "
                                           f"are lost; {rundir.RESTART}")  # fmt: skip
            print(f"warning: {file} is missing: its rows of steps up to the checkpoint (step {done}) are lost; the "
                  "run continues and writes the rows after it (restart the run to have them all)",
                  file=sys.stderr)  # fmt: skip
            return None
        try:
            frame = pd.read_parquet(file)
            if "step" not in frame.columns:
                raise ValueError("no 'step' column")
        except Exception as err:  # pyarrow raises its own types for cut-short and garbage files
            if not required:  # a damaged optional file is a missing one: a warning, the checkpoint is intact
                print(f"warning: {file} is unreadable ({_first_line(err)}), treated as missing: its rows of steps up "
                      f"to the checkpoint (step {done}) are lost; the run continues and writes the rows after it",
                      file=sys.stderr)  # fmt: skip
                return None
            raise rundir.RunStateError(f"{file}: unreadable, cut short or not this run's table "
                                       f"({_first_line(err)}); {rundir.RESTART}") from None  # fmt: skip
        frame = frame[frame["step"] <= done]
        if required and not set(range(1, done + 1)) <= set(frame["step"].astype(int)):
            raise rundir.RunStateError(f"{file}: lacks rows of steps 1-{done} that {path} has passed; "
                                       f"{rundir.RESTART}")  # fmt: skip
        return frame

    rows = upto("metrics.parquet", required=True)
    layers, tokens = upto("routing_layers.parquet", required=False), upto(TOKEN_SAMPLES, required=False)
    return state, Progress(
        step=done, data_pos=state["data_pos"], mastered=set(state.get("mastered", [])), compute=state["compute"],
        wall=state["wall"],
        rows=[] if rows is None else rows.to_dict("records"),
        layer_rows=[] if layers is None else layers.to_dict("records"), token_frames=[] if tokens is None else [tokens],
    )  # fmt: skip


def _restore(state: dict[str, Any], parts: Parts, path: Path) -> None:
    """Apply a checkpoint's state: model, optimiser, scaler and every RNG. state.pt holds the one-process form (full
    weights, torch AdamW states by one-process index), whatever layout wrote it, unless a layout run's model was too
    large for it (`full_state_fits`): a one-process resume loads it as it is, and refuses a checkpoint without it.
    Under a parallel layout, a layout run's checkpoint is loaded from its megatron distributed
    checkpoint (`distributed`: model and optimizer shards, each rank's RNG), resharded by megatron when the layout
    changed; a one-process run's checkpoint is sliced into the shards (study/policy/parallel.py)."""
    legacy = _legacy_rank_files(path.parent.parent)
    if legacy:
        raise rundir.RunStateError(f"{legacy[0]}: a per-rank optimizer shard of a checkpoint from before "
                                   "distributed checkpoints (torch AdamW, not megatron's optimizer); "
                                   f"{rundir.RESTART}")  # fmt: skip
    try:
        if parts.trainer is not None:
            if state.get("distributed") is not None:  # megatron's distributed checkpoint, resharded to this layout
                mine = torch.distributed.get_rank() < int(state.get("world", 1))
                rng = par.load_distributed(parts.trainer, path.parent / state["distributed"], rng=mine)
                state = {**state, **(rng or {})}  # a rank the saving world lacked: rank 0's RNG states
            else:  # a one-process run's: its full weights and Adam states sliced into this rank's shard
                par.load_full_state(parts.policy, state["model"])
                names = par.one_process_names(parts.policy)
                parts.trainer.load_full_optimizer_state(par.adam_state_by_name(state["optimizer"], names))
        else:
            if state["model"] is None:
                raise rundir.RunStateError(DISTRIBUTED_ONLY.format(
                    path=path, state=state, valid=f"resume it at a parallel layout (it was saved at "
                    f"{state['parallel']!r}; another layout reshards)"))  # fmt: skip
            _load_model(parts.policy, state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
        if parts.scaler is not None:
            parts.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(_numpy_rng_in(state["numpy_rng"]))
    except rundir.RunStateError:
        raise
    except (KeyError, RuntimeError, TypeError, ValueError, FileNotFoundError) as err:
        raise rundir.RunStateError(f"{path}: not a checkpoint of this run ({_first_line(err)}); "
                                   f"{rundir.RESTART}") from None  # fmt: skip


def _load_model(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A one-process state dict into the one-process model; a layout run's state.pt holds the weights alone (no
    megatron `_extra_state` entries)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.endswith("._extra_state")] + list(unexpected)
    if bad:
        raise KeyError(f"the checkpoint's model does not match the policy: {sorted(bad)[:4]}")


CHECKPOINT_KEYS = ("model", "optimizer", "scaler", "torch_rng", "python_rng", "numpy_rng", "step", "data_pos",
                   "compute", "wall")  # fmt: skip
# Checkpoints written before they stored NumPy's RNG state as a tensor hold it as an ndarray: these NumPy
# constructors (data only, no code) are allowed when loading them.
_NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, np.dtypes.UInt32DType, np._core.multiarray._reconstruct]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A run checkpoint, loaded with torch.load(weights_only=True): tensors and plain values only, so a file that
    holds anything else (a hostile pickle) is refused, never executed. Damage raises RunStateError naming the file."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            state = torch.load(path, weights_only=True)
    except Exception as err:
        if "Weights only load failed" in str(err):
            what = ("refused: it holds objects other than tensors and plain values (torch.load(weights_only=True)); "
                    "a tampered or foreign file")  # fmt: skip
        else:
            what = f"unreadable, cut short or not a checkpoint ({_first_line(err)})"
        raise rundir.RunStateError(f"{path}: {what}; {rundir.RESTART}") from None
    if not isinstance(state, dict) or set(CHECKPOINT_KEYS) - set(state):
        raise rundir.RunStateError(f"{path}: not a run checkpoint (keys {', '.join(CHECKPOINT_KEYS)}); "
                                   f"{rundir.RESTART}")  # fmt: skip
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _numpy_rng_out(state: tuple[Any, ...]) -> dict[str, Any]:
    """np.random.get_state() as a tensor and plain values (what torch.load(weights_only=True) reads)."""
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}  # fmt: skip


def _numpy_rng_in(state: Any) -> tuple[Any, ...]:
    """Inverse of `_numpy_rng_out` (an older checkpoint's tuple passes through)."""
    if isinstance(state, dict):
        keys = state["keys"].numpy().astype(np.uint32)
        return state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]
    return tuple(state)


def _check_no_lost_checkpoint(run_dir: Path, path: Path, first_checkpoint: int) -> None:
    """No checkpoint: a fresh start, unless the metrics reach the step at which the first checkpoint was written
    (then the checkpoint was lost, and starting again at step 0 silently would throw its steps away)."""
    metrics = run_dir / "metrics.parquet"
    if not metrics.exists():
        return
    try:
        reached = int(pd.read_parquet(metrics, columns=["step"])["step"].max())
    except Exception:
        reached = -1  # unreadable metrics without a checkpoint: nothing to continue from; rewritten from step 0
    if reached >= first_checkpoint:
        raise rundir.RunStateError(f"{path}: missing, but {metrics} reaches step {reached} (the first checkpoint is "
                                   f"written at step {first_checkpoint}); {rundir.RESTART}")  # fmt: skip


def _train(
    cfg: RunConfig,
    run_dir: Path,
    results: Path,
    *,
    progress: bool,
    on_eval: Callable[..., None] | None = None,
    tracking: Tracking | None = None,
) -> None:
    torch.set_num_threads(cfg.threads)
    state, log = _read_progress(run_dir, cfg)  # damaged state: an error before any compute
    if _rank0():
        rundir.set_status(run_dir, "running", step=log.step)
    parts = _setup(cfg, results)
    alg, mcfg, policy, routing, engine = parts.alg, parts.mcfg, parts.policy, parts.routing, parts.engine
    try:  # the live trackers (study/run/trackers.py): every row below goes to each, as it is recorded (rank 0's)
        if state is not None:
            _restore(state, parts, run_dir / "checkpoint" / "state.pt")
        if _rank0() and (_recorded_layout(run_dir) or cfg.layout) != cfg.layout:  # resumed under another layout
            manifest = rundir.read_json(run_dir / "manifest.json")
            if state is None:  # no checkpoint: the run starts again from step 0, all of it at this layout
                manifest["parallel"] = cfg.layout.to_dict()
            else:  # resharded from this step's checkpoint on
                resumed = {"step": log.step, "parallel": cfg.layout.to_dict()}
                manifest["parallel_resumed"] = [*manifest.get("parallel_resumed", []), resumed]
            rundir.write_json(run_dir / "manifest.json", manifest)
        tracker = RunLogger(run_dir, tracking or Tracking(), cfg.to_dict(), start_step=log.step) if _rank0() else None
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    tracker = tracker if tracker is not None else _NoTracker()
    _sync_engine(parts)
    if log.step == 0 and not log.rows and cfg.eval_every:  # the start's held-out pass@1: what RL is measured from
        row = dict.fromkeys(STEP_METRICS, math.nan)
        row.update(step=0, lr=cfg.lr, compute_flops=0.0, wall_s=0.0, precision_emulated=float(parts.emulated))
        log.rows.append({**row, **(_evaluate(cfg, engine, parts.tok, parts.evals, 0) if engine is not None else {})})
        tracker.log(log.rows[-1])

    bar = _progress(cfg.steps, log.step, progress)
    step = log.step
    last_write = time.monotonic()
    outcome = "failed"  # what the trackers are told at the end
    # The ~400k objects of the libraries and the setup live as long as the run: frozen, the cyclic garbage collector
    # stops re-walking them in each of its passes over the steps' short-lived objects (a 8-sequence update: -4%).
    gc.freeze()
    row = None
    try:
        for step in range(log.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            eval_step = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
            row: dict[str, float] = dict.fromkeys(STEP_METRICS, math.nan)
            row.update(step=step, lr=cfg.lr, precision_emulated=float(parts.emulated))  # precision hook: a label

            # 1-3. rollouts, rewards, advantages (refilling dropped groups for dynamic sampling)
            collected = _broadcast(_collect(cfg, alg, engine, parts.stream, parts.tok, log.data_pos, step,
                                            log.mastered) if engine is not None else None, parts)  # fmt: skip
            if engine is not None:
                engine.offload()  # colocated vLLM on CUDA: the GPU to the trainer until the sync
            log.data_pos = collected.data_pos
            log.mastered.update(collected.mastered)
            log.compute += collected.flops
            row.update(collected.metrics)
            batch = collected.batch
            if batch is None:  # every group had zero variance: nothing to learn from this step
                row["wall_s"] = log.wall = log.wall + time.perf_counter() - t0
                log.rows.append(row)
                tracker.log(row)
                last_write = _maybe_write(cfg, step, last_write, run_dir, log, tracker) if _rank0() else last_write
                continue

            # 4. pi_old: training-engine recompute (routing recorded or, for R3, the engine's replayed). The first
            # minibatch is not recomputed: its first update forward runs on the same tokens with the same weights
            # (nothing has been updated yet), so that forward's detached log-probs and routes are pi_old's.
            t1 = time.perf_counter()
            ids, tgt, am, pos = batch.input_ids, batch.targets, batch.attn_mask, batch.pos
            r3 = alg.routing == "rollout_replay"
            perm = torch.randperm(batch.n, generator=torch.Generator().manual_seed(derive_seed("mb", cfg.seed, step)))
            chunks = torch.tensor_split(perm, min(cfg.minibatches, batch.n))
            first, rest = chunks[0], perm[len(chunks[0]) :]
            old_parts = []
            if len(rest):
                with torch.no_grad():
                    if parts.trainer is None:
                        old_parts.append(_old_pass(policy, routing, batch, rest, r3))
                    else:  # a rank's share of each minibatch, as its update will see it
                        old_parts += [_old_pass_rows(parts, batch, idx, r3) for idx in chunks[1:]]
            t_old = time.perf_counter() - t1
            t2 = time.perf_counter()
            logp_first, free_first, entropy_first = _old_pass_rows(parts, batch, first, r3)  # the first update's
            t_first = time.perf_counter() - t2
            old_parts.insert(0, (logp_first.detach(), free_first, entropy_first))
            unperm = perm.argsort()  # the parts are in perm order (first, then rest)
            train_old = torch.cat([lp for lp, _, _ in old_parts])[unperm]  # (B, T)
            free_old = Routes(Routes.cat([r for _, r, _ in old_parts]).experts[unperm])  # pi_old's free routing
            old_routes = batch.engine_routes if r3 else free_old
            ref_logp = None
            t1 = time.perf_counter()
            if parts.ref is not None:  # KL hook: reference log-probs with the reference's own (free) routing
                with torch.no_grad():
                    ref_logp = token_logp(
                        parts.ref, ids, tgt, attention_mask=am, positions=pos, temperature=batch.temperature
                    ).cpu()  # (B, T)
                log.compute += forward_flops(mcfg, int(am.sum()), ids.shape[1] / 2)
            row["time_old_logp_s"] = t_old + time.perf_counter() - t1
            row.update(_mismatch(train_old, batch.rollout_logp, batch.mask))
            if step in (1, cfg.steps) or eval_step:
                log.token_frames.append(_token_samples(step, train_old, batch.rollout_logp, batch.mask))
            # expert load of pi_old's free routing and its routers' entropy over the real tokens (per layer: load)
            load = expert_load(free_old, routing.num_experts, am, torch.cat([e for _, _, e in old_parts])[unperm])
            if batch.engine_routes is not None:  # the engine's routing vs the trainer's free routing of the same tokens
                vol = routing_volatility(batch.engine_routes, free_old, am, per_layer=False)
                row["engine_routing_slot_mismatch"] = vol["slot_mismatch"]
                load.update({f"engine_{k}": v for k, v in expert_load(batch.engine_routes, routing.num_experts,
                                                                      am).items()})  # fmt: skip
            row.update({k: v for k, v in load.items() if k in STEP_METRICS})  # the means over layers
            old_logp = train_old if cfg.old_logp_source == "recompute" else batch.rollout_logp  # (B, T)
            if cfg.old_logp_source == "recompute":
                log.compute += forward_flops(mcfg, int(am[rest].sum()), ids.shape[1] / 2)

            # 5. minibatch updates (the first one's forward ran above)
            t2 = time.perf_counter()
            sums: dict[str, float] = {}
            vols: list[dict[str, float]] = []
            for i, idx in enumerate(chunks):
                if i == 0:
                    logp, new_free = logp_first, free_first
                else:
                    logp, new_free = _forward_rows(parts, batch, idx, old_routes if alg.routing != "free" else None)
                if i > 0:  # the first minibatch's forward precedes every update: its routing is pi_old's itself
                    vols.append(routing_volatility(free_old[idx], new_free, am[idx]))
                mb = _update(cfg, parts, logp, old_logp[idx], batch, idx,
                             None if ref_logp is None else ref_logp[idx], step)  # fmt: skip
                for key, value in mb.items():
                    sums[key] = sums.get(key, 0.0) + value
                log.compute += 3 * forward_flops(mcfg, int(am[idx].sum()), ids.shape[1] / 2)
            row.update({k: v / len(chunks) for k, v in sums.items()})
            row.update(_mean_volatility(vols))
            log.layer_rows += _layer_rows(step, vols, load, routing.num_layers)
            row["time_update_s"] = t_first + time.perf_counter() - t2

            # 6. weights to the rollout engine
            t3 = time.perf_counter()
            _sync_engine(parts)
            row["time_sync_s"] = time.perf_counter() - t3
            if cfg.sync_check_every and step % cfg.sync_check_every == 0:  # a metric, never a stop
                row.update(_sync_parity(policy, routing, engine, batch))
            log.wall += time.perf_counter() - t0
            row.update(compute_flops=log.compute, wall_s=log.wall, peak_rss_gb=_peak_rss_gb())
            row["tokens_total"] = int(am.sum())

            if eval_step and engine is not None:
                row.update(_evaluate(cfg, engine, parts.tok, parts.evals, step))
            log.rows.append(row)
            tracker.log(row)
            log.step = step
            if _rank0():
                last_write = _maybe_write(cfg, step, last_write, run_dir, log, tracker)
            _check_reward_floor(cfg, log.rows)
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                _checkpoint(run_dir, parts, log)
            if _rank0():
                rundir.set_status(run_dir, "running", step=step)
            _tick(bar, row)
            if on_eval is not None and eval_step:
                on_eval(step, row)  # tuning hook (sweeps/tune.py): may stop the run by raising
        outcome = "completed"
    except Collapse as why:  # every rank decides alike: from the global loss and the broadcast rewards
        outcome = "collapsed"
        if row is not None and (not log.rows or log.rows[-1] is not row):  # the collapsing step's row: kept
            log.rows.append(row)
            tracker.log(row)
        if _rank0():
            _write_metrics(run_dir, log)
            rundir.set_status(run_dir, "collapsed", step=step, reason=str(why))
        return
    except BaseException as exc:  # a crash or interrupt keeps the rows of the finished steps (resume recomputes them)
        outcome = "stopped" if isinstance(exc, (rundir.Stopped, KeyboardInterrupt, SystemExit)) else "failed"
        if _rank0():
            _write_metrics(run_dir, log)
        raise
    finally:
        gc.unfreeze()  # what the run leaves behind is collectable again (several runs may share a process)
        if bar is not None:
            bar.close()
        if engine is not None:
            engine.close()
        tracker.close(outcome)
    if _rank0():
        rundir.set_status(run_dir, "completed", step=cfg.steps)


def _update(
    cfg: RunConfig,
    parts: Parts,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    batch: Batch,
    idx: torch.Tensor,
    ref_logp: torch.Tensor | None,
    step: int,
) -> dict[str, float]:
    """One minibatch update from its forward's `logp` (b, T) against `old_logp` (b, T): the algorithm's loss
    (+ the KL hook), backward, global-norm clip, optimiser step. Returns the minibatch's metrics; raises Collapse
    on an exploding ratio or a non-finite loss or gradient."""
    alg, hparams = parts.alg, parts.hparams
    mask = batch.mask[idx]  # (b, T)
    with torch.no_grad():
        d = torch.where(mask.bool(), old_logp - logp.detach(), 0.0)  # (b, T) log pi_old - log pi_theta
        if float(d.abs().max()) > cfg.max_log_ratio:
            raise Collapse(f"exploding ratio: max |log pi_theta - log pi_old| = {float(d.abs().max()):.3g}")
    # ALGO: the loss
    extra = {"rollout_logp": batch.rollout_logp[idx]} if alg.needs_rollout_logp else {}
    loss, metrics = alg.loss(logp, old_logp, batch.advantages[idx], mask, **hparams, **extra)
    if ref_logp is not None:  # KL hook: + kl_coef x k3 KL(pi_theta || pi_ref), with the algorithm's averaging
        kl = kl_to_reference(logp, ref_logp, mask, aggregation_weights(alg, mask, hparams))
        loss = loss + cfg.kl_coef * kl
        metrics = {**metrics, "kl_ref": float(kl.detach())}
    if not torch.isfinite(loss):
        raise Collapse(f"non-finite loss at step {step}")
    if (
        parts.trainer is not None
    ):  # a parallel layout: megatron reduces, the global norm clips (study/policy/parallel.py)
        parts.trainer.zero_grad()
        loss.backward()
        _, norm = parts.trainer.step()
        if not math.isfinite(norm):
            raise Collapse(f"non-finite gradient norm at step {step}")
        grad_norm = torch.tensor(norm)
    else:
        grad_norm = _local_step(cfg, parts, loss, step)
    n = float(mask.sum().clamp_min(1))
    with torch.no_grad():
        k3 = float(torch.where(mask.bool(), d.exp() - 1 - d, 0.0).sum() / n)
        entropy = float(-torch.where(mask.bool(), logp.detach(), 0.0).sum() / n)
    return {**metrics, "loss": loss.item(), "approx_kl": k3, "entropy_est": entropy, "grad_norm": float(grad_norm)}


def _local_step(cfg: RunConfig, parts: Parts, loss: torch.Tensor, step: int) -> torch.Tensor:
    """One process's backward, clip and optimiser step; returns the gradient norm before clipping."""
    scaler = parts.scaler
    parts.optimizer.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    params = [p for p in parts.params if p.grad is not None]
    if scaler is not None:
        scaler.unscale_(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if not torch.isfinite(grad_norm) and scaler is None:
        raise Collapse(f"non-finite gradient norm at step {step}")
    if scaler is not None:
        scaler.step(parts.optimizer, [])  # already unscaled; skips the step on overflow
    else:
        parts.optimizer.step()
    parts.prec.round_parameters_()  # precision hook: emulated parameters are stored rounded
    return grad_norm


def _mean_volatility(vols: list[dict[str, float]]) -> dict[str, float]:
    """The step's routing volatility, old vs new policy after each update: the mean over the minibatches that follow
    at least one update (the off-policy minibatches 2..M; the first one's forward is pi_old's own, a structural zero
    that would dilute the mean by (M-1)/M). NaN with one minibatch: no update precedes any forward of the rollouts."""
    if not vols:
        return dict.fromkeys(("routing_slot_mismatch", "routing_set_flip_rate", "routing_token_flip_rate"), math.nan)
    return {f"routing_{m}": float(np.mean([v[m] for v in vols])) for m in ("slot_mismatch", "set_flip_rate",
                                                                           "token_flip_rate")}  # fmt: skip


def _layer_rows(
    step: int, vols: list[dict[str, float]], load: dict[str, float], num_layers: int
) -> list[dict[str, float]]:
    """routing_layers.parquet's rows of the step: per layer, the minibatches' mean slot mismatch and set-flip rate,
    then the pi_old pass's expert load and router entropy and the engine's expert load (NaN without its routes)."""
    moved = vols[0] if vols else {}  # no update-minibatch (one minibatch): NaN volatility
    return [{"step": step, "layer": layer, **{m: float(np.mean([v[f"{m}_l{layer}"] for v in vols]))
                                               if f"{m}_l{layer}" in moved else load.get(f"{m}_l{layer}", math.nan)
                                               for m in LAYER_METRICS}}
            for layer in range(num_layers)]  # fmt: skip


def _old_pass(
    policy: torch.nn.Module, routing: RoutingController, batch: Batch, idx: torch.Tensor, r3: bool
) -> tuple[torch.Tensor, Routes, torch.Tensor]:
    """pi_old's forward of the rows idx, the engine's routes replayed (R3) or free routing recorded: response
    log-probs (b, T), the routes free routing chose and each token's router entropy (b, S, L)."""
    with routing.replaying(batch.engine_routes[idx]) if r3 else routing.recording():
        logp = token_logp(policy, batch.input_ids[idx], batch.targets[idx], attention_mask=batch.attn_mask[idx],
                          positions=batch.pos[idx], temperature=batch.temperature)  # fmt: skip
    # the loop's tensors live on the CPU (a no-op there); on CUDA the copy is differentiable back to the GPU
    return logp.cpu(), routing.free_routes() if r3 else routing.routes(), routing.router_entropy()


def _old_pass_rows(
    parts: Parts, batch: Batch, idx: torch.Tensor, r3: bool
) -> tuple[torch.Tensor, Routes, torch.Tensor]:
    """`_old_pass` of the global rows idx: at one process those rows; under a parallel layout this rank's share
    (study/policy/parallel.py data_rows), then every rank's gathered (log-probs differentiable in this rank's rows)."""
    if parts.trainer is None:
        return _old_pass(parts.policy, parts.routing, batch, idx, r3)
    n, local = len(idx), idx[par.data_rows(len(idx))]
    logp, routes, entropy = _old_pass(parts.policy, parts.routing, batch, local, r3)
    return par.gather_rows(logp, n), Routes(par.gather_rows(routes.experts, n)), par.gather_rows(entropy, n)


def _forward_rows(parts: Parts, batch: Batch, idx: torch.Tensor, replay: Routes | None) -> tuple[torch.Tensor, Routes]:
    """An update's forward of the global rows idx: `replay`'s routes of them forced (None: free routing recorded).
    Returns the log-probs (b, T) and the routes free routing chose (gathered over ranks, like `_old_pass_rows`)."""
    rows = idx if parts.trainer is None else idx[par.data_rows(len(idx))]
    routing = parts.routing
    with routing.replaying(replay[rows]) if replay is not None else routing.recording():
        logp = token_logp(parts.policy, batch.input_ids[rows], batch.targets[rows],
                          attention_mask=batch.attn_mask[rows], positions=batch.pos[rows],
                          temperature=batch.temperature).cpu()  # fmt: skip
    free = routing.free_routes() if replay is not None else routing.routes()
    if parts.trainer is None:
        return logp, free
    return par.gather_rows(logp, len(idx)), Routes(par.gather_rows(free.experts, len(idx)))


def _collect(cfg: RunConfig, alg: Any, engine: Any, stream: Any, tok: TaskTokenizer, data_pos: int, step: int,
             mastered: set[str]) -> Collected:  # fmt: skip
    """Rollouts for one step as a padded batch, with what was measured on them. With prompt_filter = mastered the
    stream's prompts in `mastered` are skipped, and the prompts every response solved are returned to join it."""
    t0 = time.perf_counter()
    want = cfg.prompts_per_step
    kept: list[dict[str, Any]] = []
    n_groups = n_zero = n_solved = 0
    flops = 0.0
    all_rewards: list[float] = []
    lengths_all: list[int] = []
    truncated = 0
    skipped = 0
    newly_mastered: list[str] = []
    for attempt in range(3 if alg.dynamic_sampling else 1):
        need = want - len(kept) // cfg.group_size  # groups still missing (dynamic sampling refills dropped ones)
        if need <= 0:
            break
        if cfg.prompt_filter == "mastered":
            items, data_pos, n_skip = _take_unmastered(stream, need, data_pos, mastered)
            skipped += n_skip
        else:
            items = stream.take(need, start=data_pos)
            data_pos += len(items)
        prompts = [tok.encode_prompt(item.prompt) for item in items]
        rollout = engine.generate(
            prompts,
            cfg.group_size,
            seed=derive_seed("rollout", cfg.seed, step, attempt),
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=[tok.eos_id],
            return_routes=alg.routing == "rollout_replay" or engine.routes_supported,  # R3, or engine-vs-trainer
        )
        texts = [tok.decode_response(t)[0] for t in rollout.tokens]
        rewards = torch.tensor(
            [tasks.score(items[p], text) for p, text in zip(rollout.prompt_index, texts, strict=True)]
        )
        lengths = torch.tensor([len(t) for t in rollout.tokens])
        all_rewards += rewards.tolist()
        lengths_all += lengths.tolist()
        truncated += sum(r == "length" for r in rollout.finish_reasons)
        prompt_tokens = sum(len(prompts[p]) for p in rollout.prompt_index)
        flops += forward_flops(cfg.model_config(), rollout.num_tokens + prompt_tokens, cfg.max_new_tokens)
        shaped = alg.reward_shaping(rewards, lengths, cfg.max_new_tokens) if alg.reward_shaping else rewards  # ALGO
        adv = alg.advantages(shaped, cfg.group_size)  # ALGO
        grouped = shaped.view(-1, cfg.group_size)
        zero_var = (grouped == grouped[:, :1]).all(1)
        n_groups += len(items)
        n_zero += int(zero_var.sum())
        solved = (rewards.view(-1, cfg.group_size) >= 1.0).all(1)  # every response fully rewarded
        n_solved += int(solved.sum())
        if cfg.prompt_filter == "mastered":
            newly_mastered += [items[p].prompt for p in range(len(items)) if bool(solved[p])]
        for p in range(len(items)):
            if alg.dynamic_sampling and bool(zero_var[p]):
                continue
            for j in range(cfg.group_size):
                i = p * cfg.group_size + j
                routes = rollout.routes[i] if rollout.routes is not None else None
                kept.append({"prompt": prompts[p], "response": rollout.tokens[i], "logp": rollout.logprobs[i],
                             "adv": float(adv[i]), "routes": routes})  # fmt: skip
    metrics = {
        "reward_mean": float(np.mean(all_rewards)),
        "reward_std": float(np.std(all_rewards)),
        "response_len_mean": float(np.mean(lengths_all)),
        "response_len_max": float(np.max(lengths_all)),
        "truncation_rate": truncated / len(lengths_all),
        "zero_var_group_frac": n_zero / n_groups,
        "zero_var_solved_frac": n_solved / n_groups,
        "prompts_skipped_mastered": float(skipped) if cfg.prompt_filter == "mastered" else math.nan,
        "tokens": float(sum(lengths_all)),
        "time_rollout_s": time.perf_counter() - t0,
    }
    batch = _pad(kept, cfg.max_new_tokens, cfg.layout.tensor, cfg.temperature)
    return Collected(batch, data_pos, newly_mastered, metrics, flops)


MAX_SKIPS_PER_PROMPT = 64
"""prompt_filter = mastered: draws skipped per prompt taken before the stream's next prompt is taken mastered or not
(a task whose every prompt is mastered would otherwise never yield one)."""


def _take_unmastered(stream: Any, n: int, start: int, mastered: set[str]) -> tuple[list[tasks.TaskItem], int, int]:
    """The next `n` items of the stream from position `start` whose prompts are not in `mastered`: (items, the
    position after the last draw, draws skipped). After MAX_SKIPS_PER_PROMPT skips in a row the next item is taken
    as it is."""
    items: list[tasks.TaskItem] = []
    pos, skipped, run = start, 0, 0
    while len(items) < n:
        item = stream[pos]
        pos += 1
        if item.prompt in mastered and run < MAX_SKIPS_PER_PROMPT:
            skipped += 1
            run += 1
            continue
        items.append(item)
        run = 0
    return items, pos, skipped


def _pad(samples: list[dict[str, Any]], max_new: int, multiple: int = 1, temperature: float = 1.0) -> Batch | None:
    """The samples as a right-padded `Batch` (None for none): each tensor filled by one scatter over all samples (a
    per-sample loop of slice writes was ~2% of a step at 8x4x32 and 32x8x64 on `tiny`). The width S is the longest
    sequence - 1, rounded up to a `multiple` (parallel.tensor: sequence parallelism splits S over the tensor-parallel
    ranks); the extra columns are padding like any other (causal attention: no real token sees them; masked out)."""
    n = len(samples)
    if n == 0:
        return None
    p_len = torch.tensor([len(s["prompt"]) for s in samples])
    r_len = torch.tensor([len(s["response"]) for s in samples])
    seq_len = p_len + r_len
    width = -(-(int(seq_len.max()) - 1) // multiple) * multiple
    flat = torch.tensor([tok for s in samples for part in (s["prompt"], s["response"]) for tok in part])
    rows = torch.repeat_interleave(torch.arange(n), seq_len)  # the sample of each flat token
    cols = torch.arange(len(flat)) - torch.repeat_interleave(seq_len.cumsum(0) - seq_len, seq_len)
    full = torch.zeros(n, width + 1, dtype=torch.long)
    full[rows, cols] = flat
    am = (torch.arange(width) < (seq_len - 1)[:, None]).long()
    steps = torch.arange(max_new)
    in_resp = steps < r_len[:, None]
    roll = torch.zeros(n, max_new)
    roll[in_resp] = torch.cat([torch.as_tensor(s["logp"], dtype=roll.dtype) for s in samples])
    engine_routes = None
    if samples[0]["routes"] is not None:
        r0 = samples[0]["routes"]
        r_rows = torch.tensor([s["routes"].shape[0] for s in samples])
        routes = torch.zeros(n, width, *r0.shape[1:], dtype=r0.dtype)
        routes[torch.arange(width) < r_rows[:, None]] = torch.cat([s["routes"] for s in samples])
        engine_routes = Routes(routes)
    return Batch(
        input_ids=full[:, :-1] * am, targets=full[:, 1:] * am, attn_mask=am,
        pos=(p_len[:, None] - 1 + steps).clamp(max=width - 1),  # target index of response token t
        mask=in_resp.float(), rollout_logp=roll, advantages=torch.tensor([s["adv"] for s in samples]),
        engine_routes=engine_routes, temperature=temperature,
    )  # fmt: skip


SYNC_CHECK_SEQS = 4
"""Sequences of the step's batch the post-sync parity check scores (sync_check_every)."""


@torch.no_grad()
def _sync_parity(policy: torch.nn.Module, routing: RoutingController, engine: Any, batch: Batch) -> dict[str, float]:
    """Right after a weight sync: the first SYNC_CHECK_SEQS sequences of the step's batch scored teacher-forced by
    the rollout engine and by the trainer (free routing), both on the weights just synced; |difference| per response
    token. In the same real dtype this is the sync's fidelity (fp32: ~1e-6); across dtypes, the mismatch. Both at
    temperature 1 whatever the rollouts' (the engine's `score` returns raw log-probs): the weights are what is
    checked."""
    idx = torch.arange(min(SYNC_CHECK_SEQS, batch.n))
    ids, tgt, am, pos = batch.input_ids[idx], batch.targets[idx], batch.attn_mask[idx], batch.pos[idx]
    with routing.recording():
        trainer = token_logp(policy, ids, tgt, attention_mask=am, positions=pos)  # (b, T)
    if engine is None:  # a parallel layout's other ranks: the forward above is collective, rank 0's engine scores
        return {}
    prompts, responses = [], []
    for i in range(len(idx)):
        seq = [int(ids[i, 0]), *tgt[i, : int(am[i].sum())].tolist()]
        start = int(pos[i, 0]) + 1  # the prompt's length
        prompts.append(seq[:start])
        responses.append(seq[start:])
    scored, _ = engine.score(prompts, responses)
    mask = batch.mask[idx].bool()
    diff = (trainer[mask].float() - torch.cat(scored).float()).abs()
    return {"sync_parity_mean_abs": float(diff.mean()), "sync_parity_max_abs": float(diff.max())}


@torch.no_grad()
def _mismatch(train_old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    m = mask.bool()
    d = (train_old - rollout_logp)[m]  # delta = logp_train_old - logp_rollout
    if d.numel() == 0:
        return {}
    return {
        "mismatch_mean_abs": float(d.abs().mean()),
        "mismatch_max_abs": float(d.abs().max()),
        "mismatch_k3": float((d.exp() - 1 - d).mean()),
        "mismatch_frac_gt2": float((d.abs() > math.log(2.0)).float().mean()),
    }


@torch.no_grad()
def _evaluate(cfg, engine, tok, evals, step) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Mean pass@1 over k samples on each held-out set (same sampling seed at every evaluation)."""
    out = {}
    for split, items in evals.items():
        rollout = engine.generate(
            [tok.encode_prompt(item.prompt) for item in items],
            cfg.eval_samples,
            seed=derive_seed("eval", split),
            temperature=cfg.eval_temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=[tok.eos_id],
        )
        scores = [[0.0] * cfg.eval_samples for _ in items]
        for i, (p, toks) in enumerate(zip(rollout.prompt_index, rollout.tokens, strict=True)):
            scores[p][i % cfg.eval_samples] = tasks.score(items[p], tok.decode_response(toks)[0])
        out[f"eval_{split}"] = tasks.pass_at_1(scores)
    return out


def _check_reward_floor(cfg: RunConfig, rows: list[dict[str, float]]) -> None:
    if cfg.reward_floor <= -1.0 or len(rows) < cfg.collapse_window:
        return
    recent = float(np.mean([r["reward_mean"] for r in rows[-cfg.collapse_window :]]))
    if recent < cfg.reward_floor:
        raise Collapse(
            f"reward collapse: mean reward {recent:.3f} over {cfg.collapse_window} steps < {cfg.reward_floor}"
        )


def _maybe_write(
    cfg: RunConfig, step: int, last_write: float, run_dir: Path, log: Progress, tracker: RunLogger
) -> float:
    """Write the metric files at every checkpoint step (before the checkpoint: resume keeps the rows up to it), at
    the last step, and otherwise at most every METRICS_EVERY_S seconds for live monitoring: rewriting the whole table
    every step cost 9% of a tiny step. The trackers flush with them. Returns the time of the last write."""
    due = step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
    if due or time.monotonic() - last_write >= METRICS_EVERY_S:
        _write_metrics(run_dir, log)
        tracker.flush()
        return time.monotonic()
    return last_write


def _write_metrics(run_dir: Path, log: Progress) -> None:
    if not log.rows:
        return
    frame = pd.DataFrame(log.rows, columns=list(STEP_METRICS) + sorted({k for r in log.rows for k in r} -
                                                                       set(STEP_METRICS)))  # fmt: skip
    frame["step"] = frame["step"].astype("int64")
    rundir.atomic_write(run_dir / "metrics.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
    if log.layer_rows:
        layers = pd.DataFrame(log.layer_rows)
        rundir.atomic_write(run_dir / "routing_layers.parquet", lambda tmp: layers.to_parquet(tmp, index=False))
    if log.token_frames:
        tokens = pd.concat(log.token_frames, ignore_index=True)
        rundir.atomic_write(run_dir / TOKEN_SAMPLES, lambda tmp: tokens.to_parquet(tmp, index=False))


@torch.no_grad()
def _token_samples(step: int, train_old: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> pd.DataFrame:
    """The first TOKEN_SAMPLE_SEQS sequences' response tokens: trainer (pi_old recompute) vs engine log-probs."""
    m = mask[:TOKEN_SAMPLE_SEQS].bool()
    sample, pos = m.nonzero(as_tuple=True)
    frame = pd.DataFrame(
        {
            "step": np.full(len(sample), step, dtype=np.int64),
            "sample": sample.numpy().astype(np.int64),
            "pos": pos.numpy().astype(np.int64),
            "trainer_logp": train_old[:TOKEN_SAMPLE_SEQS][m].float().numpy().astype(np.float32),
            "engine_logp": rollout_logp[:TOKEN_SAMPLE_SEQS][m].float().numpy().astype(np.float32),
        }
    )
    return frame[list(TOKEN_SAMPLE_COLUMNS)]


def _checkpoint(run_dir: Path, parts: Parts, log: Progress) -> None:
    """state.pt: the model, optimiser, scaler, RNG states and position. Under a parallel layout every rank first
    writes its shards and RNG states into megatron's distributed checkpoint `dist-step{N}` (model, optimizer; made
    under a .tmp name, renamed when complete), then rank 0 writes state.pt naming that checkpoint, in the
    one-process form (the full weights and Adam states by one-process name and index: `study export` and a
    one-process resume read it) when that fits rank 0's memory (`full_state_fits`), else with model and optimizer
    None (the distributed checkpoint alone holds them); older distributed checkpoints are removed after."""
    if parts.trainer is not None:
        ckpt, name = run_dir / "checkpoint", f"dist-step{log.step}"
        rng = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
               "numpy_rng": _numpy_rng_out(np.random.get_state())}  # fmt: skip
        par.save_distributed(parts.trainer, ckpt / f"{name}.tmp", rng=rng)  # collective
        full_form = full_state_fits(parts.mcfg)  # the same answer on every rank: the gathers are collectives
        full = par.full_state_dict(parts.policy) if full_form else {}  # collective
        adam = parts.trainer.full_optimizer_state() if full_form else {}  # collective
        torch.distributed.barrier()
        if _rank0():
            shutil.rmtree(ckpt / name, ignore_errors=True)
            (ckpt / f"{name}.tmp").rename(ckpt / name)
            model = {n: full[n] for n in par.one_process_names(parts.policy)} if full_form else None
            optimizer = par.one_process_adam_state(adam, model, parts.trainer.hparams) if model is not None else None
            state = {**rng, "model": model, "optimizer": optimizer,
                     "scaler": None, "step": log.step, "data_pos": log.data_pos, "mastered": sorted(log.mastered),
                     "compute": log.compute,
                     "wall": log.wall, "distributed": name, "world": torch.distributed.get_world_size(),
                     "parallel": current_layout().to_dict()}  # fmt: skip
            rundir.atomic_write(ckpt / "state.pt", lambda tmp: torch.save(state, tmp))
            for old in ckpt.glob("dist-step*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        torch.distributed.barrier()
        return
    state = {
        "model": parts.policy.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": _numpy_rng_out(np.random.get_state()),
        "step": log.step,
        "data_pos": log.data_pos,
        "mastered": sorted(log.mastered),
        "compute": log.compute,
        "wall": log.wall,
    }
    rundir.atomic_write(run_dir / "checkpoint" / "state.pt", lambda tmp: torch.save(state, tmp))


DISTRIBUTED_ONLY = (
    "{path}: holds the weights and optimizer only in megatron's distributed checkpoint {state[distributed]!r} (a "
    "layout run writes the one-process form only when 12 bytes x its parameters fit STUDY_FULL_STATE_MAX_GB, default "
    "8); valid: {valid}"
)
"""Why a state.pt without the one-process form cannot be read as one (a one-process resume, `study export`)."""
FULL_STATE_MAX_GB = 8.0
"""Largest one-process form (fp32 weights and both Adam moments, 12 bytes a parameter) rank 0 gathers into state.pt
at a layout; the environment variable STUDY_FULL_STATE_MAX_GB overrides it. Qwen3-30B-A3B's would be ~366 GB."""


def full_state_fits(mcfg: Any) -> bool:
    """Whether a layout run's state.pt carries the one-process form: 12 bytes a parameter <= the limit."""
    limit = float(os.environ.get("STUDY_FULL_STATE_MAX_GB", FULL_STATE_MAX_GB))
    return 12 * param_counts(mcfg).total <= limit * 2**30


def _kernels_available() -> bool:
    """Whether the optional C kernels are on and built here (study/kernels/; results agree with the torch paths to
    ~1e-6): the manifest's `native_kernels`."""
    try:
        from study import kernels
    except ImportError:
        return False
    return kernels.available()


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _progress(total: int, start: int, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="rl", unit="step", file=sys.stderr, dynamic_ncols=True)


def _tick(bar, row: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
    if bar is not None:
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", clip=f"{row['clip_frac']:.2g}", refresh=False)
        bar.update(1)
