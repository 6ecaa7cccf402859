"""Rotary position embedding in C: the same products and sums as megatron's unfused RoPE, one pass each way.

megatron applies RoPE to q and k with `apply_rotary_pos_emb`: unfused, that is a dozen torch ops forward (slices,
two cos/sin tables, rotate_half's chunk, neg and cat, two products, a sum, a cat) and more backward, each a pass over
q or k: ~4% of a tiny-preset update. `rope` computes it from csrc/rope.c with the same products and sums, so outputs
and gradients equal the unfused code's bit for bit (tests/study/kernels); it returns None where the package's rule says
no (emulated precision rounds each unfused op). study/policy/layers.py puts it into megatron's fused-RoPE slot.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from study import kernels
from study.kernels import build


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with their signatures, or None where they cannot be built or are turned off."""
    p, i64 = build.PTR, build.I64
    both = ([p, p, p, i64, i64, i64, p], None)  # x or dy, cos, sin, S, rows per position, d, out
    return build.bind("rope", {"rope_forward": both, "rope_backward": both})


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


def rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin for t (S, B, h, d), freqs (S, 1, 1, d) (the angles, already [f, f] over the two
    halves), rotating all of d, non-interleaved; None where the package's rule says no or the shapes are not ones it
    takes (the caller runs its unfused code)."""
    s, d = t.shape[0], t.shape[-1]
    if t.dim() != 4 or t.numel() == 0 or d % 2 or freqs.shape != (s, 1, 1, d) or not kernels.applies(t, freqs):
        return None
    if library() is None:
        return None
    angles = freqs.reshape(s, d)
    return RopeFunction.apply(t.contiguous(), torch.cos(angles).contiguous(), torch.sin(angles).contiguous())
