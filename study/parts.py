"""What a run is made of, built once at its start (`setup`: the cold start's tokenizer and weights, the policy and
its optimiser, the routing controller and the routers' kicks (RunConfig.router_kick), the rollout engine, the task
data, the KL reference), and the trainer's forwards of a batch's rows (one process: those rows; a parallel layout:
this rank's share, then every rank's gathered): a step's, pi_old's pass and the updates', are `StepForwards`'s. The
loop that uses them is study/rl.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

import algorithms
from algorithms import Algorithm
from study import lifecycle
from study.batch import Batch
from study.core import precision as precision_mod
from study.core.model_config import ModelConfig, ParallelLayout
from study.data import tasks
from study.data.tokenizer import TaskTokenizer
from study.policy import parallel as par
from study.policy.kick import RouterKick
from study.policy.model import build_policy, token_logp
from study.policy.optim import DynamicLossScaler, build_optimizer
from study.policy.routing import Routes, RoutingController
from study.rollout import engine_class, get_engine
from study.run.config import RunConfig


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any values (the run's seed and what draws: "init", ("rollout", seed, step, attempt), ...):
    every random draw of a run is a function of them, so a resumed run redraws what an uninterrupted one draws."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


def initial_policy(cfg: RunConfig, results: Path) -> tuple[TaskTokenizer, Any]:
    """Tokenizer and weights of the cold start: a Megatron state dict (policy.pt), an HF checkpoint read lazily
    (study.coldstart.hf_import.HFCheckpoint: streamed into the policy by `load_initial`), or None (random init from
    the cold-start seed)."""
    mcfg = cfg.model_config()
    if cfg.coldstart == "scratch":
        from study.data.tokenizer import build_tokenizer

        if cfg.task == "user":  # user data hook: a tokenizer of the user's training text
            return lifecycle.user_tokenizer(cfg), None
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
    from study.coldstart import read_policy_file  # tensors and plain values only: a hostile pickle is refused

    return TaskTokenizer.load(directory), read_policy_file(directory / "policy.pt")


def load_initial(model: torch.nn.Module, init_state: Any, parallel: bool = False) -> None:
    """Load `initial_policy`'s weights into `model`: a state dict whole, an HF checkpoint tensor by tensor; under a
    parallel layout sliced into this rank's shard (an HF checkpoint streamed, each rank keeping its slice)."""
    if init_state is None:
        return
    if isinstance(init_state, dict) and parallel:
        par.load_full_state(model, init_state, strict=False)
    elif isinstance(init_state, dict):
        model.load_state_dict(init_state, strict=False)
    elif parallel:
        par.load_streamed(model, init_state.tensors())
    else:
        init_state.load_into(model)


@dataclass
class Parts:
    """What a run is made of, built once at its start (`setup`)."""

    alg: Algorithm
    hparams: dict[str, Any]
    mcfg: ModelConfig
    tok: TaskTokenizer
    policy: torch.nn.Module
    prec: Any  # the trainer's precision handle (study/core/precision.py): re-rounds emulated parameters after a step
    optimizer: torch.optim.Optimizer
    scaler: DynamicLossScaler | None  # fp16 loss scaling
    params: list[torch.nn.Parameter]  # walked after every backward: listed once here, not a module walk each time
    routing: RoutingController
    kick: RouterKick  # the routing-volatility dial (RunConfig.router_kick): the routers' kicks within a step
    engine: Any  # the rollout engine (study/rollout/); None on a parallel layout's ranks other than 0
    stream: Any
    evals: dict[str, list[tasks.TaskItem]]
    ref: torch.nn.Module | None  # KL hook: the frozen initial policy
    ref_prec: Any  # keep alive with `ref`: it owns the reference's emulation hooks
    emulated: bool  # precision hook: whether either engine runs emulated (a label on every row)
    trainer: par.ShardedTrainer | None = None  # a parallel layout: megatron's DDP and the optimizer over the shards


