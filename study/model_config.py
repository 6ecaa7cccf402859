"""Typed configuration of the MoE policy: one dataclass, a sentence per field, named presets.

The architecture is Qwen3-MoE's (the paper's model family): RMSNorm, rotary positions, grouped-query attention with
QK-norm, no biases, untied embeddings, every layer a mixture of SwiGLU experts with a softmax top-k router whose
gate weights are renormalised over the chosen experts. Megatron-core builds it for training; transformers'
Qwen3-MoE and vLLM build the same network for rollouts, so weights map one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

DType = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The numeric formats an engine computes in (the dtype fields of a run)."""
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Each of DTYPES as a torch dtype: the one map every module uses."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the MoE policy."""

    num_layers: int = 2
    """Transformer layers; every one is an MoE layer."""
    hidden_size: int = 64
    """Residual stream width."""
    num_attention_heads: int = 2
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = 32
    """Width of one attention head (vLLM's CPU attention needs at least 32)."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 128
    """Intermediate width of one expert's SwiGLU MLP."""
    vocab_size: int = 512
    """Tokenizer vocabulary size (padded embedding rows included)."""
    max_seq_len: int = 256
    """Longest prompt + response the model is built for (rotary table, engine max_model_len)."""
    rotary_base: float = 10000.0
    """Rotary position embedding base (theta)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation (from-scratch models only)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific overrides passed through unchanged (advanced)."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "num_experts",
            "moe_top_k",
            "moe_ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} = {value!r}: must be a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups = {self.num_query_groups} must divide "
                f"model.num_attention_heads = {self.num_attention_heads}"
            )
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.moe_top_k = {self.moe_top_k}: valid range is [1, {self.num_experts}]")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def active_params_per_token(self) -> int:
        """Parameters a token touches in one forward pass (attention, top-k experts, norms, LM head): the N in
        the 6 N D training-FLOPs estimate."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups) + self.num_attention_heads * d * h
        experts = self.moe_top_k * 3 * h * self.moe_ffn_hidden_size
        router = h * self.num_experts
        return self.num_layers * (attn + experts + router) + h * self.vocab_size


PRESETS: dict[str, ModelConfig] = {
    # Tests and smoke runs: seconds per RL step on one CPU thread.
    "tiny": ModelConfig(),
    # The embedded default study: a few minutes per run on one core.
    "default": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, num_experts=8,
                           moe_top_k=2, moe_ffn_hidden_size=256, vocab_size=1024, max_seq_len=512),
    # Benchmarks of the update's share of GEMM peak.
    "small": ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=4, head_dim=64,
                         num_experts=16, moe_top_k=4, moe_ffn_hidden_size=512, vocab_size=4096, max_seq_len=1024),
}  # fmt: skip


def route_index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype that holds expert ids 0..num_experts-1 (uint8 up to 256 experts, int16 up to 2^15,
    int32 beyond): the dtype of every stored route, trainer's and engine's."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


def preset(name: str) -> ModelConfig:
    """The model preset `name`; an unknown name lists the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}") from None
