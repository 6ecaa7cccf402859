"""routing_attribution: the routing-attributable log-ratio log pi_theta(y | free routes) - log pi_theta(y | pi_old's
routes) at the off-policy minibatches, from one extra no-grad forward. It is exactly 0 where the routes are pi_old's
(a dense model's always), positive on a MoE whose routing moved, and it changes no other number of a run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from study import record, rl
from study.measures import StepMeasures, routing_logratio
from study.parts import StepForwards, forward_rows, minibatches, setup
from study.policy.optim import build_optimizer
from study.policy.routing import routing_volatility
from study.run.config import load_config
from study.run.metrics import LOGRATIO_METRICS, logratio_metrics
from tests.shared import SCRATCH_STEP

SCRATCH = [*SCRATCH_STEP, "minibatches=4", "routing_attribution=true"]
MODELS = {"moe": [], "dense": ["model.num_experts=1", "model.moe_top_k=1"]}
TIMING = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")


@pytest.fixture(scope="module", params=list(MODELS))
def scratch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny scratch run's config, parts and one step's batch of 16 sequences, with random advantages (scratch
    weights solve nothing: every advantage would be 0, and so every gradient); the MoE and its one-expert model."""
    cfg = load_config(preset="tiny", sets=SCRATCH + MODELS[request.param])
    parts = setup(cfg, tmp_path_factory.mktemp("attribution"))
    batch = rl._collect(cfg, parts.alg, parts.engine, parts.stream, parts.tok, 0, 1, set()).batch
    parts.engine.close()
    advantages = torch.randn(batch.n, generator=torch.Generator().manual_seed(1))
    return request.param, cfg, parts, dataclasses.replace(batch, advantages=advantages)


def test_the_routes_replayed_that_free_routing_chose_give_the_same_logp(scratch: tuple) -> None:
    """The same weights under the same routes, once chosen and once forced: the very same log-probs, so the measure
    is 0 exactly where no route moved (under either routing of the update)."""
    _, _, parts, batch = scratch
    idx = torch.arange(batch.n)
    with torch.no_grad():
        free = forward_rows(parts, batch, idx, None)
        forced = forward_rows(parts, batch, idx, free.routes)
    zero = torch.zeros_like(free.logp)
    assert torch.equal(routing_logratio(free.logp, forced.logp, replayed=False), zero)  # an update that routed freely
    assert torch.equal(routing_logratio(forced.logp, free.logp, replayed=True), zero)  # an update that replayed


def test_the_sign_is_free_minus_pi_olds_routes() -> None:
    update, other = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.equal(routing_logratio(update, other, replayed=False), update - other)  # the update: free
    assert torch.equal(routing_logratio(update, other, replayed=True), other - update)  # the update: replayed