def setup(cfg: RunConfig, results: Path) -> Parts:
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
    # activation recompute (RunConfig.recompute): megatron's, through the model config; the trainer alone backpropagates
    recompute = {} if cfg.recompute == "none" else {"recompute_granularity": cfg.recompute}
    trained = dataclasses.replace(mcfg, extra={**mcfg.extra, **recompute})
    policy = build_policy(
        trained,
        seed=derive_seed("init", cfg.seed),
        dtype=train_prec.storage_dtype,
        experts=cfg.experts,  # the experts' path (RunConfig.experts): grouped GEMMs or one expert after another
        parallel=parallel,
    )
    load_initial(policy, init_state, parallel is not None)
    prec = precision_mod.apply_precision(policy, train_prec)  # rounds the loaded weights when emulated
    eps = precision_mod.adam_eps(train_prec)
    trainer = None
    if parallel is not None:  # the shards' optimizer (study/policy/parallel.py); checks in lifecycle.check_layout
        trainer = par.ShardedTrainer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=eps, grad_clip=cfg.grad_clip)
        optimizer = trainer.optimizer
    else:
        optimizer = build_optimizer(
            policy, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=eps, router_lr_scale=cfg.router_lr_scale
        )
    engine_kw = precision_mod.engine_kwargs(rollout_prec)
    if cfg.rollout_engine == "vllm":  # its own process(es), run as rollout_runtime says (study/run/rollout_runtime.py)
        engine_kw.update(runtime=cfg.rollout_runtime, threads=cfg.threads)
    device = next(policy.parameters()).device  # the hf engine on the policy's device (CUDA: this rank's GPU)
    if cfg.rollout_engine == "hf" and device.type != "cpu":
        engine_kw["device"] = device
    if cfg.engine_router_noise:  # the hf engine's routing perturbed (a train/inference routing mismatch)
        engine_kw["router_noise"] = cfg.engine_router_noise
    # one engine, on rank 0: it rolls out the global batch and broadcasts it (`broadcast`)
    engine = (
        get_engine(cfg.rollout_engine, mcfg, dtype=cfg.rollout_dtype, **engine_kw) if lifecycle.is_rank0() else None
    )
    stream, evals = cfg.task_data()
    ref, ref_prec = None, None
    if cfg.kl_coef > 0:  # KL hook: a frozen copy of the initial policy, the trainer's seed, weights and precision
        ref = build_policy(
            mcfg,
            seed=derive_seed("init", cfg.seed),
            dtype=train_prec.storage_dtype,
            experts=cfg.experts,
            parallel=parallel,
        )
        load_initial(ref, init_state, parallel is not None)
        ref_prec = precision_mod.apply_precision(ref, train_prec)
        ref.requires_grad_(False)
    routing = RoutingController(policy)
    return Parts(
        alg=alg,
        hparams=alg.check_hparams(cfg.hparams),
        mcfg=mcfg,
        tok=tok,
        policy=policy,
        prec=prec,
        optimizer=optimizer,
        scaler=DynamicLossScaler() if cfg.train_dtype == "fp16" else None,
        params=list(policy.parameters()),
        routing=routing,
        kick=RouterKick(routing.routers, cfg.router_kick, functools.partial(derive_seed, "router_kick", cfg.seed)),
        engine=engine,
        stream=stream,
        evals=evals,
        ref=ref,
        ref_prec=ref_prec,
        emulated=train_prec.emulated or rollout_prec.emulated,
        trainer=trainer,
    )


def micro_chunks(rows: torch.Tensor, micro_batch: int) -> tuple[torch.Tensor, ...]:
    """`rows` in forwards of at most `micro_batch` sequences (0: one forward of them all)."""
    return (rows,) if micro_batch <= 0 or micro_batch >= len(rows) else torch.split(rows, micro_batch)


def local_positions(parts: Parts, n: int) -> torch.Tensor:
    """The positions, in an n-row global minibatch, of the rows this rank forwards (study/policy/parallel.py
    data_rows: a contiguous share; at one process all of them)."""
    return torch.arange(n) if parts.trainer is None else par.data_rows(n)


