"""The training engine: the MoE policy as a megatron-core GPTModel, on CPU (gloo) or CUDA (NCCL).

Architecture (Qwen3-MoE semantics, so transformers' Qwen3MoeForCausalLM can compute the same function from mapped
weights): RMSNorm, rotary positions (non-interleaved, like HF's rotate_half), grouped-query attention with QK
RMSNorm, no biases, untied embeddings, every layer an MoE of SwiGLU experts with a softmax top-k router.

Choices that matter for parity and for the study:
1. Router: top-k over the logits, then softmax over the k chosen logits (`moe_router_pre_softmax=False`). That is
   equal to Qwen3-MoE's softmax-then-top-k with `norm_topk_prob=True`, and under Routing Replay it makes the gate a
   softmax over the current logits of the forced experts, so the router keeps learning (PAPER.md). Exception:
   top-1 needs megatron's pre-softmax path (a softmax over one logit has zero gradient): the gate is then the full
   softmax probability of the chosen expert, i.e. Qwen3-MoE with `norm_topk_prob=False`; see `norm_topk_prob()`.
2. No load-balancing aux loss by default (`moe_router_load_balancing_type="none"`, coefficient 0): the paper's RL
   runs fine-tune a cold-start model and the study measures routing drift, which an aux loss would confound. Set
   `cfg.extra["moe_aux_loss_coeff"]` (> 0) to turn on megatron's "aux_loss" balancing.
3. No dropout, no token dropping (no capacity factor), so a token's route depends on that token only and routes
   survive re-splitting a batch (study/routing.py).
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
6. Optimizer: torch's fused `torch.optim.AdamW` (megatron's distributed optimizer needs CUDA).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from study import megatron_compat
from study.config import DTYPES, ModelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------------
# Process group and megatron parallel state
# ---------------------------------------------------------------------------------------------------------------------
def init_distributed(*, tensor_parallel: int = 1, expert_parallel: int = 1) -> None:
    """Initialise torch.distributed and megatron's parallel state; idempotent.

    Without a launcher (no WORLD_SIZE in the environment) this is one process: a world of size 1 on an in-memory
    store (no port). Under torchrun it joins the launcher's group (env://). The backend is NCCL on CUDA, gloo on
    CPU; on CPU the compatibility shims (study/megatron_compat.py) are applied first. Calling again with other
    parallel sizes than the initialised ones is an error.
    """
    from megatron.core import parallel_state

    for name, size in (("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} = {size!r}: must be a positive integer")
    megatron_compat.apply()
    cuda = torch.cuda.is_available()
    if not torch.distributed.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            torch.distributed.init_process_group(backend, init_method="env://")
        else:
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != (tensor_parallel, expert_parallel):
            raise ValueError(
                f"megatron parallel state already initialised with (tensor_parallel, expert_parallel) = {have}, "
                f"asked for {(tensor_parallel, expert_parallel)}"
            )
        return
    world = torch.distributed.get_world_size()
    if world % (tensor_parallel * expert_parallel):
        raise ValueError(f"world size {world} is not divisible by tensor_parallel x expert_parallel")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel
    )


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
def norm_topk_prob(cfg: ModelConfig) -> bool:
    """Qwen3-MoE's `norm_topk_prob` that computes the same gate as `build_policy(cfg)` (False only for top-1)."""
    return cfg.moe_top_k > 1


