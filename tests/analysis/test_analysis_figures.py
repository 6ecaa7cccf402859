"""Every figure builds on synthetic data and writes non-empty PNG/PDF/SVG; Figure 2's bars are in the right order."""

import numpy as np
import pytest

from analysis import figures, stats, style
from analysis.figures import MissingData


@pytest.fixture(scope="module")
def rendered(study, tmp_path_factory):
    return figures.make_all(study, tmp_path_factory.mktemp("figs"))


def test_every_figure_renders_in_three_formats(rendered):
    assert not rendered.skipped, rendered.skipped
    assert set(rendered.paths) == set(figures.FIGURES)
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
    algs = style.order(["gspo_rr", "sapo", "grpo", "gspo", "grpo_rr"])
    assert labels == [style.label(a) for a in algs]
    per_run = {part: stats.run_mean(study.long, m) for part, m in
               {"total": "clip_frac", "low": "clip_frac_low", "high": "clip_frac_high"}.items()}  # fmt: skip
    truth = {"grpo": (0.0004, 0.0009), "grpo_rr": (0.0005, 0.0008), "gspo": (0.05, 0.1), "gspo_rr": (0.04, 0.09),
             "sapo": (0.0, 0.0)}  # fmt: skip
    for part in ("total", "low", "high"):
        bars = [p for p in ax.patches if p.get_gid() == f"clip-{part}"]
        heights = np.array([b.get_height() for b in bars])
        expected = per_run[part].groupby("algorithm", observed=True)["value"].mean().reindex(algs).to_numpy()
        np.testing.assert_allclose(heights, expected)
        # ... and close to the synthetic truth (noise 5%): the order of magnitude is right.
        known = np.array([sum(truth[a]) if part == "total" else truth[a][part == "high"] for a in algs])
        np.testing.assert_allclose(heights, known, rtol=0.05)
        assert [b.get_facecolor()[:3] for b in bars] == [
            tuple(int(style.color(a)[i : i + 2], 16) / 255 for i in (1, 3, 5)) for a in algs
        ]
    assert ax.get_yscale() == "log"


def test_routing_families_pair_by_loss_and_routing_not_by_name():
    fams = figures.routing_families(["gspo", "grpo_rr", "grpo", "gspo_rr", "sapo", "grpo_r3"])
    assert fams == [["grpo", "grpo_rr", "grpo_r3"], ["gspo", "gspo_rr"]]


def test_figure3_marks_collapsed_runs(study):
    made = figures.figure3_routing_replay(study)
    marks = [line for ax in made.fig.axes for line in ax.get_lines() if line.get_gid() == "collapse"]
    assert len(marks) == int((study.runs["state"] == "collapsed").sum())
    assert [ax.get_title() for ax in made.fig.axes] == [style.label("grpo"), style.label("gspo")]


def test_missing_axis_is_a_clear_error(study):
    with pytest.raises(MissingData, match="not swept"):
        figures.figure5_length(study, axis="no.such.axis")
