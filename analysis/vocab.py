"""The metric and axis names the figures read (issue 4's fixed vocabulary, as analysis uses it), defined once.

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
one layer).

These names follow `study.metrics.STEP_METRICS` (the run's documented vocabulary); this module only names the ones
the figures read. Swept axes are `study.runconfig.RunConfig` fields (the defaults below; each figure takes the name
as an argument): `train_dtype`, `rollout_dtype`, `old_logp_source` (Figure 4), `max_new_tokens` (Figure 5).
"""

from __future__ import annotations

REWARD = "reward_mean"
EVAL_PREFIXES = ("eval_", "eval/")
CLIP, CLIP_LOW, CLIP_HIGH = "clip_frac", "clip_frac_low", "clip_frac_high"
MISMATCH = ("mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3", "mismatch_frac_gt2")
ROUTING_SLOT = "routing_slot_mismatch"
ROUTING_FLIP = "routing_set_flip_rate"
ROUTING_ENGINE = "engine_routing_slot_mismatch"
LAYER_SLOT = "slot_mismatch"  # column of routing_layers.parquet
RESPONSE_LEN = "response_len_mean"
TRUNCATION = "truncation_rate"
TOKENS = "tokens"

TRAIN_DTYPE_AXIS = "train_dtype"
ROLLOUT_DTYPE_AXIS = "rollout_dtype"
OLD_LOGP_AXIS = "old_logp_source"
LENGTH_AXIS = "max_new_tokens"


def eval_metrics(metrics: list[str]) -> list[str]:
    """The held-out eval metrics among `metrics`, in their given order."""
    return [m for m in metrics if m.startswith(EVAL_PREFIXES)]
