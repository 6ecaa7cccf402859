"""The RL run: one algorithm on one configuration, from a cold-start checkpoint to a run directory analysis trusts.

Setup builds the parts (`setup`); then per step (GSPO paper, section 5.1; `# ALGO` marks each point where the
algorithm decides):
 1. collect: P prompts from the task stream -> G samples each from the rollout engine, with the engine's own
    log-probs; rewards from the task's verifier (truncated responses scored as they stand); ALGO reward shaping
    (DAPO); ALGO advantages `alg.advantages(rewards, G)`; ALGO dynamic sampling: zero-variance groups dropped and
    refilled;
 2. pi_old (study/parts.py `StepForwards`, the step's trainer forwards): log-probs recomputed by the training
    engine, ALGO with routing recorded or (R3) the engine's routes replayed (the first minibatch's forward is also its
    update's: same tokens, same weights); ALGO `old_logp_source: rollout` uses the engine's log-probs instead (section
    5.4);
 3. minibatch updates: the batch split into M minibatches; for each: forward with ALGO the routing the algorithm asks
    for (free / replay / rollout_replay), ALGO `alg.loss`, backward, clip, AdamW step (`micro_batch` > 0: forward
    and backward in micro-batches, the gradients accumulated before the step); with router_kick > 0 minibatch m's
    forwards route through m - 1 Gaussian kicks to the routers, never held by the weights (study/policy/kick.py);
 4. sync: the weights pushed to the rollout engine;
 5. log: a held-out evaluation every N steps, the metrics row (study/record.py; files written at checkpoints);
 6. checkpoint every N steps (study/checkpoint.py).
What a step measures besides its loss (seconds, FLOPs, mismatch, routing volatility and, with routing_attribution,
its share of the log-ratio from one extra forward per off-policy minibatch, expert load) is study/measures.py's
`StepMeasures`, one call per stage; each metric's meaning and function: study/run/metrics.py.
The run directory, its lock, the manifest and every exit are study/lifecycle.py's.
Optional (kl_coef > 0, off by default as in the paper): a frozen copy of the initial policy gives reference log-probs
(its own, free routing) and the loss adds kl_coef x k3 KL(pi_theta || pi_ref), weighted per token as the algorithm
aggregates its own tokens (`aggregation_weights`). task = "user" trains on a user's rows (study.data.tasks.UserTask) and
coldstart may name a local HF checkpoint (study/coldstart/hf_import.py).
All randomness is derived from (seed, step), so a resumed run is bit-identical to an uninterrupted one on CPU at a
fixed thread count.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from algorithms import Algorithm
from study import checkpoint, lifecycle, record
from study.batch import Batch, Minibatch, pad, take_unmastered
from study.core.weights import iter_hf_weights
from study.data import tasks
from study.data.tokenizer import TaskTokenizer
from study.measures import StepMeasures
from study.parts import Parts, StepForwards, Update, broadcast, derive_seed, minibatches, setup
from study.policy import parallel
from study.policy.model import token_logp
from study.policy.optim import clip_grad_norm
from study.policy.routing import Routes, RoutingController
from study.run import rundir
from study.run.config import RunConfig
from study.run.metrics import STEP_METRICS, forward_flops, k3
from study.run.trackers import ENV as TRACKERS_ENV
from study.run.trackers import RunLogger, Tracking, parse_trackers, saved_tracking

SYNC_CHECK_SEQS = 4  # sequences of the step's batch the post-sync parity check scores (sync_check_every)


class Collapse(Exception):
    """The run diverged or collapsed: a result to record, not a crash."""


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
    The run directory's lock, manifest and exit records: study/lifecycle.py. Damaged state raises
    rundir.RunStateError naming the file and the restart."""
    results = Path(results)
    run_dir = results / "runs" / cfg.run_id
    if lifecycle.finished(run_dir):
        return run_dir
    lifecycle.preflight(cfg, run_dir, results)  # before anything is written
    if not lifecycle.is_rank0():  # a parallel layout: every rank trains; rank 0 alone holds the lock, writes the run
        train(cfg, run_dir, results, progress=False)  # directory and logs to the trackers
        return run_dir
    if tracking is None:  # a tracker that is named but not installed: refused before anything is written
        tracking = saved_tracking(run_dir, parse_trackers(None))
    with lifecycle.claimed(cfg, run_dir) as todo:  # False: another process finished it first
        if todo:
            train(cfg, run_dir, results, progress=progress, on_eval=on_eval, tracking=tracking)
    return run_dir


