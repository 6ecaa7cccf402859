"""The process groups' timeout covers rank 0's solo phases (engine start, evaluation, rollout): NCCL's watchdog
would end the waiting ranks after its 10-minute default. Asserted on the real groups of a two-rank gloo world (the
world's and megatron's), whose backends report the timeout they were built with."""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from tests.shared import free_port, set_rank_env


def _worker(rank: int, port: int, minutes: str, out: str) -> None:
    set_rank_env(rank, port)
    if minutes:
        os.environ["STUDY_DIST_TIMEOUT_MIN"] = minutes
    from megatron.core import parallel_state

    from study.core.model_config import ParallelLayout
    from study.policy.model import init_distributed

    init_distributed(ParallelLayout(data=2))
    cpu = torch.device("cpu")
    groups = {
        "world": torch.distributed.group.WORLD,
        "data": parallel_state.get_data_parallel_group(),
        "expert_data": parallel_state.get_expert_data_parallel_group(),
    }
    seen = {name: g._get_backend(cpu).options._timeout.total_seconds() for name, g in groups.items()}
    torch.distributed.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_every_group_times_out_after_the_configured_minutes(tmp_path):
    """~40 s: one two-rank spawn."""
    import torch.multiprocessing as mp

    out, expect_s = tmp_path / "timeouts.json", 45 * 60
    mp.spawn(_worker, args=(free_port(), "45", str(out)), nprocs=2)
    seen = json.loads(out.read_text())
    assert seen == {"world": expect_s, "data": expect_s, "expert_data": expect_s}
    assert min(seen.values()) > 10 * 60  # NCCL's watchdog default


def test_the_default_covers_rank_zeros_solo_phases():
    from study.policy.model import DIST_TIMEOUT_MIN, dist_timeout

    assert dist_timeout() == datetime.timedelta(minutes=DIST_TIMEOUT_MIN) >= datetime.timedelta(hours=1)


@pytest.mark.parametrize("raw", ["0", "-5", "ten", "nan", "inf"])
def test_a_bad_timeout_is_refused_naming_the_variable(monkeypatch, raw):
    from study.policy.model import dist_timeout

    monkeypatch.setenv("STUDY_DIST_TIMEOUT_MIN", raw)
    with pytest.raises(ValueError, match="STUDY_DIST_TIMEOUT_MIN"):
        dist_timeout()
