"""CPU compatibility shims for megatron-core 0.16.1, all in one place.

megatron-core is written for CUDA machines with TransformerEngine. The policy runs megatron's local
(non-TransformerEngine) layer spec on every device: the CUDA stack is torch, megatron-core and vLLM, without
TransformerEngine or apex (the `cuda` extra installs none of them). Two kinds of patch follow:
- stand-ins for the CUDA device (points 1-3, 6, 7): `apply()` makes them only where CUDA is unavailable;
- names and behaviours megatron lacks without TransformerEngine (points 4, 5, 8): on every device, since a CUDA
  machine without TransformerEngine reads the same undefined names (the router's gating GEMM raises
  `NameError: te_general_gemm` on the first forward otherwise).
`apply()` is idempotent and decides the device once per process.

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
4. (every device, where TransformerEngine is absent) `NameError: te_general_gemm` in
   `transformer.moe.moe_utils.RouterGatingLinearFunction`: the name is imported only inside
   `try: import transformer_engine`, yet read unconditionally by the router's gating GEMM. Defined as None when
   TransformerEngine is absent, so the router takes its plain `torch.mm` branch.

6. megatron's optimizer (`get_megatron_optimizer`: Adam, the fp32 / bf16-with-fp32-main-params optimizer and the
   distributed optimizer) assumes CUDA in two ways:
   a. scalars and norms built with a literal `device='cuda'`: the found-inf flag, the unit loss scale and the
      multi-tensor-apply overflow buffers (`optimizer.MixedPrecisionOptimizer.__init__`, `FP32Optimizer.__init__`),
      the grad-norm and clip buffers (`clip_grads.get_grad_norm_fp32`, `clip_grad_by_total_norm_fp32`,
      `count_zeros_fp32`) and the result of the torch fallback for apex's L2 norm
      (`utils.local_multi_tensor_l2_norm`, `clip_grads.l2_norm_impl`). Patched by giving those two optimizer
      modules (and that one function) a `torch` whose tensor factories put a `device='cuda'` tensor on the CPU:
      everything else is the real torch, and only calls that would raise are changed.
   b. parameters recognised by `param.type()` strings ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor', ...):
      a CPU parameter is "Received torch.FloatTensor" and refused (`Float16OptimizerWithFloat16Params.__init__`,
      `DistributedOptimizer.__init__` and its `_build_model_and_main_param_groups`) or fails an assert
      (`clip_grad_by_total_norm_fp32`). Patched by wrapping those calls: while one runs, the CPU tensors it
      inspects answer `type()` with the CUDA name of their dtype (an instance attribute, removed afterwards).
   With both, megatron's own optimizer code runs on the CPU unchanged (torch's Adam / AdamW, megatron's fallback
   when neither TransformerEngine nor apex is installed; the gradient reductions over gloo).
7. megatron's distributed checkpointing (`dist_checkpointing.save`, torch_dist format) stages the tensors to host
   memory with non-blocking copies and then calls `torch.cuda.synchronize()`
   (`strategies.filesystem_async.FileSystemWriterAsync.preload_tensors`), which raises on a CPU-only torch. Patched
   to stage with blocking copies (the tensors are already in host memory: each copy is a no-op) and no sync.

5. (`apply_parallel()`, on every device) megatron's torch norm (`WrappedTorchNorm`, the local spec's norm when
   TransformerEngine is absent) refuses sequence parallelism outright, though a norm over the hidden dimension is
   exact on a sequence shard: all it needs is its weight marked `sequence_parallel`, so that
   `finalize_model_grads` sums the weight's gradient over the tensor-parallel ranks (as TE's norms are marked).
   Patched to build the same norm with the flag set on its parameters.

`8. (`apply_parallel()`, on every device where neither TransformerEngine nor apex is installed) megatron's
   distributed optimizer then steps torch's Adam, which keeps a per-weight "step" among its states; loading a
   checkpoint (`load_parameter_state_from_fully_reshardable` -> `_set_main_param_and_optimizer_states`) copies every
   state the optimizer holds from the loaded ones, which carry no "step" (megatron restores it from the parameter
   groups), and fails with KeyError 'step'. Patched to leave a state the loaded ones lack as it is. And
   `DistributedOptimizer.load_state_dict` restores that step as one tensor shared by every weight's state (its
   TransformerEngine / apex branch clones it), which torch's Adam increments in place once per weight: after a
   load, the k-th weight's next update would use step + k for its bias corrections. Patched to give each weight
   its own copy.

`SHIMS` names every patched target; tests/study/policy/test_megatron_compat.py checks that each still exists and that
the patch took effect, so a megatron upgrade that moves one fails loudly instead of failing deep inside a forward.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator
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
    ("megatron.core.optimizer.optimizer", "torch"),
    ("megatron.core.optimizer.clip_grads", "torch"),
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "__init__"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync", "preload_tensors"),
    ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "_set_main_param_and_optimizer_states"),
    ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "load_state_dict"),
)

_APPLIED = False
_DECIDED = False
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
    """Whether `apply()` has patched megatron's CUDA assumptions for the CPU in this process (False on CUDA)."""
    return _APPLIED


