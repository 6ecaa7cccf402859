"""The vllm engine's runtime settings (study/run/rollout_runtime.py): validated before any compute with the field,
the value and the valid values; not in the run id; the profile's JSON through `python -m study.launch`. No engine
starts here."""

from __future__ import annotations

import pytest

from study.run.config import RunConfig, load_config
from study.run.rollout_runtime import EngineSettings


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"tp": 0}, "rollout_runtime.tp = 0: must be an integer >= 1"),
        ({"dp": 1.5}, "rollout_runtime.dp = 1.5: must be an integer >= 1"),
        ({"ep": 3, "tp": 2}, r"rollout_runtime.ep = 3: valid: 1 .* or tp = 2"),
        ({"gpu_memory": 1.5}, r"rollout_runtime.gpu_memory = 1.5: valid range is \[0.0, 1.0\]"),
        ({"gpu_memory": 0}, r"rollout_runtime.gpu_memory = 0.0: valid range is \(0, 1.0\]"),
        ({"bucket_mb": 0}, r"rollout_runtime.bucket_mb = 0.0: valid range is \(0, "),
        ({"placement": "remote"}, "rollout_runtime.placement = 'remote'; valid: colocated, separate"),
        ({"gpus": [1, 2]}, r"rollout_runtime.gpus = \[1, 2\]: needs placement = 'separate' and tp \* dp = 1"),
        ({"placement": "separate", "gpus": [-1]}, "must be a list of GPU indices >= 0"),
        ({"cuda_graphs": "yes"}, "rollout_runtime.cuda_graphs = 'yes': must be true or false"),
        ({"tensor_parallel": 2}, r"rollout_runtime: unknown key\(s\) \['tensor_parallel'\]; valid: tp, dp, ep"),
    ],
)
def test_bad_settings_name_the_key_and_the_valid_values(given, error) -> None:
    with pytest.raises(ValueError, match=error):
        EngineSettings.parse(given)


def test_replica_gpus_by_placement() -> None:
    assert EngineSettings.parse({"tp": 2, "dp": 2}).replica_gpus(4) == [[0, 1], [2, 3]]
    assert EngineSettings.parse({"placement": "separate", "tp": 2}).replica_gpus(4) == [[2, 3]]
    assert EngineSettings.parse({"placement": "separate", "gpus": [5]}).replica_gpus(8) == [[5]]
    with pytest.raises(ValueError, match="besides the trainer's; 2 visible"):
        EngineSettings.parse({"placement": "separate", "tp": 2}).replica_gpus(2)
    with pytest.raises(ValueError, match="tp \\* dp = 4 GPUs colocated, 2 visible"):
        EngineSettings.parse({"tp": 2, "dp": 2}).replica_gpus(2)


def test_runtime_is_validated_by_the_run_config_and_not_in_the_run_id() -> None:
    base = ["rollout_engine=vllm", "model.head_dim=32"]
    plain = load_config(preset="tiny", sets=base)
    tuned = load_config(
        preset="tiny", sets=[*base, "rollout_runtime.tp=1", "rollout_runtime.bucket_mb=64", "sync_check_every=5"]
    )
    assert tuned.rollout_runtime == {"tp": 1, "bucket_mb": 64} and tuned.run_id == plain.run_id
    with pytest.raises(ValueError, match=r"rollout_runtime.placement = 'x'"):
        load_config(preset="tiny", sets=[*base, "rollout_runtime.placement=x"])
    with pytest.raises(ValueError, match="read by rollout_engine = 'vllm' only"):
        RunConfig.from_dict({"rollout_runtime": {"tp": 2}})
    with pytest.raises(ValueError, match="sync_check_every = -1: must be >= 0"):
        RunConfig.from_dict({"sync_check_every": -1})


def test_launch_checks_the_profile_runtime_before_any_job(tmp_path, capsys) -> None:
    from study.launch import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout_engine: vllm\nmodel: {preset: tiny, head_dim: 32}\n")
    assert main([str(cfg), "--results", str(tmp_path), "--rollout-runtime", '{"placement": "nowhere"}']) == 2
    assert "--rollout-runtime.placement = 'nowhere'; valid: colocated, separate" in capsys.readouterr().err
    assert main([str(cfg), "--results", str(tmp_path), "--rollout-runtime", "[1]"]) == 2
    assert "--rollout-runtime = '[1]': a JSON list; valid: a JSON mapping" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing ran
