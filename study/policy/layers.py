"""The policy's fast layers: megatron's local layer spec with the same function computed in fewer ops.

The one place that chooses the speed paths of the training engine (`build_policy(layers="fast")`, the default);
`layers="megatron"` keeps megatron's local spec as it stands, the reference these are tested against
(tests/study/policy/test_model.py). Each path keeps megatron's modules, parameters and names, and steps aside to
megatron's own code where it would not be exact (hooks on the module, a torch mode, shapes or dtypes it does not take):
1. core attention: torch's SDPA instead of the local DotProductAttention's baddbmm, Python softmax and bmm (~15% of a
   tiny update), and where the C kernels apply (study/kernels/__init__.py) the C attention over each query's visible
   span (~40% less than SDPA forward and backward at ~80 tokens);
2. experts: megatron's SequentialMLP computed by one autograd Function (study/policy/experts.py): per expert in turn,
   bit for bit, or as grouped GEMMs (`experts`: grouped on CUDA by default);
3. RMSNorms (the layers' eight per forward): torch's RMSNorm module whose forward is one C pass each way;
4. RoPE: megatron's fused-RoPE slot (which TransformerEngine fills on GPUs) filled with the C RoPE, bit for bit the
   unfused code's, which runs itself where the kernel does not apply;
5. the language-model loss: one C pass over the logits each way at one tensor-parallel rank, else megatron's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from study.policy.experts import fused_sequential_mlp, grouped_sequential_mlp

try:  # the optional C kernels: without study/kernels/ every path below runs its torch code
    from study.kernels.attention import attention
    from study.kernels.cross_entropy import cross_entropy
    from study.kernels.rms_norm import FusedRMSNorm
    from study.kernels.rope import rope
except ImportError:
    attention = cross_entropy = rope = FusedRMSNorm = None


def speed_up(spec: Any, experts: str = "sequential") -> None:
    """Put the fast modules (module doc, 1-3) into megatron's local transformer-layer `spec`, in place; `experts`:
    "grouped" or "sequential" (study.policy.model.experts_path)."""
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = fused_core_attention()
    grouped = experts == "grouped"
    spec.submodules.mlp.submodules.experts.module = grouped_sequential_mlp() if grouped else fused_sequential_mlp()
    if FusedRMSNorm is not None:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = FusedNormSpec
        attn.q_layernorm = attn.k_layernorm = FusedNormSpec


def install_rope() -> bool:
    """Put `fused_rope` into megatron's fused-RoPE slot if it is empty (no TransformerEngine); True if the slot holds
    it now, so `apply_rope_fusion` may be turned on."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`: the C RoPE where it applies, megatron's
    unfused bshd function otherwise (the same products and sums either way)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    out = None if interleaved or rope is None else rope(t, freqs)
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved) if out is None else out


@functools.cache
def gpt_model() -> type:
    """megatron's GPTModel whose language-model loss runs the C cross entropy where it applies (one tensor-parallel
    rank, no loss fusion configured): one pass over the logits each way instead of megatron's ~20 ops and three
    all-reduces. Elsewhere megatron's own loss."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    class FastLossGPTModel(GPTModel):
        def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            if cross_entropy is not None and not self.config.cross_entropy_loss_fusion and tp == 1:
                loss = cross_entropy(logits, labels.transpose(0, 1).contiguous())  # [b s] -> [s b], as megatron's
                if loss is not None:
                    return loss.transpose(0, 1).contiguous()
            return super().compute_language_model_loss(labels, logits)

    return FastLossGPTModel


class FusedNormSpec:
    """In megatron's layer spec where `WrappedTorchNorm` goes (same arguments): a `FusedRMSNorm` for RMSNorm,
    megatron's own norm otherwise."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # type: ignore[no-untyped-def]
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = WrappedTorchNorm(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        if type(norm) is not torch.nn.RMSNorm:
            return norm
        fused = FusedRMSNorm(hidden_size, eps=eps)
        fused.load_state_dict(norm.state_dict())
        fused = fused.to(device=norm.weight.device, dtype=norm.weight.dtype)
        for p in fused.parameters():  # sequence parallelism (study/policy/compat.py, point 5): marked as megatron's
            p.sequence_parallel = config.sequence_parallel
        return fused


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
            """Whether this call is softmax(q k^T scale + mask) v, with nothing SDPA (or the C attention) lacks."""
            dropout = self.config.attention_dropout if self.training else 0.0
            return (
                packed_seq_params is None
                and attention_bias is None
                and dropout == 0
                and getattr(self.config, "softmax_type", "vanilla") == "vanilla"
            )

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):  # type: ignore[no-untyped-def]
            if not self.plain(attention_bias, packed_seq_params):
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
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
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (S, B, h d)

    return SDPADotProductAttention


@functools.cache
def fused_core_attention() -> type:
    """`sdpa_core_attention` whose forward runs the C attention where it applies (a plain softmax attention, no
    hooks on the module; the kernels' rule, study/kernels/__init__.py: emulated precision's rounding must see SDPA's
    operands). Elsewhere SDPA's forward."""
    from megatron.core.transformer.enums import AttnMaskType

    class FusedDotProductAttention(sdpa_core_attention()):  # type: ignore[misc]
        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):  # type: ignore[no-untyped-def]
            hooked = self._forward_hooks or self._forward_pre_hooks
            if attention is not None and self.plain(attention_bias, packed_seq_params) and not hooked:
                mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
                out = attention(
                    query, key, value, attention_mask, causal=mask_type == AttnMaskType.causal, scale=self.softmax_scale
                )
                if out is not None:
                    return out
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    return FusedDotProductAttention
