"""The routing study's sweep (sweeps/routing.yaml): the four algorithms on a 4 x 64 top-1 MoE along the minibatch
count, its dense control with GRPO, no replay run where replay cannot act; the workflow plans it."""

from __future__ import annotations

from study.core.model_config import dense_control, resolve_model
from sweeps.expand import load_sweep
from tests.shared import ROOT
from tests.sweeps.helpers import expected_coldstarts, job_counts, snakemake

SWEEP = ROOT / "sweeps" / "routing.yaml"


def test_the_arms_and_the_dense_control() -> None:
    runs = load_sweep(SWEEP).expand()
    shapes = {}
    for cfg in runs.values():
        shapes.setdefault(cfg.model_config().num_experts, resolve_model(cfg.model))
    moe, dense = shapes[64], shapes[1]
    assert (moe.num_layers, moe.moe_top_k) == (4, 1) and dense == dense_control(moe)
    arms = {(c.algorithm, c.model_config().num_experts, c.minibatches, c.seed) for c in runs.values()}
    assert len(arms) == len(runs)
    ms = sorted({c.minibatches for c in runs.values()})
    assert ms[0] == 1 and ms[-1] >= 8 and {c.router_lr_scale for c in runs.values()} == {1.0}
    seeds = {c.seed for c in runs.values()}
    on_moe = {(a, m) for a, e, m, _ in arms if e == 64}
    # every algorithm at every M > 1 on the MoE; at M = 1 replay would force pi_old's own routing and GSPO's run is
    # GRPO's (every ratio 1): GRPO alone
    assert on_moe == {(a, m) for a in ("grpo", "grpo_rr", "gspo", "gspo_rr") for m in ms[1:]} | {("grpo", 1)}
    # the dense control: GRPO at every M, each seed
    assert {(a, m, s) for a, e, m, s in arms if e == 1} == {("grpo", m, s) for m in ms for s in seeds}


def test_the_workflow_plans_the_study(tmp_path) -> None:
    proc = snakemake("-n", "--cores", "2", "--config", f"results={tmp_path}", f"sweep={SWEEP.relative_to(ROOT)}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = job_counts(proc.stdout)
    assert counts["run"] == len(load_sweep(SWEEP).expand())
    assert counts["coldstart"] == len(expected_coldstarts(SWEEP)) == 2, counts
