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


def paired_runs(gaps: tuple[float, ...]) -> pd.DataFrame:
    """One run per arm and seed whose eval_in_dist gain differs by gaps[seed] (a seed moves both arms alike)."""
    rows = []
    for s, d in enumerate(gaps):
        base = 0.1 + 0.05 * s
        rows += [("grpo", s, base + d), ("grpo_rr", s, base)]
    return pd.concat([runs_long({a: [s]}, {a: v}).assign(run_id=f"{a}-{s}") for a, s, v in rows], ignore_index=True)


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
    long = paired_runs((0.1, 0.11, 0.09))
    assert declared.deviations(long, c) == []
    got = declared.confirm(long, c)
    assert got.verdict == "supported" and got.paired is not None and got.paired.unit == "seed"
    assert got.reading.outcome == "difference detected, with the declared sign"
    assert got.reading.interval.estimate == pytest.approx(0.1) and got.reading.interval.low > 0.05


NULL = (0.0, 0.01, -0.01, 0.02, -0.02, 0.0)
NOISY = (0.0, 0.2, -0.2, 0.3, -0.25, 0.1)
OTHER_WAY = (-0.1, -0.12, -0.09, -0.11, -0.1, -0.1)
AS_DECLARED = (0.1, 0.12, 0.09, 0.11, 0.1, 0.1)
SMALLER = (0.03, 0.04, 0.02, 0.03, 0.035, 0.025)
FAR_BELOW = (-0.2, -0.25, -0.22, -0.23, -0.2, -0.24)  # an interval about [-0.25, -0.20] against a declared +0.1


@pytest.mark.parametrize(
    ("gaps", "declaration", "outcome", "verdict"),
    [
        (NULL, {"test": "difference"}, "no difference detected", "inconclusive"),  # a null is not a contradiction
        (NULL, {"test": "exclude", "alternative": "greater"}, "the declared size excluded", "contradicted"),
        (NULL, {"test": "exclude", "alternative": "less", "threshold": -0.1}, "the declared size excluded", "contra"),
        (NULL, {"test": "equivalence", "threshold": 0.05}, "equivalent within the declared margin", "supported"),
        (NOISY, {"test": "difference"}, "no difference detected", "inconclusive"),
        (NOISY, {"test": "equivalence", "threshold": 0.05}, "equivalence not shown", "inconclusive"),
        (OTHER_WAY, {"test": "difference"}, "difference detected, opposite to the declared sign", "contradicted"),
        (AS_DECLARED, {"test": "difference"}, "difference detected, with the declared sign", "supported"),
        (SMALLER, {"test": "difference"}, "difference detected, with the declared sign", "supported"),
        # a gap of the declared sign but smaller: the declared size is neither shown nor left standing
        (
            SMALLER,
            {"test": "minimum_effect", "alternative": "greater", "assumed_gap": 0.15},
            "the declared size no",
            "",
        ),
        (SMALLER, {"test": "exclude", "alternative": "greater"}, "the declared size excluded", "contradicted"),
        (AS_DECLARED, {"test": "exclude", "alternative": "greater"}, "the declared size not excluded", "inconclusive"),
        (
            FAR_BELOW,
            {"test": "minimum_effect", "alternative": "greater", "assumed_gap": 0.2},
            "the declared size no",
            "",
        ),
        (FAR_BELOW, {"test": "difference", "alternative": "greater"}, "no difference detected", "inconclusive"),
    ],
)
def test_a_declared_test_is_read_as_what_it_tests(gaps, declaration, outcome, verdict) -> None:
    """Paired differences per seed -> the reading named for the declared test (declared.OUTCOMES)."""
    c = declared.Comparison.from_entry({**ENTRY, "seeds": list(range(len(gaps))), **declaration})
    got = declared.confirm(paired_runs(gaps), c)
    assert got.reading.outcome.startswith(outcome) and got.reading.verdict.startswith(verdict), got.reading
    assert got.reading.outcome == declared.OUTCOMES[(c.test, got.reading.verdict)]


def test_two_seeds_without_spread_are_no_reading_not_a_verdict() -> None:
    """Two seeds whose differences are equal: no spread, so no interval and no test (a zero-width interval from two
    seeds once read as 'contradicted' with p = nan)."""
    for test, extra in (("difference", {}), ("exclude", {"alternative": "greater"})):
        c = declared.Comparison.from_entry({**ENTRY, "seeds": [0, 1], "test": test, **extra})
        got = declared.confirm(paired_runs((0.02, 0.02)), c)
        assert got.reading.outcome == declared.TOO_FEW and got.reading.verdict == "inconclusive", got.reading
        assert np.isnan(got.reading.p_value) and np.isnan(got.reading.interval.low)


