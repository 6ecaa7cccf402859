"""Every metric name analysis reads is spelled once, in analysis/runs/vocab.py (eval metrics are matched by prefix)."""

from __future__ import annotations

import ast
from pathlib import Path

from analysis.runs import vocab

ANALYSIS = Path(vocab.__file__).parent.parent
TABLE_NAMES = {
    ("figures/fig4b_token_logprobs.py", "tokens"),  # Figure 4b's table of token counts, not the metric
    ("runs/columns.py", "tokens"),  # Study.tokens, the token-sample table (its output file)
    ("runs/tidy.py", "tokens"),  # Study.tokens, the token-sample table
    ("figures/fig6_routing.py", "slot_mismatch"),  # Figure 6's vs_clip column: each run's mean routing_slot_mismatch
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
    names = {*vocab.METRICS, *vocab.LAYER_METRICS, *vocab.TOKEN_LOGPS, vocab.EVAL_IN_DIST}
    for listed in (vocab.METRICS, vocab.LAYER_METRICS, vocab.TOKEN_LOGPS):
        assert len(set(listed)) == len(listed)  # a layer column may share its step metric's name, nothing else
    shared = set(vocab.METRICS) & set(vocab.LAYER_METRICS)
    assert shared == {vocab.EXPERT_LOAD, vocab.ROUTER_ENTROPY, vocab.ENGINE_EXPERT_LOAD}
    found = {
        (path.relative_to(ANALYSIS).as_posix(), s)
        for path in sorted(ANALYSIS.rglob("*.py"))
        if path.name != "vocab.py"
        for s in _strings(ast.parse(path.read_text()))
        if s in names
    }
    assert found - TABLE_NAMES == set()


def test_the_names_follow_the_run_vocabulary() -> None:
    # study/run/metrics.py is the run's documented vocabulary; analysis may not import it (tests/test_imports.py),
    # so its names are read from the source here
    source = (ANALYSIS.parent / "study" / "run" / "metrics.py").read_text()
    step_metrics, layer_metrics = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            {"STEP_METRICS": step_metrics, "LAYER_METRICS": layer_metrics}.get(node.target.id, set()).update(keys)
    assert step_metrics and layer_metrics
    from algorithms import LOSS_METRICS  # STEP_METRICS includes them (**LOSS_METRICS)

    step_metrics |= set(LOSS_METRICS)
    assert set(vocab.METRICS) <= step_metrics, set(vocab.METRICS) - step_metrics
    assert vocab.EVAL_IN_DIST in step_metrics
    assert set(vocab.LAYER_METRICS) <= layer_metrics, set(vocab.LAYER_METRICS) - layer_metrics


def test_vocabulary_lists() -> None:
    assert vocab.MISMATCH == ("mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3", "mismatch_frac_gt2")
    assert vocab.REWARD in vocab.METRICS and set(vocab.MISMATCH) <= set(vocab.METRICS)
    assert vocab.eval_metrics(["reward_mean", "eval_gsm8k", "eval/math", "clip_frac"]) == ["eval_gsm8k", "eval/math"]
