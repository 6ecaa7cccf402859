"""analysis.stats.design on synthetic runs with known answers: pairing by seed, a family's multiplicity control, the
compute window the rule names, per-update vs cumulative routing volatility, C2 in the paper's units, C6's split."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis.runs import vocab
from analysis.stats import curves, design, intervals
from analysis.stats.intervals import CI


def long_table(runs: dict[str, dict], metrics: dict[str, np.ndarray | float], compute: np.ndarray) -> pd.DataFrame:
    """A tidy long table: runs[run_id] = {algorithm, seed, ...}; every run logs each metric at steps 1..len(compute)
    (an array per step, or a constant)."""
    frames = []
    steps = np.arange(1, len(compute) + 1)
    for run_id, info in runs.items():
        for metric, value in metrics.items():
            vals = np.broadcast_to(np.asarray(value(info) if callable(value) else value, np.float64), steps.shape)
            frames.append(
                pd.DataFrame(
                    {
                        "run_id": run_id,
                        **info,
                        "step": steps,
                        "compute_flops": compute,
                        "wall_s": steps * 1.0,
                        "metric": metric,
                        "value": vals,
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)


def test_a_paired_design_that_welch_cannot_see() -> None:
    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0, 0.1, 6)  # a seed's prompts and cold start move both of its arms
    control = {s: 0.4 + seed_effect[s] + rng.normal(0, 0.005) for s in range(6)}
    treatment = {s: 0.43 + seed_effect[s] + rng.normal(0, 0.005) for s in range(6)}
    unpaired = intervals.mean_difference(list(treatment.values()), list(control.values()))
    paired = design.paired_difference(treatment, control)
    assert unpaired.low < 0 < unpaired.high  # the seed spread swamps the gap
    assert paired.ci.low > 0 and paired.ci.covers(0.03) and paired.p_value < 0.01
    assert paired.unit == "seed" and paired.units == tuple(range(6)) and "paired by seed" in str(paired)
    # a unit with one arm is dropped and named, never imputed
    short = design.paired_difference(treatment, {s: v for s, v in control.items() if s != 5})
    assert short.ci.n == 5 and short.unpaired == (5,)


def test_paired_arms_reads_a_per_run_table_and_refuses_ambiguous_units() -> None:
    per_run = pd.DataFrame(
        {"algorithm": ["grpo", "grpo_rr"] * 3, "seed": [0, 0, 1, 1, 2, 2], "value": [0.1, 0.3, 0.2, 0.35, 0.15, 0.33]}
    )
    p = design.paired_arms(per_run, "algorithm", "grpo_rr", "grpo")
    assert p.differences == pytest.approx((0.2, 0.15, 0.18))
    with pytest.raises(ValueError, match=r"algorithm = 'grpo' has several runs of seed \[0\]"):
        design.paired_arms(pd.concat([per_run, per_run.iloc[:1]]), "algorithm", "grpo_rr", "grpo")


def test_a_null_family_of_28_excludes_zero_far_more_often_unadjusted() -> None:
    rng = np.random.default_rng(1)
    sims, m, seeds = 400, 28, 6
    diffs = rng.normal(0.0, 0.05, (sims, m, seeds))  # every comparison null
    p = sps.ttest_1samp(diffs, 0.0, axis=2).pvalue  # (sims, m): each comparison's paired t test
    raw = np.mean(
        [bool(((low > 0) | (high < 0)).any()) for _, low, high, _ in map(intervals.mean_band, diffs.transpose(0, 2, 1))]
    )
    bonf = np.mean([any(not c.covers(0.0) for c in design.simultaneous(list(family))) for family in diffs])
    holm = [bool((design.holm(family) < 0.05).any()) for family in p[:20]]  # statsmodels: a gc pass per call
    assert holm == [bool(family.min() * m < 0.05) for family in p[:20]]  # Holm rejects any iff its first step does
    holm_rate = np.mean(p.min(axis=1) * m < 0.05)
    assert raw > 0.65  # 1 - 0.95^28 = 0.76
    assert bonf < 0.09 and holm_rate < 0.09  # the family-wise error held at about 5%
    assert design.simultaneous([np.array([1.0, 1.1, 1.2])] * 4)[0].confidence == pytest.approx(1 - 0.05 / 4)
    adjusted = design.holm([0.01, 0.04, 0.03, np.nan])
    assert adjusted[:3] == pytest.approx([0.03, 0.06, 0.06]) and np.isnan(adjusted[3])


def test_the_window_the_rule_names_is_the_one_computed() -> None:
    compute = np.cumsum(np.linspace(1.0, 3.0, 40)) * 1e12  # steps grow: the last 10% of steps is not of compute
    runs = {"a": {"algorithm": "grpo", "seed": 0}, "b": {"algorithm": "grpo", "seed": 1}}
    long = long_table(runs, {vocab.REWARD: lambda info: np.arange(40.0) + info["seed"]}, compute)
    rule = curves.window_rule()
    frac = float(re.search(r"\[\(1 - ([0-9.]+)\) x C, C\]", rule).group(1))
    assert "the last 10% of compute" in rule and frac == curves.WINDOW_FRAC
    win = curves.compute_window(long, vocab.REWARD)
    end = compute[-1]
    inside = np.flatnonzero(compute >= (1 - frac) * end)
    assert (win["compute_from"] == compute[inside[0]]).all() and (win["compute_to"] == end).all()
    assert compute[inside[0] - 1] < (1 - frac) * end  # the step before lies outside
    assert win["n_points"].tolist() == [inside.size] * 2
    assert win["value"].tolist() == pytest.approx([np.mean(inside), np.mean(inside) + 1])
    assert inside.size != curves.final_window(long, vocab.REWARD)["n_points"].iloc[0]  # 10% of steps differs
    # a common budget: a run that stopped before the window has no value
    cut = long[~((long["run_id"] == "b") & (long["step"] > 20))]
    assert np.isnan(curves.compute_window(cut, vocab.REWARD, budget=end)["value"].iloc[1])


@pytest.mark.parametrize(
    ("mb2", "in_regime", "sentence"),
    [
        (0.006, False, "not tested in regime: cumulative 6%, per update 0.6%; threshold 5% per update (only the cumul"),
        (0.08, True, "in regime: per update 8% >= 5% (cumulative 6%, per update 8%)"),
        (0.001, False, "not tested in regime: cumulative 6%, per update 0.1%; threshold 5% per update (only"),
    ],
)
def test_per_update_and_cumulative_volatility(mb2: float, in_regime: bool, sentence: str) -> None:
    runs = {f"r{s}": {"algorithm": "grpo", "seed": s} for s in range(3)}
    long = long_table(runs, {vocab.ROUTING_SLOT: 0.06, design.PER_UPDATE: mb2}, np.arange(1.0, 9.0))
    v = design.volatility(long, threshold=0.05)
    assert v.in_regime is in_regime and v.sentence.startswith(sentence), v.sentence
    assert v.per_update.estimate == pytest.approx(mb2) and v.cumulative.estimate == pytest.approx(0.06)
    unmeasured = design.volatility(long_table(runs, {vocab.ROUTING_SLOT: 0.06}, np.arange(1.0, 9.0)))
    assert not unmeasured.in_regime and "per-update volatility (routing_slot_mismatch_mb2) not measured" in (
        unmeasured.sentence
    )


def test_c2_is_read_beside_the_papers_two_orders_of_magnitude() -> None:
    r = design.size_against_paper(CI(10.0, 6.0, 16.0, 4))
    assert r.direction_supported is True and r.size_of_paper == pytest.approx(0.5)
    assert r.sentence.startswith("direction supported, size 0.5 of the paper's (ratio 10x [6, 16] (n=4) vs")
    assert design.size_against_paper(CI(1.2, 0.8, 1.7, 3)).sentence.startswith("direction not decided")
    assert design.size_against_paper(CI(0.5, 0.3, 0.8, 3)).direction_supported is False


def test_c6_length_gain_splits_into_truncation_and_rl() -> None:
    rng = np.random.default_rng(2)
    rows = []
    for length, cold, gain in ((16, 0.184, 0.10), (32, 0.303, 0.10)):  # equal RL gains: all of it is truncation
        for seed in range(4):
            start = cold + rng.normal(0, 0.005)
            rows.append(
                {"max_new_tokens": length, "seed": seed, "start": start, "final": start + gain + rng.normal(0, 0.01)}
            )
    gains = pd.DataFrame(rows).assign(value=lambda d: d["final"] - d["start"])
    d = design.length_decomposition(gains)
    assert d.truncation_part.covers(0.119) and d.truncation_part.low > 0.1
    assert d.rl_part.covers(0.0) and d.final_difference.low > 0.05
    assert d.final_difference.estimate == pytest.approx(d.truncation_part.estimate + d.rl_part.estimate)
    assert set(d.gains) == {16.0, 32.0} and d.gains[16.0].covers(0.10)
    with pytest.raises(ValueError, match="max_new_tokens: 1 value"):
        design.length_decomposition(gains[gains["max_new_tokens"] == 16])


def test_c6_length_decomposition_pairs_the_seeds_both_lengths_ran() -> None:
    # A seed's runs at both lengths share its prompts: a large seed effect on RL's gain, the same at both lengths,
    # and a small real length effect (+0.02). Welch over runs drowns it in the seeds' spread; within each seed it
    # is plain.
    rng = np.random.default_rng(5)
    seed_effect = rng.normal(0, 0.08, 6)
    rows = []
    for length, cold, extra in ((16, 0.184, 0.0), (32, 0.303, 0.02)):
        for seed in range(6):
            gain = 0.10 + seed_effect[seed] + extra + rng.normal(0, 0.003)
            rows.append({"max_new_tokens": length, "seed": seed, "start": cold, "final": cold + gain})
    gains = pd.DataFrame(rows).assign(value=lambda d: d["final"] - d["start"])
    paired = design.length_decomposition(gains)
    assert paired.pairing == "paired by seed" and paired.n == "6 seeds, paired"
    assert paired.rl_part.low > 0 and paired.rl_part.covers(0.02) and len(paired.rl_differences) == 6
    assert paired.final_difference.estimate == pytest.approx(paired.truncation_part.estimate + paired.rl_part.estimate)
    welch = design.length_decomposition(gains.drop(columns="seed"))  # no unit to pair on
    assert welch.pairing == "unpaired (Welch)" and welch.n == "6 vs 6" and welch.rl_part.covers(0.0)
    assert welch.rl_part.estimate == pytest.approx(paired.rl_part.estimate)
    # different seeds at the two lengths: nothing to pair
    shifted = gains.assign(seed=gains["seed"] + 10 * (gains["max_new_tokens"] == 32))
    assert design.length_decomposition(shifted).pairing == "unpaired (Welch)"


def test_rliable_iqm_and_probability_of_improvement() -> None:
    x = np.array([[0.1], [0.2], [0.3], [0.4], [0.5], [0.6], [0.7], [0.8]])
    iqm, low, high = design.iqm_interval({"a": x}, reps=500)["a"]
    assert iqm == pytest.approx(np.mean([0.3, 0.4, 0.5, 0.6])) and low < iqm < high
    p, lo, hi = design.probability_of_improvement(x + 1.0, x, reps=500)
    assert p == 1.0 and lo == hi == 1.0
    assert design.probability_of_improvement(x, x, reps=500)[0] == pytest.approx(0.5)


def test_algorithm_table_puts_iqm_and_probability_of_improvement_beside_the_t_interval(tmp_path) -> None:
    from analysis.report import sections
    from analysis.runs import tidy
    from analysis.stats import gain
    from tests.analysis import synthetic

    c = synthetic.Curve
    curves = {"grpo": c(a=0.4, c_mid=2e12), "gspo": c(a=0.8, c_mid=2e12)}
    synthetic.make_study(tmp_path, curves, seeds=(0, 1, 2, 3), n_steps=30, grid={"max_new_tokens": [256, 1024]})
    st = tidy.load_study(tmp_path)
    per = gain.per_run(st.long)
    t = design.algorithm_table(per, ["max_new_tokens"], reference="grpo", reps=300).set_index("algorithm")
    assert t["tasks"].tolist() == [2, 2] and t["n"].tolist() == [8, 8]
    for alg in ("grpo", "gspo"):
        x = per.loc[per["algorithm"].astype(str) == alg, "value"].to_numpy()
        assert t.loc[alg, "mean"] == pytest.approx(x.mean())  # the t interval's mean, beside
        assert t.loc[alg, "iqm"] == pytest.approx(np.mean(np.sort(x)[2:6]))  # the middle 50% of 8 scores
        assert t.loc[alg, "iqm_low"] <= t.loc[alg, "iqm"] <= t.loc[alg, "iqm_high"]
    # GSPO's every run gains more than GRPO's: P(gspo > grpo) = 1; the reference has none against itself
    assert t.loc["gspo", "p_improve"] == 1.0 and np.isnan(t.loc["grpo", "p_improve"])
    table, note = sections.algorithm_table(st, gain.heldout_gain(st), reps=300)
    assert list(table.columns[2:5]) == [
        "eval_in_dist gain, mean [95% t]",
        "IQM [nominal 95% bootstrap]",
        "P(> GRPO) [nominal 95% bootstrap]",
    ]
    assert table.iloc[1, 4].startswith("1.00 [") and "stratified percentile bootstrap" in note and "exploratory" in note


def test_algorithm_table_with_one_run_per_task_has_estimates_without_interval() -> None:
    per = pd.DataFrame(
        {"algorithm": ["a", "b", "a", "b"], "task": [1, 1, 2, 2], "seed": [0, 0, 0, 0], "value": [0.5, 0.2, 0.6, 0.1]}
    )
    t = design.algorithm_table(per, ["task"], reference="b", reps=100).set_index("algorithm")
    assert t.loc["a", "iqm"] == pytest.approx(0.55) and np.isnan(t.loc["a", "iqm_low"])
    assert t.loc["a", "p_improve"] == 1.0 and np.isnan(t.loc["a", "p_low"])


def test_algorithm_table_tasks_with_a_missing_axis_value_and_configurations_one_algorithm_lacks() -> None:
    # the dense control's axis (NaN for the MoE runs) is a task value like any other; a configuration only "a" ran
    # (task 3) is left out, so both algorithms are scored on the same two tasks and the mean is over those runs
    per = pd.DataFrame(
        {
            "algorithm": ["a", "b"] * 4 + ["a", "a"],
            "task": [1.0, 1.0, 1.0, 1.0, np.nan, np.nan, np.nan, np.nan, 3.0, 3.0],
            "seed": [0, 0, 1, 1, 0, 0, 1, 1, 0, 1],
            "value": [0.5, 0.2, 0.7, 0.1, 0.6, 0.3, 0.4, 0.2, 9.0, 9.0],
        }
    )
    t = design.algorithm_table(per, ["task"], reference="b", reps=100).set_index("algorithm")
    assert t["tasks"].tolist() == [2, 2] and t["n"].tolist() == [4, 4]
    assert t.loc["a", "mean"] == pytest.approx(0.55) and t.loc["a", "p_improve"] == 1.0
