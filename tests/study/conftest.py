"""Fixtures of the study/ tests: one CPU thread; megatron's CPU-fallback warnings (no Apex, no TransformerEngine,
deprecations) silenced for the tests in this folder only."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent
_QUIET = (
    "ignore:.*(Apex|Transformer Engine|TransformerEngine).*",
    "ignore:.*full scope is deprecated.*",
    "ignore:.*tp_group is None.*",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            for spec in _QUIET:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
