"""The RL run: one algorithm on one configuration, from a cold-start checkpoint to a run directory analysis trusts.

Setup builds the parts (`setup`); then per step (GSPO paper, section 5.1; `# ALGO` marks each point where the
algorithm decides):
 1. collect: P prompts from the task stream -> G samples each from the rollout engine, with the engine's own
    log-probs; rewards from the task's verifier (truncated responses scored as they stand); ALGO reward shaping
    (DAPO); ALGO advantages `alg.advantages(rewards, G)`; ALGO dynamic sampling: zero-variance groups dropped and
    refilled;
 2. pi_old: log-probs recomputed by the training engine, ALGO with routing recorded or (R3) the engine's routes
    replayed; ALGO `old_logp_source: rollout` uses the engine's log-probs instead (section 5.4);
 3. minibatch updates: the batch split into M minibatches; for each: forward with ALGO the routing the algorithm asks
    for (free / replay / rollout_replay), ALGO `alg.loss`, backward, clip, AdamW step (`micro_batch` > 0: forward
    and backward in micro-batches, the gradients accumulated before the step);
 4. sync: the weights pushed to the rollout engine;
 5. log: the metrics row (study/record.py; files written at checkpoints), a held-out evaluation every N steps;
 6. checkpoint every N steps (study/checkpoint.py).
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
from typing import Any

import numpy as np
import torch

from algorithms import Algorithm
from study import checkpoint, lifecycle, record
from study.batch import Batch, pad, take_unmastered
from study.core.weights import iter_hf_weights
from study.data import tasks
from study.data.tokenizer import TaskTokenizer
from study.parts import (
    Parts,
    broadcast,
    derive_seed,
    forward_local,
    forward_rows,
    local_positions,
    micro_chunks,
    old_pass_rows,
    setup,
)
from study.policy import parallel as par
from study.policy.model import token_logp
from study.policy.routing import Routes, RoutingController, expert_load, response_inputs, routing_volatility
from study.run import rundir
from study.run.config import RunConfig
from study.run.metrics import STEP_METRICS, forward_flops, minibatch_metrics
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
    alg, mcfg, policy, routing, engine = parts.alg, parts.mcfg, parts.policy, parts.routing, parts.engine
    try:
        if state is not None:
            checkpoint.restore(state, parts, checkpoint.path_of(run_dir))
        if rank0:  # a resume under another layout: resharded from the checkpoint, recorded in the manifest
            lifecycle.record_layout(cfg, run_dir, None if state is None else log.step)
        # the live trackers (study/run/trackers.py): every row below goes to each, as it is recorded (rank 0's)
        tracker = RunLogger(run_dir, tracking or Tracking(), cfg.to_dict(), start_step=log.step) if rank0 else None
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    tracker = tracker if tracker is not None else record.NoTracker()
    _sync_engine(parts)
    if log.step == 0 and not log.rows and cfg.eval_every:  # the start's held-out pass@1: what RL is measured from
        row = dict.fromkeys(STEP_METRICS, math.nan)
        row.update(step=0, lr=cfg.lr, compute_flops=0.0, wall_s=0.0, precision_emulated=float(parts.emulated))
        log.rows.append({**row, **(_evaluate(cfg, engine, parts.tok, parts.evals, 0) if engine is not None else {})})
        tracker.log(log.rows[-1])

    bar = record.ProgressBar(cfg.steps, log.step, progress)
    step, row, outcome = log.step, None, "failed"  # outcome: what the trackers are told at the end
    last_write = time.monotonic()
    # The ~400k objects of the libraries and the setup live as long as the run: frozen, the cyclic garbage collector
    # stops re-walking them in each of its passes over the steps' short-lived objects (a 8-sequence update: -4%).
    gc.freeze()
    try:
        for step in range(log.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            eval_step = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
            checkpoint_step = step == cfg.steps or bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            row = dict.fromkeys(STEP_METRICS, math.nan)
            row.update(step=step, lr=cfg.lr, precision_emulated=float(parts.emulated))  # precision hook: a label

            # 1. collect: rollouts, rewards, advantages (rank 0's engine; the batch broadcast to every rank)
            collected = None
            if engine is not None:
                collected = _collect(cfg, alg, engine, parts.stream, parts.tok, log.data_pos, step, log.mastered)
                engine.offload()  # colocated vLLM on CUDA: asleep before the broadcast lets any rank start its forward
            collected = broadcast(collected, parts)
            log.data_pos = collected.data_pos
            log.mastered.update(collected.mastered)
            log.compute += collected.flops
            row.update(collected.metrics)
            batch = collected.batch
            if batch is None:  # ALGO dynamic sampling dropped every group (all zero variance): nothing to learn from
                row["wall_s"] = log.wall = log.wall + time.perf_counter() - t0
                log.rows.append(row)
                tracker.log(row)
                if rank0:
                    last_write = record.maybe_write(run_dir, log, tracker, due=checkpoint_step, last_write=last_write)
                continue

            # 2. pi_old: the training engine's recompute. The first minibatch is not recomputed when forwarded whole:
            # its update's forward runs on the same tokens with the same weights (nothing has been updated yet), so
            # that forward's detached log-probs and routes are pi_old's.
            t1 = time.perf_counter()
            ids, am = batch.input_ids, batch.attn_mask
            r3 = alg.routing == "rollout_replay"  # ALGO routing: R3 replays the engine's routes from pi_old on
            perm = torch.randperm(batch.n, generator=torch.Generator().manual_seed(derive_seed("mb", cfg.seed, step)))
            chunks = torch.tensor_split(perm, min(cfg.minibatches, batch.n))
            first, rest = chunks[0], perm[len(chunks[0]) :]
            # a rank's share of a minibatch in one forward (micro_batch 0): the first update's forward is pi_old's;
            # in micro-batches every update forwards its rows again, interleaved with their backwards (_update_micro)
            whole = len(micro_chunks(local_positions(parts, len(first)), cfg.micro_batch)) == 1
            old_parts = []
            if len(rest):
                with torch.no_grad():
                    if parts.trainer is None:  # the rest together
                        old_parts.append(old_pass_rows(parts, batch, rest, r3, cfg.micro_batch))
                    else:  # a rank's share of each minibatch, as its update will see it
                        old_parts += [old_pass_rows(parts, batch, idx, r3, cfg.micro_batch) for idx in chunks[1:]]
            t_old = time.perf_counter() - t1
            t2 = time.perf_counter()
            with torch.enable_grad() if whole else torch.no_grad():  # whole: the first update's forward
                logp_first, free_first, entropy_first = old_pass_rows(parts, batch, first, r3, cfg.micro_batch)
            t_first = time.perf_counter() - t2
            old_parts.insert(0, (logp_first.detach(), free_first, entropy_first))
            unperm = perm.argsort()  # the parts are in perm order (first, then rest)
            train_old = torch.cat([lp for lp, _, _ in old_parts])[unperm]  # (B, T)
            free_old = Routes(Routes.cat([r for _, r, _ in old_parts]).experts[unperm])  # pi_old's free routing
            old_routes = batch.engine_routes if r3 else free_old
            t1 = time.perf_counter()
            ref_logp = None
            if parts.ref is not None:  # KL hook: reference log-probs with the reference's own (free) routing
                with torch.no_grad():
                    ref_logp = token_logp(parts.ref, ids, batch.targets, attention_mask=am, positions=batch.pos,
                                          temperature=batch.temperature).cpu()  # (B, T)  # fmt: skip
                log.compute += forward_flops(mcfg, int(am.sum()), ids.shape[1] / 2)
            row["time_old_logp_s"] = t_old + time.perf_counter() - t1
            row.update(record.mismatch(train_old, batch.rollout_logp, batch.mask))
            if step in (1, cfg.steps) or eval_step:
                log.token_frames.append(record.token_samples(step, train_old, batch.rollout_logp, batch.mask))
            # expert load of pi_old's free routing and its routers' entropy over the real tokens (per layer: load)
            load = expert_load(free_old, routing.num_experts, am, torch.cat([e for _, _, e in old_parts])[unperm])
            if batch.engine_routes is not None:  # the engine's routing vs the trainer's free routing of the same tokens
                row["engine_routing_slot_mismatch"] = routing_volatility(
                    batch.engine_routes, free_old, am, per_layer=False
                )["slot_mismatch"]
                load.update({f"engine_{k}": v for k, v in expert_load(batch.engine_routes, routing.num_experts,
                                                                      am).items()})  # fmt: skip
            row.update({k: v for k, v in load.items() if k in STEP_METRICS})  # the means over layers
            old_logp = train_old if cfg.old_logp_source == "recompute" else batch.rollout_logp  # ALGO pi_old (B, T)
            if cfg.old_logp_source == "recompute":
                log.compute += forward_flops(mcfg, int(am[rest if whole else perm].sum()), ids.shape[1] / 2)

            # 3. minibatch updates (the first one's forward ran above)
            t2 = time.perf_counter()
            sums: dict[str, float] = {}
            vols: list[dict[str, float]] = []
            per_mb: list[dict[str, float]] = []  # each minibatch's own values (MINIBATCH_METRICS)
            resp = response_inputs(batch.pos, batch.mask, ids.shape[1])  # (B, S) the response tokens' positions
            replay = old_routes if alg.routing != "free" else None  # ALGO routing: free, or pi_old's (R3: engine's)
            for i, idx in enumerate(chunks):
                ref = None if ref_logp is None else ref_logp[idx]
                if not whole:
                    mb, new_free = _update_micro(cfg, parts, old_logp[idx], batch, idx, ref, step, replay)
                else:
                    logp, new_free = (logp_first, None) if i == 0 else forward_rows(parts, batch, idx, replay)
                    mb = _update(cfg, parts, logp, old_logp[idx], batch, idx, ref, step)
                per_mb.append({k: mb[k] for k in ("ratio_gt2_frac", "grad_norm", "clip_frac") if k in mb})
                if i > 0:  # the first minibatch's forward precedes every update: its routing is pi_old's itself
                    vols.append(routing_volatility(free_old[idx], new_free, am[idx]))  # old vs new policy's choice
                    changed = routing_volatility(free_old[idx], new_free, resp[idx], per_layer=False)
                    per_mb[-1].update(routing_slot_mismatch=vols[-1]["slot_mismatch"],
                                      routing_token_changed_frac=changed["token_flip_rate"])  # fmt: skip
                for key, value in mb.items():
                    sums[key] = sums.get(key, 0.0) + value
                log.compute += 3 * forward_flops(mcfg, int(am[idx].sum()), ids.shape[1] / 2)
            row.update({k: v / len(chunks) for k, v in sums.items()})
            row.update(record.mean_volatility(vols))
            row.update(minibatch_metrics(per_mb))
            log.layer_rows += record.layer_rows(step, vols, load, routing.num_layers)
            row["time_update_s"] = t_first + time.perf_counter() - t2

            # 4. sync: the weights to the rollout engine
            t3 = time.perf_counter()
            _sync_engine(parts)
            row["time_sync_s"] = time.perf_counter() - t3
            if cfg.sync_check_every and step % cfg.sync_check_every == 0:  # a metric, never a stop
                row.update(_sync_parity(policy, routing, engine, batch))
            log.wall += time.perf_counter() - t0
            row.update(compute_flops=log.compute, wall_s=log.wall, peak_rss_gb=record.peak_rss_gb())
            row["tokens_total"] = int(am.sum())

            # 5. log: the held-out evaluation, the row (files: at checkpoints, and every METRICS_EVERY_S)
            if eval_step and engine is not None:
                row.update(_evaluate(cfg, engine, parts.tok, parts.evals, step))
            log.rows.append(row)
            tracker.log(row)
            log.step = step
            if rank0:
                last_write = record.maybe_write(run_dir, log, tracker, due=checkpoint_step, last_write=last_write)
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
            log.rows.append(row)
            tracker.log(row)
        if rank0:
            record.write_metrics(run_dir, log)
            rundir.set_status(run_dir, "collapsed", step=step, reason=str(why))
        return
    except BaseException as exc:  # a crash or interrupt keeps the rows of the finished steps (resume recomputes them)
        outcome = "stopped" if isinstance(exc, (rundir.Stopped, KeyboardInterrupt, SystemExit)) else "failed"
        if rank0:
            record.write_metrics(run_dir, log)
        raise
    finally:
        gc.unfreeze()  # what the run leaves behind is collectable again (several runs may share a process)
        bar.close()
        if engine is not None:
            engine.close()
        tracker.close(outcome)
    if rank0:
        rundir.set_status(run_dir, "completed", step=cfg.steps)


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


def _collect(cfg: RunConfig, alg: Algorithm, engine: Any, stream: Any, tok: TaskTokenizer, data_pos: int, step: int,
             mastered: set[str]) -> Collected:  # fmt: skip
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
        "scorer_failures": float(tasks.take_scorer_failures()),  # verifiers that failed or timed out: scored 0
        "tokens": float(sum(lengths_all)),
        "time_rollout_s": time.perf_counter() - t0,
    }
    batch = pad(kept, cfg.max_new_tokens, cfg.layout.tensor, cfg.temperature)
    return Collected(batch, data_pos, newly_mastered, metrics, flops)


# ---------------------------------------------------------------------------------------------------------------------
# 3. the update: the loss
# ---------------------------------------------------------------------------------------------------------------------
def _loss(cfg: RunConfig, parts: Parts, logp: torch.Tensor, old_logp: torch.Tensor, batch: Batch, idx: torch.Tensor,
          ref_logp: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The minibatch's loss from its log-probs `logp` (b, T) against `old_logp` (b, T), and its metrics."""
    alg, hparams, mask = parts.alg, parts.hparams, batch.mask[idx]  # mask: (b, T)
    # ALGO: the loss
    extra = {"rollout_logp": batch.rollout_logp[idx]} if alg.needs_rollout_logp else {}
    loss, metrics = alg.loss(logp, old_logp, batch.advantages[idx], mask, **hparams, **extra)
    if ref_logp is not None:  # KL hook: + kl_coef x k3 KL(pi_theta || pi_ref), with the algorithm's averaging
        kl = kl_to_reference(logp, ref_logp, mask, aggregation_weights(alg, mask, hparams))
        loss = loss + cfg.kl_coef * kl
        metrics = {**metrics, "kl_ref": float(kl.detach())}
    return loss, metrics


