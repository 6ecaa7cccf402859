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
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from analysis.runs import vocab
from analysis.stats.verdicts import Evidence

if TYPE_CHECKING:  # the command line reads the thresholds without loading pandas and scipy
    import pandas as pd

    from analysis.runs.tidy import Study
    from analysis.stats.intervals import CI

MIN_VOLATILITY = 0.05
"""C3, C4: the routing volatility the compared runs must reach in the paper's unit, the fraction of expert slots
changed after one update (PER_UPDATE): half of the ~10% the paper's model, the one on which GRPO without Routing
Replay failed, changed in a single update. The cumulative volatility (routing_slot_mismatch: the change since pi_old
averaged over minibatches 2..M, after up to M - 1 updates) is reported beside it; many small updates adding up to 5%
are not the paper's regime."""
PAPER_PER_UPDATE = 0.10
"""The paper: about 10% of activated experts change after one gradient update (Qwen3-30B-A3B)."""
PER_UPDATE = f"{vocab.ROUTING_SLOT}_mb2"
"""The expert-slot mismatch of minibatch 2: the routing's change after exactly one update since pi_old."""
MIN_MISMATCH = 1e-3
"""C5: the engine/trainer mismatch the compared runs must reach, mean |logp_train_old - logp_rollout| per response
token in nats. The same weights in fp32 in both engines measure about 1e-6 (the weight sync's fidelity), bf16 about
1e-2; GSPO clips its length-normalised sequence log-ratio at about 3e-4, so below 1e-3 the engine's log-probs are,
for either algorithm, the recompute's."""
MAX_TRUNCATION = 0.02
"""C6's length part: the most the shortest compared generation budget may cut, as the fraction of rollout responses
cut at max_new_tokens. A budget that cuts answers gains from a longer one before any RL (truncation's part), so its
comparison would not say whether RL does better with more room; 2% leaves room for the rare sample that rambles past
an answer that fits."""


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
    """The per-step metric it is measured with (analysis.runs.vocab)."""
    threshold: float
    unit: str
    """The unit after a formatted value ("of expert slots changed since pi_old")."""
    definition: str
    """What the metric measures, for the rule sentence."""
    fmt: Callable[[float], str] = percent
    companion: str = ""
    """A metric measured alongside and reported beside `metric`, which alone decides (the cumulative volatility)."""
    companion_name: str = ""
    """What `companion` is, in words ("cumulative"); `metric`'s own name is then `name`."""
    name: str = ""
    """What `metric` is, in words, beside the companion ("per update")."""
    reference: str = ""
    """The paper's own value, for the sentence ("the paper's model: ~10% after one update")."""
    emulation: Callable[[Study, set[str]], str] | None = None
    """What emulated the regime in the runs `ids` of a study, in words ("routing-volatility dial router_kick = 0.08"),
    "" where none of them ran an emulation: a regime reached that way is labelled "emulated" wherever it is shown."""
    at_most: bool = False
    """The threshold is a ceiling: the claim is tested where the quantity is at or below it (C6's truncation)."""
    select: Callable[[Study, set[str]], set[str]] | None = None
    """The compared runs the quantity is measured on, of the runs `ids` (C6: those at the shortest budget); None: all
    of them."""

    @property
    def sides(self) -> tuple[str, str]:
        """How a value in the regime and one outside it stand to the threshold."""
        return ("at or below", "above") if self.at_most else ("at or above", "below")

    @property
    def rule(self) -> str:
        """The sentence the claim's rule quotes."""
        inside, outside = self.sides
        return (
            f"Regime: the claim is tested only where the {self.quantity} of the compared runs ({self.metric}: "
            f"{self.definition}; mean over steps per run, then over the compared runs) is {inside} "
            f"{self.fmt(self.threshold)} {self.unit}; {outside} it, or where no compared run measured it, the verdict "
            "is 'not tested in regime' (never contradicted), with the measured value."
        )

    def measure(self, study: Study, run_ids: Iterable[str]) -> Measured:
        """The quantity over the runs `run_ids` (each run's mean over its RL steps, then the mean over runs)."""
        ids = {str(r) for r in run_ids}
        if self.select is not None:
            ids = self.select(study, ids)
        companion = over_runs(study.long, self.companion, ids) if self.companion else None
        emulated = self.emulation(study, ids) if self.emulation is not None else ""
        return Measured(self, over_runs(study.long, self.metric, ids), companion, emulated)


