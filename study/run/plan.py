"""Memory and layout planner: per candidate parallel layout, what one GPU holds for training and for the rollout
engine, and whether it fits. The launcher, the workflow, the checkpoint writer and the CPU machine check read it;
`python -m study plan --model qwen3-30b-a3b --gpus 16 --gpu-mem 80` (study/tools/plan.py) prints it.

Parameters are counted exactly for the policy study/policy/model.py builds (Qwen3-MoE on megatron-core: untied
embedding and output layer, QK-norm, no biases, every layer MoE; tests compare them with the built model's numel).
A layout is (TP, EP, DP, SP, distributed optimizer, full recompute) with PP = 1 and expert-TP = 1, megatron-core's
MoE "parallel folding": attention and the vocabulary are split over TP; the experts over EP (EP divides TP x DP);
norms and routers are replicated.

Per GPU, in bytes (`Precision`):
- weights: the TP/EP share of the parameters at the compute dtype (bf16: 2 bytes; fp32: 4);
- gradients: the same share at `grad_bytes` (megatron's fp32 main grads for bf16: 4);
- optimizer: AdamW's m and v (fp32, 8 bytes) plus the fp32 main copy for a 16-bit policy (4 bytes); the
  distributed optimizer shards them over the data-parallel ranks (experts over the expert-data-parallel ranks,
  TP x DP / EP);
- activations: the tensors one micro-batch keeps for backward, counted per token and layer for this architecture
  (`activation_elems_per_token_layer`), TP-split where megatron splits them (everything with SP), plus the output
  layer's logits; with full recompute only each layer's input is kept, plus one layer's full set during backward;
- the engine: its share of the weights (engine TP and EP) and its KV cache: what vLLM's share of the GPU
  (`gpu_memory`) leaves after the weights, or without a share the KV of its part of the rollout batch at full
  length; a colocated engine sleeps while the trainer updates (vLLM sleep mode), while the trainer never offloads:
  the peak is the larger of the trainer with its activations and the trainer's weights, gradients and optimizer
  state beside the awake engine (`colocated_sleep=False`: all of both);
- allocator fragmentation, a fraction of the peak (`fragmentation`, 10%: PyTorch's caching allocator typically
  leaves 5-15% of what it reserved unused), and a reserve for the CUDA context and communication buffers
  (`reserve_gb`, 5 GB).

A run (`check_run_fits`) is planned as the loop runs it: at its own `parallel` layout when it sets one (sequence
parallelism with TP, the distributed optimizer, activation recompute only where the run sets `recompute`), with its
engine's layout (`rollout_runtime`, in EngineSettings' vocabulary: `EngineLayout`), and at its micro-batch
(`micro_batch`; 0 = each rank's whole share of a minibatch in one forward; a run config without the field: 1).

Candidates never offload to the host (the project's trainer does not); `Layout.offload` (optimizer state and main
parameters in host memory, as verl and slime run this model) exists to compare published layouts.

`cpu_run_estimate` is the same arithmetic, per rank, for a CPU run of study/rl.py (fp32, the hf engine on rank 0
holding its own copy, one process or a gloo layout), plus what a CPU process holds besides tensors (the imported
libraries, code loaded on first use) and what the C allocator keeps resident: benchmarks/bench_plan.py measures it
against real runs' peak RSS (docs/performance.md, "The memory planner against measured runs").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from study.core.model_config import ModelConfig

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------------------------------------------------------------
# Parameter counts (exact)
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCounts:
    """The policy's parameters by how a layout splits them."""

    vocab: int  # embedding + output layer: split over TP (vocabulary-parallel)
    attention: int  # linear_qkv + linear_proj: split over TP
    replicated: int  # norms (input, pre-MLP, q, k, final) and routers: whole on every rank
    experts: int  # routed experts: split over EP

    @property
    def total(self) -> int:
        return self.vocab + self.attention + self.replicated + self.experts

    def per_rank(self, tp: int, ep: int) -> tuple[float, float]:
        """(dense, expert) parameters one rank holds at tensor-parallel `tp` and expert-parallel `ep`."""
        return (self.vocab + self.attention) / tp + self.replicated, self.experts / ep


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    nq, g, e, f = cfg.num_attention_heads, cfg.num_query_groups, cfg.num_experts, cfg.moe_ffn_hidden_size
    return ParamCounts(
        vocab=2 * cfg.vocab_size * h,
        attention=L * ((nq + 2 * g) * d * h + nq * d * h),
        replicated=L * (2 * h + 2 * d + e * h) + h,
        experts=L * e * 3 * f * h,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Layouts and precisions
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One way to lay the trainer out over `world` GPUs (PP = 1, expert-TP = 1)."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    sp: bool = False  # sequence parallelism: the TP group splits the non-TP activations (norms, residual, MoE input)
    dist_opt: bool = False  # megatron's distributed optimizer: optimizer state sharded over the data-parallel ranks
    recompute: bool = False  # full activation recompute: keep each layer's input only
    offload: bool = False  # optimizer state and fp32 main parameters in host memory (CPU Adam): none on the GPU

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks that hold the same experts (TP x DP / EP)."""
        return self.tp * self.dp // self.ep

    def label(self) -> str:
        flags = [
            s
            for s, on in (
                ("SP", self.sp),
                ("DistOpt", self.dist_opt),
                ("Recompute", self.recompute),
                ("Offload", self.offload),
            )
            if on
        ]
        return f"TP{self.tp} EP{self.ep} DP{self.dp}" + ("".join(f" +{s}" for s in flags))

    def check(self, cfg: ModelConfig) -> str | None:
        """Why megatron-core would refuse this layout for `cfg` (None: it builds)."""
        if cfg.num_query_groups % self.tp:
            return f"TP {self.tp} must divide num_query_groups {cfg.num_query_groups}"
        if cfg.num_attention_heads % self.tp:
            return f"TP {self.tp} must divide num_attention_heads {cfg.num_attention_heads}"
        if cfg.num_experts % self.ep:
            return f"EP {self.ep} must divide num_experts {cfg.num_experts}"
        if (self.tp * self.dp) % self.ep:
            return f"EP {self.ep} must divide TP x DP = {self.tp * self.dp}"
        if self.tp > 1 and self.ep > 1 and not self.sp:
            return "megatron needs sequence parallelism with TP > 1 and EP > 1"
        if self.tp == 1 and self.sp:
            return "SP needs TP > 1"
        return None


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of training state."""

    weight_bytes: int = 2  # model parameters at the compute dtype
    grad_bytes: int = 4  # gradient buffer (megatron accumulates main grads in fp32)
    optim_bytes: int = 12  # AdamW m + v (fp32) + fp32 main parameters
    act_bytes: int = 2  # activations

    @classmethod
    def of(cls, dtype: str) -> Precision:
        """bf16/fp16 mixed precision (megatron: 16-bit weights, fp32 main grads, main params, m and v), or plain
        fp32 (weights, grads, m, v all fp32; no main copy)."""
        if dtype == "fp32":
            return cls(weight_bytes=4, grad_bytes=4, optim_bytes=8, act_bytes=4)
        if dtype in ("bf16", "fp16"):
            return cls()
        raise ValueError(f"dtype = {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")


@dataclass(frozen=True)
class Workload:
    """What one RL step computes: the rollout batch and its lengths, and the trainer's micro-batch."""

    prompts: int = 64  # P
    group_size: int = 8  # G
    prompt_len: int = 1024  # longest prompt, tokens
    response_len: int = 8192  # max_new_tokens
    micro_batch: int = 1  # sequences per micro-batch on one trainer rank

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size


@dataclass(frozen=True)
class EngineLayout:
    """The rollout engine (vLLM) in the vocabulary of a run's `rollout_runtime` (study/run/rollout_runtime.py
    EngineSettings): tensor-parallel size `tp` per replica, experts tensor-sliced (`ep` 1) or split over the
    replica's TP ranks (`ep` = tp), `dp` replicas on the GPUs of rank 0's node (0: a replica on every GPU group of
    the world); the replicas split the rollout batch."""

    tp: int = 1
    ep: int = 1
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    dp: int = 0
    gpu_memory: float = 0.0
    """vLLM's share of each engine GPU (rollout_runtime.gpu_memory): its KV cache is what the weights leave of it
    (`estimate` with the GPU's memory); 0: the KV cache of every sequence at full length."""

    def __post_init__(self) -> None:
        if self.ep not in (1, self.tp):
            raise ValueError(f"engine ep = {self.ep}: valid: 1 or tp = {self.tp} (rollout_runtime.ep)")

    @classmethod
    def from_settings(cls, settings: Any, dtype: str = "bf16") -> EngineLayout:
        """The layout of an EngineSettings (a run's rollout_runtime)."""
        return cls(
            tp=settings.tp, ep=settings.ep, dp=settings.dp, dtype=dtype, kv_dtype=dtype, gpu_memory=settings.gpu_memory
        )

    def runtime(self) -> dict[str, Any]:
        """The rollout_runtime keys that give this layout."""
        out: dict[str, Any] = {"tp": self.tp, "ep": self.ep, "dp": max(1, self.dp)}
        return {**out, "gpu_memory": self.gpu_memory} if self.gpu_memory else out

    def check(self, cfg: ModelConfig, gpus_per_node: int) -> str | None:
        """Why the vllm engine would refuse this layout for `cfg` (None: it starts)."""
        if cfg.num_query_groups % self.tp or cfg.num_experts % self.ep:
            return (
                f"engine tp = {self.tp}, ep = {self.ep} must divide model.num_query_groups = "
                f"{cfg.num_query_groups} and model.num_experts = {cfg.num_experts}"
            )
        if self.tp * max(1, self.dp) > gpus_per_node:
            return f"engine tp x dp = {self.tp} x {max(1, self.dp)} GPUs, rank 0's node has {gpus_per_node}"
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Memory per GPU
# ---------------------------------------------------------------------------------------------------------------------
def activation_elems_per_token_layer(cfg: ModelConfig) -> tuple[float, float, float]:
    """Elements one token keeps for backward in one MoE layer: (split by TP always, split by TP only with SP,
    MoE part: split by TP with SP, spread over EP by the dispatch: on average each rank processes k copies of its
    own tokens).

    Attention (TP-split): q, k before QK-norm ((nq + g) d), q, k, v after it and RoPE ((nq + 2 g) d), the attention
    output (nq d, also linear_proj's input). Sequence-level (SP-split): the two RMSNorm inputs and outputs and the
    residual (5 H), the router logits and probabilities (2 E). MoE: each of the k routed copies keeps its permuted
    input (H), fc1's output (2 F), the SwiGLU output (F) and fc2's output (H) for the gate-weighted unpermute."""
    h, d, e, k, f = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_top_k, cfg.moe_ffn_hidden_size
    nq, g = cfg.num_attention_heads, cfg.num_query_groups
    attn = (nq + g) * d + (nq + 2 * g) * d + nq * d
    seq = 5 * h + 2 * e
    moe = k * (2 * h + 3 * f)
    return float(attn), float(seq), float(moe)


@dataclass(frozen=True)
class Estimate:
    """Bytes on one GPU (or, for a CPU run, in the process)."""

    layout: Layout
    params: float  # parameters per rank (count, not bytes)
    weights: float
    grads: float
    optimizer: float
    activations: float
    engine_weights: float
    engine_kv: float
    reserve: float
    colocated_sleep: bool = True
    fragmentation: float = 0.1  # allocator fragmentation, a fraction of the peak
    extra: float = 0.0  # transient copies

    @property
    def train(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def engine(self) -> float:
        return self.engine_weights + self.engine_kv

    @property
    def static(self) -> float:
        """What the trainer keeps on the GPU while the engine rolls out: weights, gradients (megatron's persistent
        buffer) and optimizer state; an offloading layout (published ones, not the project's trainer) keeps the
        weights only."""
        return self.weights + (0.0 if self.layout.offload else self.grads + self.optimizer)

    @property
    def total(self) -> float:
        """The peak: colocated, the engine (awake while rolling out) beside the trainer's static state, or the
        trainer with its activations while the engine sleeps; separate, both."""
        peak = max(self.train, self.static + self.engine) if self.colocated_sleep else self.train + self.engine
        return (peak + self.extra) * (1 + self.fragmentation) + self.reserve

    def fits(self, budget_bytes: float) -> bool:
        return self.total <= budget_bytes


def estimate(
    cfg: ModelConfig,
    layout: Layout,
    work: Workload,
    *,
    precision: Precision | None = None,
    engine: EngineLayout | None = None,
    colocated_sleep: bool = True,
    reserve_gb: float = 5.0,
    fragmentation: float = 0.1,
    gpu_mem_gb: float | None = None,
) -> Estimate:
    """Per-GPU memory of `layout` for `cfg` running `work` (module docstring); `gpu_mem_gb` with an engine's
    `gpu_memory`: vLLM's KV cache is what its weights leave of its share."""
    precision = precision or Precision()
    engine = engine or EngineLayout()
    counts = param_counts(cfg)
    dense, expert = counts.per_rank(layout.tp, layout.ep)
    weights = (dense + expert) * precision.weight_bytes
    grads = (dense + expert) * precision.grad_bytes
    if layout.offload:
        optimizer = 0.0
    elif layout.dist_opt:
        optimizer = (dense / layout.dp + expert / layout.edp) * precision.optim_bytes
    else:
        optimizer = (dense + expert) * precision.optim_bytes
    activations = training_activations(cfg, layout, work, precision.act_bytes)
    # The engine: one replica holds the model over engine.tp x engine.ep GPUs (attention and vocabulary over TP,
    # experts over EP); the replicas split the rollout batch; the KV cache keeps every sequence at full length.
    replica_gpus = max(engine.tp, engine.ep)
    # without EP vLLM shards every expert over TP (FusedMoE's intermediate dimension); with EP, over the EP group
    e_dense, e_expert = counts.per_rank(engine.tp, replica_gpus)
    replicas = engine.dp or max(1, layout.world // replica_gpus)
    engine_weights = (e_dense + e_expert) * DTYPE_BYTES[engine.dtype]
    kv_heads = max(1, cfg.num_query_groups // engine.tp)  # vLLM replicates KV heads when TP > groups
    seqs = -(-work.sequences // replicas)  # ceil
    per_gpu_seqs = seqs if replica_gpus == engine.tp else seqs * engine.tp / replica_gpus  # data-parallel attention
    engine_kv = (
        per_gpu_seqs * work.seq_len * cfg.num_layers * 2 * kv_heads * cfg.head_dim * DTYPE_BYTES[engine.kv_dtype]
    )
    if engine.gpu_memory and gpu_mem_gb:
        engine_kv = max(0.0, engine.gpu_memory * gpu_mem_gb * GB - engine_weights)
    return Estimate(
        layout=layout,
        params=dense + expert,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        engine_weights=engine_weights,
        engine_kv=engine_kv,
        reserve=reserve_gb * GB,
        colocated_sleep=colocated_sleep,
        fragmentation=fragmentation,
    )


def training_activations(cfg: ModelConfig, layout: Layout, work: Workload, act_bytes: int) -> float:
    """Bytes of activations one trainer rank keeps for one micro-batch: every layer's (or with full recompute, each
    layer's input plus one layer's), plus the output layer's fp32 logits, log-softmax and their gradient (TP-split
    over the vocabulary)."""
    attn, seq, moe = activation_elems_per_token_layer(cfg)
    tokens = work.micro_batch * work.seq_len
    tp, sp_div = layout.tp, (layout.tp if layout.sp else 1)
    per_layer = tokens * (attn / tp + (seq + moe) / sp_div) * act_bytes
    if layout.recompute:
        layers = cfg.num_layers * tokens * cfg.hidden_size / sp_div * act_bytes + per_layer
    else:
        layers = cfg.num_layers * per_layer
    logits = 3 * tokens * cfg.vocab_size / tp * 4
    return layers + logits


def candidate_layouts(cfg: ModelConfig, gpus: int, *, gpus_per_node: int = 8) -> list[Layout]:
    """Every layout megatron-core builds for `cfg` on `gpus` GPUs (TP within a node, powers of two)."""
    out = []
    tps = [t for t in (1, 2, 4, 8) if t <= min(gpus, gpus_per_node) and gpus % t == 0]
    for tp in tps:
        dp = gpus // tp
        eps = [e for e in _powers_of_two(gpus) if cfg.num_experts % e == 0 and (tp * dp) % e == 0]
        for ep, sp, dist_opt, recompute in itertools.product(eps, (False, True), (False, True), (False, True)):
            layout = Layout(tp=tp, ep=ep, dp=dp, sp=sp, dist_opt=dist_opt, recompute=recompute)
            if layout.check(cfg) is None:
                out.append(layout)
    return out


def _powers_of_two(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


def default_engine(cfg: ModelConfig, gpus: int, dtype: str = "bf16", *, gpus_per_node: int = 8) -> EngineLayout:
    """A colocated MoE engine's layout that the vllm engine runs (EngineLayout's vocabulary): the fewest GPUs per
    replica, tp = ep a power of two dividing the query groups, the experts and the node, that bring one GPU's share
    of the weights to 16 GB or less; as many replicas as rank 0's node holds."""
    node = max(1, min(gpus, gpus_per_node))
    counts = param_counts(cfg)
    t = 1
    while (
        sum(counts.per_rank(t, t)) * DTYPE_BYTES[dtype] > 16 * GB
        and t * 2 <= node
        and cfg.num_query_groups % (t * 2) == 0
        and cfg.num_experts % (t * 2) == 0
    ):
        t *= 2
    return EngineLayout(tp=t, ep=t, dtype=dtype, kv_dtype=dtype, dp=node // t, gpu_memory=0.3)


def plan(
    cfg: ModelConfig,
    gpus: int,
    gpu_mem_gb: float,
    work: Workload,
    *,
    dtype: str = "bf16",
    gpus_per_node: int = 8,
    engine: EngineLayout | None = None,
    reserve_gb: float = 5.0,
) -> list[Estimate]:
    """Estimates of every candidate layout, fitting ones first, each group by total memory."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus = {gpus!r}: must be a positive integer")
    if not gpu_mem_gb > 0:
        raise ValueError(f"gpu_mem = {gpu_mem_gb!r}: must be > 0 (GB per GPU)")
    engine = engine or default_engine(cfg, gpus, dtype)
    precision = Precision.of(dtype)
    layouts = candidate_layouts(cfg, gpus, gpus_per_node=gpus_per_node)
    found = [
        estimate(cfg, layout, work, precision=precision, engine=engine, reserve_gb=reserve_gb, gpu_mem_gb=gpu_mem_gb)
        for layout in layouts
    ]
    budget = gpu_mem_gb * GB
    return sorted(found, key=lambda e: (not e.fits(budget), e.total))


def fitting(estimates: Iterable[Estimate], gpu_mem_gb: float) -> list[Estimate]:
    return [e for e in estimates if e.fits(gpu_mem_gb * GB)]


def run_workload(run: Any, *, prompt_len: int = 1024, micro_batch: int = 1) -> Workload:
    """The Workload of a RunConfig (study.run.config): its P, G, max_new_tokens; prompts up to `prompt_len`."""
    return Workload(
        prompts=run.prompts_per_step,
        group_size=run.group_size,
        prompt_len=prompt_len,
        response_len=run.max_new_tokens,
        micro_batch=micro_batch,
    )


def planned_workload(run: Any, dp: int, *, prompt_len: int = 1024) -> Workload:
    """The Workload a run is planned at on `dp` data-parallel ranks: prompts of `prompt_len` tokens, or what the
    model's max_seq_len leaves beside max_new_tokens when less (an upper bound: a task's prompts are shorter), and its
    micro-batch (0: each rank's whole share of a minibatch in one forward; a run config without the field: 1)."""
    micro = getattr(run, "micro_batch", 1)
    if not micro:
        micro = max(1, run.prompts_per_step * run.group_size // run.minibatches // dp)
    room = max(1, run.model_config().max_seq_len - run.max_new_tokens)
    return run_workload(run, prompt_len=min(prompt_len, room), micro_batch=micro)


def place_run(run: Any, *, gpus_per_node: int, gpu_mem_gb: float, max_nodes: int = 64) -> tuple[int, int]:
    """(nodes, GPUs per node) of a run's job: the fewest GPUs, a power of two, on which `check_run_fits` fits it on
    nodes of `gpus_per_node` GPUs of `gpu_mem_gb`; whole nodes beyond one. ValueError (the last misfit's reason)
    when no cluster of up to `max_nodes` nodes fits it."""
    gpus = 1
    while True:
        try:
            check_run_fits(run, gpus=gpus, gpu_mem_gb=gpu_mem_gb, gpus_per_node=min(gpus_per_node, gpus))
            break
        except ValueError as err:
            if gpus * 2 > max_nodes * gpus_per_node:
                raise ValueError(f"run {run.run_id} fits on no cluster of up to {max_nodes} nodes: {err}") from None
            gpus *= 2
    return (1, gpus) if gpus <= gpus_per_node else (-(-gpus // gpus_per_node), gpus_per_node)


def run_layout(run: Any) -> Layout | None:
    """The planner's Layout of a run's `parallel` section (None: one process, the planner picks): megatron's
    sequence parallelism with TP, the distributed optimizer (study/policy/parallel.py ShardedTrainer's default), and
    activation recompute only where the run sets it (the loop offers megatron's selective recompute, which keeps no
    attention scores; the planner counts flash attention's, none, so only a full recompute changes its count)."""
    par = run.layout
    if par.world_size == 1:
        return None
    return Layout(
        tp=par.tensor,
        ep=par.expert,
        dp=par.data,
        sp=par.tensor > 1,
        dist_opt=True,
        recompute=getattr(run, "recompute", "none") == "full",
    )


def run_engine(run: Any, gpus: int, gpus_per_node: int) -> EngineLayout:
    """The engine layout of a run: its rollout_runtime's for the vllm engine, else `default_engine`'s."""
    if run.rollout_engine != "vllm":
        return default_engine(run.model_config(), gpus, run.rollout_dtype, gpus_per_node=gpus_per_node)
    from study.run.rollout_runtime import EngineSettings

    return EngineLayout.from_settings(EngineSettings.parse(run.rollout_runtime), run.rollout_dtype)


def check_run_fits(
    run: Any, *, gpus: int, gpu_mem_gb: float, gpus_per_node: int = 8, prompt_len: int = 1024
) -> Estimate:
    """The smallest-memory layout on which `run` (a RunConfig) fits on `gpus` GPUs of `gpu_mem_gb`: its own
    `parallel` layout when it sets one, with its engine layout (`rollout_runtime`). ValueError naming the run, the
    cluster and the numbers when none does or the engine's layout cannot run (raised before any job is asked for:
    study.launch calls it). A colocated vllm engine's `gpu_memory` must hold its weights and leave the trainer's
    static state room (vLLM refuses to start with less than gpu_memory x the GPU free)."""
    cfg = run.model_config()
    dtype = run.train_dtype
    node = min(gpus_per_node, gpus)
    engine = run_engine(run, gpus, node)
    why = engine.check(cfg, node) if run.rollout_engine == "vllm" else None
    if why:
        raise ValueError(f"run {run.run_id}: rollout_runtime: {why}")
    layout = run_layout(run)
    work = planned_workload(run, layout.dp if layout is not None else 1, prompt_len=prompt_len)
    if layout is not None:
        if layout.world != gpus:
            raise ValueError(
                f"run {run.run_id}: parallel = {run.parallel} has {layout.world} ranks, the job "
                f"{gpus} GPU(s); valid: one GPU per rank"
            )
        bad = layout.check(cfg)
        if bad:
            raise ValueError(f"run {run.run_id}: parallel = {run.parallel}: {bad}")
        estimates = [estimate(cfg, layout, work, precision=Precision.of(dtype), engine=engine, gpu_mem_gb=gpu_mem_gb)]
    else:
        estimates = plan(cfg, gpus, gpu_mem_gb, work, dtype=dtype, gpus_per_node=node, engine=engine)

    fit = fitting(estimates, gpu_mem_gb)
    if fit:
        _check_engine_memory(run, fit[0], gpu_mem_gb)
        return fit[0]
    best = min(estimates, key=lambda e: e.total) if estimates else None
    near = f"; the smallest, {best.layout.label()}, needs {best.total / GB:.1f} GB per GPU" if best else ""
    raise ValueError(
        f"run {run.run_id}: model {run.model!r} ({param_counts(cfg).total / 1e9:.2f}B parameters) does not fit on "
        f"{gpus} GPU(s) of {gpu_mem_gb:g} GB with {'its parallel layout' if layout else 'any layout'}{near}; valid: "
        f"more GPUs (nodes x gpus per node), GPUs with more memory, or a smaller micro-batch (see `python -m study "
        "plan`)"
    )


def _check_engine_memory(run: Any, est: Estimate, gpu_mem_gb: float) -> None:
    """A colocated vllm engine's gpu_memory against its weights and the trainer's static state (check_run_fits)."""
    if run.rollout_engine != "vllm":
        return
    from study.run.rollout_runtime import EngineSettings

    st = EngineSettings.parse(run.rollout_runtime)
    budget = st.gpu_memory * gpu_mem_gb * GB
    if budget < est.engine_weights * 1.1:
        raise ValueError(
            f"run {run.run_id}: rollout_runtime.gpu_memory = {st.gpu_memory:g} gives vLLM "
            f"{budget / GB:.1f} GB per GPU, its weights take {est.engine_weights / GB:.1f} GB; valid: a "
            "larger gpu_memory or engine tp"
        )
    if st.placement == "colocated" and budget + est.static + est.reserve > gpu_mem_gb * GB:
        raise ValueError(
            f"run {run.run_id}: rollout_runtime.gpu_memory = {st.gpu_memory:g} ({budget / GB:.1f} GB) "
            f"beside the trainer's {est.static / GB:.1f} GB that stays on the GPU exceeds "
            f"{gpu_mem_gb:g} GB; valid: gpu_memory <= "
            f"{(gpu_mem_gb * GB - est.static - est.reserve) / (gpu_mem_gb * GB):.2f}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# A CPU run of study/rl.py, per rank (benchmarks/bench_plan.py measures it)
# ---------------------------------------------------------------------------------------------------------------------
CPU_PROCESS_BYTES = 0.593e9
"""A run's process before it builds anything: the interpreter with torch, megatron-core, transformers and the study
imported (resident set, torch 2.13 CPU build; benchmarks/bench_plan.py measures it in every process it starts)."""

CPU_RUNTIME_BYTES = {"engine": 0.079e9, "trainer": 0.036e9, "distributed": 0.020e9}
"""What a run adds to its processes besides tensors, the same at every shape: code and state loaded on first use.
`engine` (rank 0, which hosts the hf engine and writes the run directory): transformers' model and the C kernels,
55 MB; the first rollout's code paths, 11 MB; the metrics writer's parquet libraries, 13 MB. `trainer` (every
rank): megatron's model build, the first forward, backward and optimizer step, the tokenizer and task data.
`distributed` (every rank of a parallel layout): gloo, megatron's DDP, optimizer and distributed-checkpoint code.
Measured at the `tiny` shape (one process, and TP 2), where tensors are a few MB: each part is the growth of the
resident set over the phase that loads it (benchmarks/bench_plan.py checks the sum at three shapes)."""


def cpu_run_estimate(
    cfg: ModelConfig, work: Workload, *, minibatches: int, parallel: Any = None, rank: int = 0
) -> dict[str, float]:
    """Bytes of one rank's process at its peak, by term, for a CPU run of study/rl.py (fp32, hf engine on rank 0,
    no KL reference, a checkpoint at the last step) at the layout `parallel` (a ParallelLayout; None: one process).

    - process, runtime: the imported libraries and what the run loads on first use (CPU_PROCESS_BYTES,
      CPU_RUNTIME_BYTES): host memory on a GPU, where `reserve` stands for the CUDA context instead;
    - weights, grads, optimizer: the rank's share of the policy, `estimate`'s terms at fp32 (the distributed
      optimizer shards AdamW's m and v over the data-parallel ranks; fp32 weights need no main copy);
    - param_buffer (a parallel layout): megatron's DDP moves the weights into one contiguous buffer at setup; the
      freed originals stay resident (below);
    - step_buffers (a parallel layout): megatron's step over gloo copies the gradient buffer for its reduction and
      gathers the updated weights into a copy of the parameter buffer (4 bytes a local parameter each);
    - activations: what one forward of the rank's share of a minibatch keeps for backward (rl.py forwards a
      minibatch whole), the (B, T, V) fp32 logits, log-softmax and their gradient included (`training_activations`);
    - engine_weights (rank 0): the hf engine's own fp32 copy of the model, beside the trainer's;
    - rollout (rank 0): the engine's decode copy of its weights (the C decode step takes every matrix transposed,
      the embedding and norms excepted) and the KV cache of every sequence at prompt + max_new_tokens;
    - sync: the weight sync's transient: one process, the engine's stacked experts, built from views of the
      policy's weights; a parallel layout, rank 0 holds every gathered full weight at once (the hf engine's
      `load_weights` collects the stream into a dict before stacking the experts) plus the stacked experts, the
      other ranks the largest full weight a gather builds;
    - checkpoint (a parallel layout; one process streams torch.save): megatron's distributed checkpoint stages and
      serializes what this rank writes (its unique shards; rank 0 also the replicated weights: weights, fp32 param,
      m and v, 16 bytes a parameter, twice), then the one-process form: the data-parallel gather of the flat
      param, m and v buffers (12 bytes a local parameter, and gloo's receive copy), the full m and v (8 bytes a
      parameter of the model, cloned) and the full weights (4 bytes a parameter), which every rank holds until the
      checkpoint is written.
    The peak is the sum of these with the larger of rollout and sync: the C allocator keeps freed heap memory
    resident (tensors under its mmap threshold, which rises to 32 MB, are heap memory), so the activations' high-
    water mark stays resident after the update, and the next rollout or sync, and the last checkpoint, land on top.
    On a GPU, torch's caching allocator keeps such blocks reserved in the same way (`fragmentation`)."""
    counts = param_counts(cfg)
    tp, ep, dp = (1, 1, 1) if parallel is None else (parallel.tensor, parallel.expert, parallel.data)
    layout = Layout(tp=tp, ep=ep, dp=dp, sp=tp > 1, dist_opt=tp * dp > 1)
    sharded = layout.world > 1
    dense, expert = counts.per_rank(tp, ep)
    local = dense + expert
    rows = -(-max(1, work.sequences // minibatches) // dp)  # this rank's share of a minibatch
    engine = rank == 0
    emb = cfg.vocab_size * cfg.hidden_size
    norms = cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size
    kv = work.sequences * work.seq_len * cfg.num_layers * 2 * cfg.num_query_groups * cfg.head_dim * 4
    attn_qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim * cfg.hidden_size
    largest = max(emb, attn_qkv, 2 * cfg.moe_ffn_hidden_size * cfg.hidden_size)  # full weights a gather builds
    if not sharded:
        sync = 4.0 * counts.experts
    elif engine:
        sync = 4.0 * (counts.total + counts.experts)
    else:
        sync = 4.0 * largest
    checkpoint = 0.0
    if sharded:
        unique = (counts.vocab + counts.attention) / tp * (tp > 1) + counts.experts / ep * (ep > 1)
        written = local if engine else unique  # rank 0 writes the replicas' copy of what every rank holds
        checkpoint = 2 * 16.0 * written + 24.0 * local + 12.0 * counts.total
    runtime = CPU_RUNTIME_BYTES["trainer"] + (CPU_RUNTIME_BYTES["engine"] if engine else 0.0)
    parts = {
        "process": CPU_PROCESS_BYTES,
        "runtime": runtime + (CPU_RUNTIME_BYTES["distributed"] if sharded else 0.0),
        "weights": 4.0 * local,
        "grads": 4.0 * local,
        "optimizer": 8.0 * ((dense / dp + expert / layout.edp) if layout.dist_opt else local),
        "param_buffer": 4.0 * local if sharded else 0.0,
        "step_buffers": 8.0 * local if sharded else 0.0,
        "activations": training_activations(cfg, layout, dataclasses.replace(work, micro_batch=rows), 4),
        "engine_weights": 4.0 * counts.total if engine else 0.0,
        "rollout": 4.0 * (counts.total - emb - norms) + kv if engine else 0.0,
        "sync": sync,
        "checkpoint": checkpoint,
    }
    transient = max(parts["rollout"], parts["sync"])
    parts["peak"] = sum(v for k, v in parts.items() if k not in ("rollout", "sync")) + transient
    return parts
