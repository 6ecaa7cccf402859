"""What a step measures besides its loss (`StepMeasures`, one call per stage of study/rl.py's step): the stages'
seconds, the FLOPs, the training-inference mismatch, pi_old's expert load and the engine's, the routing volatility of
each update against pi_old, the log-ratios of the off-policy minibatches (with routing_attribution, one extra forward
per minibatch gives the routing's share), and routing_layers.parquet's rows. Each metric's meaning:
study/run/metrics.py; the tables they are written to: study/record.py."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from study import record
from study.batch import Batch
from study.parts import Parts, PiOld, StepForwards, Update, forward_rows
from study.policy.routing import Routes, expert_load, response_inputs, routing_volatility
from study.run.config import RunConfig
from study.run.metrics import (
    LOGRATIO_METRICS,
    STEP_METRICS,
    forward_flops,
    logratio_metrics,
    mean_over_minibatches,
    minibatch_metrics,
)


class StepMeasures:
    """One step's metric row and what goes into it besides the algorithm's loss: the stages' seconds, the FLOPs
    (added to the run's cumulative count in `log` as the stages run), the training-inference mismatch, pi_old's
    expert load and the engine's, each minibatch's routing volatility against pi_old, routing_attribution's
    log-ratios, and routing_layers.parquet's rows. The loop makes one call per stage."""

    def __init__(self, cfg: RunConfig, parts: Parts, log: record.Progress, step: int) -> None:
        self.cfg, self.parts, self.log, self.step = cfg, parts, log, step
        self.start = time.perf_counter()
        self.row: dict[str, float] = dict.fromkeys(STEP_METRICS, math.nan)
        self.row.update(step=step, lr=cfg.lr, precision_emulated=float(parts.emulated))  # precision hook: a label
        self.seconds: dict[str, float] = {}  # the stages' seconds so far (`timed`)
        self.stages: list[str] = []  # the stages being timed, innermost last
        self.lap = self.start  # when the innermost stage's seconds were last counted
        self.load: dict[str, float] = {}  # pi_old's expert load per layer, for the step's routing_layers rows
        self.old_routes: Routes | None = None  # pi_old's routes (`pi_old`)
        self.other_logp: dict[int, torch.Tensor] = {}  # routing_attribution: minibatch i's (b, T), the other routing
        self.replayed = False  # routing_attribution: whether the updates replay pi_old's routes

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """The block's seconds added to the row's `name`, but for those of the blocks timed inside it: those are
        their own stage's (the first update's forward made in pi_old's pass, routing_attribution's forwards made
        among the updates)."""
        self._count()
        self.stages.append(name)
        yield
        self._count()
        self.stages.pop()

    def _count(self) -> None:
        """The seconds since the last count, to the innermost stage being timed."""
        now = time.perf_counter()
        if self.stages:
            stage = self.stages[-1]
            self.row[stage] = self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.lap
        self.lap = now

    def _flops(self, batch: Batch, tokens: int, passes: int = 1) -> None:
        """`passes` forwards' FLOPs (a forward and its backward: 3) of `tokens` tokens of the batch, into the run's
        count."""
        self.log.compute += passes * forward_flops(self.parts.mcfg, tokens, batch.input_ids.shape[1] / 2)

    def collected(self, metrics: dict[str, float], flops: float) -> None:
        """The rollout's statistics and seconds (`metrics`), its FLOPs."""
        self.log.compute += flops
        self.row.update(metrics)

    def pi_old(self, batch: Batch, old: PiOld, *, token_samples: bool) -> None:
        """The mismatch of pi_old's recompute against the engine's log-probs (and, with `token_samples`, a sample of
        both), pi_old's expert load and router entropy over the real tokens, the engine's (its routes' slot mismatch
        against the trainer's free routing of the same tokens), and the FLOPs of the reference's forward (KL hook)
        and of the forwards that were pi_old's alone."""
        row, attention, experts = self.row, batch.attn_mask, self.parts.routing.num_experts
        self.old_routes = old.routes
        if old.ref_logp is not None:  # KL hook: the reference's forward
            self._flops(batch, int(attention.sum()))
        row.update(record.mismatch(old.logp, batch.rollout_logp, batch.mask))
        if token_samples:
            self.log.token_frames.append(record.token_samples(self.step, old.logp, batch.rollout_logp, batch.mask))
        self.load = expert_load(old.routes, experts, attention, old.entropy)  # per layer too
        if batch.engine_routes is not None:  # the engine's routing vs the trainer's free routing of the same tokens
            vol = routing_volatility(batch.engine_routes, old.routes, attention, per_layer=False)
            row["engine_routing_slot_mismatch"] = vol["slot_mismatch"]
            engine_load = expert_load(batch.engine_routes, experts, attention)
            self.load.update({f"engine_{k}": v for k, v in engine_load.items()})
        row.update({k: v for k, v in self.load.items() if k in STEP_METRICS})  # the means over layers
        if self.cfg.old_logp_source == "recompute":
            self._flops(batch, old.tokens)

    @torch.no_grad()
    def routing_attribution(self, forwards: StepForwards, i: int, replay: Routes | None) -> None:
        """routing_attribution, before minibatch i's update from the second on, on the weights it starts from: its
        rows' (b, T) log-probs under the routing the update does not use (`replay`: its routes, None: free routing),
        pi_old's routes replayed when it routes freely, free routing when it replays. One forward: its seconds are
        time_attribution_s's, its FLOPs not counted; no gradient, no optimizer state, no random draw."""
        if self.cfg.routing_attribution and i > 0:
            if self.old_routes is None:
                raise RuntimeError("routing_attribution needs pi_old's routes: `pi_old` is measured first")
            with self.timed("time_attribution_s"):
                # an update that routes freely is one whose pi_old routed freely: its chosen routes are those it ran on
                self.replayed, other = replay is not None, self.old_routes if replay is None else None
                batch, idx = forwards.batch, forwards.chunks[i]
                self.other_logp[i] = forward_rows(self.parts, batch, idx, other, forwards.micro_batch).logp

    def updates(self, batch: Batch, chunks: list[torch.Tensor], old: PiOld, updates: list[Update]) -> None:
        """The loss metrics' means over the minibatches, the per-minibatch columns, the routing volatility of each
        update forward's free routing against pi_old's (from minibatch 2: the first forward is pi_old's own), the
        log-ratios of minibatches 2..M (the weights' from the update's forward; with routing_attribution the
        routing's), routing_layers.parquet's rows of the step, and the updates' FLOPs."""
        sums: dict[str, float] = {}
        volatility: list[dict[str, float]] = []
        per_minibatch: list[dict[str, float]] = []  # each minibatch's own values (MINIBATCH_METRICS)
        logratios: list[dict[str, float]] = []  # minibatches 2..M: the log-ratios of the weights' and the routing's
        attention = batch.attn_mask
        response = response_inputs(batch.pos, batch.mask, attention.shape[1])  # (B, S) the response tokens' positions
        for i, (idx, update) in enumerate(zip(chunks, updates, strict=True)):
            metrics, routes = update.metrics, update.routes
            per_minibatch.append({k: metrics[k] for k in ("ratio_gt2_frac", "grad_norm", "clip_frac") if k in metrics})
            if i > 0:  # the first minibatch's forward precedes every update: its routing is pi_old's itself
                # the old vs the new policy's choice of experts for the same tokens
                volatility.append(routing_volatility(old.routes[idx], routes, attention[idx]))
                changed = routing_volatility(old.routes[idx], routes, response[idx], per_layer=False)
                per_minibatch[-1].update(
                    routing_slot_mismatch=volatility[-1]["slot_mismatch"],
                    routing_token_changed_frac=changed["token_flip_rate"],
                )
                mask = batch.mask[idx]  # (b, T)
                logratios.append(logratio_metrics("weight_logratio", update.logp - old.logp[idx], mask))
                if i in self.other_logp:  # routing_attribution
                    routing = routing_logratio(update.logp, self.other_logp[i], replayed=self.replayed)
                    logratios[-1].update(logratio_metrics("routing_logratio", routing, mask))
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
            self._flops(batch, int(attention[idx].sum()), passes=3)
        self.row.update({k: v / len(chunks) for k, v in sums.items()})
        self.row.update(mean_over_minibatches(logratios, LOGRATIO_METRICS))
        if self.cfg.routing_attribution:  # 0 s with one minibatch: no extra forward
            self.row["time_attribution_s"] = self.seconds.get("time_attribution_s", 0.0)
        self.row.update(record.mean_volatility(volatility))
        self.row.update(minibatch_metrics(per_minibatch))
        self.log.layer_rows += record.layer_rows(self.step, volatility, self.load, self.parts.routing.num_layers)

    def finish(self, batch: Batch | None) -> dict[str, float]:
        """The step's wall seconds into the run's; with a batch, the cumulative compute, memory and tokens. The row."""
        self.log.wall += time.perf_counter() - self.start
        self.row["wall_s"] = self.log.wall
        if batch is not None:
            self.row.update(compute_flops=self.log.compute, peak_rss_gb=record.peak_rss_gb())
            self.row["tokens_total"] = int(batch.attn_mask.sum())
        return self.row


def routing_logratio(update_logp: torch.Tensor, other_logp: torch.Tensor, *, replayed: bool) -> torch.Tensor:
    """(b, T) the routing-attributable log-ratio log pi_theta(y | free routes) - log pi_theta(y | pi_old's routes)
    from the update forward's log-probs and the other routing's (`replayed`: the update's forward replayed pi_old's
    routes); the same weights in both, so only the routing differs."""
    free, pinned = (other_logp, update_logp) if replayed else (update_logp, other_logp)
    return free - pinned
