"""The smallest detectable difference (analysis/stats/power.py) and the seed pairing of C5's contrast."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from analysis.claims.common import paired_by_seed
from analysis.stats import power


def test_detectable_is_the_t_formula_on_the_pooled_seed_sd() -> None:
    a, b = np.array([0.50, 0.52, 0.54]), np.array([0.40, 0.41, 0.45])
    d = power.detectable([a, b], (1, -1))
    sd = np.sqrt((((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()) / 4)
    assert d.df == 4 and d.sd == pytest.approx(sd)
    assert d.se == pytest.approx(sd * np.sqrt(2 / 3))
    assert d.mdd == pytest.approx((sps.t.ppf(0.975, 4) + sps.t.ppf(0.8, 4)) * d.se)
    # four groups with weights +-1: SE twice that of one group mean at equal n
    four = power.detectable([a, a, b, b], (1, -1, -1, 1))
    assert four.se == pytest.approx(four.sd * np.sqrt(4 / 3))


def test_detectable_needs_two_runs_in_some_group_and_shrinks_with_seeds() -> None:
    assert np.isnan(power.detectable([np.array([0.5]), np.array([0.4])], (1, -1)).mdd)
    assert np.isnan(power.detectable([np.array([]), np.array([0.4, 0.5])], (1, -1)).mdd)
    few = [np.array([0.50, 0.53, 0.56]), np.array([0.40, 0.43, 0.46])]  # seed SD 0.03 in each group
    sd = power.detectable(few, (1, -1)).sd
    n = power.seeds_needed(few, (1, -1), 0.03)
    assert sd == pytest.approx(0.03) and n is not None and n > 3

    def mdd(k: int) -> float:  # the detectable size with k seeds per group at the same SD
        return power.detectable([sd * _unit(k), sd * _unit(k)], (1, -1)).mdd

    assert mdd(n) <= 0.03 < mdd(n - 1)


def _unit(k: int) -> np.ndarray:
    """k values with mean 0 and sample SD exactly 1."""
    x = np.arange(k, dtype=np.float64)
    return (x - x.mean()) / x.std(ddof=1)


def test_paired_aligns_by_seed_and_refuses_unmatched_seeds() -> None:
    m = paired_by_seed([np.array([1.0, 2.0]), np.array([20.0, 10.0])], [[0, 1], [1, 0]])
    assert m.tolist() == [[1.0, 10.0], [2.0, 20.0]]
    # a seed some group lacks is left out; fewer than two common seeds: no pairing
    three = paired_by_seed([np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0])], [[0, 1, 2], [2, 0]])
    assert three.tolist() == [[1.0, 5.0], [3.0, 4.0]]
    assert paired_by_seed([np.array([1.0, 2.0]), np.array([1.0, 2.0])], [[0, 1], [0, 2]]) is None
    assert (
        paired_by_seed([np.array([1.0, np.nan]), np.array([1.0, 2.0])], [[0, 1], [0, 1]]) is None
    )  # seed 1 lost a value
    assert (
        paired_by_seed([np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0])], [[0, 0, 1], [0, 1]]) is None
    )  # seed 0 twice
    assert paired_by_seed([np.array([1.0]), np.array([1.0])], [[0], [0]]) is None  # one seed: no interval
