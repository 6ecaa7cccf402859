"""RL learns: on the tiny preset and an easy verifiable task, GRPO and GSPO raise held-out pass@1 by a
stated margin within a stated number of steps. A change that stops the loop from learning fails here, in the slow
tier that CI runs, in the spirit of the recipe tests of RL frameworks (a run with metric thresholds).

The recipe is the default study's (sweeps/default.yaml) at fewer steps and samples: chain_sum with 2-3 one-digit
terms, a cold start stopped in the pass@1 band 0.3-0.7, 16 prompts x 8 samples, 4 minibatches, lr 3e-4, one seed,
rollouts at temperature 1 and at the default study's 1.4 (held-out pass@1 at 1 in both). The gains depend on the CPU
kind (its float sums change the cold start and every sampled token: tests/study/test_rl.py::cpu_kind). Measured,
held-out pass@1 (128 problems x 8 samples) from step 0 to step 60: on an AMD AVX-512 machine 0.341 -> 0.468 (GRPO)
and 0.449 (GSPO) at temperature 1, 0.468 and 0.466 at 1.4; on an Intel AMX machine 0.309 -> 0.359 (GRPO, 1.4),
0.349 (GSPO, 1) and 0.335 (GSPO, 1.4), GRPO at 1 past 0.369. The margin is below the smallest of these gains
(+0.026) and above the binomial noise of one evaluation (~0.014); the lr 1e-12 control below shows what a run
without the update does.

GSPO runs at the default study's clip range (ScaleRL's 3e-3 / 5e-3, sweeps/default.yaml's per_algorithm) and at its
rollout temperature 1.4 only. On an AMD machine without AVX-512 (cold start 0.267 held-out) GSPO at the paper's clip
range gained +0.001 at temperature 1 in 60 steps, at ScaleRL's +0.013 at temperature 1 (within one evaluation's
noise) and +0.054 at 1.4: the recipe's reach on that CPU kind.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from study import rl
from study.run.config import load_config
from tests.shared import sharing_coldstart

STEPS = 60
MARGIN = 0.02
CONTROL_DRIFT = 0.03  # the lr 1e-12 control's bound; above MARGIN: on the Intel AMX kind the test is the weaker
RECIPE = [
    "task_knobs={terms: [2, 3], digits: 1}",
    "coldstart_band=[0.3, 0.7]",
    "prompts_per_step=16",
    "group_size=8",
    "minibatches=4",
    "max_new_tokens=32",
    "lr=3e-4",
    f"steps={STEPS}",
    f"eval_every={STEPS}",
    "eval_size=128",
    "eval_samples=8",
    "threads=1",
    "checkpoint_every=0",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, coldstarts) -> Path:  # type: ignore[no-untyped-def]
    """One cold start (the recipe's band and knobs, from the session's store) for every run of the module."""
    start = coldstarts.get("tiny", "chain_sum", band=[0.3, 0.7], knobs={"terms": [2, 3], "digits": 1})
    return sharing_coldstart(start.parent.parent, tmp_path_factory.mktemp("learning"))


GSPO_CLIP = "hparams={eps_low: 3.0e-3, eps_high: 5.0e-3}"
"""The default study's GSPO clip range (sweeps/default.yaml's per_algorithm)."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "temperature", "extra"),
    [("grpo", 1.0, ()), ("grpo", 1.4, ()), ("gspo", 1.4, (GSPO_CLIP,))],
)
def test_rl_raises_held_out_pass_at_1(results: Path, algorithm: str, temperature: float, extra: tuple) -> None:
    cfg = load_config(preset="tiny", sets=[*RECIPE, f"algorithm={algorithm}", f"temperature={temperature}", *extra])
    metrics = pd.read_parquet(rl.run(cfg, results, progress=False) / "metrics.parquet").set_index("step")
    start, end = metrics.loc[0, "eval_in_dist"], metrics.loc[STEPS, "eval_in_dist"]
    assert 0.2 < start < 0.5, f"the cold start's held-out pass@1 {start:.3f} left its band"
    assert end - start >= MARGIN, (
        f"{algorithm} at T {temperature}: held-out pass@1 {start:.3f} -> {end:.3f} in {STEPS} steps"
    )
    assert metrics.loc[1:, "zero_var_group_frac"].mean() < 0.6  # the signal the recipe is chosen for


@pytest.mark.slow
def test_without_the_update_the_same_run_does_not_gain(results: Path) -> None:
    """The control: the GRPO run at temperature 1 with lr 1e-12 (lr 0 is refused): rollouts, losses and gradients
    as above, weights that move by ~1e-12 per step under Adam. It stays within the seed-level noise of its start, so
    the gain above is the update's."""
    cfg = load_config(preset="tiny", sets=[*RECIPE, "algorithm=grpo", "temperature=1.0", "lr=1e-12"])
    metrics = pd.read_parquet(rl.run(cfg, results, progress=False) / "metrics.parquet").set_index("step")
    start, end = metrics.loc[0, "eval_in_dist"], metrics.loc[STEPS, "eval_in_dist"]
    assert end - start < CONTROL_DRIFT, f"lr 1e-12: held-out pass@1 {start:.3f} -> {end:.3f} in {STEPS} steps"
    assert metrics.loc[1:, "grad_norm"].gt(0).all()  # the update ran, on non-zero gradients, at a negligible step
