"""Run configuration: presets, content-addressed run ids, and errors that name the field before any compute."""

import subprocess
import sys
from pathlib import Path

import pytest

import algorithms
from study.run.config import PRESET_RUNS, RunConfig, load_config, parse_set


@pytest.mark.parametrize("preset", sorted(PRESET_RUNS))
def test_presets_validate(preset: str) -> None:
    cfg = load_config(preset=preset)
    assert cfg.model == preset and cfg.run_id.startswith("grpo-")


def test_run_id_is_a_content_hash() -> None:
    base = RunConfig()
    assert RunConfig().run_id == base.run_id
    assert base.replace(seed=1).run_id != base.run_id
    assert base.replace(algorithm="gspo").run_id != base.run_id
    # defaults resolved against the registry: spelling out a default is the same run
    assert base.replace(hparams={"eps_low": 0.2}).run_id == base.run_id
    assert base.replace(hparams={"eps_low": 0.1}).run_id != base.run_id
    # checkpoint frequency does not change what a run computes
    assert base.replace(checkpoint_every=1).run_id == base.run_id


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["algorithm=gpso"], "algorithm = 'gpso'; valid: " + ", ".join(algorithms.names())),
        (["hparams.eps_low=-0.1"], r"grpo.eps_low = -0.1: valid range is \[0.0, 1.0\)"),
        (["hparams.clip=0.1"], "no hyper-parameter 'clip'; valid: eps_low, eps_high"),
        (["task=sudoku"], "task = 'sudoku'; valid: "),
        (["task_knobs.terms=99"], "terms"),
        (["train_dtype=fp8"], "train_dtype = 'fp8'; valid: fp32, bf16, fp16"),
        (["rollout_engine=sglang"], "rollout_engine = 'sglang'; valid: hf, vllm"),
        (["old_logp_source=engine"], "old_logp_source = 'engine'; valid: recompute, rollout"),
        (["algorithm=grpo_rr", "old_logp_source=rollout"], "replays the routes of the pi_old recompute"),
        (["group_size=1"], "group_size = 1: must be >= 2"),
        (["minibatches=3"], "minibatches = 3 must divide"),
        (["steps=zero"], "steps = 'zero': must be int"),
        (["stepz=3"], r"unknown field\(s\) \['stepz'\]; valid: algorithm, "),
        (["max_new_tokens=4096"], "max_new_tokens = 4096: must be < model.max_seq_len 256"),
    ],
)
def test_bad_config_names_the_field(sets: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(preset="tiny", sets=sets)


def test_parse_set_nests_and_parses_scalars() -> None:
    assert parse_set(["seed=3", "hparams.eps_high=5e-3", "task_knobs.operators=+-", "coldstart=scratch"]) == {
        "seed": 3,
        "hparams": {"eps_high": 5e-3},
        "task_knobs": {"operators": "+-"},
        "coldstart": "scratch",
    }


def test_yaml_exponents_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: gspo\nlr: 1e-4\nhparams:\n  eps_high: 5e-3\n")  # YAML 1.1 reads 1e-4 as a string
    cfg = load_config(path, preset="tiny")
    assert cfg.lr == 1e-4 and cfg.hparams == {"eps_high": 5e-3}


def test_cli_rejects_bad_config_before_any_compute(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "study",
            "run",
            "--preset",
            "tiny",
            "--set",
            "algorithm=gpso",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "error: algorithm = 'gpso'; valid: " in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()