def over_runs(long: pd.DataFrame, metric: str, run_ids: Iterable[str] | None = None) -> CI:
    """A regime's quantity: each run's mean of `metric` over its RL steps (`curves.run_mean`), then the mean over the
    runs `run_ids` (every run when None) with its t interval; a run without a finite value does not count, and a
    metric not logged has no value (n = 0)."""
    from analysis.runs.columns import RUN_ID
    from analysis.stats import curves, intervals

    try:
        per_run = curves.run_mean(long, metric)
    except KeyError:  # not logged
        return intervals.CI(np.nan, np.nan, np.nan, 0)
    if run_ids is not None:
        per_run = per_run[per_run[RUN_ID].astype(str).isin({str(r) for r in run_ids})]
    values = per_run["value"].to_numpy(np.float64)
    return intervals.mean_ci(values[np.isfinite(values)])


@dataclass(frozen=True)
class Measured:
    """A precondition measured in one stratum."""

    precondition: Precondition
    ci: CI
    companion: CI | None = None
    """The companion metric's value (Precondition.companion), reported, never deciding."""
    emulated: str = ""
    """What emulated the regime in these runs (Precondition.emulation), "" when nothing did."""

    @property
    def met(self) -> bool:
        p = self.precondition
        return self.ci.n > 0 and (self.ci.estimate <= p.threshold if p.at_most else self.ci.estimate >= p.threshold)

    @property
    def value(self) -> str:
        """E.g. "0.41% of expert slots changed since pi_old (n=12 runs)"; with a companion "cumulative 6%, per update
        0.6% of expert slots changed since pi_old (n=12 runs)"; or why there is no value."""
        p = self.precondition
        if self.companion is not None:
            both = [(p.companion_name, self.companion, p.companion), (p.name, self.ci, p.metric)]
            parts = [
                f"{name} {p.fmt(ci.estimate)}" if ci.n else f"{name} not measured ({metric})"
                for name, ci, metric in both
            ]
            n = max(self.ci.n, self.companion.n)
            return f"{', '.join(parts)} {p.unit} (n={n} runs)" if n else f"not measured ({p.metric}, {p.companion})"
        if self.ci.n == 0:
            return f"not measured (no compared run logged a finite {p.metric})"
        return f"{p.fmt(self.ci.estimate)} {p.unit} (n={self.ci.n} runs)"

    @property
    def sentence(self) -> str:
        """E.g. "routing volatility 0.41% of expert slots changed since pi_old (n=12 runs), below the 5% the claim
        needs"; with a companion "routing volatility: cumulative 6%, per update 0.6% of expert slots changed since
        pi_old (n=12 runs), below the 5% per update the claim needs (the paper's model: ~10% after one update); only
        the cumulative reaches it"."""
        p = self.precondition
        of = f" {p.name}" if p.name else ""
        ref = f" ({p.reference})" if p.reference else ""
        head = f"{p.quantity}: {self.value}" if self.companion is not None else f"{p.quantity} {self.value}"
        if self.emulated:
            head = f"{EMULATED} ({self.emulated}): {head}"
        needs = "allows at most" if p.at_most else "needs"
        if self.ci.n == 0:
            return f"{head}; the claim {needs} {p.fmt(p.threshold)}{of}{ref}"
        side = p.sides[0] if self.met else p.sides[1]
        only = ""
        c = self.companion
        if not self.met and c is not None and c.n and c.estimate >= p.threshold:
            only = f"; only the {p.companion_name} reaches it"
        return f"{head}, {side} the {p.fmt(p.threshold)}{of} the claim {needs}{ref}{only}"

    def evidence(self) -> Evidence:
        """The evidence line: the measured quantity with its t interval over runs, and the threshold."""
        p = self.precondition
        emulated = f"; {EMULATED}: {self.emulated}" if self.emulated else ""
        name = f"{p.quantity} ({p.metric}; threshold {p.threshold:g}{emulated})"
        return Evidence(name, self.ci.estimate, self.ci.low, self.ci.high, str(self.ci.n))


