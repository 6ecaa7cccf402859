"""The training engine: the MoE policy as a megatron-core GPTModel, on CPU (gloo) or CUDA (NCCL).

Architecture (Qwen3-MoE semantics, so transformers' Qwen3MoeForCausalLM can compute the same function from mapped
weights): RMSNorm, rotary positions (non-interleaved, like HF's rotate_half), grouped-query attention with QK
RMSNorm, no biases, untied embeddings, every layer an MoE of SwiGLU experts with a softmax top-k router.

Choices that matter for parity and for the study:
1. Router: top-k over the logits, then softmax over the k chosen logits (`moe_router_pre_softmax=False`). That is
   equal to Qwen3-MoE's softmax-then-top-k with `norm_topk_prob=True`, and under Routing Replay it makes the gate a
   softmax over the current logits of the forced experts, so the router keeps learning (the GSPO paper). Exception:
   top-1 needs megatron's pre-softmax path (a softmax over one logit has zero gradient): the gate is then the full
   softmax probability of the chosen expert, i.e. Qwen3-MoE with `norm_topk_prob=False`; see `norm_topk_prob()`.
2. No load-balancing aux loss by default (`moe_router_load_balancing_type="none"`, coefficient 0): the paper's RL
   runs fine-tune a cold-start model and the study measures routing drift, which an aux loss would confound. Set
   `cfg.extra["moe_aux_loss_coeff"]` (> 0) to turn on megatron's "aux_loss" balancing.
3. No dropout, no token dropping (no capacity factor), so a token's route depends on that token only and routes
   survive re-splitting a batch (study/policy/routing.py).
4. Padding: RL batches are prompt + response, right-padded. With right padding no mask is needed: causal attention
   never lets a real token see a later pad, and positions are 0..S-1, so `attention_mask=None` is exact for every
   real token (pad positions give garbage the caller masks out). Left-padded batches are supported by passing
   `attention_mask` (B, S), 1 on real tokens: positions restart at each row's first real token and pad keys are
   masked (rows whose keys are all masked give a uniform softmax, never NaN, as megatron fills with -10000).
5. Precision: parameters and compute in fp32 (CPU default), bf16 or fp16. The router runs in fp32 for bf16/fp16
   (`moe_router_dtype="fp32"`, megatron's recommendation). Log-probs from the labels path are fp32 always
   (megatron's cross entropy upcasts). fp16 training needs loss scaling: `DynamicLossScaler`. CPU speed depends
   on the CPU's ISA: where it has AVX-512 BF16 (this machine kind) bf16 GEMMs are ~7x fp32's and the `small`
   step ~1.5x faster, elsewhere bf16 is several times slower; fp16 GEMMs run ~100x slower than fp32 on CPU (no
   native kernels), so fp16 is for CUDA and for tests. Measure with benchmarks/bench_model.py.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from study.core.model_config import DTYPES, TORCH_DTYPES, ModelConfig, ParallelLayout
from study.policy import compat as megatron_compat
from study.policy import layers as fast_layers
from study.policy.experts import device_experts
from study.run.config import EXPERTS

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig


# ---------------------------------------------------------------------------------------------------------------------
# Process group and megatron parallel state
# ---------------------------------------------------------------------------------------------------------------------
DIST_TIMEOUT_ENV = "STUDY_DIST_TIMEOUT_MIN"
DIST_TIMEOUT_MIN = 120
"""Minutes a collective may wait for a peer (the process groups' timeout; NCCL's watchdog ends the ranks after it).
It must cover the longest phase that one rank runs alone while the others wait in a collective: rank 0 starting
the vLLM engine (loading the bf16 weights), evaluating and rolling out a step's batch. NCCL's default is 10 minutes,
megatron's groups' 30; `STUDY_DIST_TIMEOUT_MIN` in the environment sets another value for every rank."""


BACKENDS = ("gloo", "nccl")


def dist_backend(requested: str = "auto") -> str:
    """The process-group backend: NCCL where CUDA is available, else gloo ("auto"); or the one `requested`
    (NCCL needs CUDA)."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in BACKENDS:
        raise ValueError(f"backend = {requested!r}; valid: auto, {', '.join(BACKENDS)}")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend = 'nccl' needs CUDA, and none is available here; valid here: auto, gloo")
    return requested


