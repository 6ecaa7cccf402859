"""The metric and axis names analysis reads (issue 4's fixed vocabulary, as analysis uses it), defined once.

Every metric name read anywhere in analysis/ is a constant of this module: no other module spells one out.

Per-step metrics (columns of `metrics.parquet`):

| name | meaning |
|---|---|
| reward_mean | mean training reward of the step's rollouts, in [0, 1] |
| eval_<set> (or eval/<set>) | held-out mean pass@1 of eval set <set>, logged every N steps (NaN elsewhere) |
| clip_frac, clip_frac_low, clip_frac_high | token-weighted active clip fraction, total and its low/high parts |
| mismatch_mean_abs, mismatch_max_abs | mean / max abs(logp_train_old - logp_rollout) over response tokens |
| mismatch_k3 | k3 KL estimate mean(e^d - 1 - d) of that difference |
| mismatch_frac_gt2 | fraction of tokens with max(rho, 1/rho) > 2 |
| routing_slot_mismatch | old vs new policy after an update: mean(1 - abs(S_X & S_Y) / k) (the paper's "10%") |
| routing_set_flip_rate | old vs new: fraction of (token, layer) whose top-k set changed |
| engine_routing_slot_mismatch | rollout engine vs trainer, same definition |
| response_len_mean, truncation_rate | mean response length (tokens), fraction truncated at the length limit |
| tokens | response tokens trained on in the step |

Per-layer routing table (`routing_layers.parquet`): step, layer, slot_mismatch, set_flip_rate (same definitions,
one layer). Token samples (`token_samples.parquet`): step, sample, pos, trainer_logp (the training engine's pi_old
recompute), engine_logp (the rollout engine's log-prob).

These names follow `study.run.metrics.STEP_METRICS` (the run's documented vocabulary); this module only names the ones
analysis reads (METRICS, LAYER_METRICS, TOKEN_LOGPS). Swept axes are `study.run.config.RunConfig` fields (the
defaults below; each figure takes the name as an argument): `train_dtype`, `rollout_dtype`, `old_logp_source`
(Figure 4), `max_new_tokens` (Figure 5).
"""

from __future__ import annotations

REWARD = "reward_mean"
EVAL_PREFIXES = ("eval_", "eval/")
CLIP, CLIP_LOW, CLIP_HIGH = "clip_frac", "clip_frac_low", "clip_frac_high"
MISMATCH_MEAN_ABS, MISMATCH_MAX_ABS = "mismatch_mean_abs", "mismatch_max_abs"
MISMATCH_K3, MISMATCH_FRAC_GT2 = "mismatch_k3", "mismatch_frac_gt2"
MISMATCH = (MISMATCH_MEAN_ABS, MISMATCH_MAX_ABS, MISMATCH_K3, MISMATCH_FRAC_GT2)
ROUTING_SLOT = "routing_slot_mismatch"
ROUTING_FLIP = "routing_set_flip_rate"
ROUTING_ENGINE = "engine_routing_slot_mismatch"
LAYER_SLOT = "slot_mismatch"  # column of routing_layers.parquet
RESPONSE_LEN = "response_len_mean"
TRUNCATION = "truncation_rate"
TOKENS = "tokens"
METRICS = (REWARD, CLIP, CLIP_LOW, CLIP_HIGH, *MISMATCH, ROUTING_SLOT, ROUTING_FLIP, ROUTING_ENGINE, RESPONSE_LEN,
           TRUNCATION, TOKENS)  # fmt: skip
"""Every per-step metric named here (the eval metrics are matched by EVAL_PREFIXES instead)."""
LAYER_METRICS = (LAYER_SLOT,)
"""Per-layer metrics (columns of routing_layers.parquet) named here."""
TRAINER_LOGP, ENGINE_LOGP = "trainer_logp", "engine_logp"
TOKEN_LOGPS = (TRAINER_LOGP, ENGINE_LOGP)
"""The log-prob columns of token_samples.parquet (Figure 4b)."""

TRAIN_DTYPE_AXIS = "train_dtype"
ROLLOUT_DTYPE_AXIS = "rollout_dtype"
OLD_LOGP_AXIS = "old_logp_source"
LENGTH_AXIS = "max_new_tokens"


def eval_metrics(metrics: list[str]) -> list[str]:
    """The held-out eval metrics among `metrics`, in their given order."""
    return [m for m in metrics if m.startswith(EVAL_PREFIXES)]
