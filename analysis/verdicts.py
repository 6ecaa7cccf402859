"""A scorecard verdict and the evidence line it is decided on.

Every verdict is one of "supported", "contradicted" or "inconclusive" (at this scale); a stratum in which some
compared group has no usable run has "no data" instead, and is not counted when strata are combined.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "contradicted", "inconclusive"
NO_DATA = "no data"
"""A stratum in which some compared group has no usable run (not counted in the combined verdict)."""


@dataclass(frozen=True)
class Evidence:
    """One number behind a verdict: estimate, bootstrap interval over seeds, sample sizes."""

    name: str
    estimate: float
    low: float
    high: float
    n: str
    """Sample sizes, e.g. "3 vs 3" (runs of each group)."""
    stratum: str = ""
    """The stratum this number is computed in ("max_new_tokens=256, rollout_dtype=bf16"); "" = the whole study."""
    verdict: str = ""
    """The stratum's verdict, on the first evidence line of each stratum of a stratified claim."""

    def __str__(self) -> str:
        head = f"[{self.stratum}] " if self.stratum else ""
        if self.verdict == NO_DATA:
            return f"{head}{NO_DATA}: {self.name}"
        tail = f" -> {self.verdict}" if self.verdict else ""
        return f"{head}{self.name} = {self.estimate:.4g} [{self.low:.4g}, {self.high:.4g}] (n={self.n}){tail}"


__all__ = ["CONTRADICTED", "INCONCLUSIVE", "NO_DATA", "SUPPORTED", "Evidence"]
