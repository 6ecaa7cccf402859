"""Every metric name analysis reads is spelled once, in analysis/vocab.py (eval metrics are matched by prefix)."""

from __future__ import annotations

import ast
from pathlib import Path

from analysis import vocab

ANALYSIS = Path(vocab.__file__).parent
TABLE_NAMES = {
    ("figures.py", "tokens"),  # Figure 4b's table of token counts, not the metric
    ("tidy.py", "tokens"),  # Study.tokens, the token-sample table
    ("figures.py", "slot_mismatch"),  # Figure 6's vs_clip column: each run's mean routing_slot_mismatch
}
"""Strings that equal a metric name but name a table or a column analysis writes."""


def _strings(tree: ast.AST) -> set[str]:
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def test_no_module_but_vocab_spells_a_metric_name() -> None:
    names = {*vocab.METRICS, *vocab.LAYER_METRICS, *vocab.TOKEN_LOGPS}
    assert len(names) == len(vocab.METRICS) + len(vocab.LAYER_METRICS) + len(vocab.TOKEN_LOGPS)
    found = {
        (path.name, s)
        for path in sorted(ANALYSIS.glob("*.py"))
        if path.name != "vocab.py"
        for s in _strings(ast.parse(path.read_text()))
        if s in names
    }
    assert found - TABLE_NAMES == set()


def test_vocabulary_lists() -> None:
    assert vocab.MISMATCH == ("mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3", "mismatch_frac_gt2")
    assert vocab.REWARD in vocab.METRICS and set(vocab.MISMATCH) <= set(vocab.METRICS)
    assert vocab.eval_metrics(["reward_mean", "eval_gsm8k", "eval/math", "clip_frac"]) == ["eval_gsm8k", "eval/math"]
