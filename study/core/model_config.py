"""Typed configuration of the MoE policy: one dataclass, a sentence per field, named presets.

The architecture is Qwen3-MoE's (the paper's model family): RMSNorm, rotary positions, grouped-query attention with
QK-norm, no biases, untied embeddings, every layer a mixture of SwiGLU experts with a softmax top-k router whose
gate weights are renormalised over the chosen experts. Megatron-core builds it for training; transformers'
Qwen3-MoE and vLLM build the same network for rollouts, so weights map one to one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

DType = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The numeric formats an engine computes in (the dtype fields of a run)."""
TORCH_DTYPES: dict[str, torch.dtype]
"""Each of DTYPES as a torch dtype: the one map every module uses (made on first use by `__getattr__`, so that a
run's plan reads this module without loading torch)."""


def __getattr__(name: str) -> Any:
    if name == "TORCH_DTYPES":
        import torch

        globals()[name] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def positive_int(where: str, value: Any) -> int:
    """`value`, an int >= 1 (a bool is not one); else ValueError "`where` = `value`: must be a positive integer"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} = {value!r}: must be a positive integer")
    return value


def positive_number(where: str, value: Any) -> float | int:
    """`value`, a finite int or float > 0 (a bool is not one); else ValueError "`where` = `value`: must be a positive
    finite number"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{where} = {value!r}: must be a positive finite number")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the MoE policy."""

    num_layers: int = 2
    """Transformer layers; every one is an MoE layer."""
    hidden_size: int = 64
    """Residual stream width."""
    num_attention_heads: int = 2
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    head_dim: int = 32
    """Width of one attention head (vLLM's CPU attention needs at least 32)."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 128
    """Intermediate width of one expert's SwiGLU MLP."""
    vocab_size: int = 512
    """Tokenizer vocabulary size (padded embedding rows included)."""
    max_seq_len: int = 256
    """Longest prompt + response the model is built for (rotary table, engine max_model_len)."""
    rotary_base: float = 10000.0
    """Rotary position embedding base (theta)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation (from-scratch models only)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific overrides passed through unchanged (advanced)."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "num_experts",
            "moe_top_k",
            "moe_ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            positive_int(f"model.{name}", getattr(self, name))
        for name in ("rotary_base", "norm_eps", "init_std"):
            positive_number(f"model.{name}", getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups = {self.num_query_groups} must divide "
                f"model.num_attention_heads = {self.num_attention_heads}"
            )
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.moe_top_k = {self.moe_top_k}: valid range is [1, {self.num_experts}]")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def active_params_per_token(self) -> int:
        """Parameters a token touches in one forward pass (attention, top-k experts, norms, LM head): the N in
        the 6 N D training-FLOPs estimate."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups) + self.num_attention_heads * d * h
        experts = self.moe_top_k * 3 * h * self.moe_ffn_hidden_size
        router = h * self.num_experts
        return self.num_layers * (attn + experts + router) + h * self.vocab_size


PRESETS: dict[str, ModelConfig] = {
    # Tests and smoke runs: seconds per RL step on one CPU thread.
    "tiny": ModelConfig(),
    # The embedded default study: a few minutes per run on one core.
    "default": ModelConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=256,
        vocab_size=1024,
        max_seq_len=512,
    ),
    # Benchmarks of the update's share of GEMM peak.
    "small": ModelConfig(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=64,
        num_experts=16,
        moe_top_k=4,
        moe_ffn_hidden_size=512,
        vocab_size=4096,
        max_seq_len=1024,
    ),
    # The paper's model, Qwen3-30B-A3B(-Base)'s config.json: for planning (study/run/plan.py) and, with its
    # checkpoint as the run's `coldstart` (or the checkpoint directory as `model`), for runs on a GPU cluster.
    "qwen3-30b-a3b": ModelConfig(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        vocab_size=151936,
        max_seq_len=32768,
        rotary_base=1000000.0,
        norm_eps=1e-6,
    ),
}


def dense_control(cfg: ModelConfig) -> ModelConfig:
    """The dense control of an MoE shape: one expert, top-1, of width moe_top_k x moe_ffn_hidden_size, so every token
    passes through one SwiGLU MLP with as many parameters as the k experts it activates in `cfg` (3 x hidden x k x
    F per layer), the attention, norms and vocabulary unchanged. What the policy builds most simply: the same MoE
    layer with nothing to route (its one-expert router gives gate 1 to every token, and its single logit learns
    nothing), so the loop, the engines and the cold start run unchanged. Active parameters per token: `cfg`'s less
    the router's other E - 1 logits (num_layers x hidden x (E - 1)). As a sweep's model, the overrides
    {num_experts: 1, moe_top_k: 1, moe_ffn_hidden_size: k F} of `cfg`'s spec."""
    return cfg.replace(num_experts=1, moe_top_k=1, moe_ffn_hidden_size=cfg.moe_top_k * cfg.moe_ffn_hidden_size)