def resume(run_dir: str | Path, *, progress: bool = True, tracking: Tracking | None = None) -> Path:
    """Continue a killed run from its last checkpoint (its directory names everything, its trackers included:
    `tracking` None continues those recorded in trackers.json, or those STUDY_TRACKERS names when it is set)."""
    run_dir = Path(run_dir)
    cfg = lifecycle.resume_config(run_dir)
    if tracking is None:
        tracking = saved_tracking(run_dir, parse_trackers(None) if os.environ.get(TRACKERS_ENV) else None)
    return run(cfg, run_dir.parent.parent, progress=progress, tracking=tracking)


# ---------------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------------
def train(
    cfg: RunConfig,
    run_dir: Path,
    results: Path,
    *,
    progress: bool,
    on_eval: Callable[..., None] | None = None,
    tracking: Tracking | None = None,
) -> None:
    """The run from its checkpoint (or step 0) to its last step; rank 0 records `completed` or `collapsed` (every
    other exit is recorded around it: lifecycle.recorded_exit) and writes the run directory."""
    torch.set_num_threads(cfg.threads)
    rank0 = lifecycle.is_rank0()
    state, log = checkpoint.read(run_dir, cfg.checkpoint_every or cfg.steps)  # damaged state: before any compute
    if rank0:
        rundir.set_status(run_dir, "running", step=log.step)
    parts = setup(cfg, results)
    alg, engine = parts.alg, parts.engine
    recorder = _restore(cfg, parts, run_dir, state, log, tracking)
    _sync_engine(parts)
    if log.step == 0 and not log.rows and cfg.eval_every:  # the start's held-out pass@1: what RL is measured from
        recorder.keep(_start_row(cfg, parts))

    settings = UpdateSettings(cfg.kl_coef, cfg.max_log_ratio, cfg.grad_clip)
    bar = record.ProgressBar(cfg.steps, log.step, progress)
    step, row, outcome = log.step, None, "failed"  # outcome: what the trackers are told at the end
    # The ~400k objects of the libraries and the setup live as long as the run: frozen, the cyclic garbage collector
    # stops re-walking them in each of its passes over the steps' short-lived objects (a 8-sequence update: -4%).
    gc.freeze()
    try:
        for step in range(log.step + 1, cfg.steps + 1):
            eval_step = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
            checkpoint_step = step == cfg.steps or bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            measure = StepMeasures(cfg, parts, log, step)  # the step's row, timers, FLOPs and routing bookkeeping
            row = measure.row

            # 1. collect: rollouts, rewards, advantages (rank 0's engine; the batch broadcast to every rank)
            collected = _rollout_batch(cfg, parts, log, step)
            measure.collected(collected.metrics, collected.flops)
            batch = collected.batch
            if batch is None:  # ALGO dynamic sampling dropped every group (all zero variance): nothing to learn from
                recorder.add(measure.finish(None), due=checkpoint_step)
                continue

            # 2. pi_old: the trainer's log-probs of the batch, ALGO with routing recorded or (R3) the engine's replayed
            chunks = minibatches(cfg.seed, cfg.minibatches, batch.n, step)
            forwards = StepForwards(parts, batch, chunks, cfg.micro_batch, measure.timed)  # the step's trainer forwards
            with measure.timed("time_old_logp_s"):
                old = forwards.pi_old(batch.engine_routes if alg.routing == "rollout_replay" else None)  # ALGO routing
            old_logp = old.logp if cfg.old_logp_source == "recompute" else batch.rollout_logp  # ALGO pi_old (B, T)
            measure.pi_old(batch, old, token_samples=step in (1, cfg.steps) or eval_step)

            # 3. minibatch updates, ALGO routing free or pi_old's replayed (R3: the engine's)
            replay = {"free": None, "replay": old.routes, "rollout_replay": batch.engine_routes}[alg.routing]
            targets = [batch.minibatch(idx, old_logp, old.ref_logp) for idx in chunks]
            with measure.timed("time_update_s"):
                updates = _updates(parts, forwards, targets, replay, step, settings, measure)
            measure.updates(batch, chunks, old, updates)

            # 4. sync: the weights to the rollout engine
            with measure.timed("time_sync_s"):
                _sync_engine(parts)
            if cfg.sync_check_every and step % cfg.sync_check_every == 0:  # a metric, never a stop
                row.update(_sync_parity(parts.policy, parts.routing, engine, batch))
            measure.finish(batch)

            # 5. log: the held-out evaluation, the row (files: at checkpoints, and every METRICS_EVERY_S)
            if eval_step and engine is not None:
                row.update(_evaluate(cfg, engine, parts.tok, parts.evals, step))
            log.step = step
            recorder.add(row, due=checkpoint_step)
            _check_reward_floor(cfg, log.rows)

            # 6. checkpoint
            if checkpoint_step:
                checkpoint.save(run_dir, parts, log)
            if rank0:
                rundir.set_status(run_dir, "running", step=step)
            bar.tick(row)
            if on_eval is not None and eval_step:
                on_eval(step, row)  # tuning hook (sweeps/tune.py): may stop the run by raising
        outcome = "completed"
    except Collapse as why:  # every rank decides alike: from the global loss and the broadcast rewards
        outcome = "collapsed"
        if row is not None and (not log.rows or log.rows[-1] is not row):  # the collapsing step's row: kept
            recorder.keep(row)
        recorder.write()
        if rank0:
            rundir.set_status(run_dir, "collapsed", step=step, reason=str(why))
        return
    except BaseException as exc:  # a crash or interrupt keeps the rows of the finished steps (resume recomputes them)
        outcome = "stopped" if isinstance(exc, (rundir.Stopped, KeyboardInterrupt, SystemExit)) else "failed"
        recorder.write()
        raise
    finally:
        gc.unfreeze()  # what the run leaves behind is collectable again (several runs may share a process)
        bar.close()
        if engine is not None:
            engine.close()
        recorder.tracker.close(outcome)
    if rank0:
        rundir.set_status(run_dir, "completed", step=cfg.steps)


