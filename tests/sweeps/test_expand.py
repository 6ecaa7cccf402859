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
    with pytest.raises(
        SweepError,
        match=rf"makes 1000000 runs \(1000 seed x 1000 eval_size\), more than max_runs = "
        rf"{MAX_RUNS}; valid: .*`max_runs: N`.*--max-runs N",
    ):
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


def test_exclude_leaves_out_only_the_matching_combinations(tmp_path: Path) -> None:
    """`exclude` drops a grid's combinations whose values match an entry on every axis it names (here the replay
    runs of the dense shape), and nothing else."""
    from sweeps.expand import load_sweep

    dense = "{preset: tiny, num_experts: 1, moe_top_k: 1, moe_ffn_hidden_size: 256}"
    text = (
        f"name: s\npreset: tiny\naxes:\n  algorithm: [grpo, grpo_rr, gspo]\n  model: [tiny, {dense}]\n"
        f"  seed: [0, 1]\nexclude:\n  - {{algorithm: [grpo_rr, gspo], model: [{dense}]}}\n"
    )
    sweep = load_sweep(_sweep(tmp_path, text))
    kept = {(c["algorithm"], c["model"] == "tiny", c["seed"]) for c in sweep.combinations()}
    assert kept == {(a, True, s) for a in ("grpo", "grpo_rr", "gspo") for s in (0, 1)} | {
        ("grpo", False, 0),
        ("grpo", False, 1),
    }
    assert sweep.size() == len(sweep.expand()) == 8


@pytest.mark.parametrize(
    ("exclude", "match"),
    [
        ("[{lr: [1]}]", r"exclude\[0\].lr is not an axis; valid: algorithm, seed"),
        ("[{seed: [7]}]", r"exclude\[0\].seed = 7 is not a value of axes.seed; valid: 0, 1"),
        ("[{seed: 0}]", r"exclude\[0\].seed"),
    ],
)
def test_an_exclude_entry_names_an_axis_and_its_values(tmp_path: Path, exclude: str, match: str) -> None:
    from sweeps.expand import load_sweep

    text = f"name: s\npreset: tiny\naxes:\n  algorithm: [grpo]\n  seed: [0, 1]\nexclude: {exclude}\n"
    with pytest.raises(SweepError, match=match):
        load_sweep(_sweep(tmp_path, text))
    zipped = "name: s\npreset: tiny\nmode: zip\naxes:\n  seed: [0, 1]\nexclude: [{seed: [0]}]\n"
    with pytest.raises(SweepError, match=r"exclude applies to mode = 'grid'"):
        load_sweep(_sweep(tmp_path, zipped))
