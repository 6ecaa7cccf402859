"""The metric vocabulary of an RL run, in one table: each column of the run's tables with its sentence and the
function that computes it. Every reader takes it from here: the run's files and trackers (study/record.py,
study/run/trackers.py), analysis (analysis/runs/vocab.py names the columns it reads; tests/test_vocabulary.py holds them
to this table) and the docs (the tables in analysis/README.md and docs/algorithms.md are `markdown_table`'s output,
written by `python -m study.tools.metric_docs` and compared by tests/study/run/test_metrics.py).

metrics.parquet has one row per step. Analysis reads these names and never an algorithm's; every variant logs every
one (a value that does not apply is NaN, e.g. eval columns between evaluations). Loss metrics (algorithms.LOSS_METRICS
and a variant's extras) are means over the step's minibatches; MINIBATCH_METRICS are also written per minibatch
index, as `{name}_mb{m}` columns.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, NamedTuple

from algorithms import LOSS_METRICS
from study.core.model_config import ModelConfig

if TYPE_CHECKING:
    import torch


class Metric(NamedTuple):
    """One column of a run's tables."""

    sentence: str  # what it means
    computed: str  # the function (or class) that computes it, as a dotted import path


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) per sample x ~ q: e^d - 1 - d with d = log p(x) - log q(x); >= 0,
    unbiased. The run's three KL numbers are its means: approx_kl, kl_ref and mismatch_k3."""
    return log_ratio.exp() - 1 - log_ratio


_LOOP = "study.measures.StepMeasures"
_COLLECT = "study.rl._collect"
_UPDATE = "study.rl._update"
_LOSS_SOURCES = {
    "clip_frac": "algorithms.common.clip_metrics",
    "clip_frac_low": "algorithms.common.clip_metrics",
    "clip_frac_high": "algorithms.common.clip_metrics",
}


