"""The one sort order of values a reader scans: numbers by value (256 before 1024, 30 before 100), then text
alphabetically. Axis values, strata and configurations are listed in it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def natural_key(value: Any) -> tuple[int, float, str]:
    """The sort key of one value: (0, number, "") for anything `float()` reads, else (1, 0, its text)."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def natural_keys(values: Iterable[Any]) -> tuple[tuple[int, float, str], ...]:
    """The sort key of a combination of values (a tuple of axis values), element by element."""
    return tuple(natural_key(v) for v in values)


def natural_sorted(values: Iterable[Any]) -> list[Any]:
    """`values` in natural order."""
    return sorted(values, key=natural_key)


__all__ = ["natural_key", "natural_keys", "natural_sorted"]
