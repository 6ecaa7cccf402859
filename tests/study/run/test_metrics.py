"""The metric vocabulary's one table (study/run/metrics.py): every entry names a function that exists, the docs'
tables are its rendering, and k3, the one KL formula, has its hand-derived values."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from study.run import metrics
from study.run.metrics import LAYER_METRICS, MINIBATCH_METRICS, STEP_METRICS, TOKEN_SAMPLE_COLUMNS, Metric, k3
from study.tools import metric_docs

TABLES = {"step": STEP_METRICS, "layer": LAYER_METRICS, "minibatch": MINIBATCH_METRICS, "token": TOKEN_SAMPLE_COLUMNS}


def _resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("table", list(TABLES))
def test_every_metric_has_a_sentence_and_a_function_that_computes_it(table: str) -> None:
    for name, metric in TABLES[table].items():
        assert isinstance(metric, Metric) and metric.sentence.strip(), name
        assert callable(_resolve(metric.computed)), f"{name}: {metric.computed} names nothing callable"


def test_the_docs_tables_are_the_tables_rendering() -> None:
    for doc in metric_docs.DOCS:
        text = (metric_docs.ROOT / doc).read_text()
        assert "<!-- metrics: " in text, doc
        assert metric_docs.render(text) == text, f"{doc}: run python -m study.tools.metric_docs"
    readme = (metric_docs.ROOT / "analysis/README.md").read_text()
    assert all(f"| `{name}` |" in readme for name in STEP_METRICS)  # the step table is rendered, every row


def test_a_stale_or_unknown_section_is_found() -> None:
    stale = "x\n<!-- metrics: layer -->\n| old |\n<!-- end metrics -->\ny\n"
    assert metric_docs.render(stale) == (
        "x\n<!-- metrics: layer -->\n" + metrics.markdown_table(LAYER_METRICS) + "<!-- end metrics -->\ny\n"
    )
    with pytest.raises(ValueError, match="no such table; valid: step, loss"):
        metric_docs.render("<!-- metrics: nope -->\n<!-- end metrics -->")


def test_markdown_table_escapes_pipes() -> None:
    got = metrics.markdown_table({"m": Metric("mean |d|", "study.record.mismatch")})
    assert got.splitlines()[-1] == "| `m` | mean \\|d\\| | `study.record.mismatch` |"


def test_k3_by_hand() -> None:
    d = torch.tensor([0.0, math.log(2.0), -math.log(2.0)])
    # e^d - 1 - d: 0 at d = 0; 2 - 1 - ln 2; 1/2 - 1 + ln 2
    assert k3(d).tolist() == pytest.approx([0.0, 1.0 - math.log(2.0), math.log(2.0) - 0.5])
    assert (k3(torch.linspace(-5, 5, 101)) >= 0).all()
