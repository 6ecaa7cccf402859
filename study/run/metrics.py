"""The metric vocabulary of an RL run, documented once: one row per step in metrics.parquet.

Analysis reads these names and never an algorithm's; every variant logs every one (a value that does not apply is
NaN, e.g. eval columns between evaluations). Loss metrics (algorithms.LOSS_METRICS and a variant's extras) are means
over the step's minibatches; MINIBATCH_METRICS are also written per minibatch index, as `{name}_mb{m}` columns.
"""

from __future__ import annotations

import math
import statistics

from algorithms import LOSS_METRICS
from study.core.model_config import ModelConfig

STEP_METRICS: dict[str, str] = {
    "step": "RL step (rollout batch) index, from 1; with eval_every > 0 a row at step 0 holds only the held-out "
    "evaluation of the starting policy (the cold start), what RL is measured from",
    "reward_mean": "mean task reward of the step's responses (before any reward shaping)",
    "reward_std": "standard deviation of that reward",
    "scorer_failures": "responses of the step (evaluation included) whose verifier timed out or failed, each scored "
    "0 (study.data.tasks.take_scorer_failures); the run goes on",
    "eval_in_dist": "mean pass@1 over k samples on the in-distribution held-out set (NaN between evaluations)",
    "eval_hard": "the same on the harder, longer held-out set",
    "test_in_dist": "mean pass@1 over eval_test_samples samples on the held-out test split (eval_test_size problems, "
    "disjoint from the validation sets above), at the run's first and last evaluations only (NaN elsewhere, and "
    "always without a test split)",
    "response_len_mean": "mean response length in tokens (stop token included)",
    "response_len_max": "longest response of the step",
    "truncation_rate": "fraction of responses cut at max_new_tokens",
    "zero_var_group_frac": "fraction of groups whose rewards were all equal (no signal; DAPO drops them)",
    "zero_var_solved_frac": "the part of zero_var_group_frac whose every response got the full reward (1): problems "
    "the policy already solves every time, as opposed to problems no sample solves",
    "prompts_skipped_mastered": "prompt_filter = mastered: training prompts the step's draws skipped because an "
    "earlier group of theirs was solved by every response (NaN without the filter)",
    **LOSS_METRICS,
    "loss": "the algorithm's loss, mean over minibatches",
    "approx_kl": "k3 estimate of KL(pi_old || pi_theta), mean(e^d - 1 - d), d = logp_old - logp_theta, before each "
    "minibatch update, mean over minibatches",
    "kl_ref": "k3 estimate of KL(pi_theta || pi_ref) to the frozen initial policy, e^r - 1 - r, r = logp_ref - "
    "logp_theta, aggregated over tokens as the algorithm's loss aggregates them, mean over minibatches (NaN when "
    "kl_coef = 0)",
    "entropy_est": "-mean log pi_theta of the sampled response tokens (Monte-Carlo entropy estimate)",
    "grad_norm": "global gradient norm before clipping, mean over minibatches",
    "lr": "learning rate",
    "mismatch_mean_abs": "training-inference mismatch: mean |delta|, delta = logp_train_old - logp_rollout",
    "mismatch_max_abs": "max |delta|",
    "mismatch_k3": "k3 KL, mean(e^delta - 1 - delta)",
    "mismatch_frac_gt2": "fraction of tokens with max(rho, 1/rho) > 2, rho = e^delta",
    "routing_slot_mismatch": "old vs new policy: expert-slot mismatch of the update forward's free routing against "
    "the pi_old recompute's, mean over the minibatches after at least one update (2..M; NaN with one minibatch; "
    "computed alongside under replay)",
    "routing_set_flip_rate": "old vs new policy: router set-flip rate",
    "routing_token_flip_rate": "old vs new policy: token any-layer flip rate",
    "routing_token_changed_frac": "old vs new policy: fraction of the response's positions (the inputs whose forward "
    "gives a response token's log-prob) with at least one expert changed in any MoE layer, R3's measure; mean over "
    "the minibatches 2..M like routing_slot_mismatch (routing_token_flip_rate is the same over every real token, "
    "the prompt's included)",
    "ratio_gt2_frac": "fraction of response tokens whose importance ratio pi_theta / pi_old exceeds 2 at their "
    "minibatch update's forward, mean over minibatches (the first included: exactly 0 there when pi_old is the "
    "recompute)",
    "grad_norm_spike": "the step's largest minibatch gradient norm (before clipping) over the median of its "
    "minibatches' norms: 1 with one minibatch, NaN when the median is 0 (no signal)",
    "engine_routing_slot_mismatch": "rollout engine vs trainer routing of the same tokens (NaN when the engine "
    "returns no routes)",
    "expert_load_imbalance": "trainer expert load: per MoE layer, the most tokens any expert got over the mean per "
    "expert (N k / E), counting every top-k slot of the step's real (attention-masked) prompt and response tokens in "
    "the pi_old recompute's free routing; mean over layers. 1 = balanced, E / k = every token on the same k experts",
    "router_entropy": "trainer router entropy: per MoE layer, the mean over the same tokens of the entropy (nats) of "
    "the router's softmax over all E experts in the pi_old recompute; mean over layers. log E = uniform, 0 = certain",
    "engine_expert_load_imbalance": "expert_load_imbalance of the rollout engine's routes of the same tokens (NaN "
    "when the engine returns no routes)",
    "tokens": "response tokens of the step",
    "tokens_total": "prompt + response tokens of the step",
    "compute_flops": "cumulative training compute (FLOPs estimate: rollout 2N, pi_old recompute 2N, update 6N per "
    "token, N active parameters, plus attention) - the x-axis of Figure 1",
    "wall_s": "cumulative wall seconds of the run's steps (evaluation and checkpoints excluded)",
    "time_rollout_s": "seconds in rollout this step",
    "time_old_logp_s": "seconds in the pi_old recompute",
    "time_update_s": "seconds in the minibatch updates",
    "time_sync_s": "seconds pushing weights to the rollout engine",
    "sync_parity_mean_abs": "right after the weight sync, every sync_check_every steps (NaN otherwise): mean |logp "
    "trainer - logp engine| of the response tokens of the batch's first 4 sequences, both scored teacher-forced on "
    "the weights just synced (same real dtype: the sync's fidelity, ~1e-6 in fp32; other dtypes: their mismatch)",
    "sync_parity_max_abs": "the same check's largest |difference|",
    "peak_rss_gb": "peak resident memory of the process so far (GiB)",
}


