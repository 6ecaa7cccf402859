"""Time and cost planner: per parallel layout, the predicted seconds of one RL step split into its four stages
(rollout, pi_old, update, weight sync), tokens/s/GPU, and the GPU-hours of a run and of a sweep. A plan, not a
measurement: `study plan` labels its numbers as planned. The memory side is study/run/plan.py's; this module prices
the same layouts in time, from four things:

- FLOPs: `forward_flops` (study/run/metrics.py, the count the runs log as compute_flops): 2 x active parameters per
  token plus attention; a forward and its backward are 3 forwards (4 with full recompute);
- bytes moved: the weights each decode step reads (the rollout's memory-bound phase: the dense share and the experts
  the step's batch touches, plus the KV cache), the weights each trainer micro-batch reads and the activations it
  writes and reads back (plan.training_activations), AdamW's state per update, and the weight sync's and the
  collectives' bytes over the interconnect;
- kernel launches: eager ops per layer, with the experts one after another (`sequential`: ops per local expert) or
  one grouped GEMM per projection (`grouped`; RunConfig.experts, docs/performance.md "The experts");
- a device's published peak numbers (`DEVICES`, each with its source) times a stated efficiency per kind of work.

Each stage is the roofline max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) on a GPU (the sum on a
CPU thread, which does one at a time) plus launches x the dispatch time of one op plus its collectives (not
overlapped: a plan errs long). Lengths are the workload's maxima:
every response at max_new_tokens, the trainer's batch padded to the longest sequence, as study/batch.py pads it.

The `cpu` device is this form on one CPU thread, calibrated against measured steps (benchmarks/bench_step_time.py,
docs/performance.md "The time planner against measured steps"); `time_limit_min` turns a run's plan into a SLURM
time limit with a margin (sweeps/rules/common.smk `run_runtime`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from study.core.model_config import ModelConfig
from study.run.metrics import forward_flops
from study.run.plan import (
    DTYPE_BYTES,
    EngineLayout,
    Estimate,
    Layout,
    Precision,
    Workload,
    check_run_fits,
    param_counts,
    planned_workload,
    run_engine,
    run_layout,
    training_activations,
)


# ---------------------------------------------------------------------------------------------------------------------
# Devices: published peaks, and the efficiencies the plan assumes of them
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU thread): its peak numbers and the share of them each kind of work reaches."""

    name: str
    peak_flops: dict[str, float]  # dense matmul FLOP/s by dtype
    mem_bw: float  # bytes/s of device memory (HBM; a CPU thread: DRAM)
    link_bw: float  # bytes/s per direction between two devices of one node (NVLink; a CPU: memory copies)
    net_bw: float  # bytes/s per device between nodes (InfiniBand)
    mem_gb: float  # device memory, GB (the default of `study plan --gpu-mem`)
    train_eff: float  # share of peak FLOP/s the trainer's GEMM mix sustains
    prefill_eff: float  # share of peak FLOP/s the engine's prefill and decode GEMMs sustain
    decode_bw_eff: float  # share of mem_bw a decode step reaches reading weights and KV cache
    train_bw_eff: float  # share of mem_bw the trainer's weight reads and activation traffic reach
    link_eff: float  # share of link_bw / net_bw a large collective reaches (NCCL's bus bandwidth)
    launch_s: float  # seconds per eager op of the trainer (framework dispatch + kernel launch)
    engine_step_s: float  # seconds per decode step besides its kernels (scheduler, sampling, Python)
    startup_s: float  # seconds to start a run before its first step: imports, build, engine start
    load_bw: float  # bytes/s reading the starting weights and writing checkpoints (filesystem)
    source: str
    cpu: bool = False
    """A CPU thread: its compute and memory traffic add up (one core does one at a time; a GPU's overlap, and a
    stage takes the larger), the experts' `auto` path is sequential, the engine is in the run's process."""

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"device {self.name}: no peak for dtype {dtype!r}; valid: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]


