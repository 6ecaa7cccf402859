"""A scorecard verdict: the three verdicts, the evidence line, the decision rule that reads a verdict off an interval.

Every verdict is one of "supported", "contradicted" or "inconclusive" (at this scale), or "not tested in regime" for a
claim whose precondition the compared runs did not reach (analysis.stats.regime); a stratum in which some compared group
has no usable run has "no data" instead. Neither "no data" nor "not tested in regime" counts when strata are
combined.

A claim's comparison is decided by a `Decision` on the 95% interval of its quantity: two `Bound`s, one that supports
the claim and one that contradicts it. The same object decides and, as `str(decision)`, writes the sentence the
claim's rule quotes, so the rule the report prints is the rule the code applies. A claim made of several parts (or
strata) combines their verdicts with `conjunction` (contradicted if any part is, supported if every part is).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "contradicted", "inconclusive"
NO_DATA = "no data"
"""A stratum in which some compared group has no usable run (not counted in the combined verdict)."""
NOT_IN_REGIME = "not tested in regime"
"""A claim (or stratum) whose compared runs did not reach the claim's precondition (analysis.stats.regime): whatever its
interval says, it is not evidence for or against the claim (not counted in the combined verdict)."""
VERDICTS = (SUPPORTED, CONTRADICTED, INCONCLUSIVE, NOT_IN_REGIME, NO_DATA)
"""Every verdict, in the order counts of them are written."""


def css_class(verdict: str) -> str:
    """The verdict as an HTML class name ("not tested in regime" -> "not-tested-in-regime")."""
    return verdict.replace(" ", "-")


@dataclass(frozen=True)
class Evidence:
    """One number behind a verdict: estimate, t interval over seeds, sample sizes."""

    name: str
    estimate: float
    low: float
    high: float
    n: str
    """Sample sizes, e.g. "3 vs 3" (runs of each group)."""
    stratum: str = ""
    """The stratum this number is computed in ("max_new_tokens=256, rollout_precision=bf16"); "" = the whole study."""
    verdict: str = ""
    """The stratum's verdict, on the first evidence line of each stratum of a stratified claim."""

    def __str__(self) -> str:
        head = f"[{self.stratum}] " if self.stratum else ""
        if self.verdict == NO_DATA:
            return f"{head}{NO_DATA}: {self.name}"
        tail = f" -> {self.verdict}" if self.verdict else ""
        if np.isnan(self.low) and np.isnan(self.high) and np.isnan(self.estimate):  # no number: the name says why
            return f"{head}{self.name} (n={self.n}){tail}"
        if np.isnan(self.low) and np.isnan(self.high) and np.isfinite(self.estimate):  # a size, not an estimate
            return f"{head}{self.name} = {self.estimate:.4g} (n={self.n}){tail}"
        return f"{head}{self.name} = {self.estimate:.4g} [{self.low:.4g}, {self.high:.4g}] (n={self.n}){tail}"


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


@dataclass(frozen=True)
class Bound:
    """A condition on one end of an interval, e.g. "lower bound > 0"; a bound that is not finite (no interval) never
    satisfies it."""

    side: Literal["lower", "upper"]
    op: Literal[">", ">=", "<", "<="]
    value: float
    note: str = ""
    """What the condition means, printed after it in parentheses."""

    def __post_init__(self) -> None:
        if self.side not in ("lower", "upper") or self.op not in _OPS:
            raise ValueError(f"Bound({self.side!r}, {self.op!r}): side is lower or upper, op one of {', '.join(_OPS)}")

    def holds(self, low: float, high: float) -> bool:
        """Whether the interval [low, high] satisfies the condition."""
        x = low if self.side == "lower" else high
        return bool(np.isfinite(x) and _OPS[self.op](x, self.value))

    def __str__(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.side} bound {self.op} {self.value:g}{note}"


@dataclass(frozen=True)
class Decision:
    """The verdict of a 95% interval: supported when `supported` holds, else contradicted when `contradicted` holds,
    else inconclusive (also when there is no interval)."""

    supported: Bound
    contradicted: Bound

    def __call__(self, low: float, high: float) -> str:
        if self.supported.holds(low, high):
            return SUPPORTED
        if self.contradicted.holds(low, high):
            return CONTRADICTED
        return INCONCLUSIVE

    def __str__(self) -> str:
        return f"95% CI {self.supported} -> supported; {self.contradicted} -> contradicted; else inconclusive"


CONJUNCTION_RULE = "contradicted if any part is contradicted, supported if every part is supported, else inconclusive"
"""How `conjunction` combines the verdicts of a claim's parts."""


def conjunction(verdicts: Sequence[str]) -> str:
    """CONJUNCTION_RULE; no verdict at all is inconclusive."""
    if CONTRADICTED in verdicts:
        return CONTRADICTED
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    return INCONCLUSIVE


__all__ = [
    "CONJUNCTION_RULE",
    "CONTRADICTED",
    "INCONCLUSIVE",
    "NOT_IN_REGIME",
    "NO_DATA",
    "SUPPORTED",
    "VERDICTS",
    "Bound",
    "Decision",
    "Evidence",
    "conjunction",
    "css_class",
]