EMULATED = "emulated regime"
"""The label of a regime reached through an emulation rather than by the runs as they are."""
ROUTER_KICK = "router_kick"
"""The routing-volatility dial's config key (study/policy/kick.py): > 0 moves the routers by seeded noise within a
step, so the routing volatility is emulated, not the runs' own."""


def _dialled(study: Study, ids: set[str]) -> str:
    """The routing-volatility dial's settings among the runs `ids` ("routing-volatility dial router_kick = 0.08"), ""
    where none ran it."""
    sigmas = sorted({float(study.configs.get(r, {}).get(ROUTER_KICK) or 0.0) for r in ids} - {0.0})
    if not sigmas:
        return ""
    return f"routing-volatility dial {ROUTER_KICK} = " + ", ".join(f"{x:g}" for x in sigmas)


def _emulated_precision(study: Study, ids: set[str]) -> str:
    """Emulated low precision among the runs `ids` (the runs' precision_emulated), "" where none was."""
    from analysis.runs.columns import EMULATED as FLAG
    from analysis.runs.columns import RUN_ID

    runs = study.runs[study.runs[RUN_ID].astype(str).isin(ids)]
    n = int(runs[FLAG].fillna(False).astype(bool).sum()) if FLAG in runs else 0
    return f"low precision emulated on the CPU in {n} of {len(runs)} runs (precision_emulated)" if n else ""


def volatility(threshold: float = MIN_VOLATILITY) -> Precondition:
    """C3 and C4's precondition: the routing volatility in the paper's unit, the change after one update (PER_UPDATE),
    with the cumulative one (routing_slot_mismatch) beside it."""
    return Precondition(
        "routing volatility",
        PER_UPDATE,
        threshold,
        "of expert slots changed since pi_old",
        "the expert-slot mismatch of the update forward's free routing against pi_old's in the second minibatch of "
        "the rollout batch, after exactly one update, the paper's unit (its model changed about "
        f"{percent(PAPER_PER_UPDATE)} in a single update); replay runs compute their free routing alongside. The "
        f"cumulative volatility ({vocab.ROUTING_SLOT}, over minibatches 2..M, after up to M - 1 updates) is "
        "reported beside it and does not decide",
        companion=vocab.ROUTING_SLOT,
        companion_name="cumulative",
        name="per update",
        reference=f"the paper's model: ~{percent(PAPER_PER_UPDATE)} after one update",
        emulation=_dialled,
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
        emulation=_emulated_precision,
    )


def _shortest(study: Study, ids: set[str], *, axis: str) -> set[str]:
    """The runs of `ids` at the smallest value of `axis` among them (all of `ids` where the runs lack the axis)."""
    from analysis.runs.columns import RUN_ID

    runs = study.runs[study.runs[RUN_ID].astype(str).isin(ids)]
    if axis not in runs or runs[axis].isna().all():
        return ids
    return set(runs.loc[runs[axis] == runs[axis].min(), RUN_ID].astype(str))


def truncation(threshold: float = MAX_TRUNCATION, axis: str = vocab.LENGTH_AXIS) -> Precondition:
    """C6's length part's precondition: the shortest compared budget does not cut the answers, so a longer budget's
    gain is RL's, not truncation's."""
    return Precondition(
        "truncation at the shortest budget",
        vocab.TRUNCATION,
        threshold,
        "of responses cut at the budget",
        f"the fraction of rollout responses cut at max_new_tokens, measured on the compared runs at the smallest "
        f"{axis}: where that budget cuts answers, a longer one gains before any RL",
        at_most=True,
        select=partial(_shortest, axis=axis),
    )


__all__ = [
    "EMULATED",
    "MAX_TRUNCATION",
    "MIN_MISMATCH",
    "MIN_VOLATILITY",
    "PAPER_PER_UPDATE",
    "PER_UPDATE",
    "ROUTER_KICK",
    "Measured",
    "Precondition",
    "mismatch",
    "nats",
    "over_runs",
    "percent",
    "truncation",
    "volatility",
]