STEP_METRICS: dict[str, Metric] = {
    "step": Metric(
        "RL step (rollout batch) index, from 1; with eval_every > 0 a row at step 0 holds only the held-out "
        "evaluation of the starting policy (the cold start), what RL is measured from",
        _LOOP,
    ),
    "reward_mean": Metric("mean task reward of the step's responses (before any reward shaping)", _COLLECT),
    "reward_std": Metric("standard deviation of that reward", _COLLECT),
    "scorer_failures": Metric(
        "responses of the step (evaluation included) whose verifier timed out or failed, each scored "
        "0 (study.data.tasks.take_scorer_failures); the run goes on",
        _COLLECT,
    ),
    "eval_in_dist": Metric(
        "mean pass@1 over k samples on the in-distribution held-out set (NaN between evaluations)", "study.rl._evaluate"
    ),
    "eval_hard": Metric("the same on the harder, longer held-out set", "study.rl._evaluate"),
    "test_in_dist": Metric(
        "mean pass@1 over eval_test_samples samples on the held-out test split (eval_test_size problems, disjoint from "
        "the validation sets above), at the run's first and last evaluations only (NaN elsewhere, and always without "
        "a test split)",
        "study.rl._evaluate",
    ),
    "response_len_mean": Metric("mean response length in tokens (stop token included)", _COLLECT),
    "response_len_max": Metric("longest response of the step", _COLLECT),
    "truncation_rate": Metric("fraction of responses cut at max_new_tokens", _COLLECT),
    "zero_var_group_frac": Metric(
        "fraction of groups whose rewards were all equal (no signal; DAPO drops them)", _COLLECT
    ),
    "zero_var_solved_frac": Metric(
        "the part of zero_var_group_frac whose every response got the full reward (1): problems "
        "the policy already solves every time, as opposed to problems no sample solves",
        _COLLECT,
    ),
    "prompts_skipped_mastered": Metric(
        "prompt_filter = mastered: training prompts the step's draws skipped because an "
        "earlier group of theirs was solved by every response (NaN without the filter)",
        _COLLECT,
    ),
    **{
        name: Metric(sentence, _LOSS_SOURCES.get(name, "algorithms.common.ratio_metrics"))
        for name, sentence in LOSS_METRICS.items()
    },
    "loss": Metric("the algorithm's loss, mean over minibatches", _UPDATE),
    "approx_kl": Metric(
        "k3 estimate of KL(pi_old || pi_theta), mean(e^d - 1 - d), d = logp_old - logp_theta, before each "
        "minibatch update, mean over minibatches",
        _UPDATE,
    ),
    "kl_ref": Metric(
        "k3 estimate of KL(pi_theta || pi_ref) to the frozen initial policy, e^r - 1 - r, r = logp_ref - "
        "logp_theta, aggregated over tokens as the algorithm's loss aggregates them, mean over minibatches (NaN when "
        "kl_coef = 0)",
        "study.rl.kl_to_reference",
    ),
    "entropy_est": Metric("-mean log pi_theta of the sampled response tokens (Monte-Carlo entropy estimate)", _UPDATE),
    "grad_norm": Metric("global gradient norm before clipping, mean over minibatches", _UPDATE),
    "lr": Metric("learning rate", _LOOP),
    "precision_emulated": Metric(
        "1 when either engine runs an emulated precision (study/core/precision.py), else 0: a label on every row",
        _LOOP,
    ),
    "mismatch_mean_abs": Metric(
        "training-inference mismatch: mean |delta|, delta = logp_train_old - logp_rollout", "study.record.mismatch"
    ),
    "mismatch_max_abs": Metric("max |delta|", "study.record.mismatch"),
    "mismatch_k3": Metric("k3 KL, mean(e^delta - 1 - delta)", "study.record.mismatch"),
    "mismatch_frac_gt2": Metric("fraction of tokens with max(rho, 1/rho) > 2, rho = e^delta", "study.record.mismatch"),
    "routing_slot_mismatch": Metric(
        "old vs new policy: expert-slot mismatch of the update forward's free routing against "
        "the pi_old recompute's, mean over the minibatches after at least one update (2..M; NaN with one minibatch; "
        "computed alongside under replay)",
        "study.record.mean_volatility",
    ),
    "routing_set_flip_rate": Metric("old vs new policy: router set-flip rate", "study.record.mean_volatility"),
    "routing_token_flip_rate": Metric("old vs new policy: token any-layer flip rate", "study.record.mean_volatility"),
    "routing_token_changed_frac": Metric(
        "old vs new policy: fraction of the response's positions (the inputs whose forward "
        "gives a response token's log-prob) with at least one expert changed in any MoE layer, R3's measure; mean over "
        "the minibatches 2..M like routing_slot_mismatch (routing_token_flip_rate is the same over every real token, "
        "the prompt's included)",
        "study.run.metrics.minibatch_metrics",
    ),
    "ratio_gt2_frac": Metric(
        "fraction of response tokens whose importance ratio pi_theta / pi_old exceeds 2 at their "
        "minibatch update's forward, mean over minibatches (the first included: exactly 0 there when pi_old is the "
        "recompute)",
        "study.rl.ratio_gt2_frac",
    ),
    "weight_logratio_mean_abs": Metric(
        "log-ratio of the weights' change: mean |log pi_theta - log pi_old| over the response tokens of each "
        "minibatch's update forward (its routing, free or replayed, as the update ran; pi_old: the trainer's "
        "recompute), mean over the minibatches 2..M (NaN with one minibatch); with free routing it holds the routing "
        "part below, under replay it is the weights' alone",
        "study.run.metrics.logratio_metrics",
    ),
    "weight_logratio_gt_ln2_frac": Metric(
        "the same tokens' share with |log pi_theta - log pi_old| > ln 2 (a ratio above 2 or below 1/2), mean over "
        "the minibatches 2..M",
        "study.run.metrics.logratio_metrics",
    ),
    "routing_logratio_mean_abs": Metric(
        "routing_attribution only (NaN otherwise, and with one minibatch): the routing-attributable log-ratio, mean "
        "|log pi_theta(y | free routes) - log pi_theta(y | pi_old's routes)| over the response tokens, both on the "
        "weights of the minibatch's update (one from the update's forward, the other from one extra no-grad forward "
        "under the routing the update did not use: instrumentation, its FLOPs not in compute_flops), mean over the "
        "minibatches 2..M: what Routing Replay removes from the ratio. 0 for a dense model (one expert)",
        "study.run.metrics.logratio_metrics",
    ),
    "routing_logratio_gt_ln2_frac": Metric(
        "the same tokens' share with that routing log-ratio past ln 2 in absolute value, mean over the minibatches "
        "2..M (NaN without routing_attribution)",
        "study.run.metrics.logratio_metrics",
    ),
    "grad_norm_spike": Metric(
        "the step's largest minibatch gradient norm (before clipping) over the median of its "
        "minibatches' norms: 1 with one minibatch, NaN when the median is 0 (no signal)",
        "study.run.metrics.minibatch_metrics",
    ),
    "engine_routing_slot_mismatch": Metric(
        ("rollout engine vs trainer routing of the same tokens (NaN when the engine returns no routes)"),
        "study.measures.StepMeasures.pi_old",
    ),
    "expert_load_imbalance": Metric(
        "trainer expert load: per MoE layer, the most tokens any expert got over the mean per expert (N k / E), "
        "counting every top-k slot of the step's real (attention-masked) prompt and response tokens in the pi_old "
        "recompute's free routing; mean over layers. 1 = balanced, E / k = every token on the same k experts",
        "study.policy.routing.expert_load",
    ),
    "router_entropy": Metric(
        "trainer router entropy: per MoE layer, the mean over the same tokens of the entropy (nats) of the router's "
        "softmax over all E experts in the pi_old recompute; mean over layers. log E = uniform, 0 = certain",
        "study.policy.routing.expert_load",
    ),
    "engine_expert_load_imbalance": Metric(
        "expert_load_imbalance of the rollout engine's routes of the same tokens (NaN "
        "when the engine returns no routes)",
        "study.policy.routing.expert_load",
    ),
    "tokens": Metric("response tokens of the step", _COLLECT),
    "tokens_total": Metric("prompt + response tokens of the step", "study.measures.StepMeasures.finish"),
    "compute_flops": Metric(
        "cumulative training compute (FLOPs estimate: rollout 2N, pi_old recompute 2N, update 6N per "
        "token, N active parameters, plus attention) - the x-axis of Figure 1",
        "study.measures.StepMeasures",
    ),
    "wall_s": Metric(
        "cumulative wall seconds of the run's steps (evaluation and checkpoints excluded)",
        "study.measures.StepMeasures.finish",
    ),
    "time_rollout_s": Metric("seconds in rollout this step", _COLLECT),
    "time_old_logp_s": Metric(
        "seconds in the pi_old recompute (and the KL reference's forward)", "study.measures.StepMeasures.timed"
    ),
    "time_update_s": Metric(
        "seconds in the minibatch updates (the first one's forward included where pi_old's pass made it)",
        "study.measures.StepMeasures.timed",
    ),
    "time_attribution_s": Metric(
        "routing_attribution only (NaN otherwise): seconds of its extra forwards, not counted in time_update_s "
        "(wall_s counts them)",
        "study.measures.StepMeasures.routing_attribution",
    ),
    "time_sync_s": Metric("seconds pushing weights to the rollout engine", "study.measures.StepMeasures.timed"),
    "sync_parity_mean_abs": Metric(
        "right after the weight sync, every sync_check_every steps (NaN otherwise): mean |logp "
        "trainer - logp engine| of the response tokens of the batch's first 4 sequences, both scored teacher-forced on "
        "the weights just synced (same real dtype: the sync's fidelity, ~1e-6 in fp32; other dtypes: their mismatch)",
        "study.rl._sync_parity",
    ),
    "sync_parity_max_abs": Metric("the same check's largest |difference|", "study.rl._sync_parity"),
    "peak_rss_gb": Metric("peak resident memory of the process so far (GiB)", "study.record.peak_rss_gb"),
}


