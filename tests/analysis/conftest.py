"""Fixtures of the analysis tests: a small synthetic study written to disk once per session (Agg backend), the same
runs with and without their step-0 evaluation, and the check that a figure reads at a glance (`layout_problems`)."""

import itertools

import matplotlib

matplotlib.use("Agg")

import pytest

from analysis.runs import tidy
from tests.analysis import synthetic

C = synthetic.Curve
# Ground truth per algorithm (tests may name algorithms; figure code never does).
TRUTH = {
    "grpo": C(a=0.5, b=1.2, c_mid=1e13, clip_low=0.0004, clip_high=0.0009, collapse_step=120),
    "grpo_rr": C(a=0.6, b=1.2, c_mid=1e13, clip_low=0.0005, clip_high=0.0008),
    "gspo": C(a=0.8, b=2.0, c_mid=1.5e13, clip_low=0.05, clip_high=0.1),
    "gspo_rr": C(a=0.78, b=2.0, c_mid=1.5e13, clip_low=0.04, clip_high=0.09),
    "sapo": C(a=0.7, b=1.5, c_mid=1.2e13, clip_low=0.0, clip_high=0.0),
}

TOKEN_TRUTH = {"bf16": (0.02, 0.01), "fp16": (-0.005, 0.002)}
"""(mean, std) of the per-sequence log-ratio trainer - engine in token_samples.parquet, per rollout dtype."""


@pytest.fixture(scope="session")
def study_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("study")
    ids = synthetic.make_study(
        root,
        TRUTH,
        seeds=(0, 1, 2),
        n_steps=200,
        flops_per_step=1e11,
        grid={"max_new_tokens": [256, 1024], "rollout_precision": ["bf16", "fp16"]},
        fail=["sapo"],
        token_mismatch=lambda config: TOKEN_TRUTH[config["rollout_precision"]],
    )
    return root, ids


@pytest.fixture(scope="session")
def study(study_dir):
    return tidy.load_study(study_dir[0])


@pytest.fixture
def with_and_without_start(tmp_path) -> list[tidy.Study]:
    """The same runs written with their step-0 evaluation of the start and without it (as runs were before the loop
    evaluated its start), loaded: [with, without]."""
    curves = {"grpo": C(a=0.5, c_mid=2e12, collapse_step=30), "grpo_rr": C(a=0.6, c_mid=2e12), "gspo": C(a=0.8)}
    out = []
    for start in (True, False):
        synthetic.make_study(tmp_path / str(start), curves, seeds=(0, 1, 2), n_steps=40, start_eval=start)
        out.append(tidy.load_study(tmp_path / str(start)))
    return out


def _layout_problems(fig) -> list[str]:
    """Overlapping tick labels (unrotated) on any axis, and legends over any panel that shows data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    problems = []
    every = [*fig.axes, *(c for ax in fig.axes for c in ax.child_axes)]  # secondary axes are children
    for k, ax in enumerate(every):
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            ticks = [*axis.get_ticklabels(), *axis.get_ticklabels(minor=True)]
            labels = [t for t in ticks if t.get_visible() and t.get_text() and t.get_rotation() == 0]
            for a, b in itertools.combinations(labels, 2):
                if a.get_window_extent(r).overlaps(b.get_window_extent(r)):
                    problems.append(f"axes {k} {name} ticks {a.get_text()!r} and {b.get_text()!r} overlap")
    texts = [(k, t) for k, ax in enumerate(every) for t in (ax.xaxis.label, ax.yaxis.label, ax.title) if t.get_text()]
    for (i, a), (j, b) in itertools.combinations(texts, 2):  # axis labels and titles of different panels
        if i != j and a.get_window_extent(r).overlaps(b.get_window_extent(r)):
            problems.append(f"axes {i} {a.get_text()!r} and axes {j} {b.get_text()!r} overlap")
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for leg in legends:
        box = leg.get_window_extent(r)
        for k, ax in enumerate(fig.axes):
            if ax.has_data() and box.overlaps(ax.get_window_extent(r)):
                problems.append(f"a legend covers axes {k} ({ax.get_title()!r})")
    return problems


@pytest.fixture(scope="session")
def layout_problems():
    """`_layout_problems`: what keeps a drawn figure from reading at a glance ([] when nothing does)."""
    return _layout_problems
