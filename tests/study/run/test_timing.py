"""The time planner (study/run/timing.py; `study plan`'s time columns and --sweep; the workflow's SLURM time limits):
the arithmetic on a shape small enough to work by hand, the CLI's fields, the time limit's derivation, bad input."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from study.core.model_config import PRESETS, resolve_model
from study.run import plan, timing
from study.run.config import RunConfig
from study.tools.plan import plan_main
from tests.shared import ROOT

# One MoE layer of `tiny`: hidden 64, 2 heads of 32 (2 KV groups), 4 experts of width 128, top-2, vocabulary 512.
SHAPE = PRESETS["tiny"].replace(num_layers=1)
# 2 prompts x 2 samples of 6 + 10 tokens: 4 sequences of 16, 64 tokens
WORK = plan.Workload(prompts=2, group_size=2, prompt_len=6, response_len=10, micro_batch=0)
FP32 = plan.Precision.of("fp32")
ENGINE = plan.EngineLayout(dtype="fp32", kv_dtype="fp32", dp=1)  # the hf engine of a CPU run
# A device where only FLOPs cost time: 1 GFLOP/s at efficiency 0.5, memory and links free, no dispatch
COMPUTE = dataclasses.replace(
    timing.device("cpu"),
    name="hand",
    peak_flops={"fp32": 1e9},
    mem_bw=1e30,
    link_bw=1e30,
    net_bw=1e30,
    train_eff=0.5,
    prefill_eff=0.5,
    launch_s=0.0,
    engine_step_s=0.0,
)


def test_active_parameters_and_forward_flops_by_hand() -> None:
    attention = 64 * 32 * (2 + 2 * 2) + 2 * 32 * 64  # QKV + output projection: 16,384
    experts = 2 * 3 * 64 * 128  # top-2 SwiGLU experts: 49,152
    router, head = 64 * 4, 64 * 512
    assert SHAPE.active_params_per_token == attention + experts + router + head == 98_560
    # 64 tokens x (2 N + 4 L x context 8 x heads 2 x head_dim 32)
    step = timing.step_time(SHAPE, plan.Layout(), WORK, dev=COMPUTE, minibatches=1, precision=FP32, engine=ENGINE)
    flops = 64 * (2 * 98_560 + 4 * 1 * 8 * 2 * 32)
    assert flops == 12_746_752
    assert step.pi_old == pytest.approx(flops / (1e9 * 0.5))
    assert step.update == pytest.approx(3 * flops / (1e9 * 0.5))  # a forward and its backward
    recompute = timing.step_time(
        SHAPE, plan.Layout(recompute=True), WORK, dev=COMPUTE, minibatches=1, precision=FP32, engine=ENGINE
    )
    assert recompute.update == pytest.approx(4 * flops / (1e9 * 0.5))  # + the recomputed forward
    assert step.tokens == 64 and step.total == pytest.approx(step.rollout + step.pi_old + step.update + step.sync)
    assert step.tokens_per_s_per_gpu == pytest.approx(64 / step.total)


def test_kernel_launches_per_expert_or_grouped() -> None:
    """Only dispatch costs time: pi_old is one forward of L x (attention + router + experts) + head ops."""
    dev = dataclasses.replace(COMPUTE, peak_flops={"fp32": 1e30}, launch_s=1e-3)
    times = {
        experts: timing.step_time(
            SHAPE, plan.Layout(), WORK, dev=dev, precision=FP32, engine=ENGINE, experts=experts
        ).pi_old
        for experts in ("sequential", "grouped")
    }
    assert times["sequential"] == pytest.approx((20 + 15 + 8 * 4 + 10) * 1e-3)  # 8 ops per expert, 4 experts
    assert times["grouped"] == pytest.approx((20 + 15 + 10 + 10) * 1e-3)
    auto = timing.step_time(SHAPE, plan.Layout(), WORK, dev=dev, precision=FP32, engine=ENGINE).pi_old
    assert auto == pytest.approx(times["sequential"])  # auto: sequential on the CPU form
    micro = timing.step_time(
        SHAPE, plan.Layout(), dataclasses.replace(WORK, micro_batch=1), dev=dev, precision=FP32, engine=ENGINE
    )
    assert micro.pi_old == pytest.approx(4 * times["sequential"])  # a forward per sequence


def test_decode_reads_the_weights_and_the_kv_cache_every_step() -> None:
    """A memory-bound device: each of the 10 decode steps reads the dense weights, the experts the 4 sequences
    touch, and every sequence's KV cache at the mean context; the prefill is free; the sync copies the weights."""
    dev = dataclasses.replace(COMPUTE, peak_flops={"fp32": 1e30}, mem_bw=1e9, decode_bw_eff=0.5, link_eff=1.0)
    step = timing.step_time(SHAPE, plan.Layout(), WORK, dev=dev, precision=FP32, engine=ENGINE)
    c = plan.param_counts(SHAPE)
    touched = 1 - (1 - 2 / 4) ** 4  # 4 sequences, top-2 of 4 experts
    weights = 4 * (c.vocab + c.attention + c.replicated + c.experts * touched)
    kv = 4 * (6 + 10 / 2) * 1 * 2 * 2 * 32 * 4  # sequences x context x layers x (K, V) x groups x head_dim x fp32
    assert step.rollout == pytest.approx(10 * (weights + kv) / (1e9 * 0.5))
    # one process: read + write of the fp32 weights, the experts once more (the engine stacks them)
    assert step.sync == pytest.approx(2 * 4 * (c.total + c.experts) / 1e9)


