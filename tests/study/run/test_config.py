"""Run configuration: presets, content-addressed run ids, and errors that name the field before any compute."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import algorithms
from study.core.model_config import PRESETS, model_label, resolve_model
from study.run.config import PRESET_RUNS, RunConfig, load_config, merge_field, parse_set


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
        (["task_knobs.foo=1"], "task chain_sum: unknown knob 'foo'; valid: terms, digits"),
        (["task_knobs.seed=5"], "task chain_sum: unknown knob 'seed'; valid: terms, digits"),
        (["train_precision=fp8"], "train_precision = 'fp8'; valid: fp32, bf16, fp16, bf16_fp32head, fp32-emulated"),
        (["rollout_precision=bf17"], "rollout_precision = 'bf17'; valid: fp32, bf16, .*, same"),
        (["train_dtype=bf16"], "train_dtype is not a field; its replacement is train_precision .*valid values: fp32, "),
        (["rollout_dtype=bf16"], "rollout_dtype is not a field; its replacement is rollout_precision"),
        (["rollout_engine=sglang"], "rollout_engine = 'sglang'; valid: hf, vllm"),
        (["old_logp_source=engine"], "old_logp_source = 'engine'; valid: recompute, rollout"),
        (["algorithm=grpo_rr", "old_logp_source=rollout"], "replays the routes of the pi_old recompute"),
        (["group_size=1"], "group_size = 1: must be >= 2"),
        (["engine_router_noise=-0.5"], r"engine_router_noise = -0.5: must be a finite number in \[0, inf\)"),
        (
            ["engine_router_noise=0.5", "rollout_engine=vllm"],
            "engine_router_noise = 0.5 perturbs the router logits of "
            "rollout_engine = 'hf' only .* valid: engine_router_noise = 0, or rollout_engine = 'hf'",
        ),
        (["minibatches=3"], "minibatches = 3 must divide"),
        (["steps=zero"], "steps = 'zero': must be int"),
        (["routing_attribution=sometimes"], "routing_attribution = 'sometimes': must be true or false"),
        (["routing_attribution=1"], "routing_attribution = 1: must be true or false"),
        (["stepz=3"], r"unknown field\(s\) \['stepz'\]; valid: algorithm, "),
        (["max_new_tokens=4096"], "max_new_tokens = 4096: must be < model.max_seq_len 256"),
        (
            ["model=huge"],
            "model = 'huge': unknown model preset; valid: tiny, default, small, qwen3-30b-a3b, a local HF",
        ),
        (
            ["model.preset=huge"],
            "model.preset = 'huge': unknown model preset; valid: tiny, default, small, qwen3-30b-a3b",
        ),
        (["model.moe_top_k=9"], r"model.moe_top_k = 9: valid range is \[1, 4\]"),
        (["model.num_experts=16", "model.moe_top_k=17"], r"model.moe_top_k = 17: valid range is \[1, 16\]"),
        (["model.experts=8"], r"model: unknown field\(s\) \['experts'\]; valid: preset, num_layers, hidden_size"),
        (["model.num_layers=0"], "model.num_layers = 0: must be a positive integer"),
        (["model.num_experts=eight"], "model.num_experts = 'eight': must be a positive integer"),
        (["model.init_std=-1"], "model.init_std = -1: must be a positive finite number"),
        (["model.num_query_groups=3"], "model.num_query_groups = 3 must divide model.num_attention_heads = 2"),
        (["model.vocab_size=100"], "model.vocab_size = 100: must be >= 259"),
        (["model.max_seq_len=40"], "max_new_tokens = 48: must be < model.max_seq_len 40"),
        (["model=[1, 2]"], r"model = \[1, 2\]: must be a preset name \(tiny, default, small, qwen3-30b-a3b\), a local"),
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


def _cli_run(results: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    """`python -m study run --preset tiny` with `--set` of each of `sets`, into `results`."""
    cmd = [sys.executable, "-m", "study", "run", "--preset", "tiny", *(a for s in sets for a in ("--set", s))]
    return subprocess.run([*cmd, "--results", str(results)], capture_output=True, text=True, timeout=120)


def test_cli_rejects_bad_config_before_any_compute(tmp_path: Path) -> None:
    out = _cli_run(tmp_path, "algorithm=gpso")
    assert out.returncode == 2
    assert "error: algorithm = 'gpso'; valid: " in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


# --- model shape as data -------------------------------------------------------------------------------------------
def test_plain_preset_run_ids_are_unchanged() -> None:
    """Run directories are content-addressed: a run naming a plain preset has one id however the plain shape is
    spelled, and the ids are pinned, so that a change of what a run id hashes is deliberate."""
    pinned = {
        ("tiny", ()): "grpo-5fcc5da145f5",
        ("default", ()): "grpo-2e2c746da615",
        ("tiny", ("algorithm=gspo", "hparams.eps_high=5e-3")): "gspo-2c3304325e82",
        ("default", ("algorithm=gspo", "hparams.eps_high=5e-3")): "gspo-dfbf1e6fcc0e",
    }
    for (preset, sets), run_id in pinned.items():
        assert load_config(preset=preset, sets=list(sets)).run_id == run_id
        spelled = [f"model={{preset: {preset}}}", f"model.num_experts={PRESETS[preset].num_experts}"]
        cfg = load_config(preset=preset, sets=[*sets, *spelled])  # the preset's own values: the same shape
        assert cfg.model == preset and cfg.run_id == run_id


def test_a_shape_is_a_preset_plus_overrides() -> None:
    cfg = load_config(preset="default", sets=["model.num_experts=32", "model.moe_top_k=8"])
    assert cfg.model == {"preset": "default", "num_experts": 32, "moe_top_k": 8}
    assert cfg.model_config() == PRESETS["default"].replace(num_experts=32, moe_top_k=8)
    assert cfg.model_config() == resolve_model(cfg.model)
    assert model_label(cfg.model) == "default_e32_k8"
    plain = load_config(preset="default")
    assert cfg.run_id != plain.run_id and cfg.run_id.startswith("grpo-")
    # canonical: key order, spelled-out preset values and the route (from_dict / replace / YAML) do not matter
    same = RunConfig.from_dict(
        {**plain.to_dict(), "model": {"moe_top_k": 8, "num_layers": 4, "num_experts": 32, "preset": "default"}}
    )
    assert same.model == cfg.model and same.run_id == cfg.run_id
    assert RunConfig.from_dict(cfg.to_dict()).run_id == cfg.run_id  # resume reads config.yaml back
    assert plain.replace(model={"preset": "default", "num_experts": 32, "moe_top_k": 8}).run_id == cfg.run_id
    assert plain.replace(model={"num_experts": 32, "moe_top_k": 8}).run_id == cfg.run_id  # this shape, changed
    assert cfg.replace(model="default").run_id == plain.run_id
    # every distinct shape is a distinct run
    ids = {
        load_config(preset="default", sets=sets).run_id
        for sets in (
            [],
            ["model.num_experts=16"],
            ["model.num_experts=32"],
            ["model.num_experts=32", "model.moe_top_k=8"],
            ["model.num_layers=8"],
            ["model.hidden_size=256"],
            ["model.moe_ffn_hidden_size=128"],
            ["model.init_std=0.01"],
            ["model=tiny"],
        )
    }
    assert len(ids) == 9


def test_model_in_config_files_and_set(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny\n  num_experts: 8\n  init_std: 1e-2\n")  # YAML 1.1: 1e-2 is a string
    cfg = load_config(path)
    assert cfg.model == {"preset": "tiny", "num_experts": 8, "init_std": 0.01}
    # --set on top of a file's shape changes one field; a name (or a mapping with preset) replaces the shape
    assert load_config(path, sets=["model.moe_top_k=4"]).model == {**cfg.model, "moe_top_k": 4}
    assert load_config(path, sets=["model=default"]).model == "default"
    assert load_config(path, sets=["model={preset: default, num_layers: 2}"]).model == {
        "preset": "default",
        "num_layers": 2,
    }
    # a mapping without preset overrides the preset the config has so far (the field's default: tiny)
    assert load_config(sets=["model.num_experts=8"]).model == {"preset": "tiny", "num_experts": 8}
    assert load_config(preset="default", sets=["model.num_experts=16"]).model == {
        "preset": "default",
        "num_experts": 16,
    }


def test_parse_set_and_merge_field_for_the_model() -> None:
    assert parse_set(["model.num_experts=16"]) == {"model": {"num_experts": 16}}
    assert parse_set(["model=default", "model.num_experts=16", "model.moe_top_k=4"]) == {
        "model": {"preset": "default", "num_experts": 16, "moe_top_k": 4}
    }
    assert parse_set(["model.num_experts=16", "model=default"]) == {"model": "default"}  # in order
    assert merge_field("model", "default", {"num_experts": 16}) == {"preset": "default", "num_experts": 16}
    assert merge_field("model", {"preset": "default", "num_layers": 8}, {"num_experts": 16}) == {
        "preset": "default",
        "num_layers": 8,
        "num_experts": 16,
    }
    assert merge_field("model", {"preset": "default", "num_layers": 8}, {"preset": "tiny"}) == {"preset": "tiny"}
    assert merge_field("model", {"preset": "default", "num_layers": 8}, "small") == "small"
    assert merge_field("hparams", {"eps_low": 0.1}, {"eps_high": 0.2}) == {"eps_low": 0.1, "eps_high": 0.2}
    assert merge_field("seed", 1, 2) == 2


def test_cli_takes_a_shape_and_rejects_a_bad_one_before_any_compute(tmp_path: Path) -> None:
    out = _cli_run(tmp_path, "model.num_experts=2", "model.moe_top_k=3")
    assert out.returncode == 2, out.stderr
    assert "error: model.moe_top_k = 3: valid range is [1, 2]" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_router_lr_scale_and_coldstart_band() -> None:
    """Both are validated with the field and the valid values, and hashed only when set (older run ids hold)."""
    from study.policy.model import build_policy
    from study.policy.optim import build_optimizer

    base = load_config(preset="tiny")
    assert load_config(preset="tiny", sets=["router_lr_scale=1", "coldstart_band=[0.1, 0.5]"]).run_id == base.run_id
    assert load_config(preset="tiny", sets=["router_lr_scale=30"]).run_id != base.run_id
    assert load_config(preset="tiny", sets=["coldstart_band=[0.3, 0.7]"]).run_id != base.run_id
    for bad, msg in (
        ("router_lr_scale=-1", "router_lr_scale = -1.0: must be a finite number in (0, inf)"),
        ("coldstart_band=[0.6, 0.4]", "coldstart_band = [0.6, 0.4]; valid: [low, high]"),
        ("coldstart_band=0.5", "coldstart_band = 0.5; valid"),
    ):
        with pytest.raises(ValueError, match=re.escape(msg)):
            load_config(preset="tiny", sets=[bad])
    opt = build_optimizer(build_policy(base.model_config(), seed=0), lr=1e-4, router_lr_scale=30.0)
    (rest, routers) = opt.param_groups
    assert rest["lr"] == 1e-4 and routers["lr"] == pytest.approx(3e-3)
    assert len(routers["params"]) == base.model_config().num_layers  # one router weight per MoE layer


def test_parallel_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from study import rl
    from study.core.model_config import ParallelLayout

    base = RunConfig()
    cfg = load_config(sets=["parallel.expert=2", "parallel.data=2"])
    assert cfg.layout == ParallelLayout(expert=2, data=2) and cfg.layout.world_size == 2
    assert cfg.run_id == base.run_id  # a runtime choice: not in the run id, recorded in the manifest
    for sets, message in (
        (["parallel.pipeline=2"], "parallel.pipeline = 2: pipeline parallelism"),
        (["parallel.context=4"], "parallel.context = 4"),
        (["parallel.expert=2"], "must divide the world size"),
        (["parallel.tensor=4"], "num_attention_heads = 2 is not divisible by parallel.tensor = 4"),
        (["parallel.expert=8", "parallel.data=8"], "num_experts = 4 is not divisible"),
        (["parallel.tensors=2"], "unknown field"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(sets=sets)
    # the loop refuses, before any compute: a world the launcher did not start, what it does not run at a layout
    with pytest.raises(ValueError, match="needs 2 ranks, the launcher started 1"):
        rl.run(cfg, tmp_path, progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for sets, message in (
        (["parallel.tensor=2", "router_lr_scale=2"], "router_lr_scale != 1"),
        (["parallel.expert=2", "parallel.data=2", "algorithm=dapo"], "dynamic sampling"),
        (["parallel.data=2", "minibatches=32"], "does not split evenly over parallel.data = 2"),
        (["parallel.expert=2", "parallel.data=2", "coldstart=scratch"], "coldstart = 'scratch'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            rl.run(load_config(sets=sets), tmp_path, progress=False)
    monkeypatch.delenv("WORLD_SIZE")
    assert not (tmp_path / "runs").exists()  # nothing written
    run_dir = tmp_path / "runs" / base.run_id
    run_dir.mkdir(parents=True)