def route_index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype that holds expert ids 0..num_experts-1 (uint8 up to 256 experts, int16 up to 2^15,
    int32 beyond): the dtype of every stored route, trainer's and engine's."""
    import torch

    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


def preset(name: str) -> ModelConfig:
    """The model preset `name`; an unknown name lists the valid ones."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Model shape as data: a preset name, or a preset plus field overrides
# ---------------------------------------------------------------------------------------------------------------------
ModelSpec = str | Mapping[str, Any]
"""A run's `model`: a preset name ("default"), or a mapping {"preset": NAME, FIELD: VALUE, ...} of a preset and
overrides of its SHAPE_FIELDS ({"preset": "default", "num_experts": 32, "moe_top_k": 8})."""

SHAPE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "extra")
"""The ModelConfig fields a model mapping may override (`extra`, the engines' pass-through, is not one)."""
FLOAT_FIELDS: tuple[str, ...] = ("rotary_base", "norm_eps", "init_std")
"""The SHAPE_FIELDS that hold numbers; the others hold positive integers."""
SHAPE_CODES: dict[str, str] = {
    "num_layers": "l",
    "hidden_size": "h",
    "num_attention_heads": "a",
    "num_query_groups": "g",
    "head_dim": "d",
    "num_experts": "e",
    "moe_top_k": "k",
    "moe_ffn_hidden_size": "f",
    "vocab_size": "v",
    "max_seq_len": "s",
    "rotary_base": "rope",
    "norm_eps": "eps",
    "init_std": "std",
}
"""Short name of each SHAPE_FIELD in a shape's label (`default_e32_k8`: the default preset, 32 experts, top-8)."""

_MAPPING_HELP = "a local HF checkpoint directory (with config.json), or a mapping {preset: NAME, FIELD: VALUE, ...}"


def model_spec(spec: Any, *, default_preset: str = "tiny") -> str | dict[str, Any]:
    """The canonical form of a model spec, validated: the preset's name when the overrides change nothing (so a run
    naming a plain preset keeps its id), else {"preset": NAME, FIELD: VALUE, ...} with only the fields that differ
    from the preset's, in SHAPE_FIELDS order. A mapping without `preset` overrides `default_preset`. A local HF
    checkpoint directory (a path holding config.json) is read and mapped (`hf_model_config`) to the canonical spec of
    its shape (`spec_of`): the shape, not the path, names the model. Errors name the field
    (`model.moe_top_k = 9: valid range is [1, 8]`) and the valid values."""
    if isinstance(spec, str):
        if spec in PRESETS:
            return spec
        if is_checkpoint_dir(spec):
            return spec_of(read_hf_config(spec))
        if os.path.isdir(spec):
            raise ValueError(
                f"model = {spec!r}: a directory without config.json; valid: {', '.join(PRESETS)}, {_MAPPING_HELP}"
            )
        raise ValueError(f"model = {spec!r}: unknown model preset; valid: {', '.join(PRESETS)}, {_MAPPING_HELP}")
    if not isinstance(spec, Mapping):
        raise ValueError(f"model = {spec!r}: must be a preset name ({', '.join(PRESETS)}), {_MAPPING_HELP}")
    unknown = sorted(str(k) for k in set(spec) - {"preset", *SHAPE_FIELDS})
    if unknown:
        raise ValueError(f"model: unknown field(s) {unknown}; valid: preset, {', '.join(SHAPE_FIELDS)}")
    name = spec.get("preset", default_preset)
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"model.preset = {name!r}: unknown model preset; valid: {', '.join(PRESETS)}")
    overrides = {key: _shape_value(key, spec[key]) for key in SHAPE_FIELDS if key in spec}
    base = PRESETS[name]
    base.replace(**overrides)  # validates the combination (top-k against the experts, query groups against heads)
    changed = {key: value for key, value in overrides.items() if value != getattr(base, key)}
    return {"preset": name, **changed} if changed else name


def spec_of(cfg: ModelConfig) -> str | dict[str, Any]:
    """The canonical spec of a shape: the preset it equals, else the preset needing the fewest overrides."""
    if cfg.extra:
        raise ValueError(f"model.extra = {cfg.extra!r}: a model spec cannot carry engine overrides")
    specs = []
    for name, base in PRESETS.items():
        changed = {k: getattr(cfg, k) for k in SHAPE_FIELDS if getattr(cfg, k) != getattr(base, k)}
        specs.append((len(changed), {"preset": name, **changed} if changed else name))
    return min(specs, key=lambda pair: pair[0])[1]


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------------------------------
HF_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe",)
"""HF `model_type`s the policy can be (study/policy/model.py builds Qwen3-MoE)."""


