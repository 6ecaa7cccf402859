"""A local Hugging Face Qwen3-MoE checkpoint as the initial policy of an RL run (`coldstart: /path/to/hf_dir`).

The directory holds config.json, the weights as *.safetensors (one file or shards) and the tokenizer files
(tokenizer.json, with special_tokens_map.json / tokenizer_config.json naming its special tokens). This is what
`study.weights.export_hf` + `TaskTokenizer.save` write, and what the cold start writes next to its policy.pt.

The checkpoint must *match* the run's model preset rather than define the model: `model` is a hashed axis of the
study (FLOPs estimates, engine settings, analysis all read the preset), so deriving the shape from the checkpoint
would make the run id and the recorded `model` field describe a different network than the one trained. A mismatch
is reported before any compute with every differing field and the preset that would match, if one does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from study.config import PRESETS, ModelConfig
from study.tokenizer import TaskTokenizer


def is_hf_checkpoint(directory: str | Path) -> bool:
    """True when `directory` has a config.json and at least one *.safetensors file."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _rope_theta(hf: dict[str, Any]) -> Any:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return hf.get("rope_theta", params.get("rope_theta"))


def config_mismatches(hf: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """'key: checkpoint X, preset Y' for every HF config.json field that disagrees with `cfg` (empty: they match)."""
    heads = hf.get("num_attention_heads")
    expected: dict[str, tuple[Any, Any]] = {
        "model_type": (hf.get("model_type"), "qwen3_moe"),
        "vocab_size": (hf.get("vocab_size"), cfg.vocab_size),
        "hidden_size": (hf.get("hidden_size"), cfg.hidden_size),
        "num_hidden_layers": (hf.get("num_hidden_layers"), cfg.num_layers),
        "num_attention_heads": (heads, cfg.num_attention_heads),
        "num_key_value_heads": (hf.get("num_key_value_heads", heads), cfg.num_query_groups),
        "head_dim": (hf.get("head_dim", (hf.get("hidden_size") or 0) // (heads or 1)), cfg.head_dim),
        "num_experts": (hf.get("num_experts"), cfg.num_experts),
        "num_experts_per_tok": (hf.get("num_experts_per_tok"), cfg.moe_top_k),
        "moe_intermediate_size": (hf.get("moe_intermediate_size"), cfg.moe_ffn_hidden_size),
        "norm_topk_prob": (bool(hf.get("norm_topk_prob", False)), cfg.moe_top_k > 1),
        "tie_word_embeddings": (bool(hf.get("tie_word_embeddings", False)), False),
        "decoder_sparse_step": (hf.get("decoder_sparse_step", 1), 1),
        "mlp_only_layers": (list(hf.get("mlp_only_layers") or []), []),
        "rope_theta": (_rope_theta(hf), cfg.rotary_base),
        "rms_norm_eps": (hf.get("rms_norm_eps"), cfg.norm_eps),
    }
    out = [f"{key}: checkpoint {got!r}, preset {want!r}" for key, (got, want) in expected.items() if got != want]
    max_pos = hf.get("max_position_embeddings")
    if not isinstance(max_pos, int) or max_pos < cfg.max_seq_len:
        out.append(f"max_position_embeddings: checkpoint {max_pos!r}, preset needs >= {cfg.max_seq_len}")
    return out


def check_checkpoint(directory: str | Path, model: str) -> None:
    """Raise ValueError naming `coldstart` and `model` unless the HF checkpoint in `directory` can initialise the
    preset `model` (config fields, tokenizer file). Reads config.json only: no weights are loaded."""
    directory = Path(directory)
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"coldstart = {str(directory)!r}: cannot read config.json ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"coldstart = {str(directory)!r}: config.json must hold an object")
    diffs = config_mismatches(hf, PRESETS[model])
    if diffs:
        matching = [name for name, mcfg in PRESETS.items() if not config_mismatches(hf, mcfg)]
        hint = f"set model = {matching[0]!r}" if matching else f"valid presets: {', '.join(PRESETS)}"
        raise ValueError(
            f"coldstart = {str(directory)!r}: the HF checkpoint does not match model = {model!r} ("
            + "; ".join(diffs)
            + f"); {hint}"
        )
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"coldstart = {str(directory)!r}: the HF checkpoint has no tokenizer.json (save one with "
            "TaskTokenizer.save or the model's tokenizer.save_pretrained)"
        )


def load_checkpoint(directory: str | Path, cfg: ModelConfig) -> tuple[TaskTokenizer, dict[str, torch.Tensor]]:
    """(tokenizer, Megatron state dict) of the HF checkpoint in `directory`; weights mapped with hf_to_megatron."""
    from safetensors.torch import load_file

    from study.weights import hf_to_megatron

    directory = Path(directory)
    hf_state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        hf_state.update(load_file(str(shard)))
    try:
        state = hf_to_megatron(hf_state, cfg)
    except KeyError as e:
        raise ValueError(f"coldstart = {str(directory)!r}: weights do not map onto the model ({e})") from None
    tok = TaskTokenizer.load(directory)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"coldstart = {str(directory)!r}: tokenizer has {tok.vocab_size} ids > model.vocab_size {cfg.vocab_size}"
        )
    return tok, state
