"""Every figure builds on synthetic data and writes non-empty PNG/PDF/SVG; Figure 2's bars are in the right order."""

import numpy as np
import pytest

from analysis import figures
from analysis.figures import MissingData
from analysis.figures.fig3_routing_replay import routing_families
from analysis.runs import names
from analysis.stats import curves


@pytest.fixture(scope="module")
def rendered(study, tmp_path_factory):
    return figures.make_all(study, tmp_path_factory.mktemp("figs"))


def test_every_figure_renders_in_three_formats(rendered):
    # the study sweeps no minibatches per rollout batch: the off-policy figure alone is skipped, saying why
    assert set(rendered.skipped) == {"figure9_offpolicy_replay"}, rendered.skipped
    assert "does not sweep it" in rendered.skipped["figure9_offpolicy_replay"]
    assert set(rendered.paths) == set(figures.FIGURES) - {"figure9_offpolicy_replay"}
    for paths in rendered.paths.values():
        assert sorted(p.suffix for p in paths) == [".pdf", ".png", ".svg"]
        for p in paths:
            assert p.stat().st_size > 1000
    for caption in rendered.captions.values():
        assert caption.startswith("Figure")


def test_clip_fraction_bars_are_in_registry_order_with_the_known_heights(study):
    made = figures.figure2_clipping(study)
    ax = made.fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    algs = names.order(["gspo_rr", "sapo", "grpo", "gspo", "grpo_rr"])
    assert labels == [names.label(a) for a in algs]
    per_run = {
        part: curves.run_mean(study.long, m)
        for part, m in {"total": "clip_frac", "low": "clip_frac_low", "high": "clip_frac_high"}.items()
    }
    truth = {
        "grpo": (0.0004, 0.0009),
        "grpo_rr": (0.0005, 0.0008),
        "gspo": (0.05, 0.1),
        "gspo_rr": (0.04, 0.09),
        "sapo": (0.0, 0.0),
    }
    for part in ("total", "low", "high"):
        bars = [p for p in ax.patches if p.get_gid() == f"clip-{part}"]
        heights = np.array([b.get_height() for b in bars])
        expected = per_run[part].groupby("algorithm", observed=True)["value"].mean().reindex(algs).to_numpy()
        np.testing.assert_allclose(heights, expected)
        # ... and close to the synthetic truth (noise 5%): the order of magnitude is right.
        known = np.array([sum(truth[a]) if part == "total" else truth[a][part == "high"] for a in algs])
        np.testing.assert_allclose(heights, known, rtol=0.05)
        assert [b.get_facecolor()[:3] for b in bars] == [
            tuple(int(names.color(a)[i : i + 2], 16) / 255 for i in (1, 3, 5)) for a in algs
        ]
    assert ax.get_yscale() == "log"


def test_routing_families_pair_by_loss_and_routing_not_by_name():
    fams = routing_families(["gspo", "grpo_rr", "grpo", "gspo_rr", "sapo", "grpo_r3"])
    assert fams == [["grpo", "grpo_rr", "grpo_r3"], ["gspo", "gspo_rr"]]


def test_figure3_marks_collapsed_runs(study):
    made = figures.figure3_routing_replay(study)
    marks = [line for ax in made.fig.axes for line in ax.get_lines() if line.get_gid() == "collapse"]
    assert len(marks) == int((study.runs["state"] == "collapsed").sum())
    # a row per configuration of the swept axes (max_new_tokens x rollout_precision), never a mean across them: each
    # panel holds the runs of its configuration and family alone (one thin line per run, one thick mean per algorithm)
    axes = ["max_new_tokens", "rollout_precision"]
    configs = study.runs[axes].drop_duplicates().sort_values(axes)
    titles = [
        f"{names.label(fam)}\nmax_new_tokens={t}, rollout_precision={d}"
        for t, d in configs.itertuples(index=False)
        for fam in ("grpo", "gspo")
    ]
    assert [ax.get_title() for ax in made.fig.axes] == titles
    for ax, title in zip(made.fig.axes, titles, strict=True):
        t, d = title.split("\n")[1].replace("max_new_tokens=", "").replace("rollout_precision=", "").split(", ")
        fam = ["grpo", "grpo_rr"] if title.startswith(names.label("grpo")) else ["gspo", "gspo_rr"]
        runs = study.runs[
            study.runs["algorithm"].isin(fam)
            & (study.runs["max_new_tokens"].astype(str) == t)
            & (study.runs["rollout_precision"].astype(str) == d)
        ]
        thin = [ln for ln in ax.get_lines() if ln.get_linewidth() == 0.5]
        assert len(thin) == len(runs) > 0, title