def local_device_index() -> int:
    """This rank's GPU among those visible: LOCAL_RANK modulo the visible count. A node whose tasks each see all
    its GPUs gives local rank r GPU r; a scheduler that gives each task one GPU (CUDA_VISIBLE_DEVICES set per
    task) leaves one visible, index 0, whatever the local rank."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        local = int(raw)
    except ValueError:
        local = -1
    if local < 0:
        raise ValueError(f"LOCAL_RANK = {raw!r}: must be an integer >= 0")
    count = torch.cuda.device_count()
    if count < 1:
        raise ValueError("no CUDA device is visible (CUDA_VISIBLE_DEVICES) to this rank")
    return local % count


def dist_timeout() -> datetime.timedelta:
    """The process groups' timeout: `STUDY_DIST_TIMEOUT_MIN` minutes, default `DIST_TIMEOUT_MIN`."""
    raw = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not raw:
        return datetime.timedelta(minutes=DIST_TIMEOUT_MIN)
    try:
        minutes = float(raw)
    except ValueError:
        minutes = math.nan
    if not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(
            f"{DIST_TIMEOUT_ENV} = {raw!r}: must be a positive number of minutes "
            f"(default {DIST_TIMEOUT_MIN}, covering rank 0's engine start, evaluation and rollout)"
        )
    return datetime.timedelta(minutes=minutes)


