"""Optional C kernels for the CPU hot loops, over plain tensors: an accelerator the science never depends on.

One switch and one rule decide when a kernel runs (`applies`):
1. the switch: `STUDY_NATIVE=0` turns every kernel off (read at each call, so a process can compare both paths);
2. the rule: every input tensor is fp32 on the CPU and no torch function or dispatch mode is active (`intercepted`:
   emulated precision rounds the ops a kernel would hide), and the kernel's shared object built (no C compiler or a
   failed build: a warning, once);
3. each entry point returns None (or its caller's own path runs) where the rule says no, so every kernel steps aside
   the same way. Callers outside this package never name a kernel: the policy's layer spec (study/policy/layers.py)
   and the hf engine's decode step (study/rollout/hf.py) are the only places that choose them.

This package imports nothing of study/, nor megatron, nor transformers; deleting it leaves a harness that runs its
torch paths (tests/study/kernels and tests/test_imports.py check both). The kernels are single-threaded: they win at the
one or two torch threads of this harness's runs; with many threads torch's own ops may be faster, and
`STUDY_NATIVE=0` compares the two. Results agree with the torch paths to ~1e-6 (RoPE's and the experts' bit for bit);
a run's manifest records whether they built (`native_kernels`).
"""

from __future__ import annotations

import os

import torch

from study.kernels import build

__all__ = ["applies", "available", "enabled", "intercepted"]


def enabled() -> bool:
    """False where `STUDY_NATIVE=0` turns the kernels off (every use then runs its torch path)."""
    return os.environ.get("STUDY_NATIVE", "1") != "0"


def intercepted() -> bool:
    """Whether a torch function or dispatch mode is active (emulated precision's rounding is one): a C kernel would
    hide its ops from the mode, so the callers' torch paths run instead."""
    return bool(torch.overrides._get_current_function_mode_stack()) or torch._C._len_torch_dispatch_stack() > 0


def applies(*tensors: torch.Tensor) -> bool:
    """The one rule (module doc): kernels on, every tensor fp32 on the CPU, no torch mode active."""
    return enabled() and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and not intercepted()


def available() -> bool:
    """Whether the kernels are on and every one of them builds and loads here (what a run's manifest records)."""
    return enabled() and build.available()
