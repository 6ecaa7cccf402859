"""One metric vocabulary: every name analysis reads (analysis/runs/vocab.py) is one the run writes
(study/run/metrics.py), so a renamed metric fails here instead of turning a claim "inconclusive" silently."""

from __future__ import annotations

import algorithms
from analysis.runs import vocab
from study.run.metrics import LAYER_METRICS, STEP_METRICS, TOKEN_SAMPLE_COLUMNS


def test_every_step_metric_analysis_reads_is_written() -> None:
    assert vocab.METRICS and set(vocab.METRICS) <= set(STEP_METRICS), sorted(set(vocab.METRICS) - set(STEP_METRICS))
    assert set(algorithms.LOSS_METRICS) <= set(STEP_METRICS)  # every variant's loss metrics are columns


def test_every_layer_and_token_column_analysis_reads_is_written() -> None:
    assert set(vocab.LAYER_METRICS) <= set(LAYER_METRICS)
    assert set(vocab.TOKEN_LOGPS) <= set(TOKEN_SAMPLE_COLUMNS)


def test_the_eval_columns_match_analysis_prefixes() -> None:
    evals = [name for name in STEP_METRICS if name.startswith(vocab.EVAL_PREFIXES)]
    assert evals == ["eval_in_dist", "eval_hard"]