def transformer_config(
    cfg: ModelConfig, *, dtype: str = "fp32", routing_replay: bool = True, rope_fusion: bool = False
) -> TransformerConfig:
    """The megatron TransformerConfig of the policy described by `cfg`; `rope_fusion`: megatron's fused-RoPE slot
    (study/rope.py `install` must have filled it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; valid: {', '.join(DTYPES)}")
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
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_dtype=None if dtype == "fp32" else "fp32",
        moe_enable_routing_replay=routing_replay,
        # Precision.
        params_dtype=TORCH_DTYPES[dtype],
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        attention_softmax_in_fp32=True,
        # Plain-PyTorch paths (no TransformerEngine / Apex / fused CUDA kernels on CPU).
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,  # the fused kernel is an Apex/TE CUDA extension
        apply_rope_fusion=rope_fusion,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        **extra,
    )


CORE_ATTENTIONS = ("fused", "sdpa", "megatron")
EXPERTS = ("fused", "megatron")
NORMS = ("fused", "megatron")
ROPES = ("fused", "megatron")
CROSS_ENTROPIES = ("fused", "megatron")


def build_policy(
    cfg: ModelConfig,
    *,
    seed: int,
    dtype: str = "fp32",
    routing_replay: bool = True,
    core_attention: str = "fused",
    experts: str = "fused",
    norms: str = "fused",
    rope: str = "fused",
    cross_entropy: str = "fused",
) -> GPTModel:
    """Build the MoE policy as a megatron-core GPTModel on the current device, initialised from `seed`.

    Same seed and config give bit-identical weights. The caller's global RNG state is left untouched (the build
    runs inside `torch.random.fork_rng`). `routing_replay=True` gives every router a replay hook that
    study/routing.py drives (free routing until told otherwise). The module keeps `study_config` and `study_dtype`.
    Parameter names are megatron's (`decoder.layers.{i}.mlp.router.weight`, `...experts.local_experts.{e}...`);
    keep them stable, the HF weight map depends on them. `core_attention`: "fused" (the C kernel of study/attention.py
    where it runs, else SDPA: `fused_core_attention`; ~1e-6 from SDPA's), "sdpa" (torch's fused attention,
    `sdpa_core_attention`) or "megatron" (the local spec's own DotProductAttention; same function, slower on CPU).
    `experts`: "fused" (megatron's SequentialMLP computed by one autograd Function where that is bit-identical,
    study/moe_experts.py) or "megatron" (SequentialMLP's own module-per-expert forward). `norms`: "fused" (the
    layers' RMSNorms in C where that runs, study/norms.py; ~1e-6 from torch's) or "megatron" (torch's RMSNorm).
    `rope`: "fused" (RoPE in C through megatron's fused-RoPE slot where that runs, study/rope.py; bit for bit
    megatron's) or "megatron" (megatron's unfused torch code). `cross_entropy`: "fused" (the language-model loss in
    C where that runs, `fused_loss_gpt_model`; ~1e-6 from megatron's) or "megatron" (its vocab-parallel cross
    entropy).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed = {seed!r}: must be a non-negative integer")
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention = {core_attention!r}; valid: {', '.join(CORE_ATTENTIONS)}")
    if experts not in EXPERTS:
        raise ValueError(f"experts = {experts!r}; valid: {', '.join(EXPERTS)}")
    if norms not in NORMS:
        raise ValueError(f"norms = {norms!r}; valid: {', '.join(NORMS)}")
    if rope not in ROPES:
        raise ValueError(f"rope = {rope!r}; valid: {', '.join(ROPES)}")
    if cross_entropy not in CROSS_ENTROPIES:
        raise ValueError(f"cross_entropy = {cross_entropy!r}; valid: {', '.join(CROSS_ENTROPIES)}")
    rope_fusion = False
    if rope == "fused":
        from study.rope import install

        rope_fusion = install()
    tconfig = transformer_config(cfg, dtype=dtype, routing_replay=routing_replay, rope_fusion=rope_fusion)
    init_distributed()
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    if core_attention != "megatron":
        core = fused_core_attention() if core_attention == "fused" else sdpa_core_attention()
        spec.submodules.self_attention.submodules.core_attention = core
    if experts == "fused":
        from study.moe_experts import fused_sequential_mlp

        spec.submodules.mlp.submodules.experts.module = fused_sequential_mlp()
    if norms == "fused":
        from study.norms import FusedNormSpec

        attn = spec.submodules.self_attention.submodules
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = FusedNormSpec
        attn.q_layernorm = attn.k_layernorm = FusedNormSpec
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        model_class = fused_loss_gpt_model() if cross_entropy == "fused" else GPTModel
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
    model.study_config = cfg
    model.study_dtype = dtype
    return model


@functools.cache
def fused_loss_gpt_model() -> type:
    """megatron's GPTModel whose language-model loss runs study/cross_entropy.py's C kernel where it runs (fp32 CPU
    logits, one tensor-parallel rank, no loss fusion configured, no torch mode active): one pass over the logits
    each way instead of megatron's ~20 ops and three all-reduces. Elsewhere megatron's own loss."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from study.cross_entropy import cross_entropy

    class FusedLossGPTModel(GPTModel):
        def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            if not self.config.cross_entropy_loss_fusion and parallel_state.get_tensor_model_parallel_world_size() == 1:
                loss = cross_entropy(logits, labels.transpose(0, 1).contiguous())  # [b s] -> [s b], as megatron's
                if loss is not None:
                    return loss.transpose(0, 1).contiguous()
            return super().compute_language_model_loss(labels, logits)

    return FusedLossGPTModel


@functools.cache
def sdpa_core_attention() -> type:
    """megatron's local core attention (DotProductAttention) computed by torch's scaled_dot_product_attention.

    The local spec's DotProductAttention runs baddbmm, a Python masked softmax and bmm, with the (B h, S, S) scores in
    memory: ~15% of a tiny-preset update on CPU. SDPA (flash on CPU, a fused kernel on GPU) computes the same
    softmax(q k^T / sqrt(d) + mask) v in fp32 accumulation; the module, its parameters (none) and its place in the
    spec are megatron's. Anything SDPA cannot express here (packed sequences, attention bias, a softmax offset,
    dropout in training) goes to megatron's own forward.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPADotProductAttention(DotProductAttention):
        def plain(self, attention_bias, packed_seq_params) -> bool:  # type: ignore[no-untyped-def]
            """Whether this call is softmax(q k^T scale + mask) v, with nothing SDPA (or study/attention.py) lacks."""
            dropout = self.config.attention_dropout if self.training else 0.0
            return (
                packed_seq_params is None
                and attention_bias is None
                and dropout == 0
                and getattr(self.config, "softmax_type", "vanilla") == "vanilla"
            )

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # type: ignore[no-untyped-def]  # fmt: skip
            if not self.plain(attention_bias, packed_seq_params):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)  # fmt: skip
            sq, b = query.shape[:2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (S, B, h, d) -> (B, h, S, d)
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            if attention_mask is None:
                mask, causal = None, mask_type == AttnMaskType.causal
            else:
                # megatron: True = masked; SDPA: True = attend. A query may always see itself, so a fully padded row
                # (left padding) stays finite, as megatron's -10000 fill keeps it (its output is masked out anyway).
                eye = torch.eye(sq, k.shape[2], dtype=torch.bool, device=q.device)
                mask, causal = ~attention_mask | eye, False
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (S, B, h d)

    return SDPADotProductAttention


@functools.cache
def fused_core_attention() -> type:
    """`sdpa_core_attention` whose forward runs study/attention.py's C kernel where it runs (fp32 on the CPU, the
    kernel built, a plain softmax attention, no hooks on the module or torch mode: emulated precision's rounding must
    see SDPA's operands): over each query's visible span only, ~40% less time than SDPA forward
    and backward at the tiny preset's ~80-token batches (docs/performance.md). Elsewhere SDPA's forward."""
    from megatron.core.transformer.enums import AttnMaskType

    from study.attention import attention

    class FusedDotProductAttention(sdpa_core_attention()):  # type: ignore[misc]
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # type: ignore[no-untyped-def]  # fmt: skip
            if self.plain(attention_bias, packed_seq_params) and not (self._forward_hooks or self._forward_pre_hooks):
                mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
                out = attention(query, key, value, attention_mask, causal=mask_type == AttnMaskType.causal,
                                scale=self.softmax_scale)  # fmt: skip
                if out is not None:
                    return out
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)  # fmt: skip

    return FusedDotProductAttention


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
) -> torch.Tensor:
    """log pi(targets[b, t] | input_ids[b, :t+1]) as (B, S) fp32, differentiable; with `positions` (B, T) only
    those: out[b, j] = log pi(targets[b, positions[b, j]] | ...), (B, T).

    Uses megatron's labels path (`GPTModel(..., labels=targets)` returns the per-token cross entropy in fp32,
    without materialising log-softmax over the vocabulary). For a prompt+response batch pass
    `input_ids = tokens[:, :-1]`, `targets = tokens[:, 1:]`. Targets at positions the caller masks out must still be
    valid token ids (use 0 for padding). With `positions` the output layer and the cross entropy run on the kept
    positions only (a response's T of the S positions; TRL's `logits_to_keep`): the decoder still sees every token,
    the prompt's LM head and vocabulary softmax are skipped (a fifth to a third of their cost in an RL batch).
    """
    _check_ids(model, input_ids)
    _check_ids(model, targets, "targets")
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
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

    def keep(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (S, B, H), megatron's sequence-first layout
        index = positions.t()[:, :, None].expand(-1, -1, hidden.shape[-1])  # (T, B, H)
        return (hidden.gather(0, index), *args[1:])

    handle = model.output_layer.register_forward_pre_hook(keep)
    try:
        ce = model(input_ids, position_ids, mask, labels=targets.gather(1, positions))  # (B, T)
    finally:
        handle.remove()
    return -ce.float()


# ---------------------------------------------------------------------------------------------------------------------
# Optimisation
# ---------------------------------------------------------------------------------------------------------------------
def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
) -> torch.optim.AdamW:
    """Torch AdamW over every trainable parameter, its fused kernel where torch has one (CPU and CUDA, fp32 / fp16 /
    bf16). `eps` defaults to 1e-8, or 1e-6 for fp16 parameters (1e-8 is below fp16's smallest subnormal).

    Fused: one kernel over all parameters instead of ~9 ops per parameter tensor. On this CPU a step takes 0.4-0.6
    ms instead of 2.2-2.8 on `tiny` (33 tensors) and 4.2 instead of 14 on `default` (docs/performance.md, section
    6). It computes the same update to rounding (~1e-8 after 60 steps), not bit for bit.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if eps is None:
        eps = 1e-6 if any(p.dtype == torch.float16 for p in params) else 1e-8
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
                for p in params)  # fmt: skip
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused or None)


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training (the usual scheme; megatron's DynamicGradScaler needs CUDA).

    Usage: `scaler.scale(loss).backward(); stepped = scaler.step(optimizer, model.parameters())`. `step` unscales
    the gradients in place, skips the optimizer step and backs the scale off when any gradient is inf/NaN, and
    grows the scale after `growth_interval` clean steps.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x scale, in fp32."""
        return loss.float() * self.scale_value

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale in place; True when all of them are finite."""
        finite = True
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is None:
                continue
            if not bool(torch.isfinite(p.grad).all()):
                finite = False
            p.grad.mul_(inv)
        return finite

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, step unless a gradient overflowed, update the scale. Returns whether the step was taken."""
        finite = self.unscale_(params)
        if finite:
            optimizer.step()
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale_value = min(self.scale_value * self.growth_factor, self.max_scale)
        else:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
        return finite

    def state_dict(self) -> dict[str, float]:
        """Scale and step counters, for checkpoints."""
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Inverse of `state_dict`."""
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def count_parameters(model: torch.nn.Module) -> int:
    """Total parameters (all experts)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "TORCH_DTYPES",
    "DynamicLossScaler",
    "build_optimizer",
    "build_policy",
    "count_parameters",
    "init_distributed",
    "logits",
    "model_device",
    "norm_topk_prob",
    "positions_and_mask",
    "token_logp",
    "transformer_config",
]