def test_logratio_metrics_over_the_response_tokens() -> None:
    logratio = torch.tensor([[0.1, -1.0, 5.0], [0.0, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the third tokens are padding
    got = logratio_metrics("x", logratio, mask)
    assert got["x_mean_abs"] == pytest.approx((0.1 + 1.0 + 0.0 + 0.7) / 4)
    assert got["x_gt_ln2_frac"] == 0.5  # |-1.0| and 0.7 > ln 2 = 0.693


@pytest.mark.parametrize("micro_batch", [0, 2])
@pytest.mark.parametrize("routing", ["free", "replay"])
def test_updates_at_a_high_lr_move_the_moes_ratios_through_routing_and_never_the_dense_models(
    scratch: tuple, routing: str, micro_batch: int
) -> None:
    """Four minibatch updates at lr 1e-2 (each in one forward, or in micro-batches of 2): from the second on, the
    MoE's routing has moved since pi_old and the routing log-ratio is positive; the one-expert model's is exactly 0
    while its weights' log-ratio is positive."""
    model, cfg, parts, batch = scratch
    cfg = dataclasses.replace(cfg, lr=1e-2, micro_batch=micro_batch)
    optimizer = build_optimizer(parts.policy, lr=cfg.lr, weight_decay=0.0, eps=1e-8, router_lr_scale=1.0)
    saved = [p.detach().clone() for p in parts.params]
    p = dataclasses.replace(parts, optimizer=optimizer)
    chunks = minibatches(cfg.seed, cfg.minibatches, batch.n, 1)
    measure = StepMeasures(cfg, p, record.Progress(), 1)
    forwards = StepForwards(p, batch, chunks, cfg.micro_batch, measure.timed)
    assert forwards.fused == (micro_batch == 0)  # micro-batches: every update in _update_micro
    old = forwards.pi_old(None)
    measure.pi_old(batch, old, token_samples=False)
    replay = None if routing == "free" else old.routes
    targets = [batch.minibatch(idx, old.logp, None) for idx in chunks]
    settings = rl.UpdateSettings(cfg.kl_coef, cfg.max_log_ratio, cfg.grad_clip)
    try:
        updates = rl._updates(p, forwards, targets, replay, 1, settings, measure)
    finally:
        with torch.no_grad():  # the module's other tests start from the scratch weights
            for q, s in zip(parts.params, saved, strict=True):
                q.copy_(s)
    assert sorted(measure.other_logp) == [1, 2, 3]  # the first minibatch's forward is pi_old's own
    assert measure.seconds["time_attribution_s"] > 0  # its forwards' seconds: their own stage's
    moved = [
        routing_volatility(old.routes[idx], u.routes, batch.attn_mask[idx])["slot_mismatch"]
        for idx, u in zip(chunks[1:], updates[1:], strict=True)
    ]
    for i, (idx, u) in enumerate(zip(chunks[1:], updates[1:], strict=True), start=1):
        mask = batch.mask[idx]
        assert logratio_metrics("w", u.logp - old.logp[idx], mask)["w_mean_abs"] > 0
        routing = routing_logratio(u.logp, measure.other_logp[i], replayed=replay is not None)
        routing_part = logratio_metrics("r", routing, mask)["r_mean_abs"]
        if model == "dense":
            assert torch.equal(routing, torch.zeros_like(routing))
        assert (routing_part > 0) == (model == "moe")
    assert (max(moved) > 0) == (model == "moe")


def test_a_run_measures_it_and_changes_no_other_number(results: Path) -> None:
    """The tiny preset from its cold start, M = 4 at lr 1e-3, with and without routing_attribution: every column but
    the timings and the routing log-ratio's is identical (no random draw, no optimizer state touched), the run id
    is the same as without the field, and the routing log-ratio is positive at a step whose routing moved."""
    sets = ["steps=3", "minibatches=4", "lr=1e-3", "eval_every=0"]
    off_cfg = load_config(preset="tiny", sets=sets)
    on_cfg = load_config(preset="tiny", sets=[*sets, "routing_attribution=true"])
    assert off_cfg.run_id == load_config(preset="tiny", sets=[*sets, "routing_attribution=false"]).run_id
    assert on_cfg.run_id != off_cfg.run_id
    off = pd.read_parquet(rl.run(off_cfg, results, progress=False) / "metrics.parquet")
    on = pd.read_parquet(rl.run(on_cfg, results, progress=False) / "metrics.parquet")
    own = ["routing_logratio_mean_abs", "routing_logratio_gt_ln2_frac", "time_attribution_s"]
    assert off[own].isna().all().all()
    kept = [c for c in off.columns if c not in (*TIMING, *own)]
    pd.testing.assert_frame_equal(on[kept], off[kept], check_exact=True)
    assert on["time_attribution_s"].notna().all()
    moved = on["routing_slot_mismatch"] > 0
    assert moved.any()
    assert (on.loc[moved, "routing_logratio_mean_abs"] > 0).all()
    assert on.loc[~moved, "routing_logratio_mean_abs"].eq(0).all()
    assert on[list(LOGRATIO_METRICS)].ge(0).all().all()


def test_one_minibatch_has_no_off_policy_minibatch_to_measure(results: Path) -> None:
    cfg = load_config(preset="tiny", sets=["steps=1", "minibatches=1", "eval_every=0", "routing_attribution=true"])
    row = pd.read_parquet(rl.run(cfg, results, progress=False) / "metrics.parquet").iloc[-1]
    assert all(math.isnan(row[name]) for name in LOGRATIO_METRICS)