H100 = Device(
    name="h100",
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    mem_bw=3.35e12,
    link_bw=450e9,
    net_bw=50e9,
    mem_gb=80.0,
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16/FP16 1,979 TFLOPS with sparsity (989.5 dense), "
    "FP32 67 TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s (450 per direction); NVIDIA DGX H100 datasheet: 8 x ConnectX-7 "
    "400 Gb/s, one 50 GB/s port per GPU",
    # the efficiencies the plan assumes of a Hopper GPU (H200: the same), none measured here:
    # megatron-core MoE training sustains 30-40% of the bf16 peak: expert GEMMs of a few hundred rows, permutes
    train_eff=0.35,
    # prefill is long dense GEMMs over the prompts: about half of the peak
    prefill_eff=0.5,
    # decode kernels (fused MoE, paged attention) read weights and KV at 50-70% of HBM bandwidth
    decode_bw_eff=0.6,
    # the trainer's elementwise ops (norms, SwiGLU, permutes) each read and write their activations: a few passes
    train_bw_eff=0.3,
    # NCCL's all-gather / reduce-scatter bus bandwidth is 70-80% of NVLink's and of InfiniBand's peak
    link_eff=0.75,
    # an eager PyTorch op costs ~5-10 us of CPU dispatch; kernels shorter than that leave the GPU idle
    launch_s=8e-6,
    # vLLM's scheduler, sampling and Python per decode step, with CUDA graphs capturing the kernels
    engine_step_s=1e-3,
    # imports, megatron's model build, vLLM's start and CUDA-graph capture
    startup_s=300.0,
    # a parallel filesystem's read or write per node, order of GB/s
    load_bw=2e9,
)

DEVICES: dict[str, Device] = {
    "h100": H100,
    "h200": dataclasses.replace(
        H100,
        name="h200",
        mem_bw=4.8e12,
        mem_gb=141.0,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the H100 SXM's FLOPS, 141 GB HBM3e at 4.8 TB/s, "
        "NVLink 900 GB/s; the DGX H200's network as the DGX H100's",
    ),
    "cpu": Device(
        name="cpu",
        # fp32: benchmarks/bench_peak.py's 1-thread torch.mm peak; bf16: this CPU kind's bf16 expert matmuls took
        # ~12x their fp32 time (docs/performance.md, "The experts")
        peak_flops={"fp32": 98.3e9, "bf16": 98.3e9 / 12, "fp16": 98.3e9 / 12},
        mem_bw=18e9,  # one thread's torch copy of 256 MB, read + write
        link_bw=18e9,  # ranks on one machine: gloo through shared memory, a copy
        net_bw=18e9,
        mem_gb=0.0,
        source="measured on the machine kind of docs/performance.md (1 thread); efficiencies and per-op times "
        "calibrated by benchmarks/bench_step_time.py",
        train_eff=0.9,  # the GEMMs, their elementwise traffic priced apart (below); bench_peak: 82% of peak overall
        prefill_eff=0.5,  # the C decode loop's GEMMs, a few rows each, and its attention over the KV cache
        decode_bw_eff=0.6,  # the C decode loop's reads of weights and KV cache
        train_bw_eff=0.2,  # megatron's elementwise ops read and write each activation several times
        link_eff=0.6,  # the weight sync copies weight by weight: ~60% of one streaming copy
        launch_s=20e-6,  # one torch op of megatron's layers with autograd, Python included
        engine_step_s=2e-4,  # the C loop's sampling and bookkeeping per decode step
        startup_s=10.0,  # imports, the policy's build, the engine's, the run directory (a tiny run's first 10 s)
        load_bw=1e9,
        cpu=True,
    ),
}
"""The devices the plan knows (`device`): published peaks for GPUs, measured ones for a CPU thread."""


def device(name: str) -> Device:
    """The named device; ValueError listing the valid names."""
    if name not in DEVICES:
        raise ValueError(f"GPU kind {name!r}: unknown; valid: {', '.join(DEVICES)}")
    return DEVICES[name]


# Eager ops per layer and per forward (a backward: twice a forward's), counted from megatron-core's MoE layer
ATTENTION_OPS = 20  # input norm, QKV GEMM, q/k norms, RoPE, core attention, output GEMM, residual adds, reshapes
ROUTER_OPS = 15  # pre-MLP norm, router GEMM, softmax and top-k, the dispatcher's permute and unpermute
EXPERT_OPS = 8  # sequential, per local expert: gather its rows, fc1, SwiGLU (3 ops), fc2, scale by the gate, scatter
GROUPED_OPS = 10  # grouped: fc1 and fc2 one grouped GEMM each, SwiGLU and the gate over all rows at once, stacking
HEAD_OPS = 10  # embedding, final norm, output layer, log-softmax and the label gather
SYNC_LAYER_TENSORS = 7  # a layer's weights besides its experts' (3 each): QKV, output, 4 norms, router

