"""The docs' metric tables, written from the vocabulary's one table (study/run/metrics.py):

    python -m study.tools.metric_docs           # rewrite the tables
    python -m study.tools.metric_docs --check   # exit 1 naming each doc whose tables differ

In each doc of DOCS, the lines between a `<!-- metrics: NAME -->` line and the next `<!-- end metrics -->` line are
`markdown_table` of the table SECTIONS names NAME. tests/study/run/test_metrics.py checks them.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from algorithms import LOSS_METRICS
from study.run.metrics import (
    LAYER_METRICS,
    MINIBATCH_METRICS,
    STEP_METRICS,
    TOKEN_SAMPLE_COLUMNS,
    Metric,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("analysis/README.md", "docs/algorithms.md")
SECTIONS: dict[str, dict[str, Metric]] = {
    "step": STEP_METRICS,
    "loss": {name: STEP_METRICS[name] for name in LOSS_METRICS},
    "layer": LAYER_METRICS,
    "minibatch": MINIBATCH_METRICS,
    "token_samples": TOKEN_SAMPLE_COLUMNS,
}
_SECTION = re.compile(r"(<!-- metrics: (\w+) -->\n)(.*?)(<!-- end metrics -->)", re.DOTALL)


def render(text: str) -> str:
    """`text` with each marked section's lines replaced by its table; an unknown NAME raises naming the valid ones."""

    def table(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in SECTIONS:
            raise ValueError(f"<!-- metrics: {name} -->: no such table; valid: {', '.join(SECTIONS)}")
        return match.group(1) + markdown_table(SECTIONS[name]) + match.group(4)

    return _SECTION.sub(table, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.tools.metric_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a doc's tables differ")
    args = parser.parse_args(argv)
    stale = []
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(doc)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"metric tables out of date in {', '.join(stale)}: run python -m study.tools.metric_docs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
