"""Seed statistics with known answers."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis.stats import collapse, curves, intervals


def _percentile_bootstrap_covers(x: np.ndarray, truth: float, rng: np.random.Generator) -> bool:
    means = x[rng.integers(0, x.size, (999, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return bool(lo <= truth <= hi)


def test_t_interval_covers_the_mean_at_the_nominal_rate_with_three_seeds_where_a_bootstrap_does_not():
    rng = np.random.default_rng(0)
    reps, hits_t, hits_band, hits_boot = 2000, 0, 0, 0
    for _ in range(reps):
        x = rng.normal(loc=1.0, scale=2.0, size=3)
        hits_t += intervals.mean_ci(x).covers(1.0)
        _, lo, hi, _ = intervals.mean_band(x[:, None])
        hits_band += bool(lo[0] <= 1.0 <= hi[0])
        hits_boot += _percentile_bootstrap_covers(x, 1.0, rng)
    assert 0.93 <= hits_t / reps <= 0.97 and hits_band == hits_t
    assert hits_boot / reps < 0.85  # why the project left the percentile bootstrap: 0.74 at n = 3


def test_welch_contrast_and_ratio_cover_at_the_nominal_rate_with_unequal_variances():
    rng = np.random.default_rng(1)
    reps, hits_d, hits_c, hits_r = 2000, 0, 0, 0
    for _ in range(reps):
        a, b = rng.normal(1.0, 0.1, 3), rng.normal(0.5, 0.4, 4)
        hits_d += intervals.mean_difference(a, b).covers(0.5)
        g = [rng.normal(m, s, 4) for m, s in ((0.5, 0.1), (0.4, 0.2), (0.6, 0.05), (0.3, 0.3))]
        hits_c += intervals.contrast_ci(g, (1, -1, -1, 1)).covers(-0.2)
        hits_r += intervals.ratio_ci(rng.normal(0.2, 0.01, 4), rng.normal(0.01, 0.0005, 4)).covers(20.0)
    for hits in (hits_d, hits_c, hits_r):
        assert 0.93 <= hits / reps <= 0.985, hits / reps


def test_welch_difference_matches_scipy_and_a_ratio_interval_is_positive_and_asymmetric():
    a, b = np.array([0.5, 0.7, 0.65]), np.array([0.2, 0.45, 0.3, 0.1])
    ref = sps.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    d = intervals.mean_difference(a, b)
    assert d.estimate == pytest.approx(a.mean() - b.mean()) and d.n == 3
    assert (d.low, d.high) == pytest.approx((ref.low, ref.high))
    r = intervals.ratio_ci([0.3, 0.35, 0.25], [0.01, 0.012, 0.009])
    assert 0 < r.low < r.estimate < r.high and r.high - r.estimate > r.estimate - r.low
    assert np.isnan(intervals.ratio_ci([0.1, 0.2], [0.0, 0.0]).low)  # no positive denominator: no interval
    with pytest.raises(ValueError, match="2 groups but 3 weights"):
        intervals.contrast_ci([a, b], (1, -1, 1))


def test_single_seed_has_no_interval():
    ci = intervals.mean_ci([0.3])
    assert ci.estimate == 0.3 and np.isnan(ci.low) and np.isnan(ci.high) and ci.n == 1
    assert np.isnan(intervals.mean_difference([0.3], [0.1, 0.2]).low)


def test_band_is_nan_aware():
    y = np.array([[1.0, 2.0, np.nan], [3.0, 4.0, np.nan], [5.0, np.nan, 7.0]])
    mean, lo, hi, n = intervals.mean_band(y)
    np.testing.assert_allclose(mean, [3.0, 3.0, 7.0])
    assert n.tolist() == [3, 2, 1]
    assert lo[0] < 3.0 < hi[0] and np.isnan(lo[2])
    ci = intervals.mean_ci([2.0, 4.0])  # column 1: the same interval as mean_ci of its two values
    assert (lo[1], hi[1]) == pytest.approx((ci.low, ci.high))


def _long(values_by_run):
    rows = []
    for rid, (alg, vals) in values_by_run.items():
        for s, v in enumerate(vals, 1):
            rows.append(
                {
                    "run_id": rid,
                    "algorithm": alg,
                    "seed": 0,
                    "step": s,
                    "compute_flops": s * 1.0,
                    "wall_s": s * 1.0,
                    "metric": "m",
                    "value": v,
                }
            )
    df = pd.DataFrame(rows)
    for c in ("run_id", "algorithm", "metric"):
        df[c] = df[c].astype("category")
    return df


def test_final_window_is_the_mean_of_the_last_fraction():
    long = _long({"r1": ("x", list(range(1, 11))), "r2": ("x", [5.0] * 20), "r3": ("y", [1.0, 2.0])})
    fw = curves.final_window(long, "m", frac=0.2).set_index("run_id")
    assert fw.loc["r1", "value"] == 9.5 and fw.loc["r1", "n_points"] == 2  # mean of 9, 10
    assert fw.loc["r2", "value"] == 5.0 and fw.loc["r2", "n_points"] == 4
    assert fw.loc["r3", "value"] == 2.0 and fw.loc["r3", "n_points"] == 1
    s = curves.summarize(fw, by=["algorithm"]).set_index("algorithm")
    assert s.loc["x", "mean"] == 7.25 and s.loc["x", "n"] == 2 and s.loc["y", "n"] == 1


def test_curves_interpolate_on_a_common_grid_without_extrapolating():
    long = _long({"r1": ("x", [1.0, 2.0, 3.0, 4.0]), "r2": ("x", [3.0, 4.0])})
    out = curves.aggregate_curves(long, "m", by=["algorithm"], grid=np.array([1.0, 2.0, 4.0]), log=False)
    # r2 covers x in [1, 2] only: at x = 4 the mean is r1's alone.
    np.testing.assert_allclose(out["mean"], [2.0, 3.0, 4.0])
    assert out["n"].tolist() == [2, 2, 1]


def test_study_level_summary_counts_collapsed_runs(study):
    s = curves.final_summary(study.long, "reward_mean", runs=study.runs, by=["algorithm"], states=("completed",))
    s = s.set_index("algorithm")
    assert s.loc["grpo", "n_collapsed"] == 12 and s.loc["sapo", "n_failed"] == 12
    assert s.loc["gspo", "n"] == 12 and s.loc["gspo", "low"] < s.loc["gspo", "mean"] < s.loc["gspo", "high"]
    ct = collapse.collapse_table(study.long, study.runs)
    grpo = ct[ct["algorithm"] == "grpo"]
    assert grpo["collapsed"].all() and (grpo["detected_step"] >= 120).all()
    assert not ct[ct["algorithm"] == "gspo"]["collapsed"].any()


# --- the step-0 row: the starting policy's evaluation, before any RL step ------------------------------------------
def test_the_step0_row_changes_nothing_but_where_the_evaluations_start(with_and_without_start):
    from analysis.claims import scorecard
    from analysis.stats import fit

    new, old = with_and_without_start
    assert new.runs["start_eval"].all() and not old.runs["start_eval"].any()
    assert new.runs["n_steps"].tolist() == old.runs["n_steps"].tolist()  # RL steps, the step-0 row is none
    assert (new.runs.loc[new.runs["state"] == "completed", "n_steps"] == 40).all()
    at0 = new.long[new.long["step"] == 0]
    assert set(at0["metric"].astype(str)) == {"eval_in_dist", "eval_hard", "lr"} and (at0["compute_flops"] == 0).all()
    for metric in ("reward_mean", "eval_in_dist", "lr"):  # final windows and run means are over RL steps only
        for frac in (0.1, 1.0):
            a, b = (curves.final_window(st.long, metric, frac=frac) for st in (new, old))
            pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(*(collapse.collapse_table(st.long, st.runs) for st in (new, old)))
    fits = [fit.fit_study(st.long, runs=st.runs, n_boot=10) for st in (new, old)]
    pd.testing.assert_frame_equal(*(fit.fits_table(f) for f in fits))
    for a, b in zip(*(scorecard.scorecard(st) for st in (new, old)), strict=True):
        assert (a.verdict, [str(e) for e in a.evidence]) == (b.verdict, [str(e) for e in b.evidence]), a.claim
    # curves on a log compute grid never see compute 0; the step points add the step-0 values at compute 0
    pd.testing.assert_frame_equal(*(curves.aggregate_curves(st.long, "eval_in_dist") for st in (new, old)))
    sp_new, sp_old = (curves.step_points(st.long, "eval_in_dist") for st in (new, old))
    at0 = sp_new[sp_new["compute_flops"] == 0]
    assert (at0["n"] == 3).all() and len(at0) == 3 and (sp_old["compute_flops"] > 0).all()
    pd.testing.assert_frame_equal(sp_new[sp_new["compute_flops"] > 0].reset_index(drop=True), sp_old)