def _update(cfg: RunConfig, parts: Parts, logp: torch.Tensor, old_logp: torch.Tensor, batch: Batch, idx: torch.Tensor,
            ref_logp: torch.Tensor | None, step: int, accumulated: bool = False) -> dict[str, float]:  # fmt: skip
    """One minibatch update from its forward's `logp` (b, T) against `old_logp` (b, T): the algorithm's loss
    (+ the KL hook), backward, global-norm clip, optimiser step (`accumulated`: the gradients are there already,
    `logp` their forwards' values). Returns the minibatch's metrics; raises Collapse on an exploding ratio or a
    non-finite loss or gradient."""
    mask = batch.mask[idx]  # (b, T)
    with torch.no_grad():
        d = torch.where(mask.bool(), old_logp - logp.detach(), 0.0)  # (b, T) log pi_old - log pi_theta
        if float(d.abs().max()) > cfg.max_log_ratio:
            raise Collapse(f"exploding ratio: max |log pi_theta - log pi_old| = {float(d.abs().max()):.3g}")
    loss, metrics = _loss(cfg, parts, logp, old_logp, batch, idx, ref_logp)
    if not torch.isfinite(loss):
        raise Collapse(f"non-finite loss at step {step}")
    if not accumulated:
        _zero_grad(parts)
        _backward(parts, loss)
    if (
        parts.trainer is not None
    ):  # a parallel layout: megatron reduces, the global norm clips (study/policy/parallel.py)
        _, norm = parts.trainer.step()
        if not math.isfinite(norm):
            raise Collapse(f"non-finite gradient norm at step {step}")
        grad_norm = torch.tensor(norm)
    else:
        grad_norm = _local_step(cfg, parts, step)
    n = float(mask.sum().clamp_min(1))
    with torch.no_grad():
        k3 = float(torch.where(mask.bool(), d.exp() - 1 - d, 0.0).sum() / n)
        entropy = float(-torch.where(mask.bool(), logp.detach(), 0.0).sum() / n)
    return {**metrics, "loss": loss.item(), "approx_kl": k3, "entropy_est": entropy, "grad_norm": float(grad_norm),
            "ratio_gt2_frac": ratio_gt2_frac(logp.detach(), old_logp, mask)}  # fmt: skip


