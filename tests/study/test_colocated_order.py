"""The loop's colocated order (study/rl.py `_sync_engine`), recorded in a real tiny run: the engine sleeps after the
rollout and before any forward that trains, the trainer's cache is released before the engine wakes, the engine
wakes only to be fed a stream of the policy's own weights (no copy of the model), and it samples or scores only
while awake. The recorders wrap the real calls (each still runs): the engine's methods, the policy's forward
hook, the optimizer's step hook and the loop's `_free_trainer_cache`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from study import rl
from study.run.config import RunConfig
from study.tools.plan import param_counts

SETTINGS = {
    "model": "tiny",
    "coldstart": "scratch",
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "minibatches": 2,
    "max_new_tokens": 8,
    "eval_every": 2,
    "checkpoint_every": 0,
    "sync_check_every": 1,
    "threads": 1,
    "rollout_engine": "hf",
}


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Install the recorders on the run's parts as `setup` builds them; the list the events go to."""
    events: list[tuple[str, dict[str, Any]]] = []
    real_setup, real_free = rl.setup, rl._free_trainer_cache

    def setup(cfg: RunConfig, results: Path) -> Any:
        parts = real_setup(cfg, results)
        engine, policy = parts.engine, parts.policy
        storages = {p.untyped_storage().data_ptr() for p in policy.parameters()}

        def spy(name: str) -> None:
            real = getattr(engine, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                events.append((name, {}))
                return real(*args, **kwargs)

            setattr(engine, name, call)

        for name in ("generate", "score", "offload"):
            spy(name)
        real_load = engine.load_weights

        def load_weights(weights: Any) -> None:
            info: dict[str, Any] = {"mapping": isinstance(weights, Mapping), "copied_bytes": 0, "bytes": 0}
            events.append(("wake", info))

            def stream() -> Any:
                for hf_name, tensor in weights:
                    info["bytes"] += tensor.numel() * tensor.element_size()
                    if tensor.untyped_storage().data_ptr() not in storages:
                        info["copied_bytes"] += tensor.numel() * tensor.element_size()
                    yield hf_name, tensor

            real_load(weights if info["mapping"] else stream())
            events.append(("loaded", {}))

        engine.load_weights = load_weights
        policy.register_forward_pre_hook(
            lambda _m, args: events.append(("forward", {"grad": torch.is_grad_enabled(), "rows": len(args[0])}))
        )
        parts.optimizer.register_step_pre_hook(lambda *_: events.append(("step", {})))
        return parts

    def free() -> None:
        events.append(("release", {}))
        real_free()

    monkeypatch.setattr(rl, "setup", setup)
    monkeypatch.setattr(rl, "_free_trainer_cache", free)
    return events


def check_order(events: list[tuple[str, dict[str, Any]]], model_bytes: int) -> None:
    """AssertionError naming the first event out of the colocated order."""
    awake, released, trained = False, False, False
    for i, (name, info) in enumerate(events):
        where = f"event {i} {name} {info} in {[e for e, _ in events[max(0, i - 6) : i + 2]]}"
        if name in ("generate", "score"):
            assert awake, f"the engine samples or scores asleep: {where}"
        elif name == "offload":
            awake, released = False, False
        elif name == "forward" and awake:  # the post-sync parity check: a few rows, nothing kept for backward
            assert not info["grad"] and info["rows"] <= rl.SYNC_CHECK_SEQS, (
                f"the trainer trains beside the engine: {where}"
            )
        elif name == "step":
            assert not awake and not released, f"an optimizer step beside the awake engine: {where}"
            trained = True
        elif name == "release":
            assert not awake, f"released while the engine is awake: {where}"
            released = True
        elif name == "wake":
            assert released, f"the engine wakes before the trainer released its cache: {where}"
            assert not info["mapping"], f"the sync hands the engine a whole state dict: {where}"
            awake = True
        elif name == "loaded":
            assert info == {} and awake
            wake = next(inf for n, inf in reversed(events[:i]) if n == "wake")
            # views of the policy's weights, the regrouped q/k/v (split_qkv) excepted: no copy of the model
            assert wake["bytes"] >= model_bytes > 2 * wake["copied_bytes"], f"the sync copied the model: {wake}"
    assert trained and awake, "the run neither trained nor ended with its engine synced"


def test_the_loop_keeps_the_colocated_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _record(monkeypatch)
    cfg = RunConfig.from_dict(SETTINGS)
    rl.run(cfg, tmp_path, progress=False)
    names = [n for n, _ in events]
    # what the run did: 3 syncs (the start and 2 steps), 2 rollouts put to sleep, 2 parity checks
    assert names.count("wake") == 3 and names.count("offload") == 2 and names.count("score") == 2
    assert names.count("step") == 2 * cfg.minibatches
    check_order(events, 4 * param_counts(cfg.model_config()).total)  # fp32