@dataclass
class Forward:
    """The trainer's forward of some rows of a batch."""

    logp: torch.Tensor  # (b, T) response log-probs on the CPU (differentiable unless forwarded under no_grad)
    routes: Routes  # (b, S, L, k) the experts free routing chose (under replay: would have chosen)
    entropy: torch.Tensor | None = None  # (b, S, L) each token's router entropy, where asked for

    @staticmethod
    def cat(forwards: list[Forward]) -> Forward:
        """The forwards' rows one after the other."""
        if len(forwards) == 1:
            return forwards[0]
        entropy = None if forwards[0].entropy is None else torch.cat([f.entropy for f in forwards])
        return Forward(torch.cat([f.logp for f in forwards]), Routes.cat([f.routes for f in forwards]), entropy)

    def rows(self, order: torch.Tensor) -> Forward:
        """These rows taken in `order` (indices into them)."""
        entropy = None if self.entropy is None else self.entropy[order]
        return Forward(self.logp[order], Routes(self.routes.experts[order]), entropy)


def forward_local(
    parts: Parts, batch: Batch, rows: torch.Tensor, replay: Routes | None, entropy: bool = False
) -> Forward:
    """One forward of the batch's rows `rows` on this rank: `replay`'s routes of them forced (`replay`: routes of the
    whole batch), or None: free routing recorded; with `entropy` each token's router entropy too."""
    routing = parts.routing
    with routing.replaying(replay[rows]) if replay is not None else routing.recording():
        logp = token_logp(
            parts.policy,
            batch.input_ids[rows],
            batch.targets[rows],
            attention_mask=batch.attn_mask[rows],
            positions=batch.pos[rows],
            temperature=batch.temperature,
        ).cpu()
    # the loop's tensors live on the CPU (a no-op there); on CUDA the copy is differentiable back to the GPU
    free = routing.free_routes() if replay is not None else routing.routes()
    return Forward(logp, free, routing.router_entropy() if entropy else None)


def forward_rows(
    parts: Parts, batch: Batch, idx: torch.Tensor, replay: Routes | None, micro_batch: int = 0, entropy: bool = False
) -> Forward:
    """`forward_local` of the global rows idx in forwards of at most `micro_batch` rows: at one process those rows;
    under a parallel layout this rank's share, then every rank's gathered (log-probs differentiable in this rank's
    rows)."""
    n, local = len(idx), idx[local_positions(parts, len(idx))]
    out = Forward.cat([forward_local(parts, batch, rows, replay, entropy) for rows in micro_chunks(local, micro_batch)])
    if parts.trainer is None:
        return out
    entropy_all = None if out.entropy is None else par.gather_rows(out.entropy, n)
    return Forward(par.gather_rows(out.logp, n), Routes(par.gather_rows(out.routes.experts, n)), entropy_all)


def minibatches(seed: int, count: int, n: int, step: int) -> list[torch.Tensor]:
    """The step's n rows in a random order (drawn from (seed, step)) split into `count` minibatches of rows (n of one
    row when n < count)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed("mb", seed, step)))
    return list(torch.tensor_split(perm, min(count, n)))


@dataclass
class PiOld:
    """pi_old of the step's batch as the trainer computes it: the policy that sampled it, before any update."""

    logp: torch.Tensor  # (B, T) the trainer's recomputed log-probs, detached
    routes: Routes  # (B, S, L, k) the routes free routing chose in that forward (under replay: would have chosen)
    entropy: torch.Tensor  # (B, S, L) each token's router entropy in it
    ref_logp: torch.Tensor | None  # (B, T) KL hook: the frozen reference's log-probs (its own, free routing)
    tokens: int  # the real tokens of the forwards that were pi_old's alone (not the first update's, made with them)


class Update(NamedTuple):
    """One minibatch update: its metrics, and what its forward saw before the optimizer step."""

    metrics: dict[str, float]
    routes: Routes  # (b, S, L, k) the routes free routing chose in its forward (under replay: would have chosen)
    logp: torch.Tensor  # (b, T) its forward's log-probs, detached


