"""The metrics of a step that come from its minibatches one by one (study.run.metrics.minibatch_metrics): R3's
changed-token share over the off-policy minibatches, the gradient-norm spike, and the per-index columns."""

import math

import pytest
import torch

from study.rl import ratio_gt2_frac
from study.run.metrics import MINIBATCH_COLUMNS, MINIBATCH_METRICS, STEP_METRICS, minibatch_column, minibatch_metrics


def test_hand_made_steps() -> None:
    per_mb = [
        {"ratio_gt2_frac": 0.0, "grad_norm": 1.0, "clip_frac": 0.0},
        {
            "ratio_gt2_frac": 0.1,
            "grad_norm": 4.0,
            "clip_frac": 0.2,
            "routing_slot_mismatch": 0.01,
            "routing_token_changed_frac": 0.3,
        },
        {
            "ratio_gt2_frac": 0.2,
            "grad_norm": 2.0,
            "clip_frac": 0.4,
            "routing_slot_mismatch": 0.03,
            "routing_token_changed_frac": 0.5,
        },
    ]
    out = minibatch_metrics(per_mb)
    assert out["routing_token_changed_frac"] == pytest.approx(0.4)  # minibatches 2..M
    assert out["grad_norm_spike"] == pytest.approx(4.0 / 2.0)  # max over the median
    assert out["grad_norm_mb2"] == 4.0 and out["routing_slot_mismatch_mb3"] == 0.03 and out["clip_frac_mb1"] == 0.0
    assert "routing_slot_mismatch_mb1" not in out and "routing_token_changed_frac_mb1" not in out
    assert "grad_norm_mb4" not in out
    one = minibatch_metrics(per_mb[:1])  # one minibatch: nothing follows an update; the spike is 1
    assert math.isnan(one["routing_token_changed_frac"]) and one["grad_norm_spike"] == 1.0
    idle = minibatch_metrics([{"grad_norm": 0.0}, {"grad_norm": 0.0}])  # a step without signal
    assert math.isnan(idle["grad_norm_spike"])


def test_columns_stop_at_the_cap_and_the_names_are_documented() -> None:
    per_mb = [
        {"grad_norm": float(m), "routing_slot_mismatch": 0.0, "routing_token_changed_frac": 0.0}
        for m in range(1, MINIBATCH_COLUMNS + 5)
    ]
    out = minibatch_metrics(per_mb)
    assert minibatch_column("grad_norm", MINIBATCH_COLUMNS) in out
    assert minibatch_column("grad_norm", MINIBATCH_COLUMNS + 1) not in out
    norms = range(1, MINIBATCH_COLUMNS + 5)  # the spike is over all of them, past the cap too
    assert out["grad_norm_spike"] == pytest.approx(max(norms) / ((norms[0] + norms[-1]) / 2))
    assert {"routing_token_changed_frac", "grad_norm_spike", "ratio_gt2_frac"} <= set(STEP_METRICS)
    assert set(MINIBATCH_METRICS) <= set(STEP_METRICS)  # each per-index column is a step metric of one minibatch


def test_ratio_gt2_frac_by_hand() -> None:
    # ratios e^(logp - old): 3 (above 2), 1/3 (below: one-sided), exactly 2 (not above), 2.5 on a masked-out token
    logp = torch.log(torch.tensor([[3.0, 1.0, 2.0], [2.5, 1.0, 1.0]]))
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) + torch.log(torch.tensor([[1.0, 3.0, 1.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert ratio_gt2_frac(logp, old, mask) == pytest.approx(1 / 4)
    assert ratio_gt2_frac(logp, old, torch.zeros(2, 3)) == 0.0
