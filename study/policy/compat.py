"""CPU compatibility shims for megatron-core 0.16.1, all in one place.

megatron-core is written for CUDA machines. With the local (non-TransformerEngine) layer spec it computes fine on
CPU except for four places that assume a GPU. `apply()` patches them, only when CUDA is unavailable, and is
idempotent. On a CUDA machine it does nothing, so the same code runs unchanged there.

1. `torch.cuda.current_device()` used as a device (about 175 call sites, e.g. the rotary embedding's
   `inv_freq.to(device=torch.cuda.current_device())`, router buffers, token dispatchers): on a CPU-only torch it
   raises "Torch not compiled with CUDA enabled". Patched to return the CPU device. This is the one process-wide
   patch (megatron looks it up through the `torch` module at call time); it only replaces a call that would raise.
2. The RNG tracker (`tensor_parallel.random`): `CudaRNGStatesTracker.add` and `fork` read and write the CUDA
   generator (`torch.cuda.get_rng_state`, `torch.cuda.default_generators`). Attention dropout and
   `model_parallel_cuda_manual_seed` go through it. Patched to use the CPU generator's state instead.
3. Causal masks built with a hard-coded `device="cuda"` (`transformer.utils.get_default_causal_mask` and
   `get_sliding_window_causal_mask`, imported by name into `fusions.fused_softmax`, which builds the causal mask
   when no attention mask is passed). Patched in both modules to build the same masks on the CPU.
4. `NameError: te_general_gemm` in `transformer.moe.moe_utils.RouterGatingLinearFunction`: the name is imported
   only inside `try: import transformer_engine`, yet read unconditionally by the router's gating GEMM. Defined as
   None when TransformerEngine is absent, so the router takes its plain `torch.mm` branch.

5. (`apply_parallel()`, on every device) megatron's torch norm (`WrappedTorchNorm`, the local spec's norm when
   TransformerEngine is absent) refuses sequence parallelism outright, though a norm over the hidden dimension is
   exact on a sequence shard: all it needs is its weight marked `sequence_parallel`, so that
   `finalize_model_grads` sums the weight's gradient over the tensor-parallel ranks (as TE's norms are marked).
   Patched to build the same norm with the flag set on its parameters.

`SHIMS` names every patched target; tests/study/test_megatron_compat.py checks that each still exists and that the
patch took effect, so a megatron upgrade that moves one fails loudly instead of failing deep inside a forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# (module, attribute) of every patched target.
SHIMS: tuple[tuple[str, str], ...] = (
    ("torch.cuda", "current_device"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", "add"),
    ("megatron.core.transformer.utils", "get_default_causal_mask"),
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask"),
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),
    ("megatron.core.transformer.torch_norm.WrappedTorchNorm", "__new__"),
)

_APPLIED = False
_PARALLEL_APPLIED = False
# The attributes the shims replaced, as they were (MISSING where megatron leaves the name undefined); tests use them
# to show each shim is still needed.
MISSING = object()
ORIGINALS: dict[tuple[str, str], Any] = {}
_ORIGINAL_CURRENT_DEVICE: Callable[[], int] = torch.cuda.current_device


def _replace(owner: Any, owner_name: str, attr: str, new: Any) -> None:
    """Set owner.attr = new, remembering the original (first time only) in ORIGINALS."""
    ORIGINALS.setdefault((owner_name, attr), getattr(owner, attr, MISSING))
    setattr(owner, attr, new)


def _shim(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a replacement so tests can tell a patched attribute from megatron's own."""
    fn.__study_cpu_shim__ = True  # type: ignore[attr-defined]
    return fn


def is_shim(obj: Any) -> bool:
    """True when `obj` is one of this module's replacements."""
    return bool(getattr(obj, "__study_cpu_shim__", False))


def applied() -> bool:
    """Whether `apply()` has patched megatron in this process (False on CUDA machines)."""
    return _APPLIED


