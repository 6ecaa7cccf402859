"""A local Hugging Face Qwen3-MoE checkpoint as the initial policy of an RL run (`coldstart: /path/to/hf_dir`, or
the directory as the run's `model`).

The directory holds config.json, the weights as *.safetensors (one file or shards, with or without
model.safetensors.index.json) and the tokenizer files (tokenizer.json, with special_tokens_map.json /
tokenizer_config.json naming its special tokens and, for a chat model, its chat template). This is what
`study.core.weights.export_hf` + `TaskTokenizer.save` write, what the cold start writes next to its policy.pt, and what
a Hugging Face model repository holds.

The checkpoint's shape is the run's `model` (study.core.model_config.hf_model_config maps its config.json; a mismatch
with a given `model` is reported before any compute with every differing field). Loading streams: shard by shard,
one tensor at a time (safetensors' safe_open), each mapped to its Megatron name and copied into the policy's
parameter, so the process never holds the checkpoint, only the tensor in flight (and the q/k/v or gate/up parts
of one fused tensor until its last part arrives). A tensor-/expert-parallel rank reads the same stream
(`tensors()`) and keeps only its slice of each tensor (study.policy.parallel.load_streamed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from study.core.model_config import ModelConfig
from study.core.weights import check_checkpoint, hf_param_names, hf_to_megatron, is_hf_checkpoint
from study.data.tokenizer import TaskTokenizer
from study.run.rundir import json_problem

__all__ = ["HFCheckpoint", "check_checkpoint", "is_hf_checkpoint", "load_checkpoint"]


def shard_files(directory: str | Path) -> list[Path]:
    """The checkpoint's safetensors files in load order: model.safetensors.index.json's weight map order when the
    index exists (every file it names must exist), else sorted by name."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"coldstart = {str(directory)!r}: {index}: {json_problem(err)}") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise ValueError(f"coldstart = {str(directory)!r}: shards named in {index.name} are missing: {missing}")
        return [directory / f for f in files]
    return sorted(directory.glob("*.safetensors"))


class HFCheckpoint:
    """The weights of a local HF Qwen3-MoE checkpoint, read lazily: `tensors()` streams (Megatron name, tensor)
    pairs, `load_into(model)` copies them into a one-process policy's parameters."""

    def __init__(self, directory: str | Path, cfg: ModelConfig) -> None:
        self.directory, self.cfg = Path(directory), cfg
        self.files = shard_files(self.directory)
        if not self.files:
            raise ValueError(f"coldstart = {str(self.directory)!r}: no *.safetensors files")

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every tensor, shard by shard, one tensor read at a time."""
        from safetensors import safe_open

        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, f.get_tensor(name)

    def tensors(self, *, te_spec: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, tensor) of every weight, mapped as study.core.weights.hf_to_megatron maps a whole state dict.
        A fused tensor (linear_qkv, an expert's linear_fc1) is yielded when its last HF part has been read; only
        such pending parts are held. Every HF tensor must be there exactly once (a missing or unknown one raises)."""
        expected = set(hf_param_names(self.cfg))
        seen: set[str] = set()
        pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        groups = {"q_proj": ("q", "k", "v"), "k_proj": ("q", "k", "v"), "v_proj": ("q", "k", "v"),
                  "gate_proj": ("gate", "up"), "up_proj": ("gate", "up")}  # fmt: skip
        for name, tensor in self.hf_tensors():
            if name not in expected or name in seen:
                what = "appears twice" if name in seen else "is not a tensor of the model"
                raise ValueError(f"coldstart = {str(self.directory)!r}: {name!r} {what}")
            seen.add(name)
            proj = name.rsplit(".", 2)[-2]  # ...self_attn.q_proj.weight -> q_proj
            if proj not in groups:
                yield from self._mapped({name: tensor}, te_spec)
                continue
            key = (name.rsplit(".", 2)[0], *groups[proj])  # the fused tensor's HF prefix and parts
            parts = pending.setdefault(key, {})
            parts[name] = tensor
            if len(parts) == len(groups[proj]):
                del pending[key]
                yield from self._mapped(parts, te_spec)
        missing = expected - seen
        if missing:
            raise ValueError(f"coldstart = {str(self.directory)!r}: {len(missing)} tensors of the model are missing, "
                             f"e.g. {sorted(missing)[:3]}")  # fmt: skip

    def _mapped(self, hf_part: dict[str, torch.Tensor], te_spec: bool) -> Iterator[tuple[str, torch.Tensor]]:
        yield from hf_to_megatron(hf_part, self.cfg, te_spec=te_spec, partial=True, copy=False).items()

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module) -> int:
        """Copy every weight into `model`'s parameter of the same Megatron name (cast to its dtype); returns the
        number of elements copied. Every parameter of the model must be written. (A sharded model:
        study.policy.parallel.load_streamed.)"""
        params = {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")}
        written: set[str] = set()
        copied = 0
        for name, tensor in self.tensors():
            dst = params.get(name)
            if dst is None:
                raise ValueError(f"coldstart = {str(self.directory)!r}: the model has no parameter {name!r}")
            if dst.shape != tensor.shape:
                raise ValueError(f"coldstart = {str(self.directory)!r}: {name} has shape {tuple(tensor.shape)}, the "
                                 f"model's is {tuple(dst.shape)}")  # fmt: skip
            dst.data.copy_(tensor)
            written.add(name)
            copied += tensor.numel()
        unwritten = sorted(set(params) - written - {n for n in params if n.endswith(("local_tokens_per_expert",
                                                                                      "expert_bias"))})  # fmt: skip
        if unwritten:
            raise ValueError(f"coldstart = {str(self.directory)!r}: {len(unwritten)} parameters were not loaded, "
                             f"e.g. {unwritten[:3]}")  # fmt: skip
        return copied


def load_checkpoint(directory: str | Path, cfg: ModelConfig) -> tuple[TaskTokenizer, HFCheckpoint]:
    """(tokenizer, lazily read weights) of the HF checkpoint in `directory`."""
    directory = Path(directory)
    tok = TaskTokenizer.load(directory)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"coldstart = {str(directory)!r}: tokenizer has {tok.vocab_size} ids > model.vocab_size {cfg.vocab_size}"
        )
    return tok, HFCheckpoint(directory, cfg)
