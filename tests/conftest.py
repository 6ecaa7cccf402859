"""Shared test settings and fixtures: deterministic hypothesis runs without wall-clock deadlines (CI shares 2 cores),
one CPU thread per test (as the harness's runs use), and the tiny cold start every run test starts from."""

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One results dir per session holding the tiny cold start (2-4 min to make, once; reused from the checkout's
    results/coldstart when it has one)."""
    from study.coldstart import ensure_coldstart
    from tests.shared import ROOT, smoke_config

    results = tmp_path_factory.mktemp("results")
    cached = ROOT / "results" / "coldstart"
    if cached.is_dir():
        shutil.copytree(cached, results / "coldstart", ignore=shutil.ignore_patterns(".*"))
    cfg = smoke_config()
    ensure_coldstart(cfg.model, cfg.task, results)
    return results