def _restore(
    cfg: RunConfig, parts: Parts, run_dir: Path, state: Any, log: record.Progress, tracking: Tracking | None
) -> record.Recorder:
    """The checkpoint's `state` into the parts (a resume; None: a new run), the layout into the manifest, and the
    run's Recorder with the live trackers (study/run/trackers.py: rank 0's get every row as it is recorded). The
    engine is closed if any of it fails."""
    rank0 = lifecycle.is_rank0()
    try:
        if state is not None:
            checkpoint.restore(state, parts, checkpoint.path_of(run_dir))
        if rank0:  # a resume under another layout: resharded from the checkpoint, recorded in the manifest
            lifecycle.record_layout(cfg, run_dir, None if state is None else log.step)
        tracker = RunLogger(run_dir, tracking or Tracking(), cfg.to_dict(), start_step=log.step) if rank0 else None
    except BaseException:
        if parts.engine is not None:
            parts.engine.close()
        raise
    return record.Recorder(run_dir, log, tracker if tracker is not None else record.NoTracker(), writes=rank0)


def _start_row(cfg: RunConfig, parts: Parts) -> dict[str, float]:
    """Step 0's row: the starting policy's held-out evaluation (rank 0's engine), compute and wall 0, the rest NaN."""
    row = dict.fromkeys(STEP_METRICS, math.nan)
    row.update(step=0, lr=cfg.lr, compute_flops=0.0, wall_s=0.0, precision_emulated=float(parts.emulated))
    return {**row, **(_evaluate(cfg, parts.engine, parts.tok, parts.evals, 0) if parts.engine is not None else {})}


# ---------------------------------------------------------------------------------------------------------------------
# 1. collect
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Collected:
    """What `_collect` gathered and measured for one step."""

    batch: Batch | None  # None: every group had zero variance and dynamic sampling dropped them all
    data_pos: int  # the task stream's position after the prompts taken
    mastered: list[str]  # prompt_filter = mastered: prompts whose every response got the full reward this step
    metrics: dict[str, float]  # reward, length, truncation and zero-variance statistics, rollout seconds
    flops: float  # the rollout's forward FLOPs estimate


