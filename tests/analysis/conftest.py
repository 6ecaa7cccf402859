"""Fixtures of the analysis tests: a small synthetic study written to disk once per session (Agg backend)."""

import matplotlib

matplotlib.use("Agg")

import pytest

from analysis.runs import tidy
from tests.analysis import synthetic

C = synthetic.Curve
# Ground truth per algorithm (tests may name algorithms; figure code never does).
TRUTH = {
    "grpo": C(a=0.5, b=1.2, c_mid=1e13, clip_low=0.0004, clip_high=0.0009, collapse_step=120),
    "grpo_rr": C(a=0.6, b=1.2, c_mid=1e13, clip_low=0.0005, clip_high=0.0008),
    "gspo": C(a=0.8, b=2.0, c_mid=1.5e13, clip_low=0.05, clip_high=0.1),
    "gspo_rr": C(a=0.78, b=2.0, c_mid=1.5e13, clip_low=0.04, clip_high=0.09),
    "sapo": C(a=0.7, b=1.5, c_mid=1.2e13, clip_low=0.0, clip_high=0.0),
}

TOKEN_TRUTH = {"bf16": (0.02, 0.01), "fp16": (-0.005, 0.002)}
"""(mean, std) of the per-sequence log-ratio trainer - engine in token_samples.parquet, per rollout dtype."""


@pytest.fixture(scope="session")
def study_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("study")
    ids = synthetic.make_study(
        root,
        TRUTH,
        seeds=(0, 1, 2),
        n_steps=200,
        flops_per_step=1e11,
        grid={"max_new_tokens": [256, 1024], "rollout_precision": ["bf16", "fp16"]},
        fail=["sapo"],
        token_mismatch=lambda config: TOKEN_TRUTH[config["rollout_precision"]],
    )
    return root, ids


@pytest.fixture(scope="session")
def study(study_dir):
    return tidy.load_study(study_dir[0])