def test_missing_axis_is_a_clear_error(study):
    with pytest.raises(MissingData, match="not swept"):
        figures.figure5_length(study, axis="no.such.axis")


@pytest.fixture(scope="module")
def small_study(tmp_path_factory):
    # a laptop default study: 4 algorithms x 3 seeds, 40 steps of ~1.5e10 FLOPs, evals every 10 steps, flat
    # noisy rewards: the eval panels' ticks must not overlap ("3x10^-4 4x10^-4 6x10^-4") nor legends cover data
    from analysis.runs import tidy
    from tests.analysis import synthetic

    C = synthetic.Curve
    curves = {a: C(a=0.075, b=1.0, c_mid=1e11, r0=0.15, noise=0.035) for a in ("grpo", "grpo_rr", "gspo", "gspo_rr")}
    root = tmp_path_factory.mktemp("small")
    synthetic.make_study(root, curves, seeds=(0, 1, 2), n_steps=40, flops_per_step=1.5e10, eval_every=10)
    return tidy.load_study(root)


@pytest.mark.parametrize("which", ["study", "small_study"])
def test_every_figure_reads_at_a_glance(which, request, layout_problems):
    st = request.getfixturevalue(which)
    for name, fn in figures.FIGURES.items():
        try:
            made = fn(st, n_boot=20) if name == "figure7_fits" else fn(st)
        except MissingData:
            continue
        assert layout_problems(made.fig) == [], name
        # one legend per figure, outside every panel that holds data
        assert not [ax for ax in made.fig.axes if ax.get_legend() is not None and ax.has_data()], name


def test_algorithm_colours_are_colour_blind_safe_and_visible_on_white():
    from matplotlib.colors import to_rgb

    def luminance(hex_colour):
        c = np.array(to_rgb(hex_colour))
        c = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
        return float(c @ [0.2126, 0.7152, 0.0722])

    reg = names.registry()
    colours = [names.color(n) for n in reg.names()]
    assert len(set(colours)) == len(colours)  # every algorithm its own colour
    for name, c in zip(reg.names(), colours, strict=True):
        assert 1.05 / (luminance(c) + 0.05) >= 2.0, f"{name}: {c} is too light on white (yellow?)"
    okabe_ito = {"#D55E00", "#0072B2", "#009E73", "#CC79A7"}
    assert {names.color(a) for a in ("grpo", "grpo_rr", "gspo", "gspo_rr")} == okabe_ito


def test_curves_begin_where_every_seed_has_logged(study):
    made = figures.figure1_reward(study)
    curves = made.tables["reward_mean"]
    first = curves.dropna(subset=["mean"]).groupby(["algorithm", "max_new_tokens", "rollout_precision"], observed=True)
    assert (first["n"].first() == 3).all()  # every configuration's first point is a mean over its 3 seeds


# --- the step-0 row and the routing-volatility figure -----------------------------------------------------------------
def test_figure1_eval_panels_begin_at_the_start_and_the_reward_at_step_1(study, tmp_path, layout_problems):
    made = figures.figure1_reward(study)
    for metric, table in made.tables.items():
        at0 = table[table["compute_flops"] == 0]
        if metric == "reward_mean":
            assert at0.empty  # the training reward begins at the first RL step
        else:  # one point per configuration at compute 0: the mean of its 3 seeds' step-0 evaluations
            assert len(at0) == len(table.drop_duplicates(["algorithm", "max_new_tokens", "rollout_precision"]))
            assert (at0["n"] == 3).all() and at0["mean"].notna().all()
    for ax in made.fig.axes:
        assert ax.get_xscale() == "symlog" and ax.get_xlim()[0] == 0
    assert [line for line in made.fig.axes[1].get_lines() if line.get_gid() == "start"]
    assert "held-out panels begin at compute 0" in made.caption
    assert layout_problems(made.fig) == []
    assert made.fig.axes[1].xaxis.get_major_locator()()[0] == 0.0  # "0" is the first tick

    # runs without a step-0 row: a plain log axis from the first evaluation, and the caption says why
    from analysis.runs import tidy
    from tests.analysis import synthetic

    synthetic.make_study(tmp_path, {"gspo": synthetic.Curve()}, seeds=(0, 1), n_steps=30, start_eval=False)
    old = figures.figure1_reward(tidy.load_study(tmp_path))
    assert all(ax.get_xscale() == "log" for ax in old.fig.axes)
    assert all((t["compute_flops"] > 0).all() for t in old.tables.values())
    assert "No run has an evaluation of its starting policy" in old.caption
    assert "temperature" not in made.caption  # every run samples at 1

    hot = tmp_path / "hot"
    synthetic.make_study(hot, {"gspo": synthetic.Curve()}, seeds=(0, 1), n_steps=30, grid={"temperature": [1.4]})
    caption = figures.figure1_reward(tidy.load_study(hot)).caption
    assert "rollouts', sampled at temperature 1.4; the held-out evaluations sample at temperature 1." in caption