def _rollout_batch(cfg: RunConfig, parts: Parts, log: record.Progress, step: int) -> Collected:
    """The step's rollouts on rank 0's engine (`_collect`), broadcast to every rank; the task stream's position and
    the mastered prompts move on in `log`."""
    collected = None
    if parts.engine is not None:
        collected = _collect(cfg, parts.alg, parts.engine, parts.stream, parts.tok, log.data_pos, step, log.mastered)
        parts.engine.offload()  # colocated vLLM on CUDA: asleep before the broadcast lets any rank start its forward
    collected = broadcast(collected, parts)
    log.data_pos = collected.data_pos
    log.mastered.update(collected.mastered)
    return collected


def _collect(
    cfg: RunConfig,
    alg: Algorithm,
    engine: Any,
    stream: Any,
    tok: TaskTokenizer,
    data_pos: int,
    step: int,
    mastered: set[str],
) -> Collected:
    """Rollouts for one step as a padded batch, with what was measured on them. With prompt_filter = mastered the
    stream's prompts in `mastered` are skipped, and the prompts every response solved are returned to join it."""
    t0 = time.perf_counter()
    kept: list[dict[str, Any]] = []
    n_groups = n_zero = n_solved = truncated = skipped = 0
    flops = 0.0
    all_rewards: list[float] = []
    lengths_all: list[int] = []
    newly_mastered: list[str] = []
    for attempt in range(3 if alg.dynamic_sampling else 1):  # ALGO dynamic sampling: refill the dropped groups
        need = cfg.prompts_per_step - len(kept) // cfg.group_size  # groups still missing
        if need <= 0:
            break
        if cfg.prompt_filter == "mastered":
            items, data_pos, n_skip = take_unmastered(stream, need, data_pos, mastered)
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
        adv = alg.advantages(shaped, cfg.group_size)  # ALGO advantages (B,)
        grouped = shaped.view(-1, cfg.group_size)
        zero_var = (grouped == grouped[:, :1]).all(1)
        n_groups += len(items)
        n_zero += int(zero_var.sum())
        solved = (rewards.view(-1, cfg.group_size) >= 1.0).all(1)  # every response fully rewarded
        n_solved += int(solved.sum())
        if cfg.prompt_filter == "mastered":
            newly_mastered += [items[p].prompt for p in range(len(items)) if bool(solved[p])]
        for p in range(len(items)):
            if alg.dynamic_sampling and bool(zero_var[p]):  # ALGO dynamic sampling: a zero-variance group dropped
                continue
            for j in range(cfg.group_size):
                i = p * cfg.group_size + j
                routes = rollout.routes[i] if rollout.routes is not None else None
                kept.append(
                    {
                        "prompt": prompts[p],
                        "response": rollout.tokens[i],
                        "logp": rollout.logprobs[i],
                        "adv": float(adv[i]),
                        "routes": routes,
                    }
                )
    metrics = {
        "reward_mean": float(np.mean(all_rewards)),
        "reward_std": float(np.std(all_rewards)),
        "response_len_mean": float(np.mean(lengths_all)),
        "response_len_max": float(np.max(lengths_all)),
        "truncation_rate": truncated / len(lengths_all),
        "zero_var_group_frac": n_zero / n_groups,
        "zero_var_solved_frac": n_solved / n_groups,
        "prompts_skipped_mastered": float(skipped) if cfg.prompt_filter == "mastered" else math.nan,
        "scorer_failures": float(tasks.take_scorer_failures()),  # verifiers that failed or timed out: scored 0
        "tokens": float(sum(lengths_all)),
        "time_rollout_s": time.perf_counter() - t0,
    }
    batch = pad(kept, cfg.max_new_tokens, cfg.layout.tensor, cfg.temperature)
    return Collected(batch, data_pos, newly_mastered, metrics, flops)


# ---------------------------------------------------------------------------------------------------------------------
# 3. the updates
# ---------------------------------------------------------------------------------------------------------------------
class UpdateSettings(NamedTuple):
    """The run's fields a minibatch update reads (RunConfig's of the same names)."""

    kl_coef: float  # KL hook: the k3 KL(pi_theta || pi_ref) penalty's coefficient (0: no reference)
    max_log_ratio: float  # a response token's |log pi_theta - log pi_old| above it is a collapse (exploding ratio)
    grad_clip: float  # the global gradient-norm clip (0: none)