HOST_BW = 50e9
"""Bytes/s per GPU between an offloading layout's GPU and its host optimizer: a DGX H100's PCIe Gen5 x16 link per GPU
(64 GB/s per direction) and its share of the host's memory bandwidth are both of this order."""

TIME_LIMIT_FACTOR = 2.0
"""A job's time limit is the plan times this plus TIME_LIMIT_PAD_MIN: the plan is a model (the calibration's
errors, docs/performance.md), a machine's speed drifts, and a job that runs out is requeued and resumes from its last
checkpoint, losing the steps since."""
TIME_LIMIT_PAD_MIN = 10
"""Minutes added to every job's limit: queueing into the job's start, the last checkpoint's write, the exit."""


# ---------------------------------------------------------------------------------------------------------------------
# A step
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """Planned seconds of one RL step by stage, on `gpus` devices, for `tokens` tokens (every sequence at its
    maximum length: prompt_len + response_len)."""

    rollout: float
    pi_old: float
    update: float
    sync: float
    tokens: float
    gpus: int

    @property
    def total(self) -> float:
        return self.rollout + self.pi_old + self.update + self.sync

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.total / self.gpus


@dataclass(frozen=True)
class _Cost:
    """Work of one stage on one device: FLOPs at an efficiency, bytes of memory traffic, eager ops, collective
    bytes at a bandwidth."""

    flops: float = 0.0
    bytes: float = 0.0
    launches: float = 0.0
    comm_s: float = 0.0

    def __add__(self, other: _Cost) -> _Cost:
        return _Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def __mul__(self, n: float) -> _Cost:
        return _Cost(*(a * n for a in dataclasses.astuple(self)))

    def seconds(self, dev: Device, dtype: str, flops_eff: float, bw_eff: float) -> float:
        compute = self.flops / (dev.peak(dtype) * flops_eff)
        memory = self.bytes / (dev.mem_bw * bw_eff)
        bound = compute + memory if dev.cpu else max(compute, memory)
        return bound + self.launches * dev.launch_s + self.comm_s


def _collective_s(nbytes: float, group: int, dev: Device, within_node: bool) -> float:
    """Seconds of a ring all-gather or reduce-scatter of `nbytes` (the full tensor) over `group` devices."""
    if group <= 1:
        return 0.0
    bw = (dev.link_bw if within_node else dev.net_bw) * dev.link_eff
    return nbytes * (group - 1) / group / bw


def experts_touched(cfg: ModelConfig, tokens: float) -> float:
    """Expected share of a layer's experts that `tokens` tokens route to (each token picks k of E, taken as
    uniform): 1 - (1 - k / E)^tokens."""
    return 1.0 - (1.0 - cfg.moe_top_k / cfg.num_experts) ** tokens


def _trainer_forward(
    cfg: ModelConfig,
    layout: Layout,
    work: Workload,
    rows: float,
    precision: Precision,
    dev: Device,
    experts: str,
    gpus_per_node: int,
) -> _Cost:
    """One rank's forward of `rows` sequences of work.seq_len tokens, in micro-batches of work.micro_batch
    (0: all at once): FLOPs (the world splits them), weights read per micro-batch, activations written, eager ops,
    and the TP and EP collectives of every layer."""
    micro = work.micro_batch or max(1, math.ceil(rows))
    n_micro = max(1, math.ceil(rows / micro))
    mb_tokens = micro * work.seq_len
    counts = param_counts(cfg)
    dense, expert = counts.per_rank(layout.tp, layout.ep)
    # every micro-batch reads the rank's dense weights and the experts its tokens route to
    read = (dense + expert * experts_touched(cfg, mb_tokens * layout.ep)) * precision.weight_bytes
    acts = training_activations(cfg, layout, dataclasses.replace(work, micro_batch=micro), precision.act_bytes)
    local_experts = cfg.num_experts // layout.ep
    per_layer_ops = ATTENTION_OPS + ROUTER_OPS + (GROUPED_OPS if experts == "grouped" else EXPERT_OPS * local_experts)
    launches = cfg.num_layers * per_layer_ops + HEAD_OPS
    # TP + SP: each layer all-gathers its input and reduce-scatters its output, twice (attention, MoE)
    h_bytes = mb_tokens * cfg.hidden_size * precision.act_bytes
    tp_s = 4 * _collective_s(h_bytes, layout.tp, dev, within_node=True)
    # EP: each layer's token dispatch and combine, k copies of each of the rank's tokens (with SP, its 1 / TP share of
    # the sequence), an all-to-all over the EP group
    local = h_bytes / (layout.tp if layout.sp else 1)
    ep_s = 2 * _collective_s(local * cfg.moe_top_k, layout.ep, dev, within_node=layout.ep <= gpus_per_node)
    flops = forward_flops(cfg, rows * layout.dp * work.seq_len, work.seq_len / 2) / layout.world
    return _Cost(
        flops=flops,
        bytes=n_micro * (read + acts),
        launches=n_micro * launches,
        comm_s=n_micro * cfg.num_layers * (tp_s + ep_s),
    )