def test_a_family_reads_each_comparison_at_alpha_over_its_size() -> None:
    """Bonferroni: the interval at alpha / m, the p-value times m; the reading agrees with both."""
    c = declared.Comparison.from_entry({**ENTRY, "seeds": list(range(6))})
    conf = declared.confirm(paired_runs(SMALLER), c)
    one, three = conf.reading, declared.read(conf.spread, c, family=3)
    assert three.level == pytest.approx(0.05 / 3) and three.interval.confidence == pytest.approx(1 - 0.05 / 3)
    assert three.p_value == pytest.approx(min(1.0, 3 * one.p_value))
    assert three.interval.low < one.interval.low and three.interval.high > one.interval.high
    for r in (one, three):
        assert (r.p_value < c.alpha) == (r.verdict == "supported")


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


def test_a_run_stopped_before_its_last_evaluation_is_a_deviation_not_a_silent_drop() -> None:
    """A run killed early (status stopped) keeps its step-0 evaluation only: its seed drops out of the pairing, so the
    reading stands on fewer seeds than declared; the deviation names the run, its state and what it lacks."""
    c = declared.Comparison.from_entry(ENTRY)
    long = runs_long(BOTH, {"grpo": 0.19, "grpo_rr": 0.09})
    long = long[~((long["run_id"] == "grpo-2") & (long["step"] > 0))]
    ids = sorted(set(long["run_id"]))
    runs = pd.DataFrame({"run_id": ids, "state": ["stopped" if r == "grpo-2" else "completed" for r in ids]})
    found = declared.deviations(long, c, runs)
    assert any("window 'gain' reads a eval_in_dist after step 0; run(s) ['grpo-2'] have none" in d for d in found)
    assert any("run(s) grpo-2 (stopped) did not finish" in d for d in found), found
    conf = declared.confirm(long, c, runs)
    assert conf.spread.n == 2 and conf.verdict.startswith("exploratory")
    # the same runs, every one finished: no deviation
    assert (
        declared.deviations(runs_long(BOTH, {"grpo": 0.19, "grpo_rr": 0.09}), c, runs.assign(state="completed")) == []
    )


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
        ({"test": "gap"}, r"comparisons\[0\].test = 'gap'; valid: difference, minimum_effect, exclude, equivalence"),
        (
            {"threshold": -0.1, "alternative": "greater"},
            r"threshold = -0.1 with alternative = 'greater': a greater gap",
        ),
        ({"threshold": 0.1, "alternative": "less"}, r"threshold = 0.1 with alternative = 'less': a less gap is < 0"),
        ({"threshold": float("nan")}, r"comparisons\[0\].threshold = nan: not a finite number; valid: treatment -"),
        ({"threshold": float("inf")}, r"comparisons\[0\].threshold = inf: not a finite number"),
        ({"alpha": float("nan")}, r"comparisons\[0\].alpha = nan: not a finite number; valid: the test's level"),
        ({"power": float("nan")}, r"comparisons\[0\].power = nan: not a finite number"),
        ({"assumed_sd": float("inf")}, r"comparisons\[0\].assumed_sd = inf: not a finite number"),
        ({"assumed_gap": float("-inf")}, r"comparisons\[0\].assumed_gap = -inf: not a finite number"),
        ({"test": "minimum_effect"}, r"alternative = 'two-sided' with test = 'minimum_effect': .*valid: greater"),
        ({"test": "exclude", "alternative": "less"}, r"threshold = 0.1 with alternative = 'less'"),
        ({"test": "minimum_effect", "alternative": "greater"}, r"assumed_gap = None: .*valid: a number above 0.1"),
        (
            {"test": "minimum_effect", "alternative": "greater", "assumed_gap": 0.05},
            r"assumed_gap = 0.05: test = 'minimum_effect' is sized at a true gap above the threshold",
        ),
        (
            {"test": "equivalence", "alternative": "greater"},
            r"test = 'equivalence' with alternative = 'greater'.*two-sided",
        ),
        (
            {"arms": {"axis": "model.num_experts", "treatment": 64, "control": 1}},
            r"arms.axis = 'model.num_experts': .*valid: algorithm, model, minibatches, seed",
        ),
        ({"stratum": {"minibatches": "3"}}, r"stratum.minibatches = '3': not a value of axes.minibatches"),
        ({"stratum": {"minibatches": True}}, r"stratum.minibatches = True: not a value of axes.minibatches"),
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


SMALL = {
    "name": "small",
    "preset": "tiny",
    "base": {"steps": 2, "eval_every": 1},
    "axes": {"algorithm": ["grpo", "grpo_rr"], "seed": [0, 1]},
    "mode": "grid",
}
"""A sweep whose runs the declared comparison (synthetic.COMPARISON at seeds 0 and 1) can be read from."""


def small_sweep(entry: dict | None = None, **change) -> dict:
    data = copy.deepcopy({**SMALL, **change})
    data["comparisons"] = [{**synthetic.COMPARISON, "seeds": [0, 1], **(entry or {})}]
    return data


@pytest.mark.parametrize(
    ("change", "entry", "message"),
    [
        (  # the treatment arm left out by exclude
            {"exclude": [{"algorithm": ["grpo"]}]},
            {},
            r"comparisons\[0\].arms.treatment = 'grpo': the sweep runs it with seeds \[\] in the stratum \{\} \(after "
            r"exclude.*valid: both arms run the declared seeds \[0, 1\]",
        ),
        (  # zip mode: grpo runs seed 0, grpo_rr seed 1: no seed runs both arms
            {"mode": "zip"},
            {},
            r"arms.treatment = 'grpo': the sweep runs it with seeds \[0\] in the stratum",
        ),
        (  # another axis varies inside the comparison: two runs of a seed per arm
            {"axes": {"algorithm": ["grpo", "grpo_rr"], "lr": [1e-4, 2e-4], "seed": [0, 1]}},
            {},
            r"comparisons\[0\].stratum = \{\}: arm 'grpo' runs a seed several times in it \(axes lr vary\); valid: a "
            "stratum naming one value of each",
        ),
        (  # a test metric, but the axis that names the test split's size says 0
            {"axes": {"algorithm": ["grpo", "grpo_rr"], "eval_test_size": [0], "seed": [0, 1]}},
            {"metric": "test_in_dist"},
            r"metric = 'test_in_dist': arm 'grpo' scores no test split \(eval_test_size 0\); valid: eval_test_size",
        ),
        (  # one arm's own settings switch the test split off
            {
                "base": {"steps": 2, "eval_every": 1, "eval_test_size": 64},
                "per_algorithm": {"grpo_rr": {"eval_test_size": 0}},
            },
            {"metric": "test_in_dist"},
            r"arm 'grpo_rr' scores no test split",
        ),
        (  # a held-out metric of runs that never evaluate
            {"base": {"steps": 2, "eval_every": 0}},
            {},
            r"metric = 'eval_in_dist': arm 'grpo' never evaluates \(eval_every 0\)",
        ),
        (  # a stratum value matched exactly, not as a substring of `all`
            {"axes": {"algorithm": "all", "minibatches": [1, 4], "seed": [0, 1]}},
            {"arms": {"axis": "minibatches", "treatment": 4, "control": 1}, "stratum": {"algorithm": "al"}},
            r"comparisons\[0\].stratum.algorithm = 'al': not a value of axes.algorithm; valid: .*grpo, ",
        ),
    ],
)
def test_a_declaration_the_sweeps_runs_cannot_answer_is_refused_when_the_file_is_read(change, entry, message) -> None:
    from sweeps.expand import Sweep

    Sweep.from_dict(small_sweep(), where="small.yaml")  # readable as it stands
    with pytest.raises(SweepError, match=message):
        Sweep.from_dict(small_sweep(entry, **change), where="small.yaml")


def test_every_sweep_files_comparisons_are_readable_from_its_runs() -> None:
    from sweeps.expand import load_sweep

    files = [p for p in sorted((ROOT / "sweeps").glob("*.yaml")) if "comparisons" in yaml.safe_load(p.read_text())]
    assert files
    for path in files:
        load_sweep(path)  # raises naming the field when a declaration cannot be read from the runs
        for c in declared.from_sweep(path):
            assert c.test in declared.TESTS and np.isfinite(declared.sizing(c))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"threshold": float("inf")}, r"comparisons\[0\]: ValueError replay_cost: threshold = inf; valid: a finite"),
        ({"alpha": float("nan")}, r"replay_cost: alpha = nan; valid: a finite number"),
        ({"threshold": -0.1, "alternative": "greater"}, r"threshold = -0.1 with alternative = 'greater'; valid: great"),
        ({"test": "gap"}, r"test = 'gap'; valid: difference, minimum_effect, exclude, equivalence"),
        ({"test": None}, r"test = None; valid: difference"),
    ],
)
def test_the_analysis_refuses_a_declaration_it_cannot_read(tmp_path, change: dict, message: str) -> None:
    """A sweep file handed to the report need not have passed the sweep's checks: numbers no reading can use are
    refused there too (an infinite threshold once read "contradicted" off any interval)."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "comparisons": [{**synthetic.COMPARISON, **change}]}))
    with pytest.raises(ValueError, match=message):
        declared.from_sweep(path)


def test_each_test_names_what_its_interval_is_read_against() -> None:
    """The forest draws these: 0 for a difference, the declared size for a minimum effect or an exclusion, the two
    margins for an equivalence."""
    got = {
        test: declared.read_at(declared.Comparison.from_entry({**ENTRY, "test": test, "alternative": "greater"}))
        for test in ("difference", "minimum_effect", "exclude")
    }
    eq = declared.Comparison.from_entry({**ENTRY, "test": "equivalence", "alternative": "two-sided"})
    assert got == {"difference": (0.0,), "minimum_effect": (0.1,), "exclude": (0.1,)}
    assert declared.read_at(eq) == (-0.1, 0.1)