def apply() -> bool:
    """Patch megatron-core where TransformerEngine is absent (`apply_parallel()`, every device) and, when CUDA is
    unavailable, stand in for the CUDA device; idempotent. The device is decided by the first call in a process.
    Returns whether the CPU stand-ins are active."""
    global _APPLIED, _DECIDED
    apply_parallel()  # on every device
    if _DECIDED:
        return _APPLIED
    _DECIDED = True
    if torch.cuda.is_available():
        return False
    _patch_current_device()
    _patch_rng_tracker()
    _patch_causal_masks()
    _patch_optimizer()
    _patch_checkpoint_staging()
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


# 6. megatron's optimizer on the CPU ------------------------------------------------------------------------------
def _on_cpu(device: Any) -> Any:
    """`device` with CUDA replaced by the CPU ('cuda', 'cuda:0', torch.device('cuda', 0) -> 'cpu')."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaAsCpuTorch(types.ModuleType):
    """The torch module as megatron's optimizer modules see it on the CPU (module doc, point 6a): the tensor
    factories put a `device='cuda'` tensor on the CPU; every other name is torch's own."""

    __study_cpu_shim__ = True

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _factory(name: str) -> Callable[..., torch.Tensor]:
        fn = getattr(torch, name)

        @functools.wraps(fn)
        def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return fn(*args, device=_on_cpu(device), **kwargs)

        return make


for _name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
    setattr(_CudaAsCpuTorch, _name, staticmethod(_CudaAsCpuTorch._factory(_name)))


@contextlib.contextmanager
def _cuda_type_names(tensors: Iterable[torch.Tensor | None]) -> Iterator[None]:
    """While inside, each CPU tensor of `tensors` answers `type()` (no argument) with the CUDA name of its dtype
    ('torch.BFloat16Tensor' -> 'torch.cuda.BFloat16Tensor'), as megatron's optimizer checks (module doc, 6b)."""
    marked = []
    try:
        for t in tensors:
            if t is None or t.device.type != "cpu" or "type" in t.__dict__:
                continue
            name = "torch.cuda." + t.type().removeprefix("torch.")
            t.type = functools.partial(_typed, name, torch.Tensor.type.__get__(t))  # an instance attribute
            marked.append(t)
        yield
    finally:
        for t in marked:
            del t.type


def _typed(name: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return name if not args and not kwargs else original(*args, **kwargs)


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in getattr(optimizer, "param_groups", None) or [] for p in group["params"]]