def test_a_cpu_adds_compute_and_memory_a_gpu_takes_the_larger() -> None:
    compute_only = COMPUTE
    memory_only = dataclasses.replace(COMPUTE, peak_flops={"fp32": 1e30}, mem_bw=1e6)
    both = dataclasses.replace(COMPUTE, mem_bw=1e6)
    c, m, cpu, gpu = (
        timing.step_time(SHAPE, plan.Layout(), WORK, dev=dev, precision=FP32, engine=ENGINE).pi_old
        for dev in (compute_only, memory_only, both, dataclasses.replace(both, cpu=False))
    )
    assert c > 0 and m > 0
    assert cpu == pytest.approx(c + m) and gpu == pytest.approx(max(c, m))


def test_collectives_and_the_optimizer_are_priced_per_minibatch() -> None:
    """On GPUs: the data-parallel gradient reduction and AdamW's traffic, once per minibatch."""
    cfg = resolve_model("qwen3-30b-a3b")
    work = plan.Workload(prompts=64, group_size=8, prompt_len=1024, response_len=1024, micro_batch=1)
    layout = plan.Layout(tp=1, ep=8, dp=8, dist_opt=True)
    h100 = timing.device("h100")
    one, four = (timing.step_time(cfg, layout, work, dev=h100, minibatches=m) for m in (1, 4))
    assert four.update > one.update and four.rollout == one.rollout and four.pi_old == one.pi_old
    assert timing.adam_bytes_per_param(plan.Precision.of("bf16")) == 2 * 12 + 4 + 2  # m, v, main r/w; grad; weights
    assert timing.adam_bytes_per_param(FP32) == 2 * (8 + 4) + 4
    h200 = timing.step_time(cfg, layout, work, dev=timing.device("h200"))
    assert h200.rollout < timing.step_time(cfg, layout, work, dev=h100).rollout  # decode is bandwidth-bound


def test_the_slurm_time_limit_is_twice_the_plan_plus_ten_minutes() -> None:
    assert timing.time_limit_min(3600) == 2 * 60 + 10
    assert timing.time_limit_min(0) == 10
    assert timing.time_limit_min(61) == math.ceil(2 * 61 / 60 + 10) == 13
    assert timing.time_limit_min(10 * 86400, most=2880) == 2880  # the cluster's longest job
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite and >= 0"):
            timing.time_limit_min(bad)
    run = RunConfig(model="tiny", coldstart="scratch", steps=10, eval_every=5, checkpoint_every=5)
    planned = timing.plan_run(run, dev=timing.device("cpu"))
    assert planned.steps == 10 and planned.evals > 0 and planned.checkpoints > 0
    assert planned.seconds == pytest.approx(
        10 * planned.step.total + planned.evals + planned.checkpoints + planned.startup
    )
    assert planned.gpu_hours == pytest.approx(planned.seconds / 3600)


