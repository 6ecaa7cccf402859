"""The memory and layout planner (study/run/plan.py; its CLI study/tools/plan.py): exact parameter counts, the sharding
arithmetic, the CLI, and the refusal of a run that cannot fit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from study.core.model_config import PRESETS, resolve_model
from study.policy.model import build_policy, count_parameters
from study.run import plan
from study.run.config import RunConfig
from study.tools.plan import PUBLISHED, plan_main


def _paper_run(**changes: Any) -> RunConfig:
    """A scratch run of the paper's model in bf16, 64 prompts x 8 samples a step, micro-batch 1, with `changes`."""
    return RunConfig(
        model="qwen3-30b-a3b",
        coldstart="scratch",
        train_precision="bf16",
        rollout_precision="bf16",
        prompts_per_step=64,
        group_size=8,
        micro_batch=1,
        **changes,
    )


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_param_counts_equal_the_built_model(name: str) -> None:
    cfg = PRESETS[name]
    model = build_policy(cfg, seed=0)
    counts = plan.param_counts(cfg)
    assert counts.total == count_parameters(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    vocab = sum(
        p.numel()
        for n, p in model.named_parameters()
        if n in ("embedding.word_embeddings.weight", "output_layer.weight")
    )
    assert (counts.experts, counts.vocab) == (experts, vocab)


def test_param_counts_by_hand() -> None:
    # small: L 8, H 512, 8 q / 4 kv heads of 64, 16 experts of 512, vocab 4096
    c = plan.param_counts(PRESETS["small"])
    assert c.vocab == 2 * 4096 * 512
    assert c.attention == 8 * ((8 + 8) * 64 * 512 + 8 * 64 * 512)
    assert c.replicated == 8 * (2 * 512 + 2 * 64 + 16 * 512) + 512
    assert c.experts == 8 * 16 * 3 * 512 * 512
    assert c.total == 4_194_304 + 6_291_456 + 75_264 + 100_663_296 == 111_224_320  # the README's "111M"
    # Qwen3-30B-A3B: 30.5B total, 3.3B active (its model card's numbers)
    big = resolve_model("qwen3-30b-a3b")
    assert round(plan.param_counts(big).total / 1e9, 1) == 30.5
    assert round(big.active_params_per_token / 1e9, 1) == 3.0  # the card's 3.3B counts the embedding too


def test_sharding_arithmetic() -> None:
    cfg = resolve_model("qwen3-30b-a3b")
    c = plan.param_counts(cfg)
    work = plan.Workload(prompts=1, group_size=2, prompt_len=16, response_len=16)
    lay = plan.Layout(tp=4, ep=4, dp=4, sp=True, dist_opt=True)
    est = plan.estimate(cfg, lay, work, reserve_gb=0)
    dense, expert = (c.vocab + c.attention) / 4 + c.replicated, c.experts / 4
    assert est.weights == pytest.approx(2 * (dense + expert))
    assert est.grads == pytest.approx(4 * (dense + expert))
    assert est.optimizer == pytest.approx(12 * (dense / 4 + expert / 4))  # EDP = TP x DP / EP = 4
    no_shard = plan.estimate(cfg, plan.Layout(tp=4, ep=4, dp=4, sp=True), work, reserve_gb=0)
    assert no_shard.optimizer == pytest.approx(12 * (dense + expert))
    assert plan.Layout(tp=4, ep=4, dp=4).check(cfg) is not None  # TP x EP needs SP
    assert plan.Layout(tp=8, dp=2).check(cfg) is not None  # 4 KV heads
    assert all(layout.world == 16 for layout in plan.candidate_layouts(cfg, 16))


def test_published_layouts_fit_and_oversized_runs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = resolve_model("qwen3-30b-a3b")
    work = plan.Workload(prompts=64, group_size=8, prompt_len=1024, response_len=4096)
    for gpus, layout in PUBLISHED.values():
        est = plan.estimate(cfg, layout, work, engine=plan.default_engine(cfg, gpus), gpu_mem_gb=80)
        assert est.fits(80 * plan.GB), layout.label()
    verl = dataclasses.replace(PUBLISHED["verl GSPO (2x8)"][1], offload=False)  # why verl offloads
    assert not plan.estimate(cfg, verl, work, engine=plan.default_engine(cfg, 16), gpu_mem_gb=80).fits(80 * plan.GB)
    assert plan_main(["--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "TP4 EP4 DP4 +SP +DistOpt +Recompute" in out and "layouts fit on 16 GPU(s) of 80 GB" in out
    assert "(verl GSPO (2x8))" in out and "(NeMo-RL GRPO (8x8))" in out
    assert plan_main(["--model", "qwen3-30b-a3b", "--gpus", "1", "--gpu-mem", "80"]) == 1  # fits nowhere
    assert plan_main(["--model", "nosuch", "--gpus", "1", "--gpu-mem", "80"]) == 2
    assert "unknown model preset" in capsys.readouterr().err

    run = _paper_run(max_new_tokens=4096)
    assert plan.check_run_fits(run, gpus=16, gpu_mem_gb=80).fits(80 * plan.GB)
    with pytest.raises(ValueError, match=r"does not fit on 8 GPU\(s\) of 24 GB"):
        plan.check_run_fits(run, gpus=8, gpu_mem_gb=24)


def test_a_colocated_peak_counts_the_trainers_state_beside_the_engine() -> None:
    """The trainer never offloads: while the engine rolls out, its weights, gradients and optimizer state stay."""
    cfg = resolve_model("qwen3-30b-a3b")
    work = plan.Workload(prompts=64, group_size=8, prompt_len=1024, response_len=8192)
    layout = plan.Layout(tp=4, ep=16, dp=4, sp=True, dist_opt=True)
    engine = plan.EngineLayout(tp=4, ep=4, dp=2, gpu_memory=0.3)
    est = plan.estimate(cfg, layout, work, engine=engine, gpu_mem_gb=80, reserve_gb=0, fragmentation=0)
    assert est.static == pytest.approx(est.weights + est.grads + est.optimizer)
    assert est.engine == pytest.approx(0.3 * 80 * plan.GB)  # vLLM's share: its weights and what they leave for KV
    assert est.total == pytest.approx(max(est.train, est.static + est.engine))
    assert est.static + est.engine > est.train  # at this micro-batch the rollout is the peak
    with pytest.raises(ValueError, match=r"engine ep = 2: valid: 1 or tp = 4"):
        plan.EngineLayout(tp=4, ep=2)


def test_a_run_is_planned_at_its_own_layout_and_engine() -> None:
    run = _paper_run(
        max_new_tokens=8192,
        rollout_engine="vllm",
        rollout_runtime={"tp": 4, "ep": 4, "dp": 2, "gpu_memory": 0.3},
        parallel={"tensor": 4, "expert": 16, "data": 4},
    )
    est = plan.check_run_fits(run, gpus=16, gpu_mem_gb=80)
    assert est.layout == plan.Layout(tp=4, ep=16, dp=4, sp=True, dist_opt=True)
    with pytest.raises(ValueError, match=r"smaller micro-batch"):  # the loop's default: a rank's whole share at once
        plan.check_run_fits(run.replace(micro_batch=0), gpus=16, gpu_mem_gb=80)
    with pytest.raises(ValueError, match=r"parallel = .* has 16 ranks, the job 8 GPU"):
        plan.check_run_fits(run, gpus=8, gpu_mem_gb=80)
    with pytest.raises(ValueError, match=r"rollout_runtime: engine tp = 8"):
        plan.check_run_fits(run.replace(rollout_runtime={"tp": 8, "gpu_memory": 0.3}), gpus=16, gpu_mem_gb=80)
    with pytest.raises(
        ValueError, match=r"with its parallel layout; the smallest, TP4 EP16 DP4 \+SP \+DistOpt, needs 97"
    ):
        plan.check_run_fits(
            run.replace(rollout_runtime={"tp": 4, "ep": 4, "dp": 2, "gpu_memory": 0.6}), gpus=16, gpu_mem_gb=80
        )
    with pytest.raises(ValueError, match=r"its weights take 15.3 GB"):
        plan.check_run_fits(
            run.replace(rollout_runtime={"tp": 4, "ep": 4, "dp": 2, "gpu_memory": 0.15}), gpus=16, gpu_mem_gb=80
        )


def test_an_engine_without_expert_parallelism_slices_its_experts_over_tp() -> None:
    # vLLM's FusedMoE without EP shards every expert's intermediate dimension over TP: 1/4 of the experts' weights
    # per GPU at TP 4, the same bytes as splitting the experts over an EP group of 4
    cfg, work = PRESETS["qwen3-30b-a3b"], plan.Workload()
    sliced = plan.estimate(cfg, plan.Layout(tp=4, dp=4), work, engine=plan.EngineLayout(tp=4, ep=1))
    split = plan.estimate(cfg, plan.Layout(tp=4, dp=4), work, engine=plan.EngineLayout(tp=4, ep=4))
    counts = plan.param_counts(cfg)
    per_gpu = ((counts.vocab + counts.attention) / 4 + counts.replicated + counts.experts / 4) * 2  # bf16
    assert sliced.engine_weights == split.engine_weights == pytest.approx(per_gpu)