class StepForwards:
    """The trainer's forwards of one step's batch, split into its minibatches `chunks` (rows of the batch): pi_old's
    pass and the updates'. The first minibatch is forwarded once when this rank's share of it fits one forward
    (`fused`: micro_batch 0 or at least that many rows): pi_old's pass makes that forward with gradients, timed as
    the update's (`timed`, the step's clock), and the first update takes it (same tokens, same weights: nothing has
    been updated yet; the same routes: a replaying update forces those that forward ran on). Otherwise each update
    forwards its rows in micro-batches (`micro`), between their backwards."""

    def __init__(
        self,
        parts: Parts,
        batch: Batch,
        chunks: list[torch.Tensor],
        micro_batch: int,
        timed: Callable[[str], AbstractContextManager[None]],
    ) -> None:
        self.parts, self.batch, self.chunks, self.micro_batch, self.timed = parts, batch, chunks, micro_batch, timed
        self.fused = len(micro_chunks(local_positions(parts, len(chunks[0])), micro_batch)) == 1
        self.first: Forward | None = None  # the first update's forward (fused), made by pi_old's pass, until taken

    def pi_old(self, replay: Routes | None) -> PiOld:
        """The trainer's pi_old of every row (`replay`: the routes forced, None: free routing recorded), and the
        reference's log-probs (KL hook). The rows after the first minibatch's: at one process in one forward (in
        micro-batches), under a parallel layout each minibatch as its update sees it."""
        parts, batch, chunks = self.parts, self.batch, self.chunks
        rest = [torch.cat(chunks[1:])] if parts.trainer is None and len(chunks) > 1 else chunks[1:]
        with torch.no_grad():
            forwards = [forward_rows(parts, batch, idx, replay, self.micro_batch, entropy=True) for idx in rest]
        if self.fused:  # the first update's forward
            with self.timed("time_update_s"), torch.enable_grad():
                self.first = forward_rows(parts, batch, chunks[0], replay, entropy=True)
            head = dataclasses.replace(self.first, logp=self.first.logp.detach())
        else:
            with torch.no_grad():
                head = forward_rows(parts, batch, chunks[0], replay, self.micro_batch, entropy=True)
        old = Forward.cat([head, *forwards]).rows(torch.cat(chunks).argsort())  # the rows back in the batch's order
        ref_logp = None
        if parts.ref is not None:  # KL hook: reference log-probs with the reference's own (free) routing
            with torch.no_grad():
                ref_logp = token_logp(
                    parts.ref,
                    batch.input_ids,
                    batch.targets,
                    attention_mask=batch.attn_mask,
                    positions=batch.pos,
                    temperature=batch.temperature,
                ).cpu()  # (B, T)
        tokens = sum(int(batch.attn_mask[idx].sum()) for idx in (chunks[1:] if self.fused else chunks))
        return PiOld(old.logp, old.routes, old.entropy, ref_logp, tokens)

    def update(self, i: int, replay: Routes | None) -> Forward:
        """Minibatch i's update forward (`fused`), with gradients, `replay`'s routes forced (None: free routing): the
        first minibatch's made by pi_old's pass (taken once), the others' here."""
        if i > 0:
            return forward_rows(self.parts, self.batch, self.chunks[i], replay)
        if self.first is None:
            raise RuntimeError("the first update's forward is made by pi_old's pass: `pi_old` first, once a step")
        forward, self.first = self.first, None
        return forward

    def micro(self, idx: torch.Tensor, replay: Routes | None) -> Iterator[tuple[torch.Tensor, Forward]]:
        """The minibatch of rows idx as this rank forwards it in micro-batches (not `fused`), with gradients,
        `replay`'s routes forced: each micro-batch's positions in the minibatch and its forward, the next made when
        asked for (after the caller's backward)."""
        for pos in micro_chunks(local_positions(self.parts, len(idx)), self.micro_batch):
            yield pos, forward_local(self.parts, self.batch, idx[pos], replay)


def broadcast(obj: Any, parts: Parts) -> Any:
    """rank 0's `obj` on every rank (a parallel layout), else `obj`."""
    if parts.trainer is None:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
