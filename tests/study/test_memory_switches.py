"""The training engine's memory switches change no result. micro_batch: a minibatch forwarded and backpropagated in
micro-batches, its gradients accumulated before its one optimiser step, is the same update as the whole minibatch at
once (fp32: to rounding), for every registered algorithm (their losses are sums over sequences, which the
accumulation relies on), and a run's metrics are the same. recompute = selective: megatron recomputes each layer's
core attention in the backward, and a run's metrics are the same. Both are runtime fields, not in the run id."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import torch

import algorithms
from study import parts, rl
from study.parts import StepForwards, forward_rows, setup
from study.policy.optim import build_optimizer
from study.run.config import load_config
from tests.shared import SCRATCH_STEP

SETS = list(SCRATCH_STEP)


@pytest.fixture(scope="module")
def setup_and_batch(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The tiny run's parts and one step's batch of 16 sequences from its engine (with the engine's routes), with
    random advantages (scratch weights solve nothing: every advantage would be 0, and so every gradient)."""
    cfg = load_config(preset="tiny", sets=SETS)
    parts = setup(cfg, tmp_path_factory.mktemp("micro"))
    collected = rl._collect(cfg, parts.alg, parts.engine, parts.stream, parts.tok, 0, 1, set())
    parts.engine.close()
    batch = collected.batch
    return (
        cfg,
        parts,
        dataclasses.replace(batch, advantages=torch.randn(batch.n, generator=torch.Generator().manual_seed(1))),
    )


def _one_update(cfg, parts, batch, name: str, micro_batch: int) -> tuple[dict, list[torch.Tensor], list]:  # type: ignore[no-untyped-def]
    """One update of the whole batch as one minibatch, from the same weights and a fresh optimizer: its metrics, the
    (clipped) gradients and the parameters after the step. pi_old is perturbed so that ratios and clipping vary."""
    alg = algorithms.get(name)
    torch.manual_seed(0)
    cfg = dataclasses.replace(cfg, algorithm=name, micro_batch=micro_batch)
    optimizer = build_optimizer(parts.policy, lr=1e-4, weight_decay=0.0, eps=1e-8, router_lr_scale=1.0)
    p = dataclasses.replace(parts, alg=alg, hparams=alg.check_hparams({}), optimizer=optimizer)
    idx = torch.arange(batch.n)
    engine_routes = batch.engine_routes if alg.routing == "rollout_replay" else None
    with torch.no_grad():
        pi_old = forward_rows(p, batch, idx, engine_routes)
    old = pi_old.logp + 0.2 * torch.randn(pi_old.logp.shape) * batch.mask  # (B, T)
    replay = {"free": None, "replay": pi_old.routes, "rollout_replay": engine_routes}[alg.routing]
    mb, settings = batch.minibatch(idx, old, None), rl.UpdateSettings(cfg.kl_coef, cfg.max_log_ratio, cfg.grad_clip)
    if micro_batch:
        forwards = StepForwards(p, batch, [idx], micro_batch, timed=lambda _: contextlib.nullcontext())
        metrics = rl._update_micro(p, forwards, mb, replay, 1, settings).metrics
    else:
        metrics = rl._update(p, forward_rows(p, batch, idx, replay).logp, mb, 1, settings)
    grads = [q.grad.clone() if q.grad is not None else None for q in p.params]
    return metrics, grads, [q.detach().clone() for q in p.params]


@pytest.mark.parametrize("name", algorithms.names())
def test_micro_batches_give_the_whole_minibatchs_update(setup_and_batch: tuple, name: str) -> None:
    cfg, parts, batch = setup_and_batch
    start = {k: v.clone() for k, v in parts.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    results = []
    for micro_batch in (0, 3):  # 16 rows: micro-batches of 3, 3, 3, 3, 3, 1
        parts.policy.load_state_dict(start, strict=False)
        results.append(_one_update(cfg, parts, batch, name, micro_batch))
    parts.policy.load_state_dict(start, strict=False)
    (whole, g_whole, p_whole), (micro, g_micro, p_micro) = results
    assert set(whole) == set(micro)
    for key in whole:
        assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert any(g is not None and g.abs().max() > 0 for g in g_whole), "no gradient: nothing compared"
    for gw, gm in zip(g_whole, g_micro, strict=True):
        assert (gw is None) == (gm is None)
        if gw is not None:
            torch.testing.assert_close(gm, gw, rtol=1e-5, atol=1e-7)
    # Adam's first step is lr x g / (|g| + eps): where |g| is near eps (1e-8) the micro-batches' other summation order
    # (gradients equal to 1e-7 above) moves a parameter by up to a few 1e-6 at lr 1e-4; a wrong accumulation moves
    # it by lr's order
    for pw, pm in zip(p_whole, p_micro, strict=True):
        torch.testing.assert_close(pm, pw, rtol=0, atol=1e-5)


def test_a_run_in_micro_batches_has_the_same_metrics_and_run_id(tmp_path: Path) -> None:
    sets = [*SETS, "algorithm=grpo_rr", "steps=2", "minibatches=2"]
    whole, micro = (load_config(preset="tiny", sets=[*sets, f"micro_batch={m}"]) for m in (0, 3))
    assert micro.micro_batch == 3 and micro.run_id == whole.run_id  # a runtime field
    got = [
        pd.read_parquet(rl.run(cfg, tmp_path / str(cfg.micro_batch), progress=False) / "metrics.parquet")
        for cfg in (whole, micro)
    ]
    for column in ("reward_mean", "response_len_mean", "tokens_total", "clip_frac"):
        assert list(got[1][column]) == list(got[0][column]), column
    for column in ("loss", "grad_norm", "approx_kl", "mismatch_mean_abs", "routing_slot_mismatch"):
        assert list(got[1][column]) == pytest.approx(list(got[0][column]), rel=1e-4, abs=1e-7), column
    for column in ("routing_token_changed_frac", "ratio_gt2_frac", "grad_norm_spike", "grad_norm_mb2"):
        assert list(got[1][column]) == pytest.approx(list(got[0][column]), rel=1e-4, abs=1e-7, nan_ok=True), column


def test_micro_batch_is_validated() -> None:
    with pytest.raises(ValueError, match="micro_batch = -1: must be >= 0"):
        load_config(preset="tiny", sets=["micro_batch=-1"])


def test_selective_recompute_gives_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    granularity: list[str | None] = []
    build = parts.build_policy

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = build(*args, **kwargs)
        granularity.append(model.config.recompute_granularity)
        return model

    monkeypatch.setattr(parts, "build_policy", recording)
    sets = [*SETS, "algorithm=grpo_rr", "steps=2", "minibatches=2"]
    plain, recomputed = (load_config(preset="tiny", sets=[*sets, f"recompute={r}"]) for r in ("none", "selective"))
    assert recomputed.run_id == plain.run_id  # a runtime field
    got = [
        pd.read_parquet(rl.run(cfg, tmp_path / cfg.recompute, progress=False) / "metrics.parquet")
        for cfg in (plain, recomputed)
    ]
    assert granularity == [None, "selective"]
    for column in ("reward_mean", "response_len_mean", "loss", "grad_norm", "approx_kl", "routing_slot_mismatch"):
        assert list(got[1][column]) == pytest.approx(list(got[0][column]), rel=1e-6, abs=1e-9), column


def test_recompute_is_validated() -> None:
    with pytest.raises(ValueError, match="recompute = 'full'; valid: none, selective"):
        load_config(preset="tiny", sets=["recompute=full"])
