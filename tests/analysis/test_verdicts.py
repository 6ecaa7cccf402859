"""The decision rule: a verdict read off an interval, and the sentence that says so."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.stats.verdicts import CONTRADICTED, INCONCLUSIVE, SUPPORTED, Bound, Decision, conjunction

NAN, INF = float("nan"), float("inf")


def test_bounds_compare_the_named_end_and_never_hold_without_an_interval() -> None:
    assert Bound("lower", ">", 0.0).holds(0.1, 0.2) and not Bound("lower", ">", 0.0).holds(0.0, 0.2)
    assert Bound("lower", ">=", 10.0).holds(10.0, 12.0) and not Bound("lower", ">=", 10.0).holds(9.9, 12.0)
    assert Bound("upper", "<", 0.0).holds(-2.0, -1.0) and not Bound("upper", "<", 0.0).holds(-2.0, 0.0)
    assert Bound("upper", "<=", 0.0).holds(-2.0, 0.0) and not Bound("upper", "<=", 0.0).holds(-2.0, 1e-12)
    for low, high in ((NAN, NAN), (INF, INF), (-INF, -INF)):
        for op in (">", ">=", "<", "<="):
            assert not Bound("lower", op, 0.0).holds(low, high) and not Bound("upper", op, 0.0).holds(low, high)
    with pytest.raises(ValueError, match="side is lower or upper"):
        Bound("middle", ">", 0.0)  # type: ignore[arg-type]


def test_decision_and_its_sentence() -> None:
    d = Decision(Bound("lower", ">", 0.0), Bound("upper", "<=", 0.0, "no worse"))
    assert str(d) == (
        "95% CI lower bound > 0 -> supported; upper bound <= 0 (no worse) -> contradicted; else inconclusive"
    )
    assert d(0.1, 0.3) == SUPPORTED and d(-0.1, 0.0) == CONTRADICTED and d(0.0, 0.0) == CONTRADICTED
    assert d(-0.1, 0.1) == INCONCLUSIVE and d(NAN, NAN) == INCONCLUSIVE
    ratio = Decision(Bound("lower", ">=", 10.0), Bound("upper", "<", 10.0))
    assert str(ratio).startswith("95% CI lower bound >= 10 -> supported; upper bound < 10 -> contradicted")
    assert ratio(10.0, 20.0) == SUPPORTED and ratio(2.0, 9.0) == CONTRADICTED and ratio(5.0, 10.0) == INCONCLUSIVE
    # an equivalence: supported when the interval stays below a margin
    eq = Decision(Bound("upper", "<", 0.02), Bound("lower", ">", 0.02))
    assert eq(-0.01, 0.01) == SUPPORTED and eq(0.03, 0.05) == CONTRADICTED and eq(0.0, 0.03) == INCONCLUSIVE
    assert eq(-np.inf, 0.01) == SUPPORTED  # only the named end is read


def test_conjunction() -> None:
    assert conjunction([SUPPORTED, SUPPORTED]) == SUPPORTED
    assert conjunction([SUPPORTED, CONTRADICTED, INCONCLUSIVE]) == CONTRADICTED
    assert conjunction([SUPPORTED, INCONCLUSIVE]) == INCONCLUSIVE
    assert conjunction([]) == INCONCLUSIVE
