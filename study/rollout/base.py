"""The rollout-engine interface: load the training engine's weights, sample G completions per prompt, return what
the RL step needs (token ids, the engine's own log-probs, finish reasons, and where it can, the routed experts).

Semantics shared by every engine (and checked against each other by tests/study/rollout):
1. Samples are prompt-major: sample j of prompt p is `rollout.prompt_index[p * n + j] == p`.
2. `logprobs[i][t]` is log pi_engine(y_t | x, y_<t) of the distribution sampled from, softmax(logits / T) in fp32
   (vLLM's `logprobs_mode="processed_logprobs"`; at temperature 0, greedy, of the raw logits): the trainer scores the
   same tempered distribution (study.policy.model.token_logp's `temperature`), so the two are comparable at any T.
   `score` (teacher-forced) returns the raw logits' log-probs (temperature 1).
3. A response ends with the first sampled stop token (kept in `tokens`, finish reason "stop") or after
   `max_new_tokens` (finish reason "length").
4. `routes[i]` (R3) is (P_i + T_i - 1, layers, k) integer: the experts chosen for every token that is fed as an
   input when the full sequence `prompt + response` is scored teacher-forced, i.e. for `input_ids = seq[:-1]`; the
   final sampled token is never an input. Order within k is the engine's (descending gate weight); compare as sets.
5. Same seed, same prompts, same weights -> same samples (per engine; engines do not share random streams).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from study.core.model_config import ModelConfig
from study.run.config import ENGINES

FINISH_REASONS: tuple[str, ...] = ("stop", "length")


@dataclass
class Rollout:
    """The samples of one `generate` call; lists have one entry per sample, prompt-major."""

    prompt_index: list[int]
    """Which prompt each sample answers."""
    tokens: list[list[int]]
    """Response token ids, stop token included."""
    logprobs: list[torch.Tensor]
    """(T_i,) fp32 log-prob of each sampled token under the engine's untempered distribution."""
    finish_reasons: list[str]
    """"stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""
    routes: list[torch.Tensor] | None = None
    """(P_i + T_i - 1, layers, k) uint8/int16 routed experts of `(prompt + response)[:-1]`; None where the engine
    cannot return them or they were not asked for."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """Total response tokens over all samples."""
        return sum(len(t) for t in self.tokens)


@dataclass(frozen=True)
class Sampling:
    """`generate`'s sampling arguments, checked."""

    seed: int
    temperature: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    return_routes: bool


class RolloutEngine(ABC):
    """A rollout engine built from a ModelConfig; weights come from the training engine via `load_weights`."""

    name: ClassVar[str]
    routes_supported: ClassVar[bool] = False
    """Whether `generate(..., return_routes=True)` can return routed experts on this machine."""

    def __init__(self, cfg: ModelConfig, *, dtype: str = "fp32") -> None:
        self.cfg = cfg
        self.dtype = dtype

    @classmethod
    def supports_routes(cls) -> bool:
        """Whether an engine of this class built on this machine returns routed experts (asked before building one:
        a run that needs them is refused before any engine starts)."""
        return cls.routes_supported

    @abstractmethod
    def load_weights(self, hf_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight with `hf_state` (HF Qwen3-MoE checkpoint names, see study.core.weights): a state dict or
        a stream of (name, tensor) pairs (study.core.weights.iter_hf_weights), whose tensors the engine copies while
        the iteration runs and does not keep."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        *,
        seed: int,
        temperature: float = 1.0,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        return_routes: bool = False,
    ) -> Rollout:
        """Sample `n` responses for each prompt (token-id lists); see the module docstring for the semantics. The
        arguments are checked here, once for every engine, before the engine's `_sample` runs."""
        check_generate_args(prompts, n, temperature, max_new_tokens, self.cfg)
        sampling = Sampling(seed, temperature, max_new_tokens, tuple(int(t) for t in stop_token_ids), return_routes)
        return self._sample(prompts, n, sampling)

    @abstractmethod
    def _sample(self, prompts: Sequence[Sequence[int]], n: int, s: Sampling) -> Rollout:
        """The engine's sampling of checked arguments (`generate`'s)."""

    def offload(self) -> None:  # noqa: B027 - optional hook
        """Between rollout and the next `load_weights`: release what the trainer's update could use (vLLM
        colocated on a GPU sleeps); nothing by default."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""


_ENGINES: dict[str, type[RolloutEngine]] = {}


def register_engine(name: str) -> Callable[[type[RolloutEngine]], type[RolloutEngine]]:
    """Class decorator: register a rollout engine under `name`; a duplicate name raises."""

    def deco(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if name not in ENGINES:
            raise ValueError(
                f"rollout engine {name!r} is not one of study.run.config.ENGINES ({', '.join(ENGINES)}); "
                "add it there, the one list of engine names a run config may use"
            )
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered ({_ENGINES[name].__qualname__})")
        cls.name = name
        _ENGINES[name] = cls
        return cls

    return deco


def engine_names() -> list[str]:
    """The registered engine names."""
    return list(_ENGINES)


def engine_class(name: str) -> type[RolloutEngine]:
    """The registered rollout engine class `name`; an unknown name lists the valid ones."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {', '.join(_ENGINES)}") from None


def get_engine(name: str, cfg: ModelConfig, *, dtype: str = "fp32", **kwargs: object) -> RolloutEngine:
    """Build the rollout engine `name` for `cfg`; an unknown name lists the valid ones."""
    return engine_class(name)(cfg, dtype=dtype, **kwargs)


def check_generate_args(
    prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int, cfg: ModelConfig
) -> None:
    """Shared argument validation: errors, never silent clipping."""
    if n < 1:
        raise ValueError(f"n = {n}: must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: must be >= 0 (0 = greedy)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
    if not prompts:
        raise ValueError("no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} > model.max_seq_len {cfg.max_seq_len}"
            )
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size})")
