"""The policy's rotary position embedding in C, in megatron's fused-RoPE slot.

megatron applies RoPE to q and k with `apply_rotary_pos_emb`: unfused, that is a dozen torch ops forward (slices,
two cos/sin tables, rotate_half's chunk, neg and cat, two products, a sum, a cat) and more backward, each a pass over
q or k: ~4% of a tiny-preset update. With `apply_rope_fusion` megatron calls `rope_utils.fused_apply_rotary_pos_emb`
instead, a slot TransformerEngine fills on GPUs. `install` puts `fused_rope` there where nothing else has:
study/csrc/rope.c for fp32 CPU tensors (one pass forward, one backward, the same products and sums as the unfused
code, so bit for bit the same outputs and gradients; tests/study/test_model.py), megatron's unfused function for
anything else and while a torch mode intercepts ops (emulated precision rounds each of the unfused code's ops).
study/model.py turns `apply_rope_fusion` on only when `install` succeeded.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from study import native


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with their signatures, or None where they cannot be built or are turned off."""
    p, i64 = native.PTR, native.I64
    both = ([p, p, p, i64, i64, i64, p], None)  # x or dy, cos, sin, S, rows per position, d, out
    return native.bind("rope", {"rope_forward": both, "rope_backward": both})


class RopeFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for x (S, ..., d) fp32 CPU contiguous, cos and sin (S, d) fp32 contiguous."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[no-untyped-def]
        s, d = x.shape[0], x.shape[-1]
        ctx.shape = (s, x.numel() // (s * d), d)  # positions, rows per position, head size
        y = torch.empty_like(x)
        library().rope_forward(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), *ctx.shape, y.data_ptr())
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(grad)
        library().rope_backward(grad.data_ptr(), cos.data_ptr(), sin.data_ptr(), *ctx.shape, dx.data_ptr())
        return dx, None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb(t, freqs, interleaved=...)`: t (S, B, h, d), freqs (S, 1, 1, d) (the
    angles, already [f, f] over the two halves). `RopeFunction` for fp32 CPU inputs rotating all of d, not
    interleaved, with the kernel built; megatron's unfused bshd function otherwise."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, d = t.shape[0], t.shape[-1]
    if (
        interleaved
        or t.dim() != 4
        or t.numel() == 0
        or d % 2
        or freqs.shape != (s, 1, 1, d)
        or not native.runs_on(t, freqs)  # also no torch mode: emulated precision rounds each unfused op
        or library() is None
    ):
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    angles = freqs.reshape(s, d)
    return RopeFunction.apply(t.contiguous(), torch.cos(angles).contiguous(), torch.sin(angles).contiguous())


def install() -> bool:
    """Put `fused_rope` into megatron's fused-RoPE slot if it is empty (no TransformerEngine) and the kernel
    builds; True if the slot holds it now, so `apply_rope_fusion` may be turned on."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None and library() is not None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope
