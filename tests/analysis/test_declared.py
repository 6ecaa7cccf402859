"""Declared comparisons: the sweep block's validation, the power that sizes it, and the finished runs checked against
the declaration (synthetic runs, no training)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.claims import declared
from analysis.stats import power
from sweeps.schema import SweepError, validate_sweep
from tests.analysis import synthetic

ROOT = Path(__file__).resolve().parents[2]
BOTH = {"grpo": [0, 1, 2], "grpo_rr": [0, 1, 2]}
ENTRY = {**synthetic.COMPARISON, "stratum": {"minibatches": 32}}


def runs_long(arms: dict[str, list[int]], gain: dict[str, float], *, minibatches: int = 32) -> pd.DataFrame:
    """eval_in_dist at step 0 and step 16 of each (arm, seed) run: a shared seed effect, the arm's gain."""
    rows = []
    for arm, seeds in arms.items():
        for s in seeds:
            start = 0.3 + 0.05 * s
            for step, value in ((0, start), (16, start + gain[arm] + 0.004 * (-1) ** s)):
                rows.append(
                    {
                        "run_id": f"{arm}-{s}",
                        "algorithm": arm,
                        "minibatches": minibatches,
                        "seed": s,
                        "step": step,
                        "compute_flops": float(step),
                        "wall_s": float(step),
                        "metric": "eval_in_dist",
                        "value": value,
                    }
                )
    return pd.DataFrame(rows)


def test_power_matches_statsmodels_and_sizes_the_seeds() -> None:
    from statsmodels.stats.power import TTestPower

    for sd, gap, n in ((0.05, 0.1, 6), (0.07, 0.1, 6), (0.05, 0.05, 4)):
        want = TTestPower().power(effect_size=gap / sd, nobs=n, alpha=0.05, alternative="two-sided")
        assert power.power_paired(sd, gap, n) == pytest.approx(want, rel=1e-6)
    n = power.seeds_for_power(0.05, 0.1, power=0.8)
    assert power.power_paired(0.05, 0.1, n) >= 0.8 > power.power_paired(0.05, 0.1, n - 1)
    assert power.seeds_for_power(0.05, 0.1, paired=False) > n  # Welch needs more runs than pairs
    assert power.power_paired(0.05, 0.1, 6, alternative="greater") > power.power_paired(0.05, 0.1, 6)


def test_runs_that_match_the_declaration_have_no_deviation_and_are_read_as_declared() -> None:
    c = declared.Comparison.from_entry(ENTRY)
    long = runs_long(BOTH, {"grpo": 0.19, "grpo_rr": 0.09})
    assert declared.deviations(long, c) == []
    got = declared.confirm(long, c)
    assert got.verdict == "supported" and got.paired is not None and got.paired.unit == "seed"
    assert got.estimate.estimate == pytest.approx(0.1) and got.estimate.low > 0.05


@pytest.mark.parametrize(
    ("gaps", "threshold", "expected"),
    [
        ((0.0, 0.01, -0.01, 0.02, -0.02, 0.0), 0.1, "contradicted"),  # a null: the interval excludes +0.1
        ((0.0, 0.01, -0.01, 0.02, -0.02, 0.0), -0.1, "contradicted"),  # likewise a declared -0.1
        ((0.0, 0.2, -0.2, 0.3, -0.25, 0.1), 0.1, "inconclusive"),  # too noisy to exclude 0.1 or to find a gap
        ((-0.1, -0.12, -0.09, -0.11, -0.1, -0.1), 0.1, "contradicted"),  # significant, the other way
        ((0.1, 0.12, 0.09, 0.11, 0.1, 0.1), 0.1, "supported"),
        ((0.03, 0.04, 0.02, 0.03, 0.035, 0.025), 0.1, "supported"),  # a gap with the declared sign, smaller
    ],
)
def test_a_declared_gap_is_read_as_declared_a_null_that_excludes_it_included(gaps, threshold, expected) -> None:
    """Paired differences per seed -> the reading about the declared gap (declared.READING)."""
    seeds = list(range(len(gaps)))
    c = declared.Comparison.from_entry({**ENTRY, "seeds": seeds, "threshold": threshold})
    rows = []
    for s, d in zip(seeds, gaps, strict=True):
        base = 0.1 + 0.05 * s  # the seed moves both arms alike
        rows += [("grpo", s, base + d), ("grpo_rr", s, base)]
    long = pd.concat([runs_long({a: [s]}, {a: v}).assign(run_id=f"{a}-{s}") for a, s, v in rows], ignore_index=True)
    got = declared.confirm(long, c)
    assert got.reading == expected, (got.estimate, got.p_value)


@pytest.mark.parametrize(
    ("arms", "runs_state", "change", "expected"),
    [
        ({"grpo": [0, 1, 2, 3], "grpo_rr": [0, 1, 2, 3]}, None, {}, "arm 'grpo': seed(s) [3] were not declared"),
        ({"grpo": [0, 1], "grpo_rr": [0, 1, 2]}, None, {}, "treatment arm 'grpo': declared seed(s) [2] have no usable"),
        ({"grpo": [0, 1, 2], "grpo_rr": [0, 1]}, None, {}, "paired by seed, but seed(s) [2] have one arm only"),
        ({"grpo": [0, 1, 2]}, None, {}, "control arm algorithm = 'grpo_rr': no usable run"),
        (BOTH, "grpo-1", {}, "treatment arm 'grpo': declared seed(s) [1] have no"),
        (BOTH, None, {"metric": "test_in_dist"}, "metric 'test_in_dist' not logged"),
        (BOTH, None, {"stratum": {"minibatches": 4}}, "stratum minibatches = 4: no"),
        (BOTH, None, {"stratum": {"lr": 1e-4}}, "axis 'lr' is not among the runs'"),
    ],
)
def test_runs_that_deviate_from_the_declaration_are_flagged(arms, runs_state, change, expected) -> None:
    c = declared.Comparison.from_entry({**ENTRY, **change})
    long = runs_long(arms, {"grpo": 0.19, "grpo_rr": 0.09})
    runs = None
    if runs_state:  # that run failed: not usable
        ids = sorted(set(long["run_id"]))
        runs = pd.DataFrame({"run_id": ids, "state": ["failed" if r == runs_state else "completed" for r in ids]})
    found = declared.deviations(long, c, runs)
    assert any(expected in line for line in found), found
    if "metric" not in change and "stratum" not in change:
        assert declared.confirm(long, c, runs).verdict.startswith("exploratory")


def test_a_gain_without_a_step0_evaluation_is_a_deviation() -> None:
    c = declared.Comparison.from_entry(ENTRY)
    long = runs_long(BOTH, {"grpo": 0.19, "grpo_rr": 0.09})
    long = long[~((long["run_id"] == "grpo_rr-0") & (long["step"] == 0))]
    found = declared.deviations(long, c)
    assert any("window 'gain' needs a step-0 eval_in_dist; run(s) ['grpo_rr-0']" in d for d in found), found


def sweep_with(**change) -> dict:
    data = yaml.safe_load((ROOT / "sweeps" / "routing.yaml").read_text())
    data = copy.deepcopy(data)
    entry = {**ENTRY, "seeds": [0, 1], **change}
    data["comparisons"] = [entry]
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"claim": "C7"}, r"comparisons\[0\].claim = 'C7'; valid: C1, C2, C3, C4, C5, C6"),
        ({"window": "last_10pct"}, r"comparisons\[0\].window = 'last_10pct'; valid: final_eval, gain, last_10pct_comp"),
        ({"pairing": "run"}, r"comparisons\[0\].pairing = 'run'; valid: seed, none"),
        ({"power": 1.5}, r"comparisons\[0\].power = 1.5: exclusiveMaximum is 1"),
        ({"seeds": [0, 1, 2]}, r"comparisons\[0\].seeds = \[0, 1, 2\]: the sweep runs seeds \[0, 1\]; valid: the same"),
        (
            {"arms": {"axis": "algorithm", "treatment": "gspo_x", "control": "grpo"}},
            r"comparisons\[0\].arms.treatment = 'gspo_x': not a value of axes.algorithm; valid: grpo, grpo_rr, gspo",
        ),
        ({"arms": {"axis": "lr", "treatment": 1, "control": 2}}, r"arms.axis = 'lr': not an axis of the sweep; valid:"),
        ({"metric": "eval_middle"}, r"comparisons\[0\].metric = 'eval_middle': not a logged metric"),
        ({"metric": "test_in_dist"}, r"metric = 'test_in_dist': the sweep scores no test split; valid: base.eval_te"),
        ({"stratum": {"minibatches": 8}}, r"stratum.minibatches = 8: not a value of axes.minibatches; valid: 1, 4, 32"),
        ({"stratum": {"seed": 0}}, r"comparisons\[0\].stratum.seed: not another axis of the sweep; valid: model, mi"),
        ({"extra": 1}, r"comparisons\[0\]: unknown field\(s\) \['extra'\]; valid: name, role, claim, arms"),
    ],
)
def test_a_bad_declaration_names_the_field_and_the_valid_values(change: dict, message: str) -> None:
    validate_sweep(sweep_with(), where="routing.yaml")  # the unchanged entry is valid
    with pytest.raises(SweepError, match=message):
        validate_sweep(sweep_with(**change), where="routing.yaml")
    two = sweep_with()
    two["comparisons"].append({**two["comparisons"][0], "name": "other"})
    with pytest.raises(SweepError, match=r"2 primary comparisons \['replay_cost', 'other'\]; valid: one"):
        validate_sweep(two, where="routing.yaml")


def test_the_confirmation_sweep_declares_one_primary_sized_for_its_power() -> None:
    data = yaml.safe_load((ROOT / "sweeps" / "confirm_replay.yaml").read_text())
    validate_sweep(data, where="confirm_replay.yaml")
    (c,) = [c for c in declared.declared(data) if c.role == "primary"]
    assert declared.sizing(c) >= c.power >= 0.8 and abs(c.threshold) == pytest.approx(0.1)
    assert c.metric == "test_in_dist" and c.pairing == "seed" and data["base"]["eval_test_size"] > 0
    routing = yaml.safe_load((ROOT / "sweeps" / "routing.yaml").read_text())
    assert not set(c.seeds) & set(routing["axes"]["seed"])  # seeds not used before
    assert np.isfinite(power.power_paired(c.assumed_sd, c.threshold, len(c.seeds)))