def is_checkpoint_dir(path: str | Any) -> bool:
    """True when `path` is a directory holding an entry named config.json (an HF model directory; weights are not
    looked at). The entry is not opened here: `read_hf_config` refuses one that is not a regular file (a FIFO would
    be waited on for ever) in one line."""
    return isinstance(path, (str, os.PathLike)) and os.path.lexists(os.path.join(path, "config.json"))


def read_hf_config(directory: str | Any) -> ModelConfig:
    """The ModelConfig of the HF checkpoint in `directory` (its config.json, `hf_model_config`)."""
    from runfiles.bounded import read_json

    path = os.path.join(directory, "config.json")
    try:
        hf = read_json(path)  # opened without blocking: a FIFO, device or directory is refused (runfiles.bounded)
    except (OSError, ValueError) as e:  # unreadable; not a regular file, not JSON, not UTF-8 or past a bound
        raise ValueError(
            f"model = {str(directory)!r}: cannot read config.json ({e}); valid: an HF checkpoint directory whose "
            "config.json is a regular JSON file"
        ) from None
    return hf_model_config(hf, where=f"model = {str(directory)!r}: config.json")


def hf_model_config(hf: Mapping[str, Any], *, where: str = "config.json") -> ModelConfig:
    """An HF Qwen3-MoE config.json (any size) as the policy's ModelConfig. Anything the policy does not build is
    refused with the field, its value and what is supported: another architecture, dense or shared-expert layers,
    tied embeddings, biases, sliding-window attention, rope scaling, an activation other than SiLU, unnormalised
    top-k gates."""
    if not isinstance(hf, Mapping):
        raise ValueError(f"{where}: must hold a JSON object")

    def need(key: str, ok: bool, supported: str) -> None:
        if not ok:
            raise ValueError(f"{where}: {key} = {hf.get(key)!r} is not supported; valid: {supported}")

    need("model_type", hf.get("model_type") in HF_ARCHITECTURES, ", ".join(HF_ARCHITECTURES))
    need("tie_word_embeddings", not hf.get("tie_word_embeddings", False), "false (an untied output layer)")
    need("decoder_sparse_step", hf.get("decoder_sparse_step", 1) == 1, "1 (every layer MoE)")
    need("mlp_only_layers", not hf.get("mlp_only_layers"), "[] (every layer MoE)")
    need("attention_bias", not hf.get("attention_bias", False), "false")
    need("use_sliding_window", not hf.get("use_sliding_window", False), "false")
    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "silu")
    need("shared_expert_intermediate_size", not hf.get("shared_expert_intermediate_size"), "0 or absent")
    scaling = hf.get("rope_scaling") or {}
    need(
        "rope_scaling",
        not scaling or scaling.get("rope_type", scaling.get("type")) == "default",
        "null or rope_type default",
    )
    params = hf.get("rope_parameters") or {}
    need("rope_parameters", params.get("rope_type", "default") == "default", "rope_type default")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    top_k = hf.get("num_experts_per_tok")
    # megatron pre-softmaxes for top-1 (study.policy.model.norm_topk_prob); for top-k > 1 it renormalises.
    need(
        "norm_topk_prob",
        bool(hf.get("norm_topk_prob", False)) == (isinstance(top_k, int) and top_k > 1),
        "true for num_experts_per_tok > 1, false for 1",
    )
    fields = {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "num_query_groups": "num_key_value_heads",
        "head_dim": "head_dim",
        "num_experts": "num_experts",
        "moe_top_k": "num_experts_per_tok",
        "moe_ffn_hidden_size": "moe_intermediate_size",
        "vocab_size": "vocab_size",
        "max_seq_len": "max_position_embeddings",
        "rotary_base": "rope_theta",
        "norm_eps": "rms_norm_eps",
        "init_std": "initializer_range",
    }
    defaults = {
        "num_key_value_heads": heads,
        "head_dim": hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None,
        "rope_theta": params.get("rope_theta", 10000.0),
        "initializer_range": 0.02,
    }
    aliases = {"num_experts": "num_local_experts"}  # transformers 5 writes Qwen3-MoE's expert count under this name
    values: dict[str, Any] = {}
    for name, key in fields.items():
        value = hf.get(key, hf.get(aliases.get(key, ""), defaults.get(key)))
        if value is None:
            raise ValueError(f"{where}: {key} is missing; a Qwen3-MoE config.json has it")
        try:
            values[name] = _shape_value(name, value)
        except ValueError:
            raise ValueError(
                f"{where}: {key} = {value!r}: must be a positive "
                f"{'finite number' if name in FLOAT_FIELDS else 'integer'}"
            ) from None
    try:
        return ModelConfig(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _shape_value(key: str, value: Any) -> Any:
    """One override, type-checked: an int for the integer fields; a number for FLOAT_FIELDS (YAML 1.1 reads 1e-2 as
    a string, so a numeric string is read as a float)."""
    if key in FLOAT_FIELDS:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        return float(positive_number(f"model.{key}", value))
    return positive_int(f"model.{key}", value)


def base_preset(spec: ModelSpec) -> str:
    """The preset a model spec starts from (its name, or its mapping's `preset`)."""
    canonical = model_spec(spec)
    return canonical if isinstance(canonical, str) else canonical["preset"]


def resolve_model(spec: ModelSpec) -> ModelConfig:
    """The ModelConfig of a model spec: the preset with the overrides applied."""
    canonical = model_spec(spec)
    if isinstance(canonical, str):
        return PRESETS[canonical]
    return PRESETS[canonical["preset"]].replace(**{k: v for k, v in canonical.items() if k != "preset"})


def model_label(spec: ModelSpec) -> str:
    """A readable name of a shape, for directory names: the preset, then `_{code}{value}` per override in
    SHAPE_FIELDS order (`default_e32_k8`); letters, digits and underscores only (a float's `.` reads `p`, `-` `m`;
    a preset's `-` reads `_`)."""
    canonical = model_spec(spec)
    if isinstance(canonical, str):
        return canonical.replace("-", "_")
    parts = [canonical["preset"].replace("-", "_")]
    for key, value in canonical.items():
        if key != "preset":
            text = str(value) if isinstance(value, int) else f"{value:g}".replace(".", "p").replace("-", "m")
            parts.append(f"{SHAPE_CODES[key]}{text.replace('+', '')}")
    return "_".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Parallel layout: how one run's policy is split over ranks
# ---------------------------------------------------------------------------------------------------------------------
PARALLEL_FIELDS: tuple[str, ...] = ("tensor", "expert", "expert_tensor", "data", "pipeline", "context")
"""The sizes a run's `parallel` section may set (ParallelLayout's fields)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel sizes of one run. The world is tensor x data (x pipeline x context, both 1); the experts
    are split over `expert` ranks, each expert over `expert_tensor` ranks, and expert x expert_tensor must divide the
    world (megatron's expert-data-parallel size is the quotient). Under expert parallelism the dense weights are data
    parallel over the same ranks (EP 2 at world size 2 is data 2 for attention, embeddings and norms)."""

    tensor: int = 1
    """Tensor-parallel size (attention heads and the vocabulary split; sequence parallelism is on when > 1)."""
    expert: int = 1
    """Expert-parallel size (the routed experts split over ranks)."""
    expert_tensor: int = 1
    """Tensor-parallel size inside each expert."""
    data: int = 1
    """Data-parallel size of the dense weights (the batch split over ranks)."""
    pipeline: int = 1
    """Pipeline-parallel size: named so that it can be refused; only 1."""
    context: int = 1
    """Context-parallel size: named so that it can be refused; only 1."""

    def __post_init__(self) -> None:
        for name in PARALLEL_FIELDS:
            positive_int(f"parallel.{name}", getattr(self, name))
        for name, what in (("pipeline", "pipeline"), ("context", "context")):
            if getattr(self, name) != 1:
                raise ValueError(
                    f"parallel.{name} = {getattr(self, name)}: {what} parallelism is not supported (the "
                    "study's policies fit one stage and its sequences one rank); valid: 1"
                )
        if self.world_size % (self.expert * self.expert_tensor):
            raise ValueError(
                f"parallel.expert x parallel.expert_tensor = {self.expert} x {self.expert_tensor} must divide the "
                f"world size parallel.tensor x parallel.data = {self.world_size}"
            )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> ParallelLayout:
        """A run's `parallel` section ({} = one process); errors name the field and the valid ones."""
        data = dict(data or {})
        unknown = set(data) - set(PARALLEL_FIELDS)
        if unknown:
            raise ValueError(f"parallel: unknown field(s) {sorted(unknown)}; valid: {', '.join(PARALLEL_FIELDS)}")
        return cls(**data)

    @property
    def world_size(self) -> int:
        """Ranks of the run: tensor x data x pipeline x context."""
        return self.tensor * self.data * self.pipeline * self.context

    @property
    def expert_data(self) -> int:
        """Megatron's expert-data-parallel size: the world over expert x expert_tensor."""
        return self.world_size // (self.expert * self.expert_tensor)

    def check_model(self, cfg: ModelConfig) -> None:
        """The shape splits evenly under this layout; errors name both fields."""
        for model_field, size_field in (
            ("num_attention_heads", "tensor"),
            ("num_query_groups", "tensor"),
            ("vocab_size", "tensor"),
            ("num_experts", "expert"),
            ("moe_ffn_hidden_size", "expert_tensor"),
        ):
            value, size = getattr(cfg, model_field), getattr(self, size_field)
            if value % size:
                raise ValueError(f"model.{model_field} = {value} is not divisible by parallel.{size_field} = {size}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
