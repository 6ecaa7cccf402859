"""A sweep's per-algorithm fields (sweeps/expand.py)."""

import pytest

from sweeps.expand import expand
from sweeps.schema import SweepError


def test_per_algorithm_fields_apply_to_that_algorithm_only(tmp_path):
    """`per_algorithm` sets one algorithm's fields after `base` and before the axes; other algorithms keep base's."""
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\npreset: tiny\nbase: {steps: 3, hparams: {eps_low: 0.1}}\n"
        "per_algorithm:\n  gspo: {lr: 2.0e-4, hparams: {eps_low: 3.0e-3, eps_high: 5.0e-3}}\n"
        "axes: {algorithm: [grpo, gspo], seed: [0]}\n"
    )
    runs = {cfg.algorithm: cfg for cfg in expand(path).values()}
    assert runs["gspo"].hparams == {"eps_low": 3.0e-3, "eps_high": 5.0e-3} and runs["gspo"].lr == 2.0e-4
    assert runs["grpo"].hparams == {"eps_low": 0.1} and runs["grpo"].lr != 2.0e-4


def test_per_algorithm_names_a_registered_algorithm(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nper_algorithm:\n  gpso: {lr: 1.0e-4}\naxes: {algorithm: [grpo]}\n")
    with pytest.raises(SweepError, match=r"per_algorithm.*gpso.*valid: .*gspo"):
        expand(path)