def _patch_optimizer() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    cpu_torch = _CudaAsCpuTorch()
    for module in (moptimizer, clip_grads):  # 6a: their `device='cuda'` scalars
        _replace(module, module.__name__, "torch", cpu_torch)
    l2 = clip_grads.l2_norm_impl  # megatron.core.utils.local_multi_tensor_l2_norm: its result on 'cuda'
    l2_cpu = types.FunctionType(
        l2.__code__, {**l2.__globals__, "torch": cpu_torch}, l2.__name__, l2.__defaults__, l2.__closure__
    )
    _replace(clip_grads, clip_grads.__name__, "l2_norm_impl", _shim(functools.wraps(l2)(l2_cpu)))

    clip = moptimizer.clip_grad_by_total_norm_fp32  # 6b: asserts param.grad.type() == 'torch.cuda.FloatTensor'

    @_shim
    @functools.wraps(clip)
    def clip_grad_by_total_norm_fp32(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        with _cuda_type_names(p.grad for p in params):
            return clip(params, *args, **kwargs)

    _replace(moptimizer, moptimizer.__name__, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)

    for cls, module in (
        (moptimizer.Float16OptimizerWithFloat16Params, moptimizer),
        (distrib_optimizer.DistributedOptimizer, distrib_optimizer),
    ):
        init = cls.__init__

        @_shim
        @functools.wraps(init)
        def __init__(self: Any, optimizer: Any, *args: Any, __init: Any = init, **kwargs: Any) -> None:
            with _cuda_type_names(_optimizer_params(optimizer)):  # the parameters it sorts by type()
                __init(self, optimizer, *args, **kwargs)

        _replace(cls, f"{module.__name__}.{cls.__name__}", "__init__", __init__)


# 7. dist_checkpointing's staging to host memory ---------------------------------------------------------------------
def _patch_checkpoint_staging() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors  # a staticmethod: the plain function

    @_shim
    @functools.wraps(preload)
    def preload_tensors(write_buckets: Any, non_blocking: bool = True) -> Any:
        return preload(write_buckets, False)  # blocking copies: no torch.cuda.synchronize()

    owner = f"{FileSystemWriterAsync.__module__}.FileSystemWriterAsync"
    ORIGINALS.setdefault((owner, "preload_tensors"), FileSystemWriterAsync.__dict__["preload_tensors"])  # static
    _replace(FileSystemWriterAsync, owner, "preload_tensors", staticmethod(preload_tensors))


# 5. Sequence parallelism in megatron's torch norm (every device) -----------------------------------------------------
def apply_parallel() -> None:
    """The patches every device needs without TransformerEngine (module doc, points 4, 5, 8); idempotent."""
    global _PARALLEL_APPLIED
    if _PARALLEL_APPLIED:
        return
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    @_shim
    def __new__(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,  # type: ignore[no-untyped-def]
        normalization="LayerNorm",
    ):
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
    _patch_te_general_gemm()
    _patch_torch_adam_step()
    _PARALLEL_APPLIED = True


# 8. Loading the distributed optimizer's states into torch's Adam (no TransformerEngine, no apex) ----------------------
def _patch_torch_adam_step() -> None:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @_shim
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        current = self._get_main_param_and_optimizer_states(model_param)  # the same tensors: copying is a no-op
        original(self, model_param, {**current, **tensors})

    _replace(
        cls,
        f"{cls.__module__}.DistributedOptimizer",
        "_set_main_param_and_optimizer_states",
        _set_main_param_and_optimizer_states,
    )

    load_state_dict = cls.load_state_dict

    @_shim
    @functools.wraps(load_state_dict)
    def load_state_dict_own_steps(self: Any, state_dict: Any) -> None:
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():  # one step tensor per weight, as torch's Adam keeps them
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    _replace(cls, f"{cls.__module__}.DistributedOptimizer", "load_state_dict", load_state_dict_own_steps)


def mark_sequence_parallel(module: torch.nn.Module, on: bool) -> None:
    """Mark `module`'s parameters as megatron marks a sequence-parallel norm's (their gradients are summed over the
    tensor-parallel ranks by `finalize_model_grads`)."""
    for p in module.parameters():
        p.sequence_parallel = on