def adam_bytes_per_param(precision: Precision) -> float:
    """Bytes AdamW moves per parameter in one step: reads and writes m, v and the master weights (the fp32 main copy
    of a 16-bit policy, else the weights), reads the gradient, writes the 16-bit weights from the main copy."""
    main_copy = precision.optim_bytes > 8
    master = precision.optim_bytes if main_copy else precision.optim_bytes + precision.weight_bytes
    return 2 * master + precision.grad_bytes + (precision.weight_bytes if main_copy else 0)


def _optimizer_step(
    cfg: ModelConfig, layout: Layout, precision: Precision, dev: Device, gpus_per_node: int
) -> tuple[_Cost, float]:
    """One optimizer step on one rank: (AdamW's memory traffic over the rank's share of the state, the seconds of
    the data-parallel gradient reduction and, with the distributed optimizer, the weights' all-gather). An
    offloading layout (published ones) runs AdamW on the host: its state streams at HOST_BW, the gradients go down
    and the weights come back over the same link."""
    dense, expert = param_counts(cfg).per_rank(layout.tp, layout.ep)
    state = dense / layout.dp + expert / layout.edp if layout.dist_opt else dense + expert
    within = layout.world <= gpus_per_node
    per_param = precision.grad_bytes + (precision.weight_bytes if layout.dist_opt else precision.grad_bytes)
    comm = _collective_s(dense * per_param, layout.dp, dev, within) + _collective_s(
        expert * per_param, layout.edp, dev, within
    )
    if layout.offload:
        host = state * (adam_bytes_per_param(precision) + precision.grad_bytes + precision.weight_bytes)
        return _Cost(), comm + host / HOST_BW
    return _Cost(bytes=state * adam_bytes_per_param(precision)), comm


