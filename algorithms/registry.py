"""The strict algorithm registry: a decorator into a dict.

Every variant is a named, complete `Algorithm` (loss, advantage estimator, routing mode, defaults). The loss is a pure
tensor function whose keyword-only parameters *are* the hyper-parameters: their defaults are `alg.hparams`, their
`Annotated[..., Range(...)]` bounds are checked by `alg.check_hparams` before any compute is spent.
"""

from __future__ import annotations

import inspect
import math
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from algorithms.common import group_normalized_advantages

if TYPE_CHECKING:  # the registry's metadata (names, routing, hyper-parameters) is read without loading torch
    import torch

Routing = Literal["free", "replay", "rollout_replay"]
RatioLevel = Literal["token", "sequence"]
ROUTING_MODES: tuple[str, ...] = typing.get_args(Routing)
RATIO_LEVELS: tuple[str, ...] = typing.get_args(RatioLevel)

# Legend colours by registration index (colour-blind-safe Okabe-Ito first, then tab10 tones).
PALETTE = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#F0E442",
    "#000000",
    "#8C564B",
    "#7F7F7F",
    "#BCBD22",
    "#17BECF",
    "#9467BD",
    "#2CA02C",
    "#D62728",
    "#1F77B4",
)

# Keyword arguments of a loss that are inputs, not hyper-parameters.
LOSS_INPUTS = frozenset({"rollout_logp"})


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


LossFn = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
AdvantageFn = Callable[["torch.Tensor", int], "torch.Tensor"]


@dataclass(frozen=True)
class Algorithm:
    """One registered variant. Call `loss` and `advantages`; read the rest."""

    name: str
    label: str
    loss_fn: LossFn
    advantages_fn: AdvantageFn
    routing: Routing
    ratio_level: RatioLevel
    color: str
    dynamic_sampling: bool = False  # drop zero-variance groups and refill (DAPO)
    reward_shaping: Callable[..., torch.Tensor] | None = None  # (rewards, lengths, max_len) -> rewards
    doc: str = ""
    module: str = ""
    hparams: Mapping[str, Any] = field(default_factory=dict)
    ranges: Mapping[str, Range] = field(default_factory=dict)

    @property
    def needs_rollout_logp(self) -> bool:
        """True when the loss corrects for training-inference mismatch and needs the engine's log-probs."""
        return bool(getattr(self.loss_fn, "needs_rollout_logp", False))

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

    def check_hparams(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Validated `hparams` with `overrides` applied; errors name the field, the value and the valid choices."""
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

    def with_hparams(self, **overrides: Any) -> Algorithm:
        """A copy with validated new defaults (same name: a tuned instance of the same variant)."""
        merged = self.check_hparams(overrides)
        return replace(self, hparams=MappingProxyType(merged))


def hparam_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """A loss's hyper-parameters (its keyword-only parameters but the inputs), each annotation evaluated in the
    loss's own module. Only these are evaluated: the tensor annotations stay strings, so reading a loss's
    hyper-parameters never imports torch."""
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in LOSS_INPUTS:
            continue
        if isinstance(p.annotation, str):  # postponed (`from __future__ import annotations`): as get_type_hints does
            p = p.replace(annotation=eval(p.annotation, getattr(inspect.unwrap(fn), "__globals__", {})))
        params.append(p)
    return params


def loss_hparams(fn: Callable[..., Any]) -> tuple[dict[str, Any], dict[str, Range]]:
    """Defaults and ranges of a loss's keyword-only parameters (its hyper-parameters)."""
    defaults: dict[str, Any] = {}
    ranges: dict[str, Range] = {}
    for p in hparam_parameters(fn):
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: hyper-parameter '{p.name}' needs a default")
        defaults[p.name] = p.default
        for meta in getattr(p.annotation, "__metadata__", ()):
            if isinstance(meta, Range):
                ranges[p.name] = meta
    return defaults, ranges


_REGISTRY: dict[str, Algorithm] = {}


class UnknownAlgorithmError(LookupError):
    """An algorithm name that is not registered."""


def register(
    name: str,
    *,
    label: str,
    routing: Routing = "free",
    ratio_level: RatioLevel = "token",
    advantages: AdvantageFn = group_normalized_advantages,
    dynamic_sampling: bool = False,
    reward_shaping: Callable[..., torch.Tensor] | None = None,
    color: str | None = None,
    doc: str | None = None,
) -> Callable[[LossFn], LossFn]:
    """Register `loss_fn` as the variant `name`. Use as a decorator, or call on an existing loss."""
    if not name.isidentifier() or name != name.lower():
        raise ValueError(f"algorithm name {name!r} must be a lower-case identifier")
    if routing not in ROUTING_MODES:
        raise ValueError(f"{name}: routing={routing!r}; valid: {', '.join(ROUTING_MODES)}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"{name}: ratio_level={ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")

    caller = sys._getframe(1).f_globals  # the variant's own module: its docstring is the variant's doc
    module = caller.get("__name__", "?")

    def decorator(loss_fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"algorithm '{name}' is already registered (by {_REGISTRY[name].module})")
        if getattr(loss_fn, "correction_level", None) == "token" and ratio_level == "sequence":
            raise ValueError(
                f"{name}: a token-level correction cannot wrap a sequence-level ratio; use with_mis, or a "
                "token-level loss such as gspo_token"
            )
        defaults, ranges = loss_hparams(loss_fn)
        _REGISTRY[name] = Algorithm(
            name=name,
            label=label,
            loss_fn=loss_fn,
            advantages_fn=advantages,
            routing=routing,
            ratio_level=ratio_level,
            color=color or PALETTE[len(_REGISTRY) % len(PALETTE)],
            dynamic_sampling=dynamic_sampling,
            reward_shaping=reward_shaping,
            doc=(doc if doc is not None else caller.get("__doc__") or "").strip(),
            module=module,
            hparams=MappingProxyType(defaults),
            ranges=MappingProxyType(ranges),
        )
        return loss_fn

    return decorator


def get(name: str) -> Algorithm:
    """The registered algorithm `name`; an unknown name raises listing the valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; valid names: {', '.join(_REGISTRY)}") from None


def names() -> list[str]:
    """Registered names, in registration order."""
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
