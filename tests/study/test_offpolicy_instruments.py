"""The off-policy routing study's instruments in the loop: per-minibatch routing, ratio and gradient-norm measures
(study.run.metrics.MINIBATCH_METRICS), the engine's router-noise dial, and the dense control of an MoE shape."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from study import rl
from study.core.model_config import dense_control, resolve_model
from study.run.config import load_config
from study.run.metrics import MINIBATCH_METRICS
from study.run.plan import param_counts

QUICK = ["coldstart=scratch", "eval_every=0", "checkpoint_every=0"]
# From random weights no response earns a reward; DAPO's overlong penalty still tells responses apart by length, so
# its updates have a gradient to measure (any other algorithm's would be 0 here).
SIGNAL = ["algorithm=dapo", "max_new_tokens=48"]


def run_metrics(tmp_path: Path, sets: list[str]) -> pd.DataFrame:
    run_dir = rl.run(load_config(preset="tiny", sets=[*QUICK, *sets]), tmp_path, progress=False)
    return pd.read_parquet(run_dir / "metrics.parquet")


def test_per_minibatch_columns_add_up_to_the_step_metrics(tmp_path: Path) -> None:
    m = run_metrics(tmp_path, [*SIGNAL, "steps=2", "minibatches=4", "prompts_per_step=4", "group_size=4"])
    for name in MINIBATCH_METRICS:
        first = 2 if name.startswith("routing_") else 1
        cols = [f"{name}_mb{i}" for i in range(first, 5)]
        assert set(cols) <= set(m.columns) and f"{name}_mb5" not in m.columns, name
        if name != "routing_token_changed_frac":  # the others' step values are the means over their minibatches
            step = {"routing_slot_mismatch": "routing_slot_mismatch"}.get(name, name)
            assert m[cols].mean(axis=1).to_numpy() == pytest.approx(m[step].to_numpy(), rel=1e-9, abs=1e-12), name
    assert "routing_slot_mismatch_mb1" not in m.columns  # the first minibatch's forward is pi_old's own
    assert m["ratio_gt2_frac_mb1"].eq(0).all()  # pi_old recomputed: the first update starts at ratio 1
    changed = [f"routing_token_changed_frac_mb{i}" for i in (2, 3, 4)]
    assert m[changed].mean(axis=1).to_numpy() == pytest.approx(m["routing_token_changed_frac"].to_numpy())
    assert m["routing_token_changed_frac"].between(0, 1).all() and m["ratio_gt2_frac"].between(0, 1).all()
    norms = m[[f"grad_norm_mb{i}" for i in range(1, 5)]]
    assert m["grad_norm_spike"].to_numpy() == pytest.approx((norms.max(axis=1) / norms.median(axis=1)).to_numpy())
    assert m["grad_norm_spike"].ge(1).all()


def test_engine_router_noise_raises_the_engine_trainer_mismatch(tmp_path: Path) -> None:
    """Noise on the engine's router logits only: the engine's routes and log-probs part from the trainer's
    recompute of the same tokens at the same weights; without it they agree (fp32, the same network)."""
    sets = ["steps=1", "minibatches=1"]
    clean = run_metrics(tmp_path / "clean", sets)
    noisy = run_metrics(tmp_path / "noisy", [*sets, "engine_router_noise=1.0"])
    assert clean["engine_routing_slot_mismatch"].max() < 0.01 < noisy["engine_routing_slot_mismatch"].min()
    assert clean["mismatch_mean_abs"].max() < 1e-4 < 1e-3 < noisy["mismatch_mean_abs"].min()


def test_the_dense_control_builds_trains_and_matches_the_active_parameters(tmp_path: Path) -> None:
    moe = resolve_model({"preset": "tiny", "num_layers": 4, "num_experts": 32, "moe_top_k": 8})
    dense = dense_control(moe)
    assert (dense.num_experts, dense.moe_top_k, dense.moe_ffn_hidden_size) == (1, 1, 8 * moe.moe_ffn_hidden_size)
    p_moe, p_dense = param_counts(moe), param_counts(dense)
    # the experts a token passes through: k of width F in the MoE, one of width k F in the control
    assert p_dense.experts == p_moe.experts * moe.moe_top_k // moe.num_experts
    assert (p_dense.vocab, p_dense.attention) == (p_moe.vocab, p_moe.attention)
    router_gap = moe.num_layers * moe.hidden_size * (moe.num_experts - 1)  # the MoE router's other logits
    assert p_moe.replicated - p_dense.replicated == router_gap
    assert moe.active_params_per_token - dense.active_params_per_token == router_gap
    shape = {"num_layers": 4, "num_experts": 1, "moe_top_k": 1, "moe_ffn_hidden_size": dense.moe_ffn_hidden_size}
    m = run_metrics(tmp_path, [*SIGNAL, "steps=1", "minibatches=2", *(f"model.{k}={v}" for k, v in shape.items())])
    assert m["grad_norm"].gt(0).all() and m["expert_load_imbalance"].eq(1).all()
    assert m["routing_slot_mismatch"].eq(0).all()  # one expert: nothing to route
