"""Expert load in a run's metrics: a tiny run logs the trainer's and the engine's load imbalance and the router
entropy per step (metrics.parquet, the mean over layers) and per layer (routing_layers.parquet), with sane values."""

import math
from pathlib import Path

import pandas as pd
import pytest

from study import rl
from study.run.config import load_config
from study.run.metrics import LAYER_METRICS, STEP_METRICS

LOAD = ("expert_load_imbalance", "router_entropy", "engine_expert_load_imbalance")


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_r3"])  # pi_old with free routing recorded / engine routes replayed
def test_a_tiny_run_logs_expert_load(tmp_path: Path, algorithm: str) -> None:
    sets = [f"algorithm={algorithm}", "coldstart=scratch", "steps=2", "eval_every=0", "checkpoint_every=0"]
    cfg = load_config(preset="tiny", sets=sets)
    run_dir = rl.run(cfg, tmp_path, progress=False)
    experts, top_k, n_layers = (
        cfg.model_config().num_experts,
        cfg.model_config().moe_top_k,
        cfg.model_config().num_layers,
    )
    assert set(LOAD) <= set(STEP_METRICS) and set(LOAD) <= set(LAYER_METRICS)
    metrics = pd.read_parquet(run_dir / "metrics.parquet").set_index("step")
    layers = pd.read_parquet(run_dir / "routing_layers.parquet")
    assert list(layers.columns) == ["step", "layer", *LAYER_METRICS]  # existing columns first, in their order
    assert len(layers) == 2 * n_layers and layers[list(LOAD)].notna().all().all()  # the hf engine returns routes
    for frame in (metrics[list(LOAD)], layers[list(LOAD)]):
        imbalance = frame[["expert_load_imbalance", "engine_expert_load_imbalance"]]
        assert imbalance.ge(1.0).all().all() and imbalance.le(experts / top_k).all().all()
        assert frame["router_entropy"].between(0.0, math.log(experts)).all()
    # The step metric is the mean over the layer table's rows of the step.
    per_step = layers.groupby("step")[list(LOAD)].mean()
    pd.testing.assert_frame_equal(per_step, metrics[list(LOAD)], check_exact=False, rtol=1e-12)
    # fp32 on both sides, the engine's routing is the trainer's (the slot mismatch says so), and so is its load.
    same = metrics["engine_routing_slot_mismatch"].eq(0)
    assert same.any()
    assert metrics.loc[same, "engine_expert_load_imbalance"].tolist() == pytest.approx(
        metrics.loc[same, "expert_load_imbalance"].tolist(), rel=1e-12
    )