def apply() -> bool:
    """Patch megatron-core for CPU when CUDA is unavailable (and `apply_parallel()` on every device); idempotent.
    Returns whether the CPU shims are active."""
    global _APPLIED
    apply_parallel()  # on every device
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    _patch_current_device()
    _patch_rng_tracker()
    _patch_causal_masks()
    _patch_te_general_gemm()
    _APPLIED = True
    return True


# 1. torch.cuda.current_device() used as a device -------------------------------------------------------------------
def _patch_current_device() -> None:
    @_shim
    @functools.wraps(_ORIGINAL_CURRENT_DEVICE)
    def current_device() -> torch.device:
        # Megatron passes the result as `device=` / `.to(...)` (rotary inv_freq, router and dispatcher buffers).
        return torch.device("cpu")

    _replace(torch.cuda, "torch.cuda", "current_device", current_device)


# 2. RNG tracker on the CPU generator ---------------------------------------------------------------------------------
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    @_shim
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        # tensor_parallel/random.py: CudaRNGStatesTracker.fork saves/restores the generator through this function.
        return torch.get_rng_state()

    @_shim
    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        # tensor_parallel/random.py: the CUDA version indexes torch.cuda.default_generators.
        torch.set_rng_state(new_state)

    @_shim
    def add(self: Any, name: str, seed: int) -> None:
        # CudaRNGStatesTracker.add: same bookkeeping and errors as megatron's, with the CPU generator's state.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    name = "megatron.core.tensor_parallel.random"
    _replace(mrandom, name, "_get_cuda_rng_state", _get_cuda_rng_state)
    _replace(mrandom, name, "_set_cuda_rng_state", _set_cuda_rng_state)
    _replace(mrandom.CudaRNGStatesTracker, f"{name}.CudaRNGStatesTracker", "add", add)


# 3. Causal masks on the CPU ----------------------------------------------------------------------------------------
def _patch_causal_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @_shim
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        # transformer/utils.py: torch.triu(torch.ones(sq, sq, device="cuda"), diagonal=1).bool()
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)  # (sq, sq) True = masked

    @_shim
    def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        # transformer/utils.py: same construction as megatron's, without device="cuda".
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])  # (sq, skv) True = masked

    for module in (tutils, fused_softmax):  # fused_softmax imported both by name
        _replace(module, module.__name__, "get_default_causal_mask", get_default_causal_mask)
        _replace(module, module.__name__, "get_sliding_window_causal_mask", get_sliding_window_causal_mask)


# 4. te_general_gemm without TransformerEngine ------------------------------------------------------------------------
def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    # moe_utils.RouterGatingLinearFunction.forward reads `te_general_gemm`, defined only when TE imports.
    if getattr(moe_utils, "te_general_gemm", None) is None:
        _replace(moe_utils, moe_utils.__name__, "te_general_gemm", None)


# 5. Sequence parallelism in megatron's torch norm (every device) -----------------------------------------------------
def apply_parallel() -> None:
    """Let megatron's torch norm run under sequence parallelism (module doc, point 5); idempotent, any device."""
    global _PARALLEL_APPLIED
    if _PARALLEL_APPLIED:
        return
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    @_shim
    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,  # type: ignore[no-untyped-def]
                normalization="LayerNorm"):  # fmt: skip
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # megatron asserts it off; the norm it builds is exact on a shard
        try:
            norm = original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        finally:
            config.sequence_parallel = sequence_parallel
        mark_sequence_parallel(norm, sequence_parallel)
        return norm

    _replace(
        WrappedTorchNorm, "megatron.core.transformer.torch_norm.WrappedTorchNorm", "__new__", staticmethod(__new__)
    )
    _PARALLEL_APPLIED = True


def mark_sequence_parallel(module: torch.nn.Module, on: bool) -> None:
    """Mark `module`'s parameters as megatron marks a sequence-parallel norm's (their gradients are summed over the
    tensor-parallel ranks by `finalize_model_grads`)."""
    for p in module.parameters():
        p.sequence_parallel = on