def rollout_seconds(
    cfg: ModelConfig,
    engine: EngineLayout,
    work: Workload,
    world: int,
    dev: Device,
    *,
    kv_capacity: float | None = None,
) -> float:
    """Seconds the engine's replicas take to generate work.sequences responses of work.response_len tokens after
    prompts of work.prompt_len: each replica's prefill (compute-bound) and response_len decode steps (their FLOPs
    against the bytes they read: the replica's dense weights, the embedding counted whole, the experts the batch
    touches and the KV cache at the mean context), in waves when `kv_capacity` (bytes per GPU) holds fewer sequences
    than the replica's share."""
    counts = param_counts(cfg)
    gpus = max(engine.tp, engine.ep)
    replicas = engine.dp or max(1, world // gpus)
    seqs = math.ceil(work.sequences / replicas)
    wbytes, kvbytes = DTYPE_BYTES[engine.dtype], DTYPE_BYTES[engine.kv_dtype]
    kv_heads = max(1, cfg.num_query_groups // engine.tp)
    context = work.prompt_len + work.response_len / 2  # a decode step's mean attention span
    kv_per_token = cfg.num_layers * 2 * kv_heads * cfg.head_dim * kvbytes
    waves = 1
    if kv_capacity is not None and kv_capacity > 0:
        waves = max(1, math.ceil(seqs * work.seq_len * kv_per_token / kv_capacity))
    batch = seqs / waves
    prefill = forward_flops(cfg, seqs * work.prompt_len, work.prompt_len / 2) / gpus
    prefill_s = prefill / (dev.peak(engine.dtype) * dev.prefill_eff)
    dense = (counts.vocab + counts.attention) / engine.tp + counts.replicated
    expert = counts.experts * experts_touched(cfg, batch) / (engine.ep if engine.ep > 1 else engine.tp)
    step = _Cost(
        flops=forward_flops(cfg, batch, context) / gpus,
        bytes=(dense + expert) * wbytes + batch * context * kv_per_token,
    )
    step_s = step.seconds(dev, engine.dtype, dev.prefill_eff, dev.decode_bw_eff) + dev.engine_step_s
    return prefill_s + waves * work.response_len * step_s


def sync_seconds(cfg: ModelConfig, layout: Layout, engine: EngineLayout, dev: Device, gpus_per_node: int) -> float:
    """Seconds of the weight sync: every weight, gathered from its TP / EP shards, sent once at the engine's dtype
    over the interconnect (the network when the trainer spans nodes). On a CPU the hf engine is in the run's process:
    each weight tensor is one copy (an op), the weights are read and written once, the experts once more where the
    engine stacks them."""
    counts = param_counts(cfg)
    nbytes = counts.total * DTYPE_BYTES[engine.dtype]
    if dev.cpu:
        tensors = cfg.num_layers * (SYNC_LAYER_TENSORS + 3 * cfg.num_experts) + 3
        moved = 2 * (nbytes + counts.experts * DTYPE_BYTES[engine.dtype])
        return moved / (dev.mem_bw * dev.link_eff) + tensors * dev.launch_s
    bw = dev.link_bw if layout.world <= gpus_per_node else dev.net_bw
    return nbytes / (bw * dev.link_eff)


def step_time(
    cfg: ModelConfig,
    layout: Layout,
    work: Workload,
    *,
    dev: Device,
    minibatches: int = 4,
    precision: Precision | None = None,
    engine: EngineLayout | None = None,
    experts: str = "auto",
    gpus_per_node: int = 8,
    est: Estimate | None = None,
) -> StepTime:
    """Planned seconds of one step of `work` on `layout`: the rollout (`rollout_seconds`; the engine's KV cache from
    `est`, plan.estimate's, when given), pi_old's forward of the batch, `minibatches` forwards and backwards each
    followed by an optimizer step, and the weight sync. `experts`: RunConfig.experts (auto: grouped on a GPU,
    sequential on the CPU)."""
    if experts not in ("auto", "grouped", "sequential"):
        raise ValueError(f"experts = {experts!r}; valid: auto, grouped, sequential")
    precision = precision or Precision()
    engine = engine or EngineLayout()
    if experts == "auto":
        experts = "sequential" if dev.cpu else "grouped"
    dtype = {4: "fp32", 2: "bf16"}[precision.weight_bytes]
    rows = work.sequences / layout.dp  # this rank's share of the batch
    kv = est.engine_kv if est is not None and engine.gpu_memory else None
    rollout = rollout_seconds(cfg, engine, work, layout.world, dev, kv_capacity=kv)

    forward = _trainer_forward(cfg, layout, work, rows, precision, dev, experts, gpus_per_node)
    pi_old = forward.seconds(dev, dtype, dev.train_eff, dev.train_bw_eff)

    share = _trainer_forward(cfg, layout, work, rows / minibatches, precision, dev, experts, gpus_per_node)
    backward = share * 2 + (share if layout.recompute else _Cost())  # a backward: twice a forward, + the recompute
    optim, reduce_s = _optimizer_step(cfg, layout, precision, dev, gpus_per_node)
    per_minibatch = (share + backward).seconds(dev, dtype, dev.train_eff, dev.train_bw_eff)
    per_minibatch += optim.seconds(dev, dtype, 1.0, 1.0)  # a fused AdamW streams its state once
    update = minibatches * (per_minibatch + reduce_s)

    sync = sync_seconds(cfg, layout, engine, dev, gpus_per_node)
    return StepTime(rollout, pi_old, update, sync, tokens=work.sequences * work.seq_len, gpus=layout.world)


# ---------------------------------------------------------------------------------------------------------------------
# A run, a sweep, a job's time limit
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunTime:
    """Planned seconds of a whole run: its steps, its held-out evaluations, its checkpoints and its start."""

    step: StepTime
    steps: int
    evals: float
    checkpoints: float
    startup: float

    @property
    def seconds(self) -> float:
        return self.steps * self.step.total + self.evals + self.checkpoints + self.startup

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.step.gpus / 3600


def run_time(
    cfg: ModelConfig,
    layout: Layout,
    work: Workload,
    run: Any,
    *,
    dev: Device,
    precision: Precision | None = None,
    engine: EngineLayout | None = None,
    gpus_per_node: int = 8,
    est: Estimate | None = None,
) -> RunTime:
    """The plan of a run (a RunConfig's steps, minibatches, experts, evaluation and checkpoint cadence) on `layout`:
    its steps (`step_time`); each evaluation (at the start, every eval_every steps and at the end) generates
    eval_size x eval_samples responses for each of the two validation sets (and the test split at the first and
    last); each checkpoint writes the rank's weights and optimizer state; the start reads the starting weights."""
    precision = precision or Precision()
    engine = engine or EngineLayout()
    step = step_time(
        cfg,
        layout,
        work,
        dev=dev,
        minibatches=run.minibatches,
        precision=precision,
        engine=engine,
        experts=run.experts,
        gpus_per_node=gpus_per_node,
        est=est,
    )
    evals = 0.0
    if run.eval_every:
        n_evals = 1 + math.ceil(run.steps / run.eval_every)
        kv = est.engine_kv if est is not None and engine.gpu_memory else None

        def generation(problems: int, samples: int) -> float:
            eval_work = dataclasses.replace(work, prompts=problems, group_size=samples)
            return rollout_seconds(cfg, engine, eval_work, layout.world, dev, kv_capacity=kv)

        evals = n_evals * 2 * generation(run.eval_size, run.eval_samples)
        if run.eval_test_size:
            evals += 2 * generation(run.eval_test_size, run.eval_test_samples)
    dense, expert = param_counts(cfg).per_rank(layout.tp, layout.ep)
    state = (dense + expert) * (precision.weight_bytes + precision.optim_bytes)
    n_ckpt = run.steps // run.checkpoint_every if run.checkpoint_every else 1
    checkpoints = n_ckpt * state / dev.load_bw
    startup = dev.startup_s + (dense + expert) * precision.weight_bytes / dev.load_bw
    return RunTime(step=step, steps=run.steps, evals=evals, checkpoints=checkpoints, startup=startup)


def plan_run(
    run: Any, *, dev: Device, gpus: int = 1, gpu_mem_gb: float | None = None, gpus_per_node: int = 8
) -> RunTime:
    """The time plan of a RunConfig as it would run: on a GPU device, on `gpus` GPUs of `gpu_mem_gb` (default: the
    device's) at the layout and engine `check_run_fits` plans it on (ValueError when it does not fit); on the CPU, one
    process (or its `parallel` layout) with the hf engine on rank 0. Prompts as `planned_workload` sizes them."""
    precision = Precision.of(run.train_dtype)
    if dev.cpu:
        layout, est = run_layout(run) or Layout(), None
        engine = EngineLayout(dtype=run.rollout_dtype, kv_dtype=run.rollout_dtype, dp=1)
    else:
        node = min(gpus_per_node, gpus)
        est = check_run_fits(run, gpus=gpus, gpu_mem_gb=gpu_mem_gb or dev.mem_gb, gpus_per_node=node)
        layout, engine = est.layout, run_engine(run, gpus, node)
    work = planned_workload(run, layout.dp)
    return run_time(
        run.model_config(),
        layout,
        work,
        run,
        dev=dev,
        precision=precision,
        engine=engine,
        gpus_per_node=gpus_per_node,
        est=est,
    )


def time_limit_min(seconds: float, *, most: int | None = None) -> int:
    """A SLURM job's time limit for a run planned at `seconds`: TIME_LIMIT_FACTOR x the plan + TIME_LIMIT_PAD_MIN
    minutes, in whole minutes, at most `most` (the cluster's longest job: a run that times out is requeued and
    resumes from its last checkpoint)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"planned seconds = {seconds!r}: must be finite and >= 0")
    minutes = math.ceil(TIME_LIMIT_FACTOR * seconds / 60 + TIME_LIMIT_PAD_MIN)
    return minutes if most is None else min(minutes, most)