def _updates(
    parts: Parts,
    forwards: StepForwards,
    targets: list[Minibatch],
    replay: Routes | None,
    step: int,
    settings: UpdateSettings,
    measure: StepMeasures,
) -> list[Update]:
    """The step's minibatch updates in order (`targets[i]`: minibatch i's rows, `forwards.chunks[i]`, and what its
    loss is computed against), ALGO with `replay`'s routes forced (None: free routing): each from one forward of its
    rows (`forwards.update`: the first one's made by pi_old's pass), or, where this rank's share of a minibatch is more
    than one micro-batch, in micro-batches (`_update_micro`). `measure` sees the weights each update starts from
    (routing_attribution). With RunConfig.router_kick each minibatch's forwards route through the kicks drawn after
    the updates before it (study/policy/kick.py); the weights never hold them."""
    out = []
    for i, mb in enumerate(targets):
        with parts.kick.minibatch(step, i):  # the routing-volatility dial (router_kick): the routers' i kicks so far
            measure.routing_attribution(forwards, i, replay)  # instrumentation: before the update, on its weights
            if forwards.fused:
                forward = forwards.update(i, replay)
                update = Update(_update(parts, forward.logp, mb, step, settings), forward.routes, forward.logp.detach())
            else:
                update = _update_micro(parts, forwards, mb, replay, step, settings)
        out.append(update)
    return out


