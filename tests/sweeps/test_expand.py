"""A sweep's per-algorithm fields (sweeps/expand.py)."""

from pathlib import Path

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


# -- hostile and mistaken sweep files ----------------------------------------------------------------------------------
def _sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_a_sweep_too_large_is_refused_fast_unless_its_cap_is_raised(tmp_path: Path) -> None:
    import time

    from sweeps.expand import MAX_RUNS, load_sweep
    from sweeps.schema import SweepError

    values = ", ".join(str(i) for i in range(1000))
    path = _sweep(tmp_path, f"name: big\npreset: tiny\naxes:\n  seed: [{values}]\n  eval_size: [{values}]\n")
    start = time.monotonic()
    with pytest.raises(SweepError, match=rf"makes 1000000 runs \(1000 seed x 1000 eval_size\), more than max_runs = "
                       rf"{MAX_RUNS}; valid: .*`max_runs: N`.*--max-runs N"):  # fmt: skip
        load_sweep(path)
    assert time.monotonic() - start < 30
    small = _sweep(tmp_path, "name: s\npreset: tiny\nmax_runs: 2\naxes:\n  seed: [1, 2, 3]\n")
    with pytest.raises(SweepError, match=r"makes 3 runs .* more than max_runs = 2"):
        load_sweep(small)
    assert len(load_sweep(small, max_runs=3).expand()) == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("name: s\npreset: tiny\naxes:\n  seed: [1, 2, 1]\n", r"axes.seed lists 1 twice; valid: each value once"),
        ("name: s\nname: t\npreset: tiny\n", r"duplicate key 'name' \(line 2; first on line 1\)"),
        ("name: s\npreset: tiny\nbase:\n  lr: 1e-5\n  lr: 1e-4\n", r"duplicate key 'lr'"),
        (
            "name: s\npreset: tiny\nbase:\n  coldstart: '{ckpt}'\n",
            r"base.coldstart = '\{ckpt\}': placeholder \{ckpt\} "
            r"is not declared in vars:; valid: none",
        ),
        ("name: s\npreset: tiny\nvars: {a: x}\naxes:\n  coldstart: ['{b}']\n", r"placeholder \{b\} .*valid: a"),
        ("name: mlruns\npreset: tiny\n", r"name = 'mlruns'.*reserved"),
        ("name: tune\npreset: tiny\n", r"name = 'tune': reserved for tuning sweeps"),
    ],
)
def test_mistakes_in_a_sweep_file_are_named(tmp_path: Path, text: str, match: str) -> None:
    from sweeps.expand import load_sweep
    from sweeps.schema import SweepError

    with pytest.raises(SweepError, match=match):
        load_sweep(_sweep(tmp_path, text))