def init_distributed(
    layout: ParallelLayout | None = None, *, tensor_parallel: int | None = None, expert_parallel: int | None = None
) -> ParallelLayout:
    """Initialise torch.distributed and megatron's parallel state for `layout`; idempotent. Returns the layout.

    Without a launcher (no WORLD_SIZE in the environment) this is one process: a world of size 1 on an in-memory
    store (no port). Under torchrun or submitit's tasks it joins the launcher's group (env://). The backend is NCCL
    on CUDA, gloo on CPU; every group (the world's and megatron's) times out after `dist_timeout()`. The
    compatibility shims (study/policy/compat.py) are applied first. `layout` None is one rank per layout size
    (`tensor_parallel` / `expert_parallel` set those two, with data the rest of the world). The world must be the
    layout's size; calling again with another layout is an error.
    """
    from megatron.core import parallel_state

    for name, size in (("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} = {size!r}: must be a positive integer")
    megatron_compat.apply()
    megatron_compat.apply_parallel()
    cuda = torch.cuda.is_available()
    timeout = dist_timeout()  # before anything starts: a bad value fails here
    if not torch.distributed.is_initialized():
        if parallel_state.model_parallel_is_initialized():
            # its groups belong to a world that was destroyed (an in-process vLLM engine's shutdown destroys the
            # default group): stale handles, rebuilt below for the new world
            parallel_state.destroy_model_parallel()
        backend = dist_backend()
        if cuda:
            torch.cuda.set_device(local_device_index())
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            torch.distributed.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            torch.distributed.init_process_group(
                backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    world = torch.distributed.get_world_size()
    if layout is None:
        tp, ep = tensor_parallel or 1, expert_parallel or 1
        try:
            layout = ParallelLayout(tensor=tp, expert=ep, data=max(world // tp, 1))
        except ValueError as e:
            raise ValueError(f"world size {world}: {e}") from None
    if parallel_state.model_parallel_is_initialized():
        have = current_layout()
        if have != layout:
            raise ValueError(f"megatron parallel state already initialised with {have}, asked for {layout}")
        return layout
    if layout.world_size != world:
        raise ValueError(
            f"parallel = {layout.to_dict()} needs tensor x data = {layout.world_size} ranks, but the world has {world} "
            "(start one process per rank, e.g. torchrun --nproc_per_node N or the launcher's tasks_per_node)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        distributed_timeout_minutes=max(1, math.ceil(timeout.total_seconds() / 60)),
    )
    return layout


def current_layout() -> ParallelLayout:
    """The layout megatron's parallel state is initialised with (one process when it is not)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return ParallelLayout()
    return ParallelLayout(
        tensor=parallel_state.get_tensor_model_parallel_world_size(),
        expert=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor=parallel_state.get_expert_tensor_parallel_world_size(),
        data=parallel_state.get_data_parallel_world_size(),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
def norm_topk_prob(cfg: ModelConfig) -> bool:
    """Qwen3-MoE's `norm_topk_prob` that computes the same gate as `build_policy(cfg)` (False only for top-1)."""
    return cfg.moe_top_k > 1


def device_paths(cuda: bool | None = None) -> dict[str, object]:
    """The MoE paths megatron takes on this device (`cuda` None: whether CUDA is available), chosen here only:
    - the token dispatcher: all-to-all on CUDA (tokens go only to the ranks of their experts; it needs CUDA
      streams), the all-gather dispatcher on the CPU;
    - initialisation: on the GPU under CUDA (each tensor-parallel shard drawn on its rank from megatron's
      model-parallel RNG; runs load their cold start's weights over it), on the CPU from full master weights there;
    - experts: megatron's SequentialMLP, computed by study/policy/experts.py in one autograd Function: grouped GEMMs
      (torch's `_grouped_mm`) on CUDA, the per-expert loop on the CPU (`experts_path`, build_policy's `experts`
      "auto"). Megatron's own grouped GEMM (the local spec's GroupedMLP) needs the separately built `grouped_gemm`
      CUDA package and names its weights `weight1` / `weight2`, which the HF weight map, the weight sync and the
      checkpoints do not read; TransformerEngine's grouped experts need TransformerEngine, which the CUDA stack
      leaves out (study/policy/compat.py)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return {
        "dispatcher": "alltoall" if cuda else "allgather",
        "cpu_init": not cuda,
        "grouped_gemm": False,
        "experts": device_experts(cuda),
    }


def transformer_config(
    cfg: ModelConfig,
    *,
    dtype: str = "fp32",
    routing_replay: bool = True,
    rope_fusion: bool = False,
    parallel: ParallelLayout | None = None,
) -> TransformerConfig:
    """The megatron TransformerConfig of the policy described by `cfg`; `rope_fusion`: megatron's fused-RoPE slot
    (study/kernels/rope.py `install` must have filled it). `parallel` (None: one process): the tensor, expert and
    expert-tensor sizes, sequence parallelism where tensor parallelism is on (megatron needs it to train with TP
    and MoE), and per-token loss accounting (the loop's losses are already normalised over the global batch, so
    megatron's DDP sums gradients over data-parallel ranks instead of averaging them)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    sizes: dict = {}
    if parallel is not None and parallel != ParallelLayout():
        parallel.check_model(cfg)
        sizes = dict(
            tensor_model_parallel_size=parallel.tensor,
            expert_model_parallel_size=parallel.expert,
            expert_tensor_parallel_size=parallel.expert_tensor,
            sequence_parallel=parallel.tensor > 1,
            calculate_per_token_loss=True,
        )
    fast = device_paths()
    extra = dict(cfg.extra)
    aux = float(extra.pop("moe_aux_loss_coeff", 0.0))
    if aux < 0:
        raise ValueError(f"model.extra.moe_aux_loss_coeff = {aux}: must be >= 0")
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,  # SwiGLU: silu(x W_gate) * (x W_up), fc1 = [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        # MoE: softmax top-k router, gate renormalised over the chosen experts (module docstring, point 1).
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_top_k,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=cfg.moe_top_k == 1,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_token_dispatcher_type=fast["dispatcher"],
        moe_grouped_gemm=False,
        moe_router_dtype=None if dtype == "fp32" else "fp32",
        moe_enable_routing_replay=routing_replay,
        # Precision.
        params_dtype=TORCH_DTYPES[dtype],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        attention_softmax_in_fp32=True,
        # Plain-PyTorch paths (no TransformerEngine / Apex / fused CUDA kernels); on CUDA initialised on the GPU.
        use_cpu_initialization=fast["cpu_init"],
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,  # the fused kernel is an Apex/TE CUDA extension
        apply_rope_fusion=rope_fusion,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        **sizes,
        **extra,
    )


LAYERS = ("fast", "megatron")
"""`build_policy(layers=...)`: "fast" (study/policy/layers.py: the same function with fewer ops, the C kernels where
they apply) or "megatron" (megatron's local spec as it stands: the reference the fast layers are tested against)."""


def experts_path(experts: str, layers: str = "fast") -> str:
    """build_policy's `experts` (study.run.config.EXPERTS) resolved on this device: "grouped" or "sequential";
    "auto" is `device_paths()["experts"]`. Only the fast layers choose (megatron's spec is the reference)."""
    if experts not in EXPERTS:
        raise ValueError(f"experts = {experts!r}; valid: {', '.join(EXPERTS)}")
    if layers != "fast" and experts != "auto":
        raise ValueError(f"experts = {experts!r} needs layers = 'fast' (layers = {layers!r} is megatron's own spec)")
    return device_paths()["experts"] if experts == "auto" else experts


def build_policy(
    cfg: ModelConfig,
    *,
    seed: int,
    dtype: str = "fp32",
    routing_replay: bool = True,
    layers: str = "fast",
    experts: str = "auto",
    parallel: ParallelLayout | None = None,
) -> GPTModel:
    """Build the MoE policy as a megatron-core GPTModel on the current device, initialised from `seed`.

    Same seed and config give bit-identical weights. The caller's global RNG state is left untouched (the build
    runs inside `torch.random.fork_rng`). `routing_replay=True` gives every router a replay hook that
    study/policy/routing.py drives (free routing until told otherwise). The module keeps `study_config` and
    `study_dtype`. Parameter names are megatron's (`decoder.layers.{i}.mlp.router.weight`,
    `...experts.local_experts.{e}...`) whatever `layers` is; keep them stable, the HF weight map depends on them.
    `layers` (LAYERS): "fast" computes the same function as "megatron" to ~1e-6 (bit for bit with `STUDY_NATIVE=0`
    but for SDPA's attention sums, tests/study/policy/test_model.py). `experts` (study.run.config.EXPERTS, fast
    layers only): how the experts are computed, "auto" by device (`experts_path`); the same parameters either way.
    `parallel` (None: one process): this rank's shard of the policy under that layout (study/policy/parallel.py
    wraps it for training, loads full weights into it and exports them). Its dense weights are the one-process
    model's slices (megatron initialises on the CPU from full master weights); its experts are not (their init
    draws per rank): load the one-process weights with `parallel.load_full_state` for the same model.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed = {seed!r}: must be a non-negative integer")
    if layers not in LAYERS:
        raise ValueError(f"layers = {layers!r}; valid: {', '.join(LAYERS)}")
    fast = layers == "fast"
    experts = experts_path(experts, layers)
    rope_fusion = fast and fast_layers.install_rope()
    tconfig = transformer_config(
        cfg, dtype=dtype, routing_replay=routing_replay, rope_fusion=rope_fusion, parallel=parallel
    )
    layout = init_distributed(parallel or ParallelLayout())
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    model_class = GPTModel
    if fast:
        fast_layers.speed_up(spec, experts)
        model_class = fast_layers.gpt_model()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        model = model_class(
            config=tconfig,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=cfg.rotary_base,
        )
    model.to(device=_device(), dtype=TORCH_DTYPES[dtype])
    if layout != ParallelLayout():
        # megatron marks expert weights for the expert-data-parallel reduction (`allreduce = False`) only when
        # expert parallelism is on; with tensor parallelism and expert_tensor != tensor at EP 1 their gradients are
        # then partial per rank yet reduced as dense weights (over the dense data-parallel group): mark them always.
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.allreduce = False
    model.study_config = cfg
    model.study_dtype = dtype
    model.study_layout = layout
    return model


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's parameters."""
    return next(model.parameters()).device


# ---------------------------------------------------------------------------------------------------------------------
# Forward helpers
# ---------------------------------------------------------------------------------------------------------------------
def positions_and_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Position ids (B, S) and megatron's boolean attention mask (B, 1, S, S), True = masked, or None.

    `attention_mask` (B, S) is 1 on real tokens. None, or a right-padded mask (every row real tokens first), gives
    positions 0..S-1 and no mask (the causal default is exact for real tokens). Any other layout (left padding,
    holes) gives positions counted over real tokens and an explicit causal-and-padding mask.
    """
    b, s = input_ids.shape
    arange = torch.arange(s, device=input_ids.device)
    if attention_mask is None:
        return arange.expand(b, s), None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    real = attention_mask.to(device=input_ids.device).bool()  # (B, S)
    lengths = real.sum(-1, keepdim=True)  # (B, 1)
    if bool((real == (arange < lengths)).all()):  # right-padded: nothing to mask
        return arange.expand(b, s), None
    position_ids = (real.long().cumsum(-1) - 1).clamp_min(0)  # (B, S)
    causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)  # (S, S) True above diagonal
    mask = causal[None] | ~real[:, None, :]  # (B, S, S): future keys and pad keys
    return position_ids, mask[:, None]  # (B, 1, S, S)


def _check_ids(model: torch.nn.Module, input_ids: torch.Tensor, name: str = "input_ids") -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must be (B, S), got shape {tuple(input_ids.shape)}")
    tp = _sequence_parallel_size(model)
    if input_ids.shape[1] % tp:
        raise ValueError(
            f"{name} length {input_ids.shape[1]}: under sequence parallelism the sequence is split over "
            f"parallel.tensor = {tp} ranks, so it must be a multiple of {tp} (right-pad it)"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor, got {input_ids.dtype}")
    cfg: ModelConfig | None = getattr(model, "study_config", None)
    if cfg is not None:
        if input_ids.shape[1] > cfg.max_seq_len:
            raise ValueError(f"{name} length {input_ids.shape[1]} > model.max_seq_len = {cfg.max_seq_len}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            raise ValueError(f"{name} out of range [0, {cfg.vocab_size})")


def logits(
    model: torch.nn.Module, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token logits (B, S, V) in the model's dtype. `attention_mask` (B, S): see `positions_and_mask`."""
    _check_ids(model, input_ids)
    device = model_device(model)
    input_ids = input_ids.to(device)
    position_ids, mask = positions_and_mask(input_ids, attention_mask)
    return model(input_ids, position_ids, mask)  # (B, S, V)


def token_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(targets[b, t] | input_ids[b, :t+1]) as (B, S) fp32, differentiable; with `positions` (B, T) only
    those: out[b, j] = log pi(targets[b, positions[b, j]] | ...), (B, T).

    `temperature` T scores the tempered distribution softmax(logits / T), the one an engine sampling at T draws from
    (verl's actor divides its logits the same way): the output layer has no bias, so its input is divided by T.

    Uses megatron's labels path (`GPTModel(..., labels=targets)` returns the per-token cross entropy in fp32,
    without materialising log-softmax over the vocabulary). For a prompt+response batch pass
    `input_ids = tokens[:, :-1]`, `targets = tokens[:, 1:]`. Targets at positions the caller masks out must still be
    valid token ids (use 0 for padding). With `positions` the output layer and the cross entropy run on the kept
    positions only (a response's T of the S positions; TRL's `logits_to_keep`): the decoder still sees every token,
    the prompt's LM head and vocabulary softmax are skipped (a fifth to a third of their cost in an RL batch).
    Under sequence parallelism (tensor parallelism > 1) S must be a multiple of the TP size (ValueError otherwise);
    the kept positions are taken from the all-gathered sequence, each TP rank its share of them (T padded to a
    multiple of TP), which the output layer gathers back: the same log-probs and gradients as one process.
    """
    _check_ids(model, input_ids)
    _check_ids(model, targets, "targets")
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature = {temperature}: must be finite and > 0")
    if temperature == 1.0:
        return _token_logp(model, input_ids, targets, attention_mask, positions)
    if getattr(model.output_layer, "bias", None) is not None:
        raise ValueError("temperature != 1 divides the output layer's input, which needs an output layer without bias")
    handle = model.output_layer.register_forward_pre_hook(lambda _m, args: (args[0] / temperature, *args[1:]))
    try:
        return _token_logp(model, input_ids, targets, attention_mask, positions)
    finally:
        handle.remove()


def _token_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    attention_mask: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """`token_logp` at temperature 1."""
    device = model_device(model)
    input_ids, targets = input_ids.to(device), targets.to(device)
    position_ids, mask = positions_and_mask(input_ids, attention_mask)
    if positions is None:
        ce = model(input_ids, position_ids, mask, labels=targets)  # (B, S) fp32 cross entropy
        return -ce.float()
    b, s = input_ids.shape
    if positions.dim() != 2 or positions.shape[0] != b or positions.dtype != torch.int64:
        raise ValueError(f"positions must be (B={b}, T) int64, got {tuple(positions.shape)} {positions.dtype}")
    positions = positions.to(device)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= s):
        raise ValueError(f"positions out of range [0, {s})")
    tp = _sequence_parallel_size(model)
    t = positions.shape[1]
    if t % tp:  # the output layer gathers T/TP positions from each rank: T padded with position 0, cut off below
        positions = torch.cat([positions, positions.new_zeros(b, tp - t % tp)], dim=1)

    def keep(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (S, B, H), megatron's sequence-first layout; under sequence parallelism (S/TP, B, H)
        index = positions.t()  # (T, B)
        if tp > 1:  # every rank's sequence shard, then this rank's share of the kept positions (module doc of
            # _sequence_parallel_size): the output layer all-gathers the shares back to (T, B, H) in rank order
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
            share = index.shape[0] // tp
            rank = _tp_rank()
            index = index[rank * share : (rank + 1) * share]
        return (hidden.gather(0, index[:, :, None].expand(-1, -1, hidden.shape[-1])), *args[1:])

    handle = model.output_layer.register_forward_pre_hook(keep)
    try:
        ce = model(input_ids, position_ids, mask, labels=targets.gather(1, positions))  # (B, T)
    finally:
        handle.remove()
    return -ce[:, :t].float()


def _sequence_parallel_size(model: torch.nn.Module) -> int:
    """How many ranks the model's sequence is split over: the tensor-parallel size under sequence parallelism (the
    embedding scatters [S, B, H] along S in TP contiguous chunks, rank order; the output layer all-gathers its input
    the same way), else 1."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "sequence_parallel", False):
        return 1
    return int(config.tensor_model_parallel_size)


def _tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def count_parameters(model: torch.nn.Module) -> int:
    """Total parameters (all experts)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "LAYERS",
    "build_policy",
    "count_parameters",
    "device_paths",
    "dist_backend",
    "dist_timeout",
    "experts_path",
    "init_distributed",
    "local_device_index",
    "logits",
    "model_device",
    "norm_topk_prob",
    "positions_and_mask",
    "token_logp",
    "transformer_config",
]
