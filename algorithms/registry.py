"""The strict algorithm registry: a decorator into a dict.

Every variant is a named, complete `Algorithm` (loss, advantage estimator, routing mode, defaults). The loss is a pure
tensor function whose keyword-only parameters *are* the hyper-parameters: their defaults are `alg.hparams`, their
`Annotated[..., Range(...)]` bounds are checked by `alg.check_hparams` before any compute is spent. Its ratio level
is the loss's own (`ratio_level`), so every registration of a loss, or of a correction wrapping it, has it.

The variants are the modules of this package (each registers on import): the first `get` or `names` imports them all.
The registry's order (the legend order of every figure) is that of the files that register, by name, then of the
registrations within a file; variants registered elsewhere (a test's) follow.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from algorithms.common import group_normalized_advantages

if TYPE_CHECKING:  # the registry's metadata (names, routing, hyper-parameters) is read without loading torch
    import torch

Routing = Literal["free", "replay", "rollout_replay"]
RatioLevel = Literal["token", "sequence"]
ROUTING_MODES: tuple[str, ...] = typing.get_args(Routing)
RATIO_LEVELS: tuple[str, ...] = typing.get_args(RatioLevel)
EXTRA_COLORS = ("#AA4499", "#117733", "#88CCEE", "#CC6677", "#8C564B", "#9467BD", "#BCBD22", "#D62728")
"""Legend colours of variants registered without one: the first that no registered variant has (the built-in variants
name theirs)."""
LOSS_INPUTS = frozenset({"rollout_logp"})
"""Keyword arguments of a loss that are inputs, not hyper-parameters."""
PACKAGE = Path(__file__).resolve().parent
"""The folder of the variants: every module in it not starting with "_" and not in LIBRARY registers some."""
LIBRARY = frozenset({"catalog", "common", "corrections", "registry"})

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
AdvantageFn = Callable[["torch.Tensor", int], "torch.Tensor"]
T = TypeVar("T")


class UnknownAlgorithmError(LookupError):
    """An algorithm name that is not registered."""


@dataclass(frozen=True)
class Range:
    """Valid interval of a hyper-parameter, used as `Annotated[float, Range(ge=0.0)]`."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def check(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        lo = f"[{self.ge}" if self.ge is not None else (f"({self.gt}" if self.gt is not None else "(-inf")
        hi = f"{self.le}]" if self.le is not None else (f"{self.lt})" if self.lt is not None else "inf)")
        return f"{lo}, {hi}"


def ratio_level(level: RatioLevel) -> Callable[[LossFn], LossFn]:
    """Declare, where a loss is defined, the level of its importance ratio: `@ratio_level("sequence")` under the
    `register` line. A loss without the declaration is token-level."""
    if level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level = {level!r}; valid: {', '.join(RATIO_LEVELS)}")

    def mark(loss_fn: LossFn) -> LossFn:
        loss_fn.ratio_level = level  # type: ignore[attr-defined]
        return loss_fn

    return mark


def hparam_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """A loss's hyper-parameters: its keyword-only parameters but the inputs. A postponed annotation (a string, under
    `from __future__ import annotations`) is evaluated in the loss's module, as `typing.get_type_hints` would, but
    only these: the tensor annotations stay strings, so reading a loss's hyper-parameters never imports torch."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    module = getattr(inspect.unwrap(fn), "__globals__", {})
    return [
        p.replace(annotation=eval(p.annotation, module)) if isinstance(p.annotation, str) else p
        for p in params
        if p.name not in LOSS_INPUTS
    ]


@dataclass(frozen=True)
class Spec:
    """What is read of a variant without running it (algorithms.catalog): its name, legend, routing, ratio level and
    hyper-parameters."""

    name: str
    label: str
    routing: Routing
    ratio_level: RatioLevel
    color: str
    needs_rollout_logp: bool  # the loss corrects training-inference mismatch and needs the engine's log-probs
    dynamic_sampling: bool  # drop zero-variance groups and refill (DAPO)
    doc: str  # the docstring of the file that registers it
    module: str  # that file's module
    hparams: Mapping[str, Any]
    ranges: Mapping[str, Range]

    def check_hparams(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """`hparams` with validated `overrides` applied; errors name the field, the value and the valid choices."""
        out = dict(self.hparams)
        for key, value in overrides.items():
            if key not in self.hparams:
                raise ValueError(
                    f"algorithm '{self.name}' has no hyper-parameter '{key}'; valid: {', '.join(self.hparams)}"
                )
            default = self.hparams[key]
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"{self.name}.{key} = {value!r}: must be a finite number")
                bounds = self.ranges.get(key)
                if bounds is not None and not bounds.check(value):
                    raise ValueError(f"{self.name}.{key} = {value!r}: valid range is {bounds}")
            out[key] = value
        return out


@dataclass(frozen=True)
class Algorithm(Spec):
    """One registered variant: its Spec and its functions. Call `loss` and `advantages`; read the rest."""

    loss_fn: LossFn
    advantages_fn: AdvantageFn
    reward_shaping: Callable[..., torch.Tensor] | None  # (rewards, lengths, max_len) -> rewards

    def loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        rollout_logp: torch.Tensor | None = None,
        **hparams: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to minimise, metrics). Hyper-parameters not given take `self.hparams`."""
        unknown = set(hparams) - set(self.hparams)
        if unknown:
            raise TypeError(f"{self.name}: unknown hyper-parameter(s) {sorted(unknown)}; valid: {sorted(self.hparams)}")
        kwargs = {**self.hparams, **hparams}
        if self.needs_rollout_logp:
            if rollout_logp is None:
                raise ValueError(f"{self.name} corrects training-inference mismatch: pass rollout_logp (B, T)")
            kwargs["rollout_logp"] = rollout_logp
        return self.loss_fn(logp, old_logp, advantages, mask, **kwargs)

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """(B,) advantages from (B,) rewards laid out group by group."""
        return self.advantages_fn(rewards, group_size)

    @property
    def spec(self) -> Spec:
        """The variant's metadata, without its functions."""
        return Spec(**{f.name: getattr(self, f.name) for f in fields(Spec)})

    def with_hparams(self, **overrides: Any) -> Algorithm:
        """A copy with validated new defaults (same name: a tuned instance of the same variant)."""
        return replace(self, hparams=MappingProxyType(self.check_hparams(overrides)))


_REGISTRY: dict[str, Algorithm] = {}
_discovered = False  # True once every variant module is imported


def register(
    name: str,
    *,
    label: str,
    routing: Routing = "free",
    advantages: AdvantageFn = group_normalized_advantages,
    dynamic_sampling: bool = False,
    reward_shaping: Callable[..., torch.Tensor] | None = None,
    color: str | None = None,
    doc: str | None = None,
) -> Callable[[LossFn], LossFn]:
    """Register `loss_fn` as the variant `name`. Use as a decorator, or call on an existing loss. The variant's ratio
    level is the loss's (`ratio_level`); its doc, unless given, the docstring of the file that calls `register`."""
    if not name.isidentifier() or name != name.lower():
        raise ValueError(f"algorithm name {name!r} must be a lower-case identifier")
    if routing not in ROUTING_MODES:
        raise ValueError(f"{name}: routing={routing!r}; valid: {', '.join(ROUTING_MODES)}")
    caller = inspect.currentframe().f_back.f_globals  # type: ignore[union-attr]  # the file that registers

    def decorator(loss_fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"algorithm '{name}' is already registered (by {_REGISTRY[name].module})")
        params = hparam_parameters(loss_fn)
        missing = [p.name for p in params if p.default is p.empty]
        if missing:
            raise TypeError(f"{getattr(loss_fn, '__name__', loss_fn)}: hyper-parameter '{missing[0]}' needs a default")
        ranges = {p.name: m for p in params for m in getattr(p.annotation, "__metadata__", ()) if isinstance(m, Range)}
        taken = {alg.color for alg in _REGISTRY.values()}
        _REGISTRY[name] = Algorithm(
            name=name,
            label=label,
            routing=routing,
            ratio_level=getattr(loss_fn, "ratio_level", "token"),
            color=color or next((c for c in EXTRA_COLORS if c not in taken), EXTRA_COLORS[-1]),
            needs_rollout_logp=bool(getattr(loss_fn, "needs_rollout_logp", False)),
            dynamic_sampling=dynamic_sampling,
            doc=(doc or caller.get("__doc__") or "").strip(),
            module=caller.get("__name__", "?"),
            hparams=MappingProxyType({p.name: p.default for p in params}),
            ranges=MappingProxyType(ranges),
            loss_fn=loss_fn,
            advantages_fn=advantages,
            reward_shaping=reward_shaping,
        )
        return loss_fn

    return decorator


def discover() -> None:
    """Import every variant module, once, in the order of their names, and order the registry by them."""
    global _discovered
    if _discovered:
        return
    modules = sorted(
        m.name for m in pkgutil.iter_modules([str(PACKAGE)]) if not m.name.startswith("_") and m.name not in LIBRARY
    )
    place = {f"{__package__}.{short}": index for index, short in enumerate(modules)}
    for module in place:
        importlib.import_module(module)
    ordered = sorted(_REGISTRY.values(), key=lambda alg: place.get(alg.module, len(place)))  # stable: then in turn
    _REGISTRY.clear()
    _REGISTRY.update((alg.name, alg) for alg in ordered)
    _discovered = True


def lookup(table: Mapping[str, T], name: str) -> T:
    """`table[name]`; an unknown name raises listing the valid ones."""
    if name not in table:
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; valid names: {', '.join(table)}")
    return table[name]


def get(name: str) -> Algorithm:
    """The registered algorithm `name`; an unknown name raises listing the valid ones."""
    discover()
    return lookup(_REGISTRY, name)


def names() -> list[str]:
    """Registered names, in the registry's order."""
    discover()
    return list(_REGISTRY)


def routing_variants(name: str) -> list[str]:
    """`name` and every registered variant with the same loss function, in registration order: the same algorithm
    under each routing mode it is registered with (e.g. grpo, grpo_rr, grpo_r3), its Routing Replay ablations."""
    loss_fn = get(name).loss_fn
    return [n for n, alg in _REGISTRY.items() if alg.loss_fn is loss_fn]


def replay_partner(name: str) -> str | None:
    """The Routing Replay variant of `name`: the first registered algorithm other than `name` with the same loss
    function and routing "replay" (grpo -> grpo_rr, gspo -> gspo_rr); None when there is none."""
    return next((n for n in routing_variants(name) if n != name and _REGISTRY[n].routing == "replay"), None)


def unregister(name: str) -> None:
    """Remove `name` (tests that register throw-away variants clean up with this)."""
    _REGISTRY.pop(name, None)
