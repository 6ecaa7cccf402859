"""A claim's regime: the measured quantity of the compared runs without which the claim is not put to the test.

The paper's claims about routing and precision describe what happens once something has moved: GRPO without Routing
Replay fails on a model whose routing moved about 10% of its expert slots after one update (C3, C4), and GSPO
tolerates the rollout engine's log-probs as pi_old because they differ from the trainer's (C5). A study whose runs
never move that far does not test the claim; a verdict of "contradicted" there would say the paper is wrong about a
regime the study never reached. So each such claim states its precondition as a measured quantity of the runs it
compares, with a threshold (`Rules`, settable), and a stratum below it is "not tested in regime" with the measured
value and the threshold (verdicts.NOT_IN_REGIME), whatever its interval says. Its evidence is still shown: a
collapse rate of 0 below the regime is evidence about this scale, not about the claim.

The quantity of a stratum is the mean over its compared runs of each run's mean over its RL steps (steps >= 1), with
a t interval over runs; a run without a finite value (the metric not logged, or NaN at every step: with one
minibatch per rollout batch no minibatch is off-policy) does not count, and a stratum with none is not tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from analysis import vocab
from analysis.verdicts import Evidence

if TYPE_CHECKING:  # the command line reads the thresholds without loading pandas and scipy
    from analysis.stats import CI
    from analysis.tidy import Study

MIN_VOLATILITY = 0.05
"""C3, C4: the routing volatility the compared runs must reach, as a fraction of expert slots changed since pi_old
(mean over the off-policy minibatches): half of the ~10% the paper's model, the one on which GRPO without Routing
Replay failed, changed in a single update."""
MIN_MISMATCH = 1e-3
"""C5: the engine/trainer mismatch the compared runs must reach, mean |logp_train_old - logp_rollout| per response
token in nats. The same weights in fp32 in both engines measure about 1e-6 (the weight sync's fidelity), bf16 about
1e-2; GSPO clips its length-normalised sequence log-ratio at about 3e-4, so below 1e-3 the engine's log-probs are,
for either algorithm, the recompute's."""


def percent(x: float) -> str:
    """0.0041 -> "0.41%", 0.0234 -> "2.3%" (two significant digits)."""
    return f"{100 * x:.2g}%"


def nats(x: float) -> str:
    """0.0123 -> "0.0123 nats"."""
    return f"{x:.3g} nats"


@dataclass(frozen=True)
class Precondition:
    """A measured quantity of the compared runs that must reach `threshold` for the claim to be tested."""

    quantity: str
    """What is measured, in words ("routing volatility")."""
    metric: str
    """The per-step metric it is measured with (analysis.vocab)."""
    threshold: float
    unit: str
    """The unit after a formatted value ("of expert slots changed since pi_old")."""
    definition: str
    """What the metric measures, for the rule sentence."""
    fmt: Callable[[float], str] = percent

    @property
    def rule(self) -> str:
        """The sentence the claim's rule quotes."""
        return (
            f"Regime: the claim is tested only where the {self.quantity} of the compared runs ({self.metric}: "
            f"{self.definition}; mean over steps per run, then over the compared runs) is at or above "
            f"{self.fmt(self.threshold)} {self.unit}; below it, or where no compared run measured it, the verdict is "
            "'not tested in regime' (never contradicted), with the measured value."
        )

    def measure(self, study: Study, run_ids: Iterable[str]) -> Measured:
        """The quantity over the runs `run_ids` (each run's mean over its RL steps, then the mean over runs)."""
        from analysis import stats
        from analysis.tidy import RUN_ID

        ids = {str(r) for r in run_ids}
        values = np.array([], np.float64)
        if self.metric in study.metrics:
            per_run = stats.run_mean(study.long, self.metric)
            per_run = per_run[per_run[RUN_ID].astype(str).isin(ids)]
            values = per_run["value"].to_numpy(np.float64)
        return Measured(self, stats.mean_ci(values[np.isfinite(values)]))


@dataclass(frozen=True)
class Measured:
    """A precondition measured in one stratum."""

    precondition: Precondition
    ci: CI

    @property
    def met(self) -> bool:
        return self.ci.n > 0 and self.ci.estimate >= self.precondition.threshold

    @property
    def value(self) -> str:
        """E.g. "0.41% of expert slots changed since pi_old (n=12 runs)", or why there is no value."""
        p = self.precondition
        if self.ci.n == 0:
            return f"not measured (no compared run logged a finite {p.metric})"
        return f"{p.fmt(self.ci.estimate)} {p.unit} (n={self.ci.n} runs)"

    @property
    def sentence(self) -> str:
        """E.g. "routing volatility 0.41% of expert slots changed since pi_old (n=12 runs), below the 5% the claim
        needs"."""
        p = self.precondition
        if self.ci.n == 0:
            return f"{p.quantity} {self.value}; the claim needs {p.fmt(p.threshold)}"
        side = "at or above" if self.met else "below"
        return f"{p.quantity} {self.value}, {side} the {p.fmt(p.threshold)} the claim needs"

    def evidence(self) -> Evidence:
        """The evidence line: the measured quantity with its t interval over runs, and the threshold."""
        p = self.precondition
        name = f"{p.quantity} ({p.metric}; threshold {p.threshold:g})"
        return Evidence(name, self.ci.estimate, self.ci.low, self.ci.high, str(self.ci.n))


def volatility(threshold: float = MIN_VOLATILITY) -> Precondition:
    """C3 and C4's precondition: the routing volatility of the off-policy minibatches."""
    return Precondition(
        "routing volatility",
        vocab.ROUTING_SLOT,
        threshold,
        "of expert slots changed since pi_old",
        "the expert-slot mismatch of the update forward's free routing against pi_old's, over the minibatches after "
        "at least one update on the same rollout batch, where the two can differ; replay runs compute their free "
        "routing alongside. The paper's model changed about 10% in a single update",
    )


def mismatch(threshold: float = MIN_MISMATCH) -> Precondition:
    """C5's precondition: the rollout engine's log-probs against the trainer's recompute of the same tokens."""
    return Precondition(
        "engine/trainer mismatch",
        vocab.MISMATCH_MEAN_ABS,
        threshold,
        "per response token",
        "mean |logp_train_old - logp_rollout| of the response tokens, the trainer's pi_old recompute against the "
        "rollout engine's log-probs at the same weights, logged by every arm",
        nats,
    )


__all__ = ["MIN_MISMATCH", "MIN_VOLATILITY", "Measured", "Precondition", "mismatch", "nats", "percent", "volatility"]
