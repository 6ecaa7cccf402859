"""RMSNorm in C: torch's RMSNorm module whose forward and backward are one C pass each where the kernels apply.

megatron's local layer spec builds its norms as `torch.nn.RMSNorm` (`WrappedTorchNorm`), which on the CPU is
composite: six elementwise ops forward and about a dozen backward, each a pass over the activations. The layers'
eight norms per forward (two per layer, the q and k norms; the final norm is built by megatron's block and stays
torch's) made ~10% of a 64-sequence update. `FusedRMSNorm` is the same module (class, parameter, state dict)
whose forward calls `RMSNormFunction`, csrc/rms_norm.c, where the package's rule applies (study/kernels/__init__.py)
and no hooks sit on the module; elsewhere torch's forward. The C sums run in another order: outputs and gradients
agree with torch's to ~1e-6 relative (tests/study/kernels).
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
        "rms_norm",
        {
            "rms_forward": ([p, p, i64, i64, build.F64, p, p], None),
            "rms_backward": ([p, p, p, p, i64, i64, p, p], None),
        },
    )


class RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight for fp32 CPU tensors, in C both ways."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[no-untyped-def]
        lib = library()
        x = x.contiguous()
        d = x.shape[-1]
        rows = x.numel() // d if d else 0
        y, rstd = torch.empty_like(x), torch.empty(rows, dtype=x.dtype)
        lib.rms_forward(x.data_ptr(), weight.data_ptr(), rows, d, eps, y.data_ptr(), rstd.data_ptr())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        d = x.shape[-1]
        dx, dw = torch.empty_like(x), torch.empty_like(weight)
        library().rms_backward(
            grad.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rstd.data_ptr(),
            rstd.numel(),
            d,
            dx.data_ptr(),
            dw.data_ptr(),
        )
        return dx, dw, None


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm; its forward runs `RMSNormFunction` where that applies (see the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            w is not None
            and kernels.applies(x, w)
            and x.shape[-1] == w.numel()
            and x.numel() > 0
            and not (self._forward_hooks or self._forward_pre_hooks)
            and library() is not None
        ):
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            return RMSNormFunction.apply(x, w, eps)
        return super().forward(x)
