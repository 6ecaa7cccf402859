"""The resolved configuration of one RL run: a typed dataclass with a sentence per field, presets, `--set` overrides,
validation before any compute, and the content hash that names the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from algorithms import catalog
from runfiles.bounded import load_yaml, read_yaml
from study.core.model_config import DTYPES, ModelConfig, ParallelLayout, is_checkpoint_dir, model_spec, resolve_model

if TYPE_CHECKING:  # study.data loads reasoning-gym: imported where used
    from study.data.tasks import EvalPass

OLD_LOGP_SOURCES = ("recompute", "rollout")
"""Where pi_old's log-probs come from: the training engine's recompute, or the rollout engine's own."""
ENGINES = ("hf", "vllm")
"""The rollout engines a run may name: the one list of engine names (study/rollout registers a class under each)."""
PROMPT_FILTERS = ("none", "mastered")
RECOMPUTE = ("none", "selective")
EXPERTS = ("auto", "grouped", "sequential")
"""How the training engine computes a layer's experts (RunConfig.experts; study/policy/experts.py)."""
"""Activation recompute of the training engine (RunConfig.recompute)."""
"""Which training prompts leave the stream (RunConfig.prompt_filter)."""


@dataclass(frozen=True)
class RunConfig:
    """One algorithm on one configuration. Every field is part of the run id except those in `NOT_HASHED`."""

    algorithm: str = "grpo"
    """Registered algorithm name (`python -m algorithms` lists them)."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """Overrides of the algorithm's loss hyper-parameters (e.g. eps_low); the rest take the registry's defaults."""
    seed: int = 0
    """Seed of the run: prompt order, rollout sampling, minibatch split. The cold start has its own seed."""
    model: str | dict[str, Any] = "tiny"
    """Model shape: a preset name (study.core.model_config.PRESETS), or a preset plus overrides of its fields,
    {preset: default, num_experts: 32, moe_top_k: 8} (study.core.model_config.SHAPE_FIELDS; `--set
    model.num_experts=32`), or a local HF Qwen3-MoE checkpoint directory: its config.json gives the shape (recorded as
    a preset plus overrides) and, with coldstart = "auto", the directory becomes the cold start. `qwen3-30b-a3b` is the
    paper's model. Kept canonical: overrides equal to the preset's values are dropped, and no override left is the plain
    name (the same run id). The auto cold start is keyed by the shape; a given checkpoint must match it."""
    task: str = "chain_sum"
    """Training task (study.data.tasks.TASKS), or "user": the rows of `data`, scored by `verifier`."""
    task_knobs: dict[str, Any] = field(default_factory=dict)
    """Difficulty/length knobs of the task (study.data.tasks.make_task)."""
    coldstart: str = "auto"
    """Cold-start checkpoint directory, or "auto" (make or reuse the preset's own under the results dir), or
    "scratch" (random initialisation, for tests of the machinery only)."""
    coldstart_band: list[float] = field(default_factory=lambda: [0.1, 0.5])
    """With coldstart = "auto": the held-out pass@1 band [low, high] at which the cold start's SFT stops (its
    recipe checks every few steps and keeps the check nearest the band). The RL signal needs a start that solves
    some problems some of the time: too low and most groups have zero variance."""
    prompt_filter: str = "none"
    """Which training prompts leave the stream: none, or mastered (a prompt whose G responses all got the full
    reward is never drawn again, as Skywork-OR1 and POLARIS filter solved prompts online: its group carries no
    signal, and a policy that has mastered it would spend rollouts on it every time the stream returns to it)."""
    steps: int = 20
    """RL steps (rollout batches)."""
    prompts_per_step: int = 8
    """P: prompts per rollout batch."""
    group_size: int = 4
    """G: responses sampled per prompt."""
    minibatches: int = 4
    """M: gradient updates per rollout batch (paper: 4; minibatches 2..M are off-policy)."""
    max_new_tokens: int = 32
    """Maximum response length; longer responses are truncated and scored as they stand."""
    temperature: float = 1.0
    """Rollout sampling temperature T: the engine samples from softmax(logits / T) and the trainer's log-probs (pi_old,
    pi_theta, the KL reference) are of that same tempered distribution, so the importance ratios and the policy
    gradient are for the distribution the samples come from (verl's actor divides its logits by T the same way)."""
    eval_temperature: float = 1.0
    """Sampling temperature of the held-out evaluations (pass@1), separate from the rollouts' (verl's
    val_kwargs.temperature): 1.0 measures every run, and the cold start's band, on the same footing."""
    lr: float = 1e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    router_lr_scale: float = 1.0
    """The MoE routers' learning rate as a multiple of `lr` (their own AdamW group; 1 = one lr for every weight):
    the routing-volatility knob, moving the routing while the rest trains at `lr`."""
    rollout_engine: str = "hf"
    """Inference engine for rollouts: hf (transformers, the fast CPU default) or vllm."""
    train_precision: str = "fp32"
    """Training engine precision (study.core.precision.PRECISIONS): a format computed for real (fp32, bf16, fp16,
    bf16_fp32head: bf16 with an fp32 LM head), or NAME-emulated (fp32 compute rounded where a GPU rounds)."""
    rollout_precision: str = "fp32"
    """Rollout engine precision, like train_precision; "same" = train_precision's value."""
    rollout_runtime: dict[str, Any] = field(default_factory=dict)
    """How the vllm engine runs (study.run.rollout_runtime.EngineSettings: tp, dp, ep, gpu_memory, placement, gpus,
    cuda_graphs, bucket_mb, kv_cache_gb; `--set rollout_runtime.tp=2`); {} = one replica on the defaults. Runtime
    only, not in the run id; rollout_engine = 'vllm' only."""
    sync_check_every: int = 0
    """Every this many steps, right after the weight sync, the rollout engine and the trainer score a few of the
    step's sequences teacher-forced: metrics sync_parity_mean_abs / sync_parity_max_abs (0 = never; a metric, never
    a stop). Not in the run id."""
    routing_attribution: bool = False
    """Instrumentation: at each minibatch after the first, one extra no-grad forward of its rows on the current
    weights under the routing the update did not use (pi_old's routes replayed when the update routed freely; free
    routing when it replayed), giving the routing-attributable log-ratio log pi_theta(y | free routes) - log
    pi_theta(y | pi_old's routes) per response token (metrics routing_logratio_*). Changes no other number of the
    run; its FLOPs are not in compute_flops. Off: no extra forward."""
    micro_batch: int = 0
    """Sequences per forward and backward of the training engine (each rank's share of a minibatch, and of the
    pi_old pass, in forwards of at most this many; the minibatch's gradients accumulated over them before its one
    optimizer step); 0 = a rank's whole share in one forward. The same update to rounding: not in the run id."""
    recompute: str = "none"
    """Activation recompute of the training engine: none, or selective (megatron's recompute_granularity =
    "selective": each layer's core attention is recomputed in the backward instead of keeping its (B, heads, S, S)
    scores). Megatron's "full" recompute is not offered: the loop backpropagates after the routing-replay context of
    the forward has closed, so a recomputed forward would route freely. The same gradients: not in the run id."""
    experts: str = "auto"
    """How the training engine computes each layer's experts (study/policy/experts.py): grouped (each projection of
    every expert one grouped GEMM, forward and backward), sequential (the experts one after another in one autograd
    Function; megatron's SequentialMLP where that Function is not exact), or auto (grouped on CUDA, sequential on the
    CPU, where it is faster: docs/performance.md). The same parameters, names and checkpoints either way, and the
    same numbers to rounding (bit for bit on the CPU at one thread): not in the run id."""
    old_logp_source: str = "recompute"
    """pi_old log-probs: recomputed by the training engine (routing recorded) or taken from the rollout engine."""
    engine_router_noise: float = 0.0
    """A train/inference routing mismatch the trainer does not have (R3's regime): the standard deviation of Gaussian
    noise the rollout engine adds to every MoE router's logits before its top-k (the gates then softmax the noisy
    logits), drawn from the seed of each `generate` call (the run's seed and step: rollouts, and the held-out
    evaluations alike); the engine's `score` and the trainer route without it. 0 = off; rollout_engine = 'hf' only."""
    router_kick: float = 0.0
    """The routing-volatility dial (study/policy/kick.py), in the router weights' units: after each minibatch's
    optimizer step a Gaussian kick of this standard deviation per router weight entry, drawn from (seed, step,
    minibatch) alone, so minibatch m of a step routes through the m - 1 kicks before it; taken back before the weight
    sync (the rollout policy, evaluations and checkpoints never carry it). An emulated regime: a run with it > 0 moves
    its routing by noise, not by its updates alone (docs/studies/regime.md). 0 = off."""
    eval_every: int = 10
    """Evaluate on the held-out sets every this many steps (and at the end); 0 = never."""
    eval_size: int = 32
    """Problems per held-out validation set (eval_in_dist, eval_hard): what every design choice reads."""
    eval_samples: int = 4
    """k samples per problem for mean pass@1."""
    eval_test_size: int = 0
    """Problems of the held-out test split (study.data.tasks.held_out_test_set, logged as test_in_dist), scored at
    the run's first and last evaluations only; 0 = none. Its prompts leave the run's training stream and cold start,
    so a run with a test split trains on a stream of its own. Only verdicts and the headline read it."""
    eval_test_samples: int = 8
    """k samples per problem of the test split."""
    checkpoint_every: int = 10
    """Checkpoint (model, optimizer, every RNG, data position) every this many steps; 0 = only at the end."""
    reward_floor: float = -1.0
    """Collapse when the mean reward over the last `collapse_window` steps falls below this (-1 = off)."""
    collapse_window: int = 5
    """Steps in the reward-collapse window."""
    max_log_ratio: float = 20.0
    """Collapse when any |log pi_theta - log pi_old| on a response token exceeds this (exploding ratios)."""
    threads: int = 1
    """torch threads; results are bit-identical only at a fixed thread count."""
    data: str = ""
    """task = "user": a JSONL or parquet file of (prompt, answer[, solution][, metadata]) rows. Its content hash, not
    its path, goes into the run id."""
    verifier: str = ""
    """task = "user": the scorer of the rows: exact, numeric, or a reasoning-gym task name."""
    eval_data: str = ""
    """task = "user": held-out rows (same format and verifier), logged as eval_in_dist; "" = `eval_size` rows of
    `data` held out with a fixed seed (study.data.tasks.split_user_data)."""
    kl_coef: float = 0.0
    """Coefficient of a k3 KL(pi_theta || pi_ref) penalty to the frozen initial policy, added to the loss
    (0 = off, as in the paper)."""
    parallel: dict[str, Any] = field(default_factory=dict)
    """How the policy is split over ranks: {tensor, expert, expert_tensor, data}
    (study.core.model_config.ParallelLayout; pipeline and context are named and refused unless 1); {} = one process. A
    runtime choice, not in the run id (each layout computes the one-process run's numbers to rounding,
    tests/study/policy/test_parallel.py): recorded in the run's manifest; a resume under another layout reshards the
    checkpoint (study/rl.py `_restore`). Validated against the model's shape here and against the launcher's world size
    when the run starts (`--set parallel.expert=2 --set parallel.data=2`)."""

    def __post_init__(self) -> None:
        # An HF checkpoint directory as the model: its shape is the model, its weights the cold start.
        if is_checkpoint_dir(self.model) and self.coldstart == "auto":
            object.__setattr__(self, "coldstart", str(self.model))
        # The shape in its canonical form, so that spellings of one shape are one run (and one run id).
        object.__setattr__(self, "model", model_spec(self.model, default_preset=_DEFAULT_MODEL))

    # -- construction ------------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config") -> RunConfig:
        replaced = sorted(set(data) & set(REPLACED_FIELDS))
        if replaced:
            old = replaced[0]
            raise ValueError(
                f"{where}: {old} is not a field; its replacement is {REPLACED_FIELDS[old]} (one field per "
                f"engine: format and mode); valid values: {', '.join(_precisions())}"
            )
        unknown = set(data) - set(cls.field_names())
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {', '.join(cls.field_names())}")
        hints = typing.get_type_hints(cls)
        data = _resolve_precision(data)  # precision hook (study/core/precision.py): "same", canonical labels
        clean: dict[str, Any] = {}
        for key, value in data.items():
            clean[key] = _coerce(key, value, hints[key])
        cfg = cls(**clean)
        cfg.validate()
        return cfg

    def replace(self, **changes: Any) -> RunConfig:
        """This config with `changes` (field -> value), validated. A field is set to its new value, but for `model`,
        which changes as a layer does (merge_field): `model={"num_experts": 32}` changes one field of this shape."""
        data = {**self.to_dict(), **changes}
        if "model" in changes:
            data["model"] = merge_field("model", self.model, changes["model"])
        return RunConfig.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- validation --------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every error names the field, the value and the valid choices, before any compute is spent."""
        from study.data import tasks

        alg = catalog.spec(self.algorithm) if self.algorithm in catalog.names() else None
        if alg is None:
            raise ValueError(f"algorithm = {self.algorithm!r}; valid: {', '.join(catalog.names())}")
        alg.check_hparams(self.hparams)
        self._validate_model()
        self.layout.check_model(self.model_config())
        _choice("task", self.task, (*tasks.TASKS, "user"))
        self._validate_user_data()
        if self.task != "user":
            tasks.resolve_knobs(self.task, **self.task_knobs)  # validates the knobs: errors name the knob
        self._validate_coldstart()
        self._validate_floats()
        band = self.coldstart_band
        if not (
            isinstance(band, list)
            and len(band) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in band)
            and 0.0 <= band[0] < band[1] <= 1.0
        ):
            raise ValueError(f"coldstart_band = {band!r}; valid: [low, high] with 0 <= low < high <= 1")
        _choice("rollout_engine", self.rollout_engine, ENGINES)
        self._validate_rollout_runtime()
        _choice("old_logp_source", self.old_logp_source, OLD_LOGP_SOURCES)
        _choice("prompt_filter", self.prompt_filter, PROMPT_FILTERS)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("experts", self.experts, EXPERTS)
        self._validate_precision()
        for name in (
            "steps",
            "prompts_per_step",
            "minibatches",
            "max_new_tokens",
            "eval_size",
            "eval_samples",
            "collapse_window",
            "threads",
        ):
            _positive(name, getattr(self, name))
        if self.group_size < 2:
            raise ValueError(f"group_size = {self.group_size}: must be >= 2 (group-relative advantages)")
        self._validate_test_split()
        for name in ("eval_every", "checkpoint_every", "seed", "sync_check_every", "micro_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 0")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError(
                f"minibatches = {self.minibatches} must divide prompts_per_step x group_size = "
                f"{self.prompts_per_step * self.group_size}"
            )
        if self.task != "user":  # the held-out sets are prefixes of fixed pools (task = "user": user_split checks)
            pool = min(tasks.EVAL_SPECS[(self.task, split)].size for split in tasks.EVAL_SPLITS)
            if self.eval_size > pool:
                raise ValueError(
                    f"eval_size = {self.eval_size}: the {self.task} held-out sets hold {pool} problems; "
                    f"valid: 1..{pool}"
                )
        model = self.model_config()
        if self.max_new_tokens >= model.max_seq_len:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: must be < model.max_seq_len {model.max_seq_len}")
        if self.engine_router_noise and self.rollout_engine != "hf":
            raise ValueError(
                f"engine_router_noise = {self.engine_router_noise} perturbs the router logits of "
                f"rollout_engine = 'hf' only (rollout_engine = {self.rollout_engine!r} has no hook for "
                "it); valid: engine_router_noise = 0, or rollout_engine = 'hf'"
            )
        if self.router_kick and (self.minibatches < 2 or model.num_experts < 2):
            raise ValueError(
                f"router_kick = {self.router_kick} moves the routing of minibatches 2..M of an MoE (minibatches = "
                f"{self.minibatches}, model.num_experts = {model.num_experts}); valid: router_kick = 0, or "
                "minibatches >= 2 with num_experts >= 2"
            )
        if self.old_logp_source == "rollout" and alg.routing == "replay":
            raise ValueError(
                f"algorithm {self.algorithm} replays the routes of the pi_old recompute, but old_logp_source = "
                "'rollout' skips that recompute; valid: old_logp_source = 'recompute', or a rollout_replay variant"
            )

    def _validate_floats(self) -> None:
        """Every float field is a finite number (a NaN compares false with every bound, so without this check a
        NaN max_log_ratio would switch the exploding-ratio guard off) inside its FLOAT_RANGES interval."""
        for name, (low, high, meaning) in FLOAT_RANGES.items():
            value = getattr(self, name)
            lo_ok = value > low[0] if low[1] == "(" else value >= low[0]
            hi_ok = value < high[0] if high[1] == ")" else value <= high[0]
            if not (math.isfinite(value) and lo_ok and hi_ok):
                interval = f"{low[1]}{low[0]:g}, {high[0]:g}{high[1]}"
                raise ValueError(f"{name} = {value}: must be a finite number in {interval}{meaning}")

    def _validate_rollout_runtime(self) -> None:
        """rollout_runtime: the vllm engine's settings, every key checked (study.run.rollout_runtime)."""
        from study.run.rollout_runtime import EngineSettings

        if self.rollout_runtime and self.rollout_engine != "vllm":
            raise ValueError(
                f"rollout_runtime = {self.rollout_runtime!r} is read by rollout_engine = 'vllm' only "
                f"(rollout_engine = {self.rollout_engine!r}); valid: rollout_runtime = {{}}"
            )
        EngineSettings.parse(self.rollout_runtime, field="rollout_runtime")

    def _validate_model(self) -> None:
        """The shape (canonical since construction), and what the tokenizer needs of it."""
        from study.data.tokenizer import MIN_VOCAB_SIZE

        model = self.model_config()
        if model.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size = {model.vocab_size}: must be >= {MIN_VOCAB_SIZE} (the tokenizer's "
                "256 bytes and special tokens)"
            )

    def _validate_user_data(self) -> None:
        """User data hook: task = "user" needs `data` and `verifier`; the files load (every row checked by the
        verifier) and split before any compute. Errors name the field."""
        from study.data import tasks

        if self.task != "user":
            for name in ("data", "verifier", "eval_data"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name} = {getattr(self, name)!r} is only read with task = 'user' (task = "
                        f"{self.task!r}); valid: task = 'user', or {name} = ''"
                    )
            return
        if self.task_knobs:
            raise ValueError(f"task_knobs = {self.task_knobs!r}: task = 'user' has no knobs; valid: {{}}")
        if not self.data:
            raise ValueError("data = '': task = 'user' needs a JSONL or parquet file of (prompt, answer) rows")
        if not self.verifier:
            raise ValueError(
                f"verifier = '': task = 'user' needs one; valid: {', '.join(tasks.USER_VERIFIERS)}, "
                "or a reasoning-gym task name"
            )
        tasks.check_verifier(self.verifier)
        if self.coldstart == "auto":
            raise ValueError(
                "coldstart = 'auto' trains on a generated task; with task = 'user' valid: 'scratch', a "
                "cold-start directory (policy.pt) or an HF checkpoint directory"
            )
        self.user_split()

    def user_split(self) -> tuple[list[Any], list[Any]]:
        """(training items, held-out items) of task = "user" (study.data.tasks.split_user_data); errors name the
        field."""
        from study.data import tasks

        loaded = {name: self.user_rows(name) for name in ("data", "eval_data") if getattr(self, name)}
        try:
            return tasks.split_user_data(loaded["data"], eval_size=self.eval_size, eval_items=loaded.get("eval_data"))
        except ValueError as e:
            raise ValueError(f"data = {self.data!r}: {e}") from None

    def task_data(self) -> tuple[Any, dict[str, list[Any]]]:
        """(training stream with `take(n, start)`, held-out sets by split: `in_dist` drawn with the training knobs,
        `hard` with the task's hard knobs). task = "user": the user's training rows cycled in a seed-dependent order
        per epoch, and their held-out split (or eval_data) as `in_dist`."""
        from study.data import tasks

        if self.task == "user":
            train, held = self.user_split()
            return tasks.UserTask(tuple(train), self.seed), {"in_dist": held}
        stream = tasks.make_task(self.task, seed=self.seed, held_out_test=self.eval_test_size > 0, **self.task_knobs)
        return stream, {
            split: tasks.eval_set(
                self.task, split, size=self.eval_size, knobs=self.task_knobs if split == "in_dist" else None
            )
            for split in tasks.EVAL_SPLITS
        }

    def user_rows(self, name: str = "data") -> tuple[Any, ...]:
        """The items of task = "user"'s file `name` ("data" or "eval_data"), one per row in the file's order
        (study.data.tasks.load_user_data, cached by content); () when the field is empty. Errors name the field."""
        from study.data import sandbox

        path = getattr(self, name)
        if not path:
            return ()
        try:
            return _load_user_data(path, self.verifier, _file_digest(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"{name} = {path!r}: {e}") from None
        except sandbox.SandboxRefused as e:
            raise ValueError(f"verifier = {self.verifier!r}: {e}") from None

    def _validate_test_split(self) -> None:
        from study.data import tasks

        if not 0 <= self.eval_test_size <= tasks.TEST_POOL:
            raise ValueError(f"eval_test_size = {self.eval_test_size}: valid: 0 (no test split) .. {tasks.TEST_POOL}")
        _positive("eval_test_samples", self.eval_test_samples)
        if self.eval_test_size and self.task == "user":
            raise ValueError(
                f"eval_test_size = {self.eval_test_size}: task = 'user' has one held-out set "
                "(eval_data); valid: eval_test_size = 0"
            )
        if self.eval_test_size and not self.eval_every:
            raise ValueError(
                f"eval_test_size = {self.eval_test_size}: the test split is scored at the first and last "
                "evaluations; valid: eval_every >= 1, or eval_test_size = 0"
            )

    def eval_plan(self, validation: dict[str, list[Any]], step: int) -> list[EvalPass]:
        """What the evaluation at `step` scores (tasks.evaluation_plan): the validation sets, and the test split at
        step 0 and the last step."""
        from study.data import tasks

        test = (
            tasks.held_out_test_set(self.task, size=self.eval_test_size, knobs=self.task_knobs)
            if self.eval_test_size
            else []
        )
        return tasks.evaluation_plan(
            validation,
            samples=self.eval_samples,
            step=step,
            last_step=self.steps,
            test=test,
            test_samples=self.eval_test_samples,
        )

    def _validate_coldstart(self) -> None:
        """An HF checkpoint directory (config.json + safetensors, no policy.pt) must match the model's shape; other
        paths are checked when the run starts (a sweep may name a cold start that is still being made)."""
        from study.core import weights

        if self.coldstart in ("auto", "scratch"):
            return
        directory = Path(self.coldstart)
        if not (directory / "policy.pt").is_file() and weights.is_hf_checkpoint(directory):
            weights.check_checkpoint(directory, self.model)

    def _validate_precision(self) -> None:
        """Precision hook (study/core/precision.py): valid labels, supported by the rollout engine."""
        from study.core.precision import PRECISIONS, Precision

        _choice("train_precision", self.train_precision, PRECISIONS)
        _choice("rollout_precision", self.rollout_precision, (*PRECISIONS, "same"))
        if self.rollout_engine == "vllm" and not Precision.parse(self.rollout_precision).plain:
            raise ValueError(
                f"rollout_precision = {self.rollout_precision!r} needs module hooks that vLLM's fused kernels do not "
                f"offer; valid with rollout_engine = 'vllm': {', '.join(DTYPES)} (real), or use rollout_engine = 'hf'"
            )

    @property
    def precisions(self) -> tuple[Any, Any]:
        """(train, rollout) study.core.precision.Precision of the run."""
        from study.core.precision import Precision

        return Precision.parse(self.train_precision), Precision.parse(self.rollout_precision)

    @property
    def train_dtype(self) -> str:
        """The format the training engine computes in (bf16 for bf16_fp32head, the format when emulated)."""
        return self.precisions[0].dtype

    @property
    def rollout_dtype(self) -> str:
        """The format the rollout engine computes in."""
        return self.precisions[1].dtype

    @property
    def layout(self) -> ParallelLayout:
        """The `parallel` section as a validated ParallelLayout (errors name the field)."""
        return ParallelLayout.from_mapping(self.parallel)

    def model_config(self) -> ModelConfig:
        """The resolved shape: the preset with the run's overrides (study.core.model_config.resolve_model)."""
        return resolve_model(self.model)

    @property
    def run_id(self) -> str:
        """Content hash of the resolved config (hyper-parameters resolved against the registry's defaults)."""
        resolved = self.to_dict()
        resolved["hparams"] = catalog.spec(self.algorithm).check_hparams(self.hparams)
        for key in NOT_HASHED:
            resolved.pop(key)
        for key, default in HASHED_IF_SET.items():  # fields added later: run ids of older configs stay valid
            if resolved.get(key) == default:
                resolved.pop(key)
        for key in ("data", "eval_data"):  # user data: the content, not where it lies
            if key in resolved:
                resolved[key] = f"sha256:{_file_digest(resolved[key])}"
        blob = json.dumps(resolved, sort_keys=True, separators=(",", ":"), default=str)
        return f"{self.algorithm}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


_INF = math.inf
FLOAT_RANGES: dict[str, tuple[tuple[float, str], tuple[float, str], str]] = {
    # every float field of RunConfig: (low, "(" or "["), (high, ")" or "]"), a note; finite always (a test checks
    # that each float field is listed)
    "temperature": ((0.0, "("), (2.0, "]"), ""),
    "eval_temperature": ((0.0, "("), (2.0, "]"), ""),
    "lr": ((0.0, "("), (_INF, ")"), ""),
    "weight_decay": ((0.0, "["), (_INF, ")"), ""),
    "grad_clip": ((0.0, "["), (_INF, ")"), " (0 = off)"),
    "router_lr_scale": ((0.0, "("), (_INF, ")"), " (1 = routers at lr)"),
    "reward_floor": ((-1.0, "["), (1.0, "]"), " (-1 = off)"),
    "max_log_ratio": ((0.0, "("), (_INF, ")"), ""),
    "kl_coef": ((0.0, "["), (_INF, ")"), " (0 = no KL penalty)"),
    "engine_router_noise": ((0.0, "["), (_INF, ")"), " (0 = off)"),
    "router_kick": ((0.0, "["), (_INF, ")"), " (0 = off)"),
}
"""The valid interval of each float field of RunConfig (checked by validate, besides finiteness)."""

# Fields that do not change what a run computes (`parallel`: to rounding, like the thread count's sums).
NOT_HASHED: tuple[str, ...] = (
    "checkpoint_every",
    "rollout_runtime",
    "sync_check_every",
    "parallel",
    "micro_batch",
    "recompute",
    "experts",
)
# Fields hashed only when not at their default (added after runs existed; the default computes what runs did before).
HASHED_IF_SET: dict[str, Any] = {
    "data": "",
    "verifier": "",
    "eval_data": "",
    "kl_coef": 0.0,
    "coldstart_band": [0.1, 0.5],
    "router_lr_scale": 1.0,
    "prompt_filter": "none",
    "eval_temperature": 1.0,
    "engine_router_noise": 0.0,
    "eval_test_size": 0,
    "eval_test_samples": 8,
    "routing_attribution": False,
    "router_kick": 0.0,
}


_DEFAULT_MODEL: str = RunConfig.model  # the preset a model mapping without `preset` overrides


def merge_field(key: str, old: Any, new: Any) -> Any:
    """A field's value after a later layer (preset run, config file, `--set`, sweep base, tuned values, axis) sets
    it to `new` over `old` (None: unset). Mappings such as hparams merge key by key. `model`: a name or a mapping
    with `preset` is a whole shape and replaces; a mapping without `preset` changes fields of the shape so far."""
    if key == "model":
        if isinstance(new, Mapping) and "preset" not in new:
            shape = {"preset": old} if isinstance(old, str) else dict(old) if isinstance(old, Mapping) else {}
            return {**shape, **new}
        return new
    if isinstance(new, Mapping) and isinstance(old, Mapping):
        return {**old, **new}
    return new


def _file_digest(path: str) -> str:
    """sha256 of the file's bytes, cached by (path, size, mtime)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        raise FileNotFoundError(f"no such file {path}") from None
    return _digest(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the bytes the bounded reader gives (study.data.tasks.read_data_file: a FIFO or device is refused,
    never waited on)."""
    from study.data import tasks

    return hashlib.sha256(tasks.read_data_file(path)).hexdigest()


@functools.lru_cache(maxsize=16)
def _load_user_data(path: str, verifier: str, digest: str) -> tuple[Any, ...]:
    """study.data.tasks.load_user_data, cached by content (validation runs on every from_dict / replace)."""
    from study.data import tasks

    return tuple(tasks.load_user_data(path, verifier=verifier))


REPLACED_FIELDS: dict[str, str] = {"train_dtype": "train_precision", "rollout_dtype": "rollout_precision"}
"""Names that are not fields, each with the field that holds what it would mean: a config or `--set` naming one is
refused naming the replacement."""


def _precisions() -> tuple[str, ...]:
    from study.core.precision import PRECISIONS

    return PRECISIONS


def _resolve_precision(data: dict[str, Any]) -> dict[str, Any]:
    """Precision hook (study/core/precision.py): rollout_precision "same" -> train_precision's value; each precision
    as its canonical label ("bf16-real" -> "bf16"). Invalid labels are left to validate()."""
    from study.core.precision import PRECISIONS, Precision

    data = dict(data)
    if data.get("rollout_precision") == "same":
        data["rollout_precision"] = data.get("train_precision", RunConfig.train_precision)
    for side in ("train", "rollout"):
        spec = data.get(f"{side}_precision")
        if isinstance(spec, str) and spec in (*PRECISIONS, *(f"{n}-real" for n in PRECISIONS if "-" not in n)):
            data[f"{side}_precision"] = Precision.parse(spec).label
    return data


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} = {value!r}; valid: {', '.join(valid)}")


def _positive(name: str, value: Any) -> None:
    if value < 1:
        raise ValueError(f"{name} = {value}: must be >= 1")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Type-check one field (YAML and --set give strings, ints for floats...)."""
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} = {value!r}: must be a mapping")
        return {k: _scalar(v, f"{key}.{k}") if isinstance(v, str) else v for k, v in value.items()}
    if hint is float and isinstance(value, str):
        value = _scalar(value, key)  # YAML 1.1 reads 1e-4 as a string
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"{key} = {value!r}: must be true or false")
    if hint in (int, float, str) and not (isinstance(value, hint) and not isinstance(value, bool)):
        raise ValueError(f"{key} = {value!r}: must be {hint.__name__}")
    return value


PRESET_RUNS: dict[str, dict[str, Any]] = {
    # Tests and smoke runs: a minute or two per run on one thread; random-init cold start is made automatically.
    "tiny": {
        "model": "tiny",
        "steps": 6,
        "prompts_per_step": 4,
        "group_size": 4,
        "minibatches": 2,
        "max_new_tokens": 48,
        "eval_every": 3,
        "eval_size": 8,
        "eval_samples": 2,
        "checkpoint_every": 3,
    },
    # The embedded default study: a few minutes per run on one core.
    "default": {
        "model": "default",
        "steps": 40,
        "prompts_per_step": 8,
        "group_size": 8,
        "minibatches": 4,
        "max_new_tokens": 48,
        "eval_every": 10,
        "eval_size": 32,
        "eval_samples": 4,
    },
}


MAX_SET_CHARS = 1 << 16
"""Longest value a `--set key=value` may have."""


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values parsed as YAML scalars; `hparams.eps_low=0.1` and
    `model.num_experts=16` nest. Applied in order (merge_field): `model=default` then `model.num_experts=16` is
    {preset: default, num_experts: 16}."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if len(raw) > MAX_SET_CHARS:
            raise ValueError(
                f"--set {key}=...: a value of {len(raw)} characters; valid: at most {MAX_SET_CHARS} "
                "(put a long value in a config file)"
            )
        try:
            value = _scalar(raw, key)
        except yaml.YAMLError as err:
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({_yaml_error(err)})") from None
        except ValueError as err:  # a number of more digits than Python reads
            raise ValueError(f"--set {err}") from None
        if "." in key:
            key, sub = key.split(".", 1)
            value = {sub: value}
        out[key] = merge_field(key, out.get(key), value)
    return out


def _scalar(raw: str, key: str = "value") -> Any:
    """int, then float (YAML 1.1 reads "5e-3" as a string), then any YAML scalar or flow collection; ValueError
    naming `key` for an integer of more digits than Python reads (which float() would read as inf)."""
    for parse in (int, float):
        try:
            return parse(raw)
        except ValueError:
            if parse is int and re.fullmatch(r"\s*[+-]?\d+\s*", raw):
                raise ValueError(_too_many_digits(key, raw.strip())) from None
    return load_yaml(raw) if raw else ""


def load_config(path: str | Path | None = None, *, preset: str | None = None, sets: list[str] = ()) -> RunConfig:
    """Preset, then the YAML file, then `--set` overrides; validated."""
    data: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESET_RUNS:
            raise ValueError(f"preset = {preset!r}; valid: {', '.join(PRESET_RUNS)}")
        data.update(PRESET_RUNS[preset])
    if path is not None:
        loaded = read_yaml_file(path, what="a YAML file of RunConfig fields")
        if loaded is None:
            raise ValueError(
                f"{path}: empty (no config fields); give a YAML mapping of RunConfig fields, e.g. 'algorithm: gspo'"
            )
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: must hold a mapping of config fields")
        data.update(loaded)
    for key, value in parse_set(list(sets)).items():
        data[key] = merge_field(key, data.get(key), value)
    return RunConfig.from_dict(data, where=str(path or "config"))


def _yaml_error(err: yaml.YAMLError) -> str:
    return " ".join(str(err).split())


def read_yaml_file(path: str | Path, *, what: str) -> Any:
    """The YAML document in `path`; a missing file, a directory, a FIFO or device, invalid YAML or a number of more
    digits than Python reads is a ValueError naming the path (and the key) and `what` it should be."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path}: is a directory; give {what}")
    if p.exists() and not p.is_file():  # a FIFO would be waited on for ever, a device read for ever
        kind = "a FIFO" if p.is_fifo() else "a device or socket"
        raise ValueError(f"{path}: not a regular file ({kind}); give {what}")
    try:
        return read_yaml(p)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; give {what}") from None
    except OSError as err:
        raise ValueError(f"{path}: unreadable ({err}); give {what}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({_yaml_error(err)})") from None
    except ValueError as err:  # the YAML reader's int(): a number of more digits than Python reads
        found = _LONG_NUMBER.search(p.read_text(encoding="utf-8", errors="replace"))
        if found is None:
            raise ValueError(f"{path}: not valid YAML ({err})") from None
        raise ValueError(f"{path}: {_too_many_digits(found['key'], found['number'])}") from None


_LONG_NUMBER = re.compile(
    r"^[ \t-]*(?P<key>[^\s:#'\"][^:#\n]*?)[ \t]*:[ \t]*(?P<number>[+-]?\d{"
    + str(sys.get_int_max_str_digits() + 1)
    + r",})[ \t]*$",
    re.MULTILINE,
)
"""A YAML line `key: <a number of more digits than Python reads>`."""


def _too_many_digits(key: str, number: str) -> str:
    digits = len(number.lstrip("+-"))
    limit = sys.get_int_max_str_digits()
    return f"{key} = a {digits}-digit number; valid: a number of at most {limit} digits"