def _loss(parts: Parts, logp: torch.Tensor, mb: Minibatch, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The minibatch's loss from its log-probs `logp` (b, T) against `mb.old_logp` (b, T), and its metrics."""
    alg, hparams = parts.alg, parts.hparams
    # ALGO: the loss
    extra = {"rollout_logp": mb.rollout_logp} if alg.needs_rollout_logp else {}
    loss, metrics = alg.loss(logp, mb.old_logp, mb.advantages, mb.mask, **hparams, **extra)
    if mb.ref_logp is not None:  # KL hook: + kl_coef x k3 KL(pi_theta || pi_ref), with the algorithm's averaging
        kl = kl_to_reference(logp, mb.ref_logp, mb.mask, aggregation_weights(alg, mb.mask, hparams))
        loss = loss + kl_coef * kl
        metrics = {**metrics, "kl_ref": float(kl.detach())}
    return loss, metrics


def _update(
    parts: Parts, logp: torch.Tensor, mb: Minibatch, step: int, settings: UpdateSettings, accumulated: bool = False
) -> dict[str, float]:
    """One minibatch update from its forward's `logp` (b, T) against `mb.old_logp` (b, T): the algorithm's loss
    (+ the KL hook), backward, global-norm clip, optimiser step (`accumulated`: the gradients are there already,
    `logp` their forwards' values). Returns the minibatch's metrics; raises Collapse on an exploding ratio or a
    non-finite loss or gradient."""
    mask, old_logp = mb.mask, mb.old_logp  # (b, T)
    with torch.no_grad():
        d = torch.where(mask.bool(), old_logp - logp.detach(), 0.0)  # (b, T) log pi_old - log pi_theta
        if float(d.abs().max()) > settings.max_log_ratio:
            raise Collapse(f"exploding ratio: max |log pi_theta - log pi_old| = {float(d.abs().max()):.3g}")
    loss, metrics = _loss(parts, logp, mb, settings.kl_coef)
    if not torch.isfinite(loss):
        raise Collapse(f"non-finite loss at step {step}")
    if not accumulated:
        _zero_grad(parts)
        _backward(parts, loss)
    if parts.trainer is not None:  # a parallel layout: megatron reduces, the global norm clips (policy/parallel.py)
        _, norm = parts.trainer.step()
        if not math.isfinite(norm):
            raise Collapse(f"non-finite gradient norm at step {step}")
        grad_norm = torch.tensor(norm)
    else:
        grad_norm = _local_step(parts, step, settings.grad_clip)
    n = float(mask.sum().clamp_min(1))
    with torch.no_grad():
        approx_kl = float(torch.where(mask.bool(), k3(d), 0.0).sum() / n)  # k3 KL(pi_old || pi_theta)
        entropy = float(-torch.where(mask.bool(), logp.detach(), 0.0).sum() / n)
    return {
        **metrics,
        "loss": loss.item(),
        "approx_kl": approx_kl,
        "entropy_est": entropy,
        "grad_norm": float(grad_norm),
        "ratio_gt2_frac": ratio_gt2_frac(logp.detach(), old_logp, mask),
    }


def ratio_gt2_frac(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of the response tokens (`mask` (b, T)) whose importance ratio pi_theta / pi_old =
    exp(logp - old_logp) exceeds 2 (R3's measure of extreme ratios; `logp`, `old_logp` (b, T))."""
    above = (logp - old_logp > math.log(2.0)) & mask.bool()  # (b, T)
    return float(above.sum() / mask.sum().clamp_min(1))


def _update_micro(
    parts: Parts, forwards: StepForwards, mb: Minibatch, replay: Routes | None, step: int, settings: UpdateSettings
) -> Update:
    """`_update` of the minibatch `mb` with this rank's rows forwarded in micro-batches (`forwards.micro`), each
    backpropagated before the next is forwarded: its rows enter the minibatch's loss, the other rows as constants.
    Every registered loss is a sum over sequences (weighted by the mask alone), so each micro-batch's gradient is its
    rows' share of the whole minibatch's, and their sum is the whole minibatch's gradient
    (tests/study/test_memory_switches.py). Returns the metrics, the routes free routing chose and the log-probs
    (gathered)."""
    values, routes = [], []
    _zero_grad(parts)
    for pos, forward in forwards.micro(mb.idx, replay):
        full = mb.old_logp.detach().index_put((pos,), forward.logp)  # (b, T): these rows differentiable, the rest not
        _backward(parts, _loss(parts, full, mb, settings.kl_coef)[0])
        values.append(forward.logp.detach())
        routes.append(forward.routes)
    logp, free = torch.cat(values), Routes.cat(routes)
    if parts.trainer is not None:
        n = len(mb.idx)
        logp, free = parallel.gather_rows(logp, n), Routes(parallel.gather_rows(free.experts, n))
    return Update(_update(parts, logp, mb, step, settings, accumulated=True), free, logp)


def _zero_grad(parts: Parts) -> None:
    if parts.trainer is not None:
        parts.trainer.zero_grad()
    else:
        parts.optimizer.zero_grad(set_to_none=True)


def _backward(parts: Parts, loss: torch.Tensor) -> None:
    (parts.scaler.scale(loss) if parts.scaler is not None else loss).backward()


def _local_step(parts: Parts, step: int, grad_clip: float) -> torch.Tensor:
    """One process's clip (`grad_clip`, 0: none) and optimiser step after the backward; returns the gradient norm
    before clipping."""
    scaler = parts.scaler
    params = [p for p in parts.params if p.grad is not None]
    if scaler is not None:
        scaler.unscale_(params)
    grad_norm = clip_grad_norm(params, grad_clip if grad_clip > 0 else math.inf)
    if not torch.isfinite(grad_norm) and scaler is None:
        raise Collapse(f"non-finite gradient norm at step {step}")
    if scaler is not None:
        scaler.step(parts.optimizer, [])  # already unscaled; skips the step on overflow
    else:
        parts.optimizer.step()
    parts.prec.round_parameters_()  # precision hook: emulated parameters are stored rounded
    return grad_norm


def aggregation_weights(alg: Algorithm, mask: torch.Tensor, hparams: dict[str, Any]) -> torch.Tensor:
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
    return (weights * k3(r)).sum()


# ---------------------------------------------------------------------------------------------------------------------
# 4. sync, 5. evaluation
# ---------------------------------------------------------------------------------------------------------------------
def _sync_engine(parts: Parts) -> None:
    """The policy's weights to the rollout engine: every rank takes part in gathering the full tensors (a parallel
    layout), rank 0's engine loads them.

    The colocated order (an engine sharing the trainer's GPUs; tests/study/test_colocated_order.py runs it): the
    engine sleeps (`engine.offload()`) right after the rollout, before the batch is broadcast, so no rank forwards
    while it is awake; the update runs; every rank hands its cached blocks back (`_free_trainer_cache`) and meets
    the others at a barrier; then the engine wakes inside `load_weights`, fed a stream (one tensor at a time, never
    a copy of the whole model)."""
    _free_trainer_cache()
    if parts.trainer is None:
        weights = iter_hf_weights(parts.policy, parts.mcfg)  # views of the policy's weights: no copy of the model
    else:
        torch.distributed.barrier()  # no engine wakes before every rank has released its cache
        weights = parallel.full_hf_weights(parts.policy)  # collective: every rank iterates it to the end
    if parts.engine is not None:
        parts.engine.load_weights(weights)
    else:
        for _ in weights:
            pass


def _free_trainer_cache() -> None:
    """The trainer's cached, unused GPU blocks back to the driver before the engine wakes (it checks that its
    gpu_memory share is free first); nothing without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def _sync_parity(policy: torch.nn.Module, routing: RoutingController, engine: Any, batch: Batch) -> dict[str, float]:
    """Right after a weight sync: the first SYNC_CHECK_SEQS sequences of the step's batch scored teacher-forced by
    the rollout engine and by the trainer (free routing), both on the weights just synced; |difference| per response
    token. In the same real dtype this is the sync's fidelity (fp32: ~1e-6); across dtypes, the mismatch. Both at
    temperature 1 whatever the rollouts' (the engine's `score` returns raw log-probs): the weights are what is
    checked."""
    idx = torch.arange(min(SYNC_CHECK_SEQS, batch.n))
    ids, targets, attention = batch.input_ids[idx], batch.targets[idx], batch.attn_mask[idx]  # (b, S)
    with routing.recording():  # on the model's device, brought to the CPU, where the engine's scores are
        trainer = token_logp(policy, ids, targets, attention_mask=attention, positions=batch.pos[idx]).cpu()
    if engine is None:  # a parallel layout's other ranks: the forward above is collective, rank 0's engine scores
        return {}
    prompts, responses = [], []
    for i in range(len(idx)):
        seq = [int(ids[i, 0]), *targets[i, : int(attention[i].sum())].tolist()]
        start = int(batch.pos[i, 0]) + 1  # the prompt's length
        prompts.append(seq[:start])
        responses.append(seq[start:])
    scored, _ = engine.score(prompts, responses)
    mask = batch.mask[idx].bool()
    diff = (trainer[mask].float() - torch.cat(scored).float()).abs()
    return {"sync_parity_mean_abs": float(diff.mean()), "sync_parity_max_abs": float(diff.max())}


@torch.no_grad()
def _evaluate(
    cfg: RunConfig, engine: Any, tok: TaskTokenizer, evals: dict[str, list[tasks.TaskItem]], step: int
) -> dict[str, float]:
    """Mean pass@1 over k samples on each held-out set of the step's plan (RunConfig.eval_plan: the validation sets,
    and the test split at the first and last evaluations), with the same sampling seed at every evaluation."""
    out = {}
    for ev in cfg.eval_plan(evals, step):
        rollout = engine.generate(
            [tok.encode_prompt(item.prompt) for item in ev.items],
            ev.samples,
            seed=derive_seed("eval", ev.metric.removeprefix("eval_")),
            temperature=cfg.eval_temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=[tok.eos_id],
        )
        scores = [[0.0] * ev.samples for _ in ev.items]
        for i, (p, toks) in enumerate(zip(rollout.prompt_index, rollout.tokens, strict=True)):
            scores[p][i % ev.samples] = tasks.score(ev.items[p], tok.decode_response(toks)[0])
        out[ev.metric] = tasks.pass_at_1(scores)
    return out


def _check_reward_floor(cfg: RunConfig, rows: list[dict[str, float]]) -> None:
    if cfg.reward_floor <= -1.0 or len(rows) < cfg.collapse_window:
        return
    recent = float(np.mean([r["reward_mean"] for r in rows[-cfg.collapse_window :]]))
    if recent < cfg.reward_floor:
        raise Collapse(
            f"reward collapse: mean reward {recent:.3f} over {cfg.collapse_window} steps < {cfg.reward_floor}"
        )