def test_the_workflow_asks_slurm_for_the_planned_time(tmp_path: Path) -> None:
    """`snakemake -n --profile slurm-cpu` (the profile asks for no GPU): every run's --time-min is its CPU plan's
    limit; the coldstart keeps the profile's fixed number."""
    from sweeps.expand import load_sweep

    runs = load_sweep(ROOT / "sweeps" / "smoke.yaml").expand()
    cmd = [sys.executable, "-m", "snakemake", "-n", "--profile", "slurm-cpu", "--config", "sweep=sweeps/smoke.yaml"]
    proc = subprocess.run([*cmd, f"results={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launches = re.findall(r"-m study\.launch \S+/configs/(\S+)\.yaml .*--time-min (\d+)", proc.stdout)
    assert sorted(run_id for run_id, _ in launches) == sorted(runs)
    for run_id, minutes in launches:
        expected = timing.time_limit_min(timing.plan_run(runs[run_id], dev=timing.device("cpu")).seconds, most=2880)
        assert int(minutes) == expected


def test_the_paper_run_prints_time_throughput_and_gpu_hours(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--gpu-mem", "80", "--gpus-per-node", "8"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "PLANNED on h100" in out and "s/step" in out and "tok/s/GPU" in out and "GPU-h" in out
    headline = re.search(
        r"^planned: (.+?): ([\d,.]+) s/step .* ([\d,]+) tokens/s/GPU, .* ([\d,.]+) GPU-hours", out, re.M
    )
    assert headline, out
    fit = [e for e in plan.plan(resolve_model("qwen3-30b-a3b"), 16, 80, plan.Workload()) if e.fits(80 * plan.GB)]
    assert headline.group(1) in {e.layout.label() for e in fit}  # the fastest of the layouts that fit
    assert "1,102 tokens/s/GPU, 192 s/step" in out and "NeMo-RL" in out and "(verl GSPO (2x8))" in out
    assert plan_main([*argv, "--gpu", "h200"]) == 0  # more bandwidth: a faster rollout
    h200 = re.search(r"^planned: .*?: ([\d,.]+) s/step", capsys.readouterr().out, re.M)
    assert h200 and float(h200.group(1).replace(",", "")) < float(headline.group(2).replace(",", ""))


def test_a_sweep_is_priced_run_by_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--sweep", "sweeps/paper.yaml", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\w+-[0-9a-f]{12} ", line)]
    assert len(rows) == 12 and all(row[1] == "16" for row in rows)  # 12 runs, each on 2 nodes x 8 GPUs
    total = float(re.search(r"sweep total: ([\d,]+) GPU-hours", out).group(1).replace(",", ""))
    assert total == pytest.approx(sum(float(row[-1].replace(",", "")) for row in rows), abs=1)


def test_bad_input_names_the_valid_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", "tiny", "--gpus", "1", "--gpu", "a100"]) == 2
    assert "--gpu = 'a100': unknown GPU kind; valid: h100, h200" in capsys.readouterr().err
    assert plan_main(["--model", "tiny", "--gpus", "1", "--experts", "loop"]) == 2
    assert "valid: auto, grouped, sequential" in capsys.readouterr().err
    assert plan_main(["--model", "tiny", "--gpu-mem", "80"]) == 2
    assert "give --gpus (or --sweep)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"GPU kind 'tpu': unknown; valid: h100, h200, cpu"):
        timing.device("tpu")
    with pytest.raises(ValueError, match=r"no peak for dtype 'fp8'; valid: bf16, fp16, fp32"):
        timing.device("h100").peak("fp8")
