"""The labels of the design's intervals, checked: a family's simultaneous level where paired and Welch rows mix, the
IQM bootstrap's coverage at 4 runs (simulated with `design.iqm_interval` itself), and C2's size against the paper's
with an interval."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.stats import design
from analysis.stats.intervals import CI, mean_ci, mean_difference


def test_a_mixed_familys_paired_rows_are_read_at_the_whole_familys_level() -> None:
    """Six gaps, two paired by seed and four Welch: every simultaneous interval at 1 - 0.05 / 6 (99.2%), the paired
    ones included (they were read at 1 - 0.05 / 2 = 97.5%, as if the family were its paired rows)."""
    rng = np.random.default_rng(0)
    seeds = range(6)
    rows = []
    for _ in range(2):
        x, y = rng.normal(0.5, 0.05, 6), rng.normal(0.45, 0.05, 6)
        rows.append(design.arm_gap(x, y, dict(zip(seeds, x, strict=True)), dict(zip(seeds, y, strict=True))))
    for _ in range(4):
        x, y = rng.normal(0.5, 0.05, 5), rng.normal(0.45, 0.05, 4)
        rows.append(design.arm_gap(x, y, None, None))
    diffs = [np.asarray(r["_diffs"]) for r in rows[:2]]
    xy = [r["_xy"] for r in rows[2:]]
    design.read_as_family(rows)
    level = 1 - 0.05 / 6
    assert all(f"each at {100 * level:.4g}%" in r["family"] for r in rows) and "family of 6" in rows[0]["family"]
    for r, d in zip(rows[:2], diffs, strict=True):
        want = mean_ci(d, confidence=level)
        assert r["pairing"] == "paired by seed"
        assert (r["simultaneous_low"], r["simultaneous_high"]) == pytest.approx((want.low, want.high))
    for r, (x, y) in zip(rows[2:], xy, strict=True):
        want = mean_difference(x, y, confidence=level)
        assert (r["simultaneous_low"], r["simultaneous_high"]) == pytest.approx((want.low, want.high))


def test_the_iqm_bootstrap_at_four_runs_covers_what_its_label_says() -> None:
    """Normal runs, one task, 4 runs: `iqm_interval`'s nominal 95% interval covers the mean about 87% of the time,
    as design.IQM_COVERAGE states (and the table's note says), never more than the 87.5% of studies whose runs'
    range holds the mean, since no resample's IQM leaves that range."""
    rng = np.random.default_rng(4)
    sims = 160
    covered = in_range = 0
    for i in range(sims):
        x = rng.normal(0.0, 1.0, (4, 1))  # (runs, tasks)
        _, low, high = design.iqm_interval({"a": x}, reps=200, seed=i)["a"]
        assert x.min() <= low <= high <= x.max()
        covered += low <= 0.0 <= high
        in_range += x.min() <= 0.0 <= x.max()
    coverage = covered / sims
    se = np.sqrt(design.IQM_COVERAGE[4] * (1 - design.IQM_COVERAGE[4]) / sims)
    assert abs(coverage - design.IQM_COVERAGE[4]) <= 4 * se, coverage
    assert covered <= in_range and design.IQM_COVERAGE[4] <= 1 - 2 / 2**4 < 0.95
    note = design.ALGORITHM_TABLE_NOTE.format(ref="GRPO", reps=200)
    assert "nominal 95%" in note and f"{design.IQM_COVERAGE[4]:.0%} at 4 runs" in note


def test_c2s_size_has_an_interval_and_says_when_the_papers_ratio_lies_outside() -> None:
    """36.1x [33.7, 38.6] against the paper's ~100x: size 0.78 [0.76, 0.79], and the paper's ratio above the
    interval is said (the sentence once gave the size alone)."""
    r = design.size_against_paper(CI(36.1, 33.7, 38.6, 6))
    assert r.size is not None and (r.size.low, r.size.high) == pytest.approx(
        (np.log(33.7) / np.log(100), np.log(38.6) / np.log(100))
    )
    assert r.size.low <= r.size_of_paper <= r.size.high and r.paper_outside == "above"
    assert "log scale: size [0.76, 0.79])" in r.sentence
    assert "the paper's ~100x lies above the interval: this study's ratio is not the paper's" in r.sentence
    inside = design.size_against_paper(CI(80.0, 40.0, 160.0, 3))
    assert inside.paper_outside == "" and "the paper's ~100x lies inside the interval" in inside.sentence
    below = design.size_against_paper(CI(300.0, 150.0, 600.0, 3))
    assert below.paper_outside == "below"
    none = design.size_against_paper(CI(5.0, np.nan, np.nan, 1))  # one seed: no interval, nothing said of it
    assert none.size is None and none.paper_outside == "" and "interval" not in none.sentence.split("log scale")[1]
