"""The held-out test split: disjoint from the validation sets and from the streams that hold it out, scored at a
run's first and last evaluations only, never read by tuning."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from study.data import tasks
from study.run.config import RunConfig
from sweeps import tune
from sweeps.schema import SweepError

KNOBS = {"terms": (2, 3), "digits": 1}  # the routing study's small problem space: a stream revisits most of it


def test_the_test_pool_is_disjoint_from_every_validation_set() -> None:
    test = {item.prompt for item in tasks.held_out_test_set("chain_sum", size=tasks.TEST_POOL, knobs=KNOBS)}
    validation = {item.prompt for split in tasks.EVAL_SPLITS for item in tasks.eval_set("chain_sum", split)}
    validation |= {item.prompt for item in tasks.eval_set("chain_sum", "in_dist", knobs=KNOBS)}
    assert len(test) == tasks.TEST_POOL and not test & validation
    small = tasks.held_out_test_set("chain_sum", size=16, knobs=KNOBS)
    assert small == tasks.held_out_test_set("chain_sum", size=64, knobs=KNOBS)[:16]  # smaller splits nest


def test_a_stream_that_holds_the_test_split_out_never_yields_it() -> None:
    test = {item.prompt for item in tasks.held_out_test_set("chain_sum", size=tasks.TEST_POOL, knobs=KNOBS)}
    free = [tasks.make_task("chain_sum", seed=0, **KNOBS)[i].prompt for i in range(600)]
    held = [tasks.make_task("chain_sum", seed=0, held_out_test=True, **KNOBS)[i].prompt for i in range(600)]
    assert sum(p in test for p in free) > 100  # without it, the stream trains on the test problems
    assert not any(p in test for p in held)


def test_the_test_split_is_scored_at_the_first_and_last_evaluation_only() -> None:
    validation = {"in_dist": tasks.eval_set("chain_sum", size=4), "hard": tasks.eval_set("chain_sum", "hard", size=4)}
    test = tasks.held_out_test_set("chain_sum", size=8)
    metrics = {
        step: [
            (p.metric, len(p.items), p.samples)
            for p in tasks.evaluation_plan(validation, samples=2, step=step, last_step=20, test=test, test_samples=8)
        ]
        for step in (0, 10, 20)
    }
    assert metrics[10] == [("eval_in_dist", 4, 2), ("eval_hard", 4, 2)]
    assert metrics[0] == metrics[20] == [*metrics[10], (tasks.TEST_METRIC, 8, 8)]
    none = tasks.evaluation_plan(validation, samples=2, step=0, last_step=20)
    assert [p.metric for p in none] == ["eval_in_dist", "eval_hard"]


def test_run_config_test_split_fields() -> None:
    cfg = RunConfig(eval_test_size=16, eval_test_samples=4)
    cfg.validate()
    plan = cfg.eval_plan({"in_dist": tasks.eval_set("chain_sum", size=4)}, cfg.steps)
    assert [(p.metric, len(p.items), p.samples) for p in plan][-1] == (tasks.TEST_METRIC, 16, 4)
    assert RunConfig().run_id == RunConfig(eval_test_samples=8).run_id  # default: no change
    assert RunConfig().run_id != cfg.run_id
    for fields, message in [
        ({"eval_test_size": tasks.TEST_POOL + 1}, r"eval_test_size = 513: valid: 0 \(no test split\) .. 512"),
        ({"eval_test_size": -1}, r"eval_test_size = -1: valid: 0"),
        ({"eval_test_size": 8, "eval_test_samples": 0}, r"eval_test_samples = 0: must be >= 1"),
        ({"eval_test_size": 8, "eval_every": 0}, r"eval_test_size = 8: the test split is scored at the first and last"),
    ]:
        with pytest.raises(ValueError, match=message):
            RunConfig(**fields).validate()


def test_tuning_reads_the_validation_split_only(tmp_path: Path) -> None:
    def sweep(name: str, base: dict, objective: str = "eval_in_dist") -> Path:
        path = tmp_path / f"{name}.yaml"
        base = {"coldstart": "scratch", "steps": 4, "eval_every": 2, "eval_size": 4, "eval_samples": 1, **base}
        data = {
            "name": name,
            "preset": "tiny",
            "base": base,
            "axes": {"algorithm": ["grpo"]},
            "tune": {"trials": 2, "objective": objective, "pruner": {"name": "none"}},
        }
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    assert tune.plan(sweep("ok", {})).objective == "eval_in_dist"
    with pytest.raises(SweepError, match=r"tune.objective = 'test_in_dist'; valid: eval_in_dist, eval_hard"):
        tune.plan(sweep("objective", {}, tasks.TEST_METRIC))
    with pytest.raises(SweepError, match=r"base.eval_test_size = 8: tuning reads the validation sets only"):
        tune.plan(sweep("scored", {"eval_test_size": 8}))
