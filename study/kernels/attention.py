"""Core attention in C: softmax(scale q k^T + mask) v over each query's visible span, forward and backward.

torch's SDPA on the CPU (its flash kernel) scores every query against every key and applies the mask afterwards;
its forward and backward were ~14% of an update at the tiny preset's ~80-token sequences (docs/performance.md).
`attention` computes the same function from csrc/attention.c over each query's visible span only (a causal,
left-padded batch: about half the dense work), with register-blocked score loops over transposed keys and a backward
that recomputes the probabilities from the saved log-sum-exp. It returns None where the package's rule says no
(study/kernels/__init__.py) or the shapes are not ones it takes; its caller (study/policy/layers.py) then runs SDPA.
The C sums run in another order: outputs and gradients agree with SDPA's to ~1e-6 relative (tests/study/kernels).
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
    p, i64, rc = build.PTR, build.I64, build.INT
    shape = [p, i64, rc, i64, i64, i64, i64, i64, build.F64]  # mask, its stride, causal, S, B, hq, hk, d, scale
    forward = [p, p, p, *shape, p, p]  # q, k, v, ..., out, lse
    backward = [p, p, p, *shape, p, p, p, p, p, p]  # q, k, v, ..., out, dout, lse, dq, dk, dv
    return build.bind("attention", {"attention_forward": (forward, rc), "attention_backward": (backward, rc)})


def _shape_args(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> list:
    b, hq, s, d = q.shape
    stride = 0 if mask is None or mask.shape[0] == 1 else s * s
    return [None if mask is None else mask.data_ptr(), stride, int(causal), s, b, hq, k.shape[1], d, scale]


class AttentionFunction(torch.autograd.Function):
    """softmax(scale q k^T, masked) v for q (B, hq, S, d), k and v (B, hk, S, d), fp32 CPU, contiguous; `mask`
    (B or 1, S, S) uint8, 1 = masked (a query always sees itself), or None: causal if `causal`, else unmasked.
    Returns (B, hq, S, d)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):  # type: ignore[no-untyped-def]
        b, hq, s, _ = q.shape
        out, lse = torch.empty_like(q), torch.empty(b, hq, s, dtype=q.dtype)
        args = _shape_args(q, k, mask, causal, scale)
        if library().attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), *args, out.data_ptr(), lse.data_ptr()):
            raise MemoryError("native attention: out of memory for its workspace")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.args = mask, args  # args holds the mask's pointer: keep the mask alive with it
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ptrs = [t.data_ptr() for t in (out, dout, lse, dq, dk, dv)]
        if library().attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), *ctx.args, *ptrs):
            raise MemoryError("native attention: out of memory for its workspace")
        return dq, dk, dv, None, None, None


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor | None:
    """`AttentionFunction` on megatron's core-attention inputs (query (S, B, hq, d), key and value (S, B, hk, d),
    `mask` megatron's (B or 1, 1, S, S) bool, True = masked, or None), output (S, B, hq d); None where the kernel does
    not run (not fp32 on the CPU, shapes it does not take, a torch mode active, no kernel): the caller's own path
    then runs."""
    if not kernels.applies(query, key, value) or not all(t.dim() == 4 for t in (query, key, value)):
        return None
    s, b, hq, d = query.shape
    if key.shape != value.shape or key.shape[:2] != (s, b) or key.shape[3] != d or hq % key.shape[2] or s == 0:
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.device.type != "cpu" or mask.dim() != 4 or mask.shape[1:] != (1, s, s):
            return None
        if mask.shape[0] not in (1, b):
            return None
        mask = mask[:, 0].contiguous().view(torch.uint8)
    if library() is None:
        return None
    # (S, B, h, d) -> (B, h, S, d): d stays innermost, a fast copy; autograd permutes the gradients back
    q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
    out = AttentionFunction.apply(q, k, v, mask, causal, scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)
