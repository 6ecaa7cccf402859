"""The metric and axis names analysis reads (the run directory's fixed vocabulary, as analysis uses it), defined once.

Every metric name read anywhere in analysis/ is a constant of this module: no other module spells one out.

What each name means, and which function of the run computes it, is the run's vocabulary table
(`study.run.metrics`, rendered in analysis/README.md, "The run's metric vocabulary"); analysis does not import the
run (tests/test_imports.py), so tests/test_vocabulary.py holds every name here to that table.

This module names only the ones analysis reads (METRICS, LAYER_METRICS, TOKEN_LOGPS). Swept axes are
`study.run.config.RunConfig` fields (the defaults below; each figure takes the name as an argument): `train_precision`,
`rollout_precision`, `old_logp_source` (Figure 4), `max_new_tokens` (Figure 5). The routing-volatility figure (8) reads
no axis name: its configurations are the combinations of whatever non-algorithm axes the study sweeps
(`router_lr_scale`, the model shape, ...). The off-policy figure (9) reads `minibatches` and tells a dense control
from the MoE by `model.num_experts` = 1.
"""

from __future__ import annotations

REWARD = "reward_mean"
EVAL_PREFIXES = ("eval_", "eval/")
EVAL_IN_DIST = "eval_in_dist"
"""The in-distribution validation set (the held-out set a study's design may have been chosen on)."""
TEST_IN_DIST = "test_in_dist"
"""The held-out test split (runs with eval_test_size > 0), scored at the first and last evaluations only: the
held-out gain (last evaluation minus the step-0 one) is read on it where a study has it, else on EVAL_IN_DIST."""
CLIP, CLIP_LOW, CLIP_HIGH = "clip_frac", "clip_frac_low", "clip_frac_high"
MISMATCH_MEAN_ABS, MISMATCH_MAX_ABS = "mismatch_mean_abs", "mismatch_max_abs"
MISMATCH_K3, MISMATCH_FRAC_GT2 = "mismatch_k3", "mismatch_frac_gt2"
MISMATCH = (MISMATCH_MEAN_ABS, MISMATCH_MAX_ABS, MISMATCH_K3, MISMATCH_FRAC_GT2)
ROUTING_SLOT = "routing_slot_mismatch"
ROUTING_FLIP = "routing_set_flip_rate"
ROUTING_ENGINE = "engine_routing_slot_mismatch"
EXPERT_LOAD = "expert_load_imbalance"
ROUTER_ENTROPY = "router_entropy"
ENGINE_EXPERT_LOAD = "engine_expert_load_imbalance"
LAYER_SLOT = "slot_mismatch"  # columns of routing_layers.parquet
LAYER_FLIP = "set_flip_rate"
ROUTING_LOGRATIO, ROUTING_LOGRATIO_LN2 = "routing_logratio_mean_abs", "routing_logratio_gt_ln2_frac"
WEIGHT_LOGRATIO, WEIGHT_LOGRATIO_LN2 = "weight_logratio_mean_abs", "weight_logratio_gt_ln2_frac"
LOGRATIOS = (ROUTING_LOGRATIO, ROUTING_LOGRATIO_LN2, WEIGHT_LOGRATIO, WEIGHT_LOGRATIO_LN2)
"""The off-policy minibatches' log-ratios: the routing's part (runs with routing_attribution) and the weights'."""
RESPONSE_LEN = "response_len_mean"
TRUNCATION = "truncation_rate"
TOKENS = "tokens"
METRICS = (
    REWARD,
    CLIP,
    CLIP_LOW,
    CLIP_HIGH,
    *MISMATCH,
    ROUTING_SLOT,
    ROUTING_FLIP,
    ROUTING_ENGINE,
    EXPERT_LOAD,
    ROUTER_ENTROPY,
    ENGINE_EXPERT_LOAD,
    *LOGRATIOS,
    RESPONSE_LEN,
    TRUNCATION,
    TOKENS,
)
"""Every per-step metric named here (the eval metrics are matched by EVAL_PREFIXES instead; EVAL_IN_DIST is one)."""
LAYER_METRICS = (LAYER_SLOT, LAYER_FLIP, EXPERT_LOAD, ROUTER_ENTROPY, ENGINE_EXPERT_LOAD)
"""Per-layer metrics (columns of routing_layers.parquet) named here; the last three are also step metrics' names."""
TRAINER_LOGP, ENGINE_LOGP = "trainer_logp", "engine_logp"
TOKEN_LOGPS = (TRAINER_LOGP, ENGINE_LOGP)
"""The log-prob columns of token_samples.parquet (Figure 4b)."""

TRAIN_PRECISION_AXIS = "train_precision"
ROLLOUT_PRECISION_AXIS = "rollout_precision"
OLD_LOGP_AXIS = "old_logp_source"
LENGTH_AXIS = "max_new_tokens"
MINIBATCH_AXIS = "minibatches"
"""M, gradient updates per rollout batch: minibatches 2..M are off-policy (the off-policy figure's axis)."""
NUM_EXPERTS_KEY = "model.num_experts"
"""The flattened config key of a run's expert count: 1 is a dense control (one expert, nothing to route)."""


def eval_metrics(metrics: list[str]) -> list[str]:
    """The held-out eval metrics among `metrics`, in their given order."""
    return [m for m in metrics if m.startswith(EVAL_PREFIXES)]