def ratio_gt2_frac(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of the response tokens (`mask` (b, T)) whose importance ratio pi_theta / pi_old =
    exp(logp - old_logp) exceeds 2 (R3's measure of extreme ratios; `logp`, `old_logp` (b, T))."""
    above = (logp - old_logp > math.log(2.0)) & mask.bool()  # (b, T)
    return float(above.sum() / mask.sum().clamp_min(1))


def _update_micro(
    cfg: RunConfig, parts: Parts, old_logp: torch.Tensor, batch: Batch, idx: torch.Tensor,
    ref_logp: torch.Tensor | None, step: int, replay: Routes | None,
) -> tuple[dict[str, float], Routes]:  # fmt: skip
    """`_update` of the minibatch idx with this rank's rows forwarded in micro-batches of `micro_batch` sequences,
    each backpropagated before the next is forwarded: its rows enter the minibatch's loss, the other rows as
    constants. Every registered loss is a sum over sequences (weighted by the mask alone), so each micro-batch's
    gradient is its rows' share of the whole minibatch's, and their sum is the whole minibatch's gradient
    (tests/study/test_memory_switches.py). Returns the metrics and the routes free routing chose (gathered)."""
    n = len(idx)
    values, routes = [], []
    _zero_grad(parts)
    for pos in micro_chunks(local_positions(parts, n), cfg.micro_batch):
        rows = idx[pos]
        logp, free = forward_local(parts, batch, rows, None if replay is None else replay[rows])  # (m, T)
        full = old_logp.detach().index_put((pos,), logp)  # (b, T): these rows differentiable, the others constant
        _backward(parts, _loss(cfg, parts, full, old_logp, batch, idx, ref_logp)[0])
        values.append(logp.detach())
        routes.append(free)
    logp, free = torch.cat(values), Routes.cat(routes)
    if parts.trainer is not None:
        logp, free = par.gather_rows(logp, n), Routes(par.gather_rows(free.experts, n))
    return _update(cfg, parts, logp, old_logp, batch, idx, ref_logp, step, accumulated=True), free


def _zero_grad(parts: Parts) -> None:
    if parts.trainer is not None:
        parts.trainer.zero_grad()
    else:
        parts.optimizer.zero_grad(set_to_none=True)


def _backward(parts: Parts, loss: torch.Tensor) -> None:
    (parts.scaler.scale(loss) if parts.scaler is not None else loss).backward()


def _local_step(cfg: RunConfig, parts: Parts, step: int) -> torch.Tensor:
    """One process's clip and optimiser step after the backward; returns the gradient norm before clipping."""
    scaler = parts.scaler
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
    return (weights * (r.exp() - 1.0 - r)).sum()


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
        weights = par.full_hf_weights(parts.policy)  # collective: every rank iterates it to the end
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
    ids, tgt, am, pos = batch.input_ids[idx], batch.targets[idx], batch.attn_mask[idx], batch.pos[idx]
    with routing.recording():  # on the model's device, brought to the CPU, where the engine's scores are
        trainer = token_logp(policy, ids, tgt, attention_mask=am, positions=pos).cpu()  # (b, T)
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
def _evaluate(cfg: RunConfig, engine: Any, tok: TaskTokenizer, evals: dict[str, list[tasks.TaskItem]],
              step: int) -> dict[str, float]:  # fmt: skip
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
