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

from pathlib import Path

import torch

from study.data.tokenizer import TaskTokenizer
from study.model_config import ModelConfig
from study.weights import check_checkpoint, hf_to_megatron, is_hf_checkpoint

__all__ = ["check_checkpoint", "is_hf_checkpoint", "load_checkpoint"]


def load_checkpoint(directory: str | Path, cfg: ModelConfig) -> tuple[TaskTokenizer, dict[str, torch.Tensor]]:
    """(tokenizer, Megatron state dict) of the HF checkpoint in `directory`; weights mapped with hf_to_megatron."""
    from safetensors.torch import load_file

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