LAYER_METRICS: dict[str, str] = {
    "slot_mismatch": "old vs new policy: expert-slot mismatch of one layer (routing_layers.parquet, one row per step "
    "and layer), mean over the step's minibatches",
    "set_flip_rate": "old vs new policy: router set-flip rate of one layer",
    "expert_load_imbalance": "trainer expert load of one layer: max over mean tokens per expert (the step metric's "
    "definition, before its mean over layers)",
    "router_entropy": "trainer router entropy of one layer, nats (the step metric's definition, one layer)",
    "engine_expert_load_imbalance": "the rollout engine's expert load imbalance of one layer (NaN when the engine "
    "returns no routes)",
}
"""The per-layer routing table's metrics (routing_layers.parquet: step, layer, then these)."""

MINIBATCH_METRICS: dict[str, str] = {
    "routing_slot_mismatch": "routing_slot_mismatch of minibatch m alone: its update forward after m - 1 updates on "
    "the rollout batch (m >= 2)",
    "routing_token_changed_frac": "routing_token_changed_frac of minibatch m alone (m >= 2)",
    "ratio_gt2_frac": "ratio_gt2_frac of minibatch m alone",
    "clip_frac": "clip_frac of minibatch m alone",
    "grad_norm": "grad_norm of minibatch m alone",
}
"""Per-minibatch columns of metrics.parquet, `{name}_mb{m}` for the minibatch index m = 1..min(M, MINIBATCH_COLUMNS)
(the routing ones from m = 2; the first minibatch's forward is pi_old's own): how a measure grows with the updates
since pi_old (m - 1) where the step's mean over minibatches hides it. A run with M minibatches writes these columns
for its own indices only."""

MINIBATCH_COLUMNS = 32
"""Highest minibatch index with its own `{name}_mb{m}` columns; later minibatches enter the step's means only."""


def minibatch_column(name: str, m: int) -> str:
    """The metrics.parquet column of MINIBATCH_METRICS `name` at minibatch index m (1-based)."""
    return f"{name}_mb{m}"


def minibatch_metrics(per_minibatch: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics that come from its minibatches one by one (`per_minibatch[i]`: MINIBATCH_METRICS values of
    minibatch i + 1, the routing ones from the second on): routing_token_changed_frac (mean over minibatches 2..M,
    NaN with one), grad_norm_spike, and the `{name}_mb{m}` columns up to MINIBATCH_COLUMNS."""
    changed = [mb["routing_token_changed_frac"] for mb in per_minibatch[1:] if "routing_token_changed_frac" in mb]
    norms = [mb["grad_norm"] for mb in per_minibatch]
    median = statistics.median(norms) if norms else math.nan
    out = {
        "routing_token_changed_frac": statistics.fmean(changed) if changed else math.nan,
        "grad_norm_spike": max(norms) / median if norms and median > 0 else math.nan,
    }
    for m, mb in enumerate(per_minibatch[:MINIBATCH_COLUMNS], start=1):
        out.update({minibatch_column(name, m): value for name, value in mb.items() if name in MINIBATCH_METRICS})
    return out


TOKEN_SAMPLE_COLUMNS: dict[str, str] = {
    "step": "RL step",
    "sample": "index of the sequence in the step's batch",
    "pos": "response token index",
    "trainer_logp": "the training engine's log-prob of the sampled token (pi_old recompute)",
    "engine_logp": "the rollout engine's log-prob of the same token",
}
"""token_samples.parquet's columns."""


def forward_flops(cfg: ModelConfig, tokens: int, context: float) -> float:
    """Forward FLOPs for `tokens` tokens attending over `context` positions on average: 2 N per token (N active
    parameters) plus attention scores and values (2 x 2 x context x heads x head_dim per layer per token)."""
    attention = 4.0 * cfg.num_layers * context * cfg.num_attention_heads * cfg.head_dim
    return tokens * (2.0 * cfg.active_params_per_token + attention)