def test_figure1_keeps_an_evaluation_whose_compute_differs_by_seed(tmp_path):
    """A run that evaluates at its start and its last step only, its seeds at different compute there (they
    generated different lengths): the held-out panel's last point is the mean of both seeds, not left out."""
    import pandas as pd

    from analysis.runs import tidy
    from tests.analysis import synthetic

    synthetic.make_study(tmp_path, {"gspo": synthetic.Curve()}, seeds=(0, 1), n_steps=16, eval_every=16)
    path = sorted((tmp_path / "runs").glob("*/metrics.parquet"))[1]
    m = pd.read_parquet(path)
    m["compute_flops"] *= 1.05
    m.to_parquet(path)
    made = figures.figure1_reward(tidy.load_study(tmp_path))
    for metric, table in made.tables.items():
        if metric == "reward_mean":
            continue
        assert list(table["n"]) == [2, 2], (metric, table)
        assert table["compute_flops"].iloc[-1] == pytest.approx(16e11 * (1 + 1.05) / 2)


@pytest.fixture(scope="module")
def routing_study(tmp_path_factory):
    from analysis.runs import tidy
    from tests.analysis import synthetic

    root = tmp_path_factory.mktemp("routing")
    synthetic.make_routing_study(root, seeds=(0, 1, 2), n_steps=60)
    return tidy.load_study(root)


def test_figure8_gaps_against_routing_volatility_have_the_known_answer(routing_study, layout_problems):
    from tests.analysis import synthetic

    made = figures.figure8_routing_volatility(routing_study)
    vol, gaps, load = made.tables["volatility"], made.tables["gaps"], made.tables["routing_load"]
    # x: the measured volatility per configuration rises with the router learning-rate scale, as constructed
    assert vol["router_lr_scale"].tolist() == list(synthetic.ROUTER_LR_SCALES)
    assert vol["mean"].is_monotonic_increasing and (vol["n"] == 12).all() and (vol["low"] < vol["high"]).all()
    truth = [synthetic.routing_truth(s)["grpo"].slot_mismatch for s in synthetic.ROUTER_LR_SCALES]
    np.testing.assert_allclose(vol["mean"], np.array(truth) * 1.1, rtol=0.05)  # +20% drift over the run: x 1.1
    # the pairs are the claims' (registry replay partners, the GRPO baseline), never picked by name here
    assert list(dict.fromkeys(gaps["claim"])) == ["C1", "C3", "C4"]
    c3 = gaps[(gaps["claim"] == "C3") & (gaps["quantity"] == "final reward")]
    assert c3["estimate"].is_monotonic_increasing and (c3["low"] > 0).all()  # replay's gain opens with volatility
    c4 = gaps[(gaps["claim"] == "C4") & (gaps["quantity"] == "final reward")]
    assert (c4["low"] < 0.02).all() and (c4["estimate"].abs() < 0.02).all()  # GSPO: no gap at any volatility
    assert set(gaps["quantity"]) == {"final reward", "held-out gain"}
    # a seed's arms are paired; the gaps are one exploratory family (Holm never below the raw p-value)
    assert (gaps["pairing"] == "paired by seed").all() and (gaps["n"] == "3 seeds, paired").all()
    assert (gaps["p_holm"] >= gaps["p"] - 1e-12).all() and gaps["family"].str.startswith("exploratory, family").all()
    assert ((gaps["simultaneous_low"] <= gaps["low"]) & (gaps["simultaneous_high"] >= gaps["high"])).all()
    assert set(load["metric"]) == {"expert_load_imbalance", "router_entropy"} and (load["n"] == 3).all()
    imb = load[(load["metric"] == "expert_load_imbalance") & (load["algorithm"] == "grpo_rr")]["mean"]
    assert imb.is_monotonic_increasing
    assert layout_problems(made.fig) == []
    assert not [ax for ax in made.fig.axes if ax.get_legend() is not None]
    assert "router_lr_scale" in made.caption and "C3" in made.caption


