"""Fixtures of the study/ tests: one CPU thread (megatron's CPU-fallback warnings are filtered in pyproject.toml)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
