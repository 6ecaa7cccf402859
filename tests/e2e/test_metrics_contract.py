"""A real run feeds the analysis: two short runs (GSPO and GRPO) from the session's tiny cold start, loaded by
analysis.runs.tidy and scored by the scorecard. Every metric of the run's vocabulary (study.run.metrics.STEP_METRICS,
LAYER_METRICS, TOKEN_SAMPLE_COLUMNS) is a column of the tidy study and holds a number (not NaN) on every step where
it applies. The loop pre-fills each step's row with NaN, so a metric it stopped computing would otherwise show up
only as an all-NaN column and a claim turned quietly inconclusive.

Where a metric applies (the settings below switch every optional one on):
- step 0 (eval_every > 0) holds the start's held-out evaluation only: eval_*, lr, precision_emulated,
  compute_flops and wall_s;
- eval_in_dist, eval_hard: step 0, every eval_every steps and the last step;
- test_in_dist: step 0 and the last step (the test split; the runs name the session's tiny cold start as their
  `coldstart`, which a test-split run would otherwise train anew without the test problems);
- sync_parity_mean_abs, sync_parity_max_abs: every sync_check_every steps;
- kl_ref: kl_coef > 0; prompts_skipped_mastered: prompt_filter = mastered;
- routing_logratio_mean_abs, routing_logratio_gt_ln2_frac, time_attribution_s: routing_attribution = true;
- routing_slot_mismatch, routing_set_flip_rate, routing_token_flip_rate (and the per-layer slot_mismatch,
  set_flip_rate), weight_logratio_mean_abs, weight_logratio_gt_ln2_frac and the routing log-ratio: minibatches >= 2
  (old vs new policy after an update);
- engine_routing_slot_mismatch, engine_expert_load_imbalance: an engine that returns its routes (hf does);
- grad_norm_spike: a step whose update had signal (grad_norm > 0: with every group's rewards equal there is no
  gradient to compare the largest minibatch's with);
- every other step metric: every step from 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.claims import scorecard
from analysis.runs import tidy
from analysis.stats import gain
from study import rl
from study.run.config import load_config
from study.run.metrics import LAYER_METRICS, STEP_METRICS, TOKEN_SAMPLE_COLUMNS
from tests.shared import sharing_coldstart

STEPS, EVAL_EVERY, SYNC_CHECK_EVERY = 3, 2, 2
SETS = [
    f"steps={STEPS}",
    f"eval_every={EVAL_EVERY}",
    f"sync_check_every={SYNC_CHECK_EVERY}",
    "minibatches=2",
    "kl_coef=0.01",
    "prompt_filter=mastered",
    "checkpoint_every=0",
    "eval_size=8",
    "eval_samples=1",
    "eval_test_size=8",
    "eval_test_samples=1",
    "routing_attribution=true",
]
X_AXES = ("compute_flops", "wall_s")
"""Step metrics that tidy keeps as columns of the long table (the figures' x-axes), not as rows of `metric`."""
START_ONLY = {"step", "lr", "precision_emulated", *X_AXES}
"""The step-0 row's metrics besides the evaluations."""
EVAL_STEPS = {0, EVAL_EVERY, STEPS}


def applies(metric: str, step: int) -> bool:
    """Whether `metric` must hold a number at `step` of a run with SETS."""
    if metric == "test_in_dist":
        return step in (0, STEPS)
    if metric.startswith("eval_"):
        return step in EVAL_STEPS
    if step == 0:
        return metric in START_ONLY
    if metric.startswith("sync_parity_"):
        return step % SYNC_CHECK_EVERY == 0
    return True


@pytest.fixture(scope="module")
def study(results: Path, tmp_path_factory: pytest.TempPathFactory) -> tidy.Study:
    root = sharing_coldstart(results, tmp_path_factory.mktemp("contract"))
    coldstart = next(p for p in (root / "coldstart").iterdir() if p.name.startswith("tiny-chain_sum"))
    for algorithm in ("gspo", "grpo"):
        sets = [*SETS, f"algorithm={algorithm}", f"coldstart={coldstart.resolve()}"]
        run_dir = rl.run(load_config(preset="tiny", sets=sets), root, progress=False)
        assert json.loads((run_dir / "status.json").read_text())["state"] == "completed", algorithm
    return tidy.load_study(root)


@pytest.mark.slow
def test_every_step_metric_reaches_the_tidy_study_where_it_applies(study: tidy.Study) -> None:
    wide = study.long.pivot_table(
        index=["run_id", "step"], columns="metric", values="value", dropna=False, observed=True
    )
    for axis in X_AXES:  # columns of the long table, beside every metric's rows
        assert study.long[axis].notna().all(), axis
    vocabulary = set(STEP_METRICS) - {"step", *X_AXES}
    assert vocabulary <= set(study.metrics), f"not in the tidy study: {sorted(vocabulary - set(study.metrics))}"
    assert sorted(wide.index.get_level_values("step").unique()) == list(range(STEPS + 1))
    empty = []
    for metric in sorted(vocabulary):
        for (run_id, step), value in wide[metric].items():
            idle = metric == "grad_norm_spike" and wide["grad_norm"][(run_id, step)] == 0
            if applies(metric, step) and not idle and not np.isfinite(value):
                empty.append(f"{metric} @ step {step} of {run_id}")
            if step == 0 and not applies(metric, 0):
                assert np.isnan(value), f"{metric} at step 0 = {value}: the start row holds the evaluation only"
    assert not empty, f"{len(empty)} empty where the metric applies: {empty[:20]}"


@pytest.mark.slow
def test_layers_and_token_samples_reach_the_tidy_study(study: tidy.Study) -> None:
    layers = study.layers[study.layers["step"] > 0]  # long: run_id, step, layer, metric, value
    assert set(LAYER_METRICS) <= set(layers["metric"]), set(LAYER_METRICS) - set(layers["metric"])
    empty = layers[layers["value"].isna()]
    assert not len(empty), empty.groupby("metric", observed=True).size()
    logps = [c for c in TOKEN_SAMPLE_COLUMNS if c.endswith("_logp")]
    assert set(logps) <= set(study.tokens.columns) and study.tokens[logps].notna().all().all()


@pytest.mark.slow
def test_the_scorecard_finds_every_metric_it_reads(study: tidy.Study) -> None:
    """Two runs decide nothing, but no claim may lack its metric: the claims whose runs are present (C1, C2: GSPO vs
    GRPO) are evaluated, and none says a metric was not logged; the held-out gain is computed for both runs. (C3, C4
    need Routing Replay partners, C5 an old_logp_source axis, C6 a max_new_tokens axis and at least 4 steps.)"""
    cards = {card.claim: card for card in scorecard.scorecard(study)}
    assert len(scorecard.scorecard_table(list(cards.values()))) == len(cards) >= 6
    for card in cards.values():
        assert "not logged" not in card.reason, f"{card.claim}: {card.reason}"
    for claim in ("C1", "C2"):
        assert not cards[claim].reason.startswith(scorecard.NOT_IN_STUDY), f"{claim}: {cards[claim].reason}"
    held_out = gain.heldout_gain(study)
    assert not held_out.reason and len(held_out.table) == 2 and held_out.table["gain"].notna().all(), held_out