LAYER_METRICS: dict[str, Metric] = {
    "slot_mismatch": Metric(
        "old vs new policy: expert-slot mismatch of one layer (routing_layers.parquet, one row per step "
        "and layer), mean over the step's minibatches",
        "study.record.layer_rows",
    ),
    "set_flip_rate": Metric("old vs new policy: router set-flip rate of one layer", "study.record.layer_rows"),
    "expert_load_imbalance": Metric(
        "trainer expert load of one layer: max over mean tokens per expert (the step metric's "
        "definition, before its mean over layers)",
        "study.policy.routing.expert_load",
    ),
    "router_entropy": Metric(
        "trainer router entropy of one layer, nats (the step metric's definition, one layer)",
        "study.policy.routing.expert_load",
    ),
    "engine_expert_load_imbalance": Metric(
        ("the rollout engine's expert load imbalance of one layer (NaN when the engine returns no routes)"),
        "study.policy.routing.expert_load",
    ),
}
"""The per-layer routing table's metrics (routing_layers.parquet: step, layer, then these)."""

MINIBATCH_METRICS: dict[str, Metric] = {
    "routing_slot_mismatch": Metric(
        "routing_slot_mismatch of minibatch m alone: its update forward after m - 1 updates on "
        "the rollout batch (m >= 2)",
        "study.run.metrics.minibatch_metrics",
    ),
    "routing_token_changed_frac": Metric(
        "routing_token_changed_frac of minibatch m alone (m >= 2)", "study.run.metrics.minibatch_metrics"
    ),
    "ratio_gt2_frac": Metric("ratio_gt2_frac of minibatch m alone", "study.run.metrics.minibatch_metrics"),
    "clip_frac": Metric("clip_frac of minibatch m alone", "study.run.metrics.minibatch_metrics"),
    "grad_norm": Metric("grad_norm of minibatch m alone", "study.run.metrics.minibatch_metrics"),
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


def logratio_metrics(prefix: str, logratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`{prefix}_mean_abs` and `{prefix}_gt_ln2_frac` of the log-ratios `logratio` (b, T) over the response tokens
    (`mask` (b, T)): the mean |log-ratio| and the share of tokens whose |log-ratio| exceeds ln 2."""
    on = mask.bool()
    size = on.sum().clamp_min(1)
    magnitude = logratio.detach().float().abs()
    return {
        f"{prefix}_mean_abs": float(magnitude.masked_fill(~on, 0.0).sum() / size),
        f"{prefix}_gt_ln2_frac": float(((magnitude > math.log(2.0)) & on).sum() / size),
    }


def mean_over_minibatches(rows: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, float]:
    """Each of `names` averaged over `rows` (one per minibatch measured); NaN for a name no row holds."""
    return {
        name: statistics.fmean(vals) if (vals := [r[name] for r in rows if name in r]) else math.nan for name in names
    }


LOGRATIO_METRICS: tuple[str, ...] = (
    "weight_logratio_mean_abs",
    "weight_logratio_gt_ln2_frac",
    "routing_logratio_mean_abs",
    "routing_logratio_gt_ln2_frac",
)
"""The step's log-ratio metrics (`logratio_metrics` of minibatches 2..M, averaged)."""


TOKEN_SAMPLE_COLUMNS: dict[str, Metric] = {
    "step": Metric("RL step", "study.record.token_samples"),
    "sample": Metric("index of the sequence in the step's batch", "study.record.token_samples"),
    "pos": Metric("response token index", "study.record.token_samples"),
    "trainer_logp": Metric(
        "the training engine's log-prob of the sampled token (pi_old recompute)", "study.record.token_samples"
    ),
    "engine_logp": Metric("the rollout engine's log-prob of the same token", "study.record.token_samples"),
}
"""token_samples.parquet's columns."""


def markdown_table(table: dict[str, Metric]) -> str:
    """`table` as a Markdown table: each name, its sentence and where it is computed."""
    rows = [f"| `{name}` | {_cell(m.sentence)} | `{m.computed}` |" for name, m in table.items()]
    return "\n".join(["| name | meaning | computed by |", "|---|---|---|", *rows]) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe inside a cell would end it


def forward_flops(cfg: ModelConfig, tokens: int, context: float) -> float:
    """Forward FLOPs for `tokens` tokens attending over `context` positions on average: 2 N per token (N active
    parameters) plus attention scores and values (2 x 2 x context x heads x head_dim per layer per token)."""
    attention = 4.0 * cfg.num_layers * context * cfg.num_attention_heads * cfg.head_dim
    return tokens * (2.0 * cfg.active_params_per_token + attention)
