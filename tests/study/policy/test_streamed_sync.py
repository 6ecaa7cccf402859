"""The weight sync of a sharded policy streams: one full weight at a time gathered from the shards, only onto the
rank that hosts the engine. At world size 2 (gloo), for EP 2 and TP 2: the sync's extra peak memory per rank
(resident memory sampled every 0.2 ms against its level before the sync, every large allocation its own mapping so
that a free returns it) is at most the largest full weight plus 1 MiB of slack, against a model of 32 MiB, and the
engine's weights (preallocated, as vLLM's are, and filled from the stream) equal the one-process model's."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from study.core.model_config import ModelConfig, ParallelLayout
from tests.shared import free_port, set_rank_env

CFG = ModelConfig(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=64,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=256,
    vocab_size=8192,
    max_seq_len=64,
)
LAYOUTS = {"ep2": ParallelLayout(expert=2, data=2), "tp2": ParallelLayout(tensor=2)}
SLACK = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Samples this process's resident memory in a thread until stopped; `peak` is the largest sample."""

    def __init__(self) -> None:
        self.peak, self.running = _rss(), True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, _rss())


def _worker(rank: int, port: int, state: dict, out: str) -> None:
    import gc

    set_rank_env(rank, port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from study.core.weights import hf_param_shapes, megatron_to_hf
    from study.policy import parallel as P
    from study.policy.model import build_policy

    want = megatron_to_hf(state, CFG) if rank == 0 else {}
    results = {}
    for name, layout in LAYOUTS.items():
        model = build_policy(CFG, seed=3, routing_replay=False, parallel=layout)
        P.load_full_state(model, state)
        engine = {n: torch.zeros(s) for n, s in hf_param_shapes(CFG).items()} if rank == 0 else {}
        gc.collect()
        torch.distributed.barrier()
        base = _rss()
        sampler = _PeakRSS()
        got = []
        for hf_name, tensor in P.full_hf_weights(model):
            engine[hf_name].copy_(tensor)
            got.append(hf_name)
            del tensor  # as the engine's loader: the full tensor goes before the next is gathered
        extra = sampler.stop() - base
        same = sorted(got) == sorted(want) and all(torch.equal(engine[n], want[n]) for n in want)
        results[name] = {"extra": extra, "got": len(got), "same": same}
        del model, engine
        parallel_state.destroy_model_parallel()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_the_sync_streams_one_weight_at_a_time_to_the_engine_rank(tmp_path, monkeypatch):
    """~40 s: one two-rank spawn for both layouts."""
    import torch.multiprocessing as mp

    from study.policy.model import build_policy

    model = build_policy(CFG, seed=3, routing_replay=False)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    largest = max(t.numel() * t.element_size() for t in state.values())
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total > 3 * largest  # a model the bound tells apart from a whole copy
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # large tensors mapped and unmapped (glibc, the children)
    out = str(tmp_path / "sync")
    mp.spawn(_worker, args=(free_port(), state, out), nprocs=2)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for name in LAYOUTS:
        assert ranks[0][name]["same"] and ranks[0][name]["got"] > 0, name
        assert ranks[1][name]["got"] == 0, name  # the engine's rank alone receives weights
        for r in range(2):
            assert ranks[r][name]["extra"] <= largest + SLACK, (name, r, ranks[r][name]["extra"], largest, total)
