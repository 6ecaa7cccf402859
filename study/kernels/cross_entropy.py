"""The language-model loss in C: per-token cross entropy, one pass over the logits forward and one backward.

megatron's vocab-parallel cross entropy is about twenty torch ops forward (max, an in-place subtract, the target
gather, exp, sum, log, three all-reduces over the tensor-parallel group even when it holds one process) and several
backward, each a pass over the (positions, vocabulary) logits: ~10% of a pi_old forward of 192 sequences on the tiny
preset. `cross_entropy` computes the same per-token loss from csrc/cross_entropy.c, and returns None where the
package's rule says no (study/kernels/__init__.py) or the targets are not ones it takes; its caller
(study/policy/layers.py, at one tensor-parallel rank) then runs megatron's. Sums run in another order and exp is
glibc's: losses and gradients agree with megatron's to ~1e-6 (tests/study/kernels).
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
    return build.bind(
        "cross_entropy",
        {"ce_forward": ([p, p, i64, i64, p, p], None), "ce_backward": ([p, p, p, p, i64, i64, p], None)},
    )


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row cross entropy of logits (..., V) fp32 CPU contiguous against int64 targets (...), contiguous."""

    @staticmethod
    def forward(ctx, logits, target):  # type: ignore[no-untyped-def]
        v = logits.shape[-1]
        rows = target.numel()
        loss, lse = torch.empty(target.shape, dtype=logits.dtype), torch.empty(rows, dtype=logits.dtype)
        library().ce_forward(logits.data_ptr(), target.data_ptr(), rows, v, loss.data_ptr(), lse.data_ptr())
        ctx.save_for_backward(logits, target, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        logits, target, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(logits)
        library().ce_backward(
            logits.data_ptr(),
            target.data_ptr(),
            lse.data_ptr(),
            grad.data_ptr(),
            target.numel(),
            logits.shape[-1],
            dx.data_ptr(),
        )
        return dx, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """The per-token loss of `logits` (S, B, V) against `target` (S, B) as megatron's `vocab_parallel_cross_entropy`
    computes it at one tensor-parallel rank, in C; None where the kernel does not run (not fp32 on the CPU, targets
    outside the vocabulary, a torch mode active, no kernel): the caller's own path then runs."""
    if not kernels.applies(logits):
        return None
    if target.shape != logits.shape[:-1] or target.dtype != torch.int64 or target.device.type != "cpu":
        return None
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= logits.shape[-1]):
        return None
    if library() is None:
        return None
    return CrossEntropyFunction.apply(logits.contiguous(), target.contiguous())
