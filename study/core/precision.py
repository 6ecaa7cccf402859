"""Precision as a study axis: each engine in fp32, bf16, fp16 or bf16 with an fp32 LM head, `real` or `emulated`.

Why an emulated mode. The GSPO paper's section 5.4 (claim C5) is about the training and rollout engines computing
slightly different log-probs in low precision. Real low-precision compute is what a GPU does; on a CPU it can be
fast (bf16 with AVX-512 BF16) or impractically slow (fp16: no native GEMM kernels, ~0.5 GFLOP/s), depending on the
ISA. `emulated` computes in fp32 and rounds to the target dtype at the points where a GPU rounds:

1. Parameters are stored rounded (fp32 tensors holding bf16/fp16 values), and training is mixed precision as in the
   real mode and megatron's: the optimizer steps fp32 master copies and writes each update back rounded
   (study/policy/optim.py `MasterWeightAdamW`, which reads the mark `apply_precision` leaves on each rounded
   parameter). `PrecisionHandle.round_parameters_` rounds the stored parameters after a load (and is a no-op after
   a step, whose write-back is rounded already).
2. The inputs and outputs of every matmul-family op (F.linear, matmul/@, mm, bmm, baddbmm, addmm, einsum, and
   scaled_dot_product_attention's q/k/v and output) are rounded: tensor cores read low-precision operands, accumulate
   in fp32 and round the output. Rounding an op's inputs catches the elementwise results in between (SwiGLU's
   silu(g) * u, RoPE outputs) that a real low-precision run stores rounded. This includes megatron's attention
   scores (its local attention is an unfused baddbmm) and the LM head's logits.
3. The inputs and outputs of every norm and the outputs of every other submodule (attention, MoE layer, decoder
   layer, softmax, experts, HF rotary cos/sin) are rounded: residual adds and norms write the target dtype.
4. Islands that the real configuration computes in fp32 are left alone (no rounding inside or of their outputs):
   megatron's router (`moe_router_dtype="fp32"`) and rotary angles, and the LM head of `bf16_fp32head` (its weight
   stays fp32 too). Log-probs are fp32 in both modes (megatron's cross entropy and the engines upcast the logits).
5. Backward: parameter gradients are rounded (tensor hooks); activation gradients are rounded wherever the forward
   rounding is an autograd-visible cast (module boundaries, matmuls outside custom autograd Functions), not inside
   megatron's linear Function. fp16 (real or emulated) trains with `study.policy.optim.DynamicLossScaler`.

Not modelled: the accumulation order of a particular kernel (sums of k > 2 terms in the target dtype are rounded
once here, not per add), and kernels that keep scores in fp32 differ from
megatron's unfused attention in the real modes too. tests/study/core/test_precision.py and benchmarks/bench_precision.py
measure how close emulated log-probs are to real CPU low-precision ones.

Spelling: a `Precision(name, mode)`, or the string `name` (real) / `name-emulated` / `name-real`, or a mapping
`{"name": ..., "mode": ...}`; `Precision.label` is the canonical string (`"bf16-emulated"`, `"fp16"`) that the run
config (one field per engine: `train_precision`, `rollout_precision`), the manifest and the figures carry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a tensor is computed: a run's config reads the spellings without loading torch
    import torch

PRECISION_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16_fp32head")
"""Numeric formats of one engine: parameters and compute in fp32, bf16, fp16, or bf16 with an fp32 LM head."""
MODES: tuple[str, ...] = ("real", "emulated")
"""real: the engine computes in the dtype; emulated: fp32 compute rounded where a GPU rounds (module docstring)."""
ROUND_ATTR = "study_round_to"
"""The attribute of an fp32 parameter whose stored values are rounded to this dtype (emulated mode): the optimizer
writes its updates back rounded (study/policy/optim.py)."""
PRECISIONS: tuple[str, ...] = PRECISION_NAMES + tuple(f"{n}-emulated" for n in PRECISION_NAMES)
"""Canonical labels (`Precision.label`): the valid values of RunConfig.train_precision / rollout_precision."""


@dataclass(frozen=True)
class Precision:
    """One engine's precision: a format name (PRECISION_NAMES) and a mode (MODES)."""

    name: str = "fp32"
    """fp32, bf16, fp16 or bf16_fp32head."""
    mode: str = "real"
    """real or emulated."""

    def __post_init__(self) -> None:
        if self.name not in PRECISION_NAMES:
            raise ValueError(f"precision name = {self.name!r}; valid: {', '.join(PRECISION_NAMES)}")
        if self.mode not in MODES:
            raise ValueError(f"precision mode = {self.mode!r}; valid: {', '.join(MODES)}")

    @classmethod
    def parse(cls, spec: str | Mapping[str, str] | Precision, *, field: str = "precision") -> Precision:
        """`"bf16"`, `"bf16-emulated"`, `"bf16-real"`, `{"name": "bf16", "mode": "emulated"}` or a Precision."""
        if isinstance(spec, Precision):
            return spec
        try:
            if isinstance(spec, Mapping):
                unknown = set(spec) - {"name", "mode"}
                if unknown:
                    raise ValueError(f"unknown key(s) {sorted(unknown)}; valid: name, mode")
                return cls(str(spec.get("name", "fp32")), str(spec.get("mode", "real")))
            if not isinstance(spec, str):
                raise ValueError("must be a string or a {name, mode} mapping")
            name, _, mode = spec.partition("-")
            return cls(name, mode or "real")
        except ValueError as err:
            raise ValueError(f"{field} = {spec!r}: {err}; valid: {', '.join(PRECISIONS)}") from None

    @property
    def label(self) -> str:
        """Canonical string: the name, suffixed `-emulated` in emulated mode."""
        return self.name if self.mode == "real" else f"{self.name}-{self.mode}"

    @property
    def emulated(self) -> bool:
        return self.mode == "emulated"

    @property
    def fp32_head(self) -> bool:
        """Whether the LM head (weight and logits) stays fp32."""
        return self.name == "bf16_fp32head"

    @property
    def dtype(self) -> str:
        """The format the engine's bulk computes in (study.core.model_config.DTYPES): bf16 for bf16_fp32head."""
        return "bf16" if self.fp32_head else self.name

    @property
    def torch_dtype(self) -> torch.dtype:
        from study.core.model_config import TORCH_DTYPES

        return TORCH_DTYPES[self.dtype]

    @property
    def storage_dtype(self) -> str:
        """The dtype to build the model in: fp32 when emulated, else `dtype`."""
        return "fp32" if self.emulated else self.dtype

    @property
    def plain(self) -> bool:
        """Expressible by a dtype alone (real, no fp32 head): what engines without hooks support."""
        return not self.emulated and not self.fp32_head

    def __str__(self) -> str:
        return self.label


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `t` rounded to `dtype` (round-to-nearest-even, fp16 overflow -> inf) and back to fp32; differentiable
    (the gradient is rounded the same way). Anything else (integers, bool, other dtypes) is returned unchanged."""
    import torch

    if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and dtype != torch.float32:
        return t.to(dtype).to(torch.float32)
    return t


def _round_tree(obj: Any, dtype: torch.dtype) -> Any:
    """round_to over tensors, tuples and lists (module outputs such as megatron's (output, bias))."""
    import torch

    if isinstance(obj, torch.Tensor):
        return round_to(obj, dtype)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_round_tree(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_round_tree(o, dtype) for o in obj]
    return obj


@functools.cache
def _matmuls() -> dict[Callable[..., Any], tuple[int, ...] | None]:
    """Matmul-family ops -> positions of the operands to round (None: every tensor argument)."""
    import torch
    import torch.nn.functional as F

    return {
        F.linear: (0, 1),
        torch.matmul: (0, 1),
        torch.Tensor.matmul: (0, 1),
        torch.Tensor.__matmul__: (0, 1),
        torch.Tensor.__rmatmul__: (0, 1),
        torch.mm: (0, 1),
        torch.Tensor.mm: (0, 1),
        torch.bmm: (0, 1),
        torch.Tensor.bmm: (0, 1),
        torch.baddbmm: (1, 2),  # (input, batch1, batch2): input is beta-scaled and often an empty buffer
        torch.Tensor.baddbmm: (1, 2),
        torch.addmm: (1, 2),
        torch.Tensor.addmm: (1, 2),
        torch.einsum: None,
        F.scaled_dot_product_attention: (0, 1, 2),  # q, k, v; never the (additive, -inf) mask
    }


# Modules whose ops a real run computes in the target dtype one by one (RoPE, SwiGLU, activations): inside them every
# op's output is rounded, not only the matmuls'. Megatron's attention softmax upcasts to fp32 (fp32 inside, output
# rounded); norms upcast internally (one fused op on CPU).
_ELEMENTWISE: frozenset[str] = frozenset({"SelfAttention", "MLP", "Qwen3MoeAttention", "Qwen3MoeExperts"})
_FP32_INSIDE: frozenset[str] = frozenset({"FusedScaleMaskSoftmax"})


@functools.cache
def _rounding_mode_type() -> type:
    """The torch function mode of the emulated precision, made on first use: a run's config reads this module's
    spellings (Precision, PRECISIONS) without loading torch."""
    import torch
    from torch.overrides import TorchFunctionMode

    matmuls = _matmuls()

    class _RoundingMode(TorchFunctionMode):
        """Rounds the operands and outputs of matmul-family ops to `dtype`, unless suspended (inside an fp32 island)."""

        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.dtype = dtype
            self.suspended = 0
            self.elementwise = 0
            """> 0 inside modules whose every op a real run computes in the target dtype: round every op's output."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            where = matmuls.get(func, ())
            if self.suspended:
                return func(*args, **kwargs)
            if where == ():
                out = func(*args, **kwargs)
                return _round_tree(out, self.dtype) if self.elementwise and isinstance(out, torch.Tensor) else out
            args = tuple(_round_tree(a, self.dtype) if where is None or i in where else a for i, a in enumerate(args))
            return _round_tree(func(*args, **kwargs), self.dtype)

    return _RoundingMode


class PrecisionHandle:
    """What `apply_precision` installed on a model: hooks to remove, parameters to re-round after each update."""

    def __init__(self, model: torch.nn.Module, precision: Precision) -> None:
        self.model = model
        self.precision = precision
        self.handles: list[Any] = []
        self.rounded: list[torch.nn.Parameter] = []
        """Parameters stored rounded (emulated mode): every one except an fp32 head's."""

    def round_parameters_(self) -> None:
        """Re-round the stored parameters to the target dtype (emulated mode; call after each optimizer step and
        after loading weights). A no-op in real mode."""
        import torch

        with torch.no_grad():
            for p in self.rounded:
                p.copy_(round_to(p, self.precision.torch_dtype))

    def remove(self) -> None:
        """Remove every hook and rounding mark (parameters keep their values and dtypes)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p in self.rounded:
            p.__dict__.pop(ROUND_ATTR, None)


def _model_kind(model: torch.nn.Module) -> str:
    return "megatron" if any(c.__name__ == "GPTModel" for c in type(model).__mro__) else "hf"


def _head(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(name, module) of the LM head: megatron's output_layer or transformers' lm_head."""
    import torch

    for name in ("output_layer", "lm_head"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name, getattr(model, name)
    raise ValueError(f"{type(model).__name__}: no output_layer / lm_head")


def _islands(model: torch.nn.Module, precision: Precision) -> dict[str, torch.nn.Module]:
    """Submodules the real configuration computes in fp32 (module docstring, point 4), by qualified name."""
    out: dict[str, torch.nn.Module] = {}
    if _model_kind(model) == "megatron":
        for name, mod in model.named_modules():
            if name.endswith(".mlp.router") or type(mod).__name__ == "RotaryEmbedding":
                out[name] = mod
    if precision.fp32_head:
        name, head = _head(model)
        out[name] = head
    return out


def apply_precision(model: torch.nn.Module, precision: str | Mapping[str, str] | Precision) -> PrecisionHandle:
    """Make `model` (a megatron GPTModel from study.policy.model.build_policy, or a transformers Qwen3-MoE) compute in
    `precision`. The model must have been built in `precision.storage_dtype`; call before building the optimizer.

    real + plain dtype: nothing to do. real bf16_fp32head: the LM head is cast to fp32 and its input upcast.
    emulated: parameters rounded in place, rounding hooks installed (module docstring). Returns the handle.
    """
    from study.core.model_config import TORCH_DTYPES

    precision = Precision.parse(precision)
    handle = PrecisionHandle(model, precision)
    want = TORCH_DTYPES[precision.storage_dtype]
    bulk = [p.dtype for n, p in model.named_parameters() if not n.startswith(("output_layer", "lm_head"))]
    if any(d != want for d in bulk):
        raise ValueError(f"precision {precision.label}: build the model in {precision.storage_dtype}, got {set(bulk)}")
    if precision.fp32_head:
        _, head = _head(model)
        head.float()
        # The head reads the bf16 (or rounded) final hidden state, upcast; weight and logits stay fp32.
        handle.handles.append(head.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:])))
    if not precision.emulated:
        return handle

    dtype = precision.torch_dtype
    islands = _islands(model, precision)
    # Only an fp32 head's weight stays fp32 (megatron's router weight is stored in bf16, params_dtype; computed in fp32)
    island_params = {id(p) for p in _head(model)[1].parameters()} if precision.fp32_head else set()
    handle.rounded = [p for p in model.parameters() if id(p) not in island_params]
    handle.round_parameters_()
    for p in handle.rounded:  # the optimizer writes its fp32 master weights back rounded (study/policy/optim.py)
        setattr(p, ROUND_ATTR, dtype)
    for p in handle.rounded:
        if p.requires_grad:
            handle.handles.append(p.register_hook(lambda g: round_to(g, dtype)))

    mode = _rounding_mode_type()(dtype)

    def enter(_m: torch.nn.Module, _args: Any) -> None:
        mode.__enter__()

    def leave(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
        mode.__exit__(None, None, None)

    def suspend(_m: torch.nn.Module, _args: Any) -> None:
        mode.suspended += 1

    def resume(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
        mode.suspended -= 1

    def fine(_m: torch.nn.Module, _args: Any) -> None:
        mode.elementwise += 1

    def coarse(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
        mode.elementwise -= 1

    def round_inputs(_m: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return None if mode.suspended else _round_tree(args, dtype)

    def round_outputs(_m: torch.nn.Module, _args: Any, out: Any) -> Any:
        return None if mode.suspended else _round_tree(out, dtype)

    handle.handles.append(model.register_forward_pre_hook(enter))
    handle.handles.append(model.register_forward_hook(leave, always_call=True))
    island_members = {id(m) for mod in islands.values() for m in mod.modules()}
    for mod in model.modules():
        if mod is model:
            continue  # the root returns fp32 log-probs / loss or the head's (already rounded) logits
        if id(mod) in island_members:
            if mod in islands.values():
                handle.handles.append(mod.register_forward_pre_hook(suspend))
                handle.handles.append(mod.register_forward_hook(resume, always_call=True))
            continue
        kind = type(mod).__name__
        if kind in _FP32_INSIDE:
            handle.handles.append(mod.register_forward_pre_hook(suspend))
            handle.handles.append(mod.register_forward_hook(resume, always_call=True))
        if "Norm" in kind:
            handle.handles.append(mod.register_forward_pre_hook(round_inputs))
        if kind in _ELEMENTWISE:
            handle.handles.append(mod.register_forward_pre_hook(fine))
            handle.handles.append(mod.register_forward_hook(coarse, always_call=True))
        handle.handles.append(mod.register_forward_hook(round_outputs))
    return handle


def engine_kwargs(precision: Precision) -> dict[str, str]:
    """Extra `get_engine` keyword arguments for `precision`: none for a plain dtype (every engine's API), else
    `precision=<label>` (engines that implement hooks: hf)."""
    return {} if precision.plain else {"precision": precision.label}


def adam_eps(precision: Precision) -> float | None:
    """AdamW eps for the trainer: 1e-6 for emulated fp16 (what study.policy.optim.build_optimizer picks for real fp16
    parameters), else None (build_optimizer's default)."""
    return 1e-6 if precision.emulated and precision.dtype == "fp16" else None


def labels(train: Precision, rollout: Precision) -> dict[str, Any]:
    """The precision labels of a run (manifest entry): each engine's label and whether any result is emulated."""
    return {
        "train_precision": train.label,
        "rollout_precision": rollout.label,
        "precision_emulated": train.emulated or rollout.emulated,
    }


__all__ = [
    "MODES",
    "PRECISIONS",
    "PRECISION_NAMES",
    "ROUND_ATTR",
    "Precision",
    "PrecisionHandle",
    "adam_eps",
    "apply_precision",
    "engine_kwargs",
    "labels",
    "round_to",
]
