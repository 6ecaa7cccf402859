"""The ScaleRL fit recovers a known sigmoid, says when A is not identified, and compares A before B."""

import numpy as np
import pytest

from analysis.stats import fit

X = 1e11 * np.arange(1, 1001)  # cumulative compute of 1,000 steps
GRID = np.geomspace(X[0], X[-1], 60)


def _runs(truth, *, seeds, noise, rng):
    y = fit.sigmoid(X, **truth) + noise * rng.standard_normal((seeds, X.size))
    return np.array([np.interp(np.log(GRID), np.log(X), r) for r in y])


def test_noise_free_sigmoid_is_recovered_exactly():
    truth = {"r0": 0.1, "a": 0.6, "b": 1.2, "c_mid": 1e13}
    f = fit.fit_curves(GRID, _runs(truth, seeds=1, noise=0.0, rng=np.random.default_rng(0)), r0=0.1, n_boot=0)
    assert f.params.a == pytest.approx(0.6, abs=1e-4)
    assert f.params.b == pytest.approx(1.2, rel=1e-3)
    assert f.params.c_mid == pytest.approx(1e13, rel=1e-3)
    assert f.a_identified


@pytest.mark.parametrize(
    "truth", [{"r0": 0.1, "a": 0.6, "b": 1.2, "c_mid": 1e13}, {"r0": 0.05, "a": 0.85, "b": 2.5, "c_mid": 2e13}]
)
def test_noisy_sigmoid_is_recovered_within_its_bootstrap_interval(truth):
    f = fit.fit_curves(GRID, _runs(truth, seeds=8, noise=0.02, rng=np.random.default_rng(7)), n_boot=200)
    assert f.a_ci[0] <= truth["a"] <= f.a_ci[1]
    assert f.b_ci[0] <= truth["b"] <= f.b_ci[1]
    assert f.c_mid_ci[0] <= truth["c_mid"] <= f.c_mid_ci[1]
    assert abs(f.params.a - truth["a"]) < 0.02
    assert f.a_ci[1] - f.a_ci[0] < 0.05  # informative, not a trivially wide interval
    assert f.a_identified and f.ci_method.startswith("bootstrap")


def test_too_short_a_run_is_reported_as_unidentified():
    truth = {"r0": 0.1, "a": 0.9, "b": 1.0, "c_mid": 5e14}  # C_mid five times beyond the last step
    f = fit.fit_curves(GRID, _runs(truth, seeds=4, noise=0.02, rng=np.random.default_rng(1)), n_boot=100)
    assert not f.a_identified
    assert any("A not identified" in n for n in f.notes)


def test_single_seed_uses_the_profile_interval():
    truth = {"r0": 0.1, "a": 0.6, "b": 1.2, "c_mid": 1e13}
    f = fit.fit_curves(GRID, _runs(truth, seeds=1, noise=0.01, rng=np.random.default_rng(3)))
    assert f.ci_method.startswith("profile") and f.a_ci == f.a_profile
    assert f.a_ci[0] <= f.params.a <= f.a_ci[1]


def test_compare_decides_by_a_then_by_b_at_common_a():
    rng = np.random.default_rng(5)
    lo = fit.fit_curves(GRID, _runs({"r0": 0.1, "a": 0.6, "b": 1.5, "c_mid": 1e13}, seeds=6, noise=0.02, rng=rng))
    hi = fit.fit_curves(GRID, _runs({"r0": 0.1, "a": 0.8, "b": 1.5, "c_mid": 1e13}, seeds=6, noise=0.02, rng=rng))
    c = fit.compare_fits(lo, hi)
    assert c.decided_by == "A" and c.winner == 1 and c.a_diff < -0.15
    slow = fit.fit_curves(GRID, _runs({"r0": 0.1, "a": 0.7, "b": 1.0, "c_mid": 1e13}, seeds=6, noise=0.01, rng=rng))
    fast = fit.fit_curves(GRID, _runs({"r0": 0.1, "a": 0.7, "b": 3.0, "c_mid": 1e13}, seeds=6, noise=0.01, rng=rng))
    c = fit.compare_fits(slow, fast)
    assert c.decided_by == "B at common A" and c.winner == 1
    assert c.b_at_common_a[1] > c.b_at_common_a[0]


def test_fit_study_on_tidy_data(study):
    fits = fit.fit_study(study.long, runs=study.runs, n_boot=50)
    table = fit.fits_table(fits).set_index("algorithm")
    assert "grpo" in table.index and "not fitted" in table.loc["grpo", "notes"]
    # 200 steps of 1e11 FLOPs end at 2e13, past gspo's C_mid of 1.5e13: A is identified, near 0.8.
    assert table.loc["gspo", "A_identified"]
    assert table.loc["gspo", "A_low"] <= 0.8 <= table.loc["gspo", "A_high"] + 0.02


def test_flat_data_are_not_identified():
    # on flat data an unguarded fit rises to A = 1 with B at its bound of 20 and A's interval [0.078, 1.000]
    rng = np.random.default_rng(11)
    flat = 0.1 + 0.035 * rng.standard_normal((3, GRID.size))
    f = fit.fit_curves(GRID, flat, n_boot=100)
    assert not f.identified and f.why_not_identified
    assert any("bound" in n for n in f.notes)
    assert not fit.fits_table({("flat",): f}).iloc[0]["identified"]
    # the constrained curve of the same shape of data is identified, parameters and intervals inside the bounds
    truth = {"r0": 0.1, "a": 0.6, "b": 1.2, "c_mid": 1e13}
    g = fit.fit_curves(GRID, _runs(truth, seeds=3, noise=0.035, rng=rng), n_boot=100)
    assert g.identified and g.why_not_identified == "" and not any(g.boot_at_bound.values())
    assert fit.compare_fits(f, g).decided_by == "inconclusive"


def test_figure7_draws_identified_fits_only(tmp_path):
    from analysis import figures
    from analysis.runs import tidy
    from tests.analysis import synthetic

    C = synthetic.Curve
    curves = {"gspo": C(a=0.8, b=2.0, c_mid=1e13), "grpo": C(a=0.1, r0=0.1, noise=0.035)}  # a sigmoid, flat data
    synthetic.make_study(tmp_path, curves, seeds=(0, 1, 2), n_steps=200, flops_per_step=1e11)
    study = tidy.load_study(tmp_path)
    fits = fit.fit_study(study.long, runs=study.runs, n_boot=100)
    assert fits[("gspo",)].identified and not fits[("grpo",)].identified
    made = figures.figure7_fits(study, fits=fits)
    gids = {line.get_gid() for ax in made.fig.axes for line in ax.get_lines()}
    assert {"fit-curve-gspo", "fit-extrapolation-gspo", "fit-asymptote-gspo", "fit-points-gspo"} <= gids
    assert "fit-points-grpo" in gids and not {g for g in gids if g and g.startswith("fit-") and "grpo" in g} - {
        "fit-points-grpo"
    }
    assert "Not identified, points only and no numbers: GRPO (" in made.caption