def test_figure8_needs_a_swept_axis_and_says_so_without_a_start(small_study, tmp_path):
    from analysis.runs import tidy
    from tests.analysis import synthetic

    with pytest.raises(MissingData, match="swept axis other than algorithm"):
        figures.figure8_routing_volatility(small_study)
    synthetic.make_routing_study(tmp_path, scales=(1.0, 300.0), seeds=(0, 1), n_steps=30, start_eval=False)
    made = figures.figure8_routing_volatility(tidy.load_study(tmp_path))
    assert set(made.tables["gaps"]["quantity"]) == {"final reward"}
    assert "no held-out gain (no run evaluated its start at step 0)" in made.caption


def test_figure8_without_a_compared_pair_draws_the_volatility_and_says_why(tmp_path):
    from analysis.runs import tidy
    from tests.analysis import synthetic

    C = synthetic.Curve
    synthetic.make_study(
        tmp_path, {"gspo": C(), "sapo": C()}, seeds=(0, 1), n_steps=20, grid={"max_new_tokens": [8, 16]}
    )
    made = figures.figure8_routing_volatility(tidy.load_study(tmp_path))
    assert made.tables["gaps"].empty and list(made.tables["gaps"].columns)[:3] == ["config", "comparison", "claim"]
    texts = [t.get_text() for ax in made.fig.axes[:2] for t in ax.texts]
    why = "gap: no two algorithms the claims compare here"
    assert texts == [f"no final reward {why}", f"no held-out gain {why}"]
    assert len(made.tables["volatility"]) == 2 and len(made.tables["routing_load"]) == 8


def test_the_claims_forest_draws_a_one_sided_bound_as_an_arrow_to_its_open_side():
    """A declared one-sided reading ([low, +inf) or (-inf, high]) has no second end to draw: its finite bound is drawn
    with an arrow to the panel's edge, inside a panel wide enough to show it and the threshold."""
    from matplotlib.text import Annotation

    from analysis.claims.common import ClaimResult
    from analysis.figures import claims_forest
    from analysis.stats.verdicts import Evidence

    evidence = [
        Evidence("gain (difference): d", -0.003, -0.022, np.inf, "6 seeds, paired"),
        Evidence("size (exclude): d", -0.003, -np.inf, 0.015, "6 seeds, paired"),
    ]
    card = ClaimResult("C6", "claim", "contradicted", "rule", evidence, declared="gain, size", read_at=(0.0, 0.05))
    made = claims_forest.claims_forest([card])
    ax = made.fig.axes[0]
    arrows = sorted(
        (a.xyann[0], a.xy[0]) for a in ax.get_children() if isinstance(a, Annotation) and a.arrow_patch is not None
    )
    low, high = ax.get_xlim()
    assert arrows == [(-0.022, high), (0.015, low)]  # from each finite bound to the open side's edge
    assert low < -0.022 and high > 0.05  # both bounds and what they are read against (0, the declared 0.05) inside
    dashed = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
    assert dashed == [0.0, 0.05]


@pytest.mark.parametrize(
    "name", ["replay_neutral_gspo_at_triple_volatility", "rl_length_gain_gspo_size", "at_0.01", "length: 256, bf16"]
)
def test_the_forest_breaks_a_long_comparison_name_after_its_underscores(name):
    from analysis.figures.claims_forest import _wrapped

    lines = _wrapped(name).split("\n")
    assert "".join(lines) == name  # nothing lost or added: the breaks fall after underscores
    assert all(len(line) <= 23 for line in lines) or len(lines) == 1
    assert all(line.endswith("_") for line in lines[:-1])
