"""The off-policy routing study's sweep (sweeps/routing_offpolicy.yaml): the four algorithms on the routing study's
MoE and on its dense control along the minibatch count, sharing the routing study's cold start and runs; the
workflow plans it."""

from __future__ import annotations

from study.core.model_config import dense_control, resolve_model
from sweeps.expand import load_sweep
from tests.shared import ROOT
from tests.sweeps.test_sweeps import _snakemake, coldstart_dir, expected_coldstarts, job_counts

SWEEP = ROOT / "sweeps" / "routing_offpolicy.yaml"


def test_the_arms_the_dense_control_and_what_is_shared_with_the_routing_study() -> None:
    runs = load_sweep(SWEEP).expand()
    shapes = {}
    for cfg in runs.values():
        shapes.setdefault(cfg.model_config().num_experts, resolve_model(cfg.model))
    moe, dense = shapes[32], shapes[1]
    assert (moe.num_layers, moe.moe_top_k) == (4, 8) and dense == dense_control(moe)
    arms = {(c.algorithm, c.model_config().num_experts, c.minibatches, c.seed) for c in runs.values()}
    assert len(arms) == len(runs) == 4 * 2 * 5 * 3
    assert {c.minibatches for c in runs.values()} == {1, 2, 4, 8, 16}
    assert {c.router_lr_scale for c in runs.values()} == {1.0}
    routing = load_sweep(ROOT / "sweeps" / "routing.yaml").expand()
    moe_runs = [c for c in runs.values() if c.model_config().num_experts == 32]
    assert {coldstart_dir(c) for c in moe_runs} == {coldstart_dir(c) for c in routing.values()}  # its cold start
    shared = set(runs) & set(routing)  # the routing study's x1 stratum: M = 4, seeds 0 and 1
    assert len(shared) == 8 and all(runs[r].minibatches == 4 for r in shared)


def test_the_workflow_plans_the_study(tmp_path) -> None:
    proc = _snakemake("-n", "--cores", "2", "--config", f"results={tmp_path}", f"sweep={SWEEP.relative_to(ROOT)}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = job_counts(proc.stdout)
    assert counts["run"] == 120 and counts["coldstart"] == len(expected_coldstarts(SWEEP)) == 2, counts
