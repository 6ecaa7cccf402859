"""The algorithms a study ran, as the registry names them: labels, colours, order (the legend, bar and table order
everywhere), and the registry itself for routing modes and Routing Replay partners. The registry is imported on first
use (a variant file may import torch)."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType


def registry() -> ModuleType:
    """The algorithm registry (the `algorithms` package), imported on first use because it imports torch: colours,
    labels and order here, routing modes and Routing Replay partners (`replay_partner`, `routing_variants`) for the
    figures and the scorecard."""
    import algorithms

    return algorithms


def color(name: str) -> str:
    """The registry colour of algorithm `name` (unknown names raise, listing the valid ones)."""
    return registry().get(name).color


def label(name: str) -> str:
    """The registry label of algorithm `name`."""
    return registry().get(name).label


def order(names: Iterable[str]) -> list[str]:
    """`names` in registry order (the legend and bar order of every figure)."""
    reg = {n: i for i, n in enumerate(registry().names())}
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in reg]
    if unknown:
        registry().get(unknown[0])  # raises with the valid names
    return sorted(names, key=reg.__getitem__)


def label_or_name(name: str) -> str:
    """The registry label of `name`, or `name` itself for an algorithm the registry does not know."""
    try:
        return label(name)
    except LookupError:  # algorithms.UnknownAlgorithmError
        return name


def order_or_sorted(names: Iterable[str]) -> list[str]:
    """`names` in registry order, then the names the registry does not know, sorted."""
    known = set(registry().names())
    names = list(dict.fromkeys(names))
    return order(n for n in names if n in known) + sorted(n for n in names if n not in known)
