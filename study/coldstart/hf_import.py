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

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from runfiles.bounded import json_file_problem, load_json, read_json
from study.core.model_config import ModelConfig
from study.core.weights import (
    check_checkpoint,
    confined,
    hf_param_names,
    hf_param_shapes,
    hf_to_megatron,
    is_hf_checkpoint,
)
from study.data import chat_template
from study.data.tokenizer import TaskTokenizer
from study.run.rundir import json_problem

__all__ = ["HFCheckpoint", "check_checkpoint", "check_files", "check_tokenizer", "is_hf_checkpoint", "load_checkpoint"]


INDEX = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header read (the safetensors library's own limit)."""

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "C64": 8,
}
"""Bytes per element of each safetensors dtype."""

WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")
"""The dtypes a model's tensor may have in a checkpoint: the floating-point formats its parameters are cast from."""


def _where(directory: Path) -> str:
    return f"coldstart = {str(directory)!r}"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The tokenizer's files in a checkpoint's folder (study.data.tokenizer.TaskTokenizer.load reads each present)."""

FOLDER_FILES = ("config.json", INDEX, *TOKENIZER_FILES)
"""The files of a checkpoint's folder a run reads besides its shards, each where present."""


def check_links(directory: str | Path, names: tuple[str, ...] = FOLDER_FILES) -> None:
    """Each of `names` present in the checkpoint's folder resolves inside it or its hub cache's blobs
    (study.core.weights.confined), checked before any of them is read; ValueError naming the file otherwise."""
    directory = Path(directory)
    for name in names:
        if os.path.lexists(directory / name):
            confined(directory, name, "the folder", "file")


def _weight_map(directory: Path) -> dict[str, str] | None:
    """model.safetensors.index.json's weight map (tensor name -> shard file), None without an index; ValueError
    naming the file when it is not such a map."""
    index = directory / INDEX
    if not index.is_file():
        return None
    try:
        data = read_json(index)
    except (OSError, ValueError) as err:  # unreadable; not JSON, not UTF-8, past a bound
        raise ValueError(f"{_where(directory)}: {index}: {json_file_problem(err)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f"{_where(directory)}: {index}: no weight_map; valid: a JSON object whose weight_map maps "
            "each tensor name to its shard file"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(
                f"{_where(directory)}: {index}: weight_map[{name[:200]!r}] = {str(file)[:100]}; valid: "
                "a shard file name"
            )
    return weight_map


def shard_files(directory: str | Path) -> list[Path]:
    """The checkpoint's safetensors files in load order: model.safetensors.index.json's weight map order when the
    index exists, else sorted by name; each a file inside the checkpoint's folder (study.core.weights.confined)."""
    directory = Path(directory)
    weight_map = _weight_map(directory)
    if weight_map is not None:
        return [confined(directory, f, INDEX) for f in dict.fromkeys(weight_map.values())]
    return [confined(directory, p.name, "the folder") for p in sorted(directory.glob("*.safetensors"))]


def safetensors_names(path: Path, where: str, shapes: Mapping[str, tuple[int, ...]] | None = None) -> list[str]:
    """The tensor names of a safetensors file, its header checked against the file without reading any tensor: the
    header's length within the file (at most MAX_HEADER_BYTES), the header a JSON object (runfiles.bounded), each
    tensor a known dtype with a shape whose size is its byte range, the ranges tiling the data exactly, and each
    tensor named in `shapes` (the model's) a WEIGHT_DTYPES float of exactly that shape. ValueError naming the file
    otherwise (never with the bytes of a file that has no header)."""
    import math
    import struct

    where = f"{where}: {path.name}"
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{where}: {size} bytes; not a safetensors file (its first 8 bytes are the header length)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(
                f"{where}: its first 8 bytes are no header length within its {size - 8} bytes after them (at most "
                f"{MAX_HEADER_BYTES}); not a safetensors file, or cut short"
            )
        raw = f.read(n)
    try:
        header = load_json(raw, max_bytes=MAX_HEADER_BYTES)
    except ValueError as err:
        raise ValueError(f"{where}: header {json_problem(err)}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the header is a JSON {type(header).__name__}; valid: a JSON object")
    data = size - 8 - n
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        bad = f"{where}: tensor {name[:200]!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{bad}: valid: an object of dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{bad}: dtype {str(dtype)[:50]!r}; valid: {', '.join(DTYPE_BYTES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{bad}: shape {str(shape)[:100]}; valid: a list of sizes >= 0")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise ValueError(f"{bad}: data_offsets {str(offsets)[:100]} outside the file's {data} bytes of data")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{bad}: shape {shape} of {dtype} is {math.prod(shape) * DTYPE_BYTES[dtype]} bytes, its "
                f"data_offsets {offsets} hold {offsets[1] - offsets[0]}"
            )
        if shapes is not None and name in shapes and (tuple(shape) != shapes[name] or dtype not in WEIGHT_DTYPES):
            raise ValueError(
                f"{bad}: shape {shape} of {dtype}; the model's is {list(shapes[name])} of a float dtype "
                f"({', '.join(WEIGHT_DTYPES)})"
            )
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            raise ValueError(
                f"{where}: tensor {name[:200]!r} starts at byte {begin} of the data, not at {end}; the "
                "tensors must tile the data (overlapping or with gaps)"
            )
        end = stop
    if end != data:
        raise ValueError(f"{where}: the tensors hold {end} bytes, the file has {data} after the header")
    return [name for _, _, name in ranges]


def check_files(directory: str | Path, cfg: ModelConfig) -> None:
    """Everything of the HF checkpoint in `directory` a run reads, checked before the run writes anything, no tensor
    read: config.json (study.core.weights.check_checkpoint), the index's shard names inside the folder, every
    shard's header (`safetensors_names`: each of the model's tensors of its shape and a float dtype), each of the
    model's tensors exactly once (in the shard the index names),
    the tokenizer files and the chat template, rendered once under a time and memory limit
    (study.data.chat_template.check). ValueError naming the file and why."""
    directory = Path(directory)
    where = _where(directory)
    check_links(directory)
    weight_map = _weight_map(directory)
    files = shard_files(directory)
    if not files:
        raise ValueError(f"{where}: no *.safetensors files")
    found: dict[str, Path] = {}
    shapes = hf_param_shapes(cfg)
    for path in files:
        for name in safetensors_names(path, where, shapes):
            if name in found:
                raise ValueError(f"{where}: tensor {name[:200]!r} is in {found[name].name} and in {path.name}")
            found[name] = path
    if weight_map is not None:
        for name, file in weight_map.items():
            if found.get(name) != directory / file:
                raise ValueError(f"{where}: {INDEX} maps {name[:200]!r} to {file[:200]!r}, which does not hold it")
    expected = set(hf_param_names(cfg))
    missing, unknown = sorted(expected - set(found)), sorted(set(found) - expected)
    if missing or unknown:
        raise ValueError(
            f"{where}: "
            + "; ".join(
                f"{len(names)} tensors {what}, e.g. {names[:3]}"
                for names, what in ((missing, "of the model are missing"), (unknown, "are not tensors of the model"))
                if names
            )
        )
    check_tokenizer(directory)


def check_tokenizer(directory: str | Path) -> None:
    """The folder's tokenizer files, confined to it (`check_links`), load (study.data.tokenizer.TaskTokenizer.load:
    bounded, checked JSON) and its chat template, if any, renders a prompt under the limits of
    study.data.chat_template.check. ValueError naming the file and why."""
    directory = Path(directory)
    check_links(directory, TOKENIZER_FILES)
    try:
        tok = TaskTokenizer.load(directory)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{_where(directory)}: {err}") from None
    if tok.chat_template is not None:
        source = directory / (
            "chat_template.jinja" if (directory / "chat_template.jinja").is_file() else "tokenizer_config.json"
        )
        chat_template.check(tok.chat_template, tok.specials, where=f"{_where(directory)}: {source}")


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
        groups = {
            "q_proj": ("q", "k", "v"),
            "k_proj": ("q", "k", "v"),
            "v_proj": ("q", "k", "v"),
            "gate_proj": ("gate", "up"),
            "up_proj": ("gate", "up"),
        }
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
            raise ValueError(
                f"coldstart = {str(self.directory)!r}: {len(missing)} tensors of the model are missing, "
                f"e.g. {sorted(missing)[:3]}"
            )

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
                raise ValueError(
                    f"coldstart = {str(self.directory)!r}: {name} has shape {tuple(tensor.shape)}, the "
                    f"model's is {tuple(dst.shape)}"
                )
            dst.data.copy_(tensor)
            written.add(name)
            copied += tensor.numel()
        unwritten = sorted(
            set(params) - written - {n for n in params if n.endswith(("local_tokens_per_expert", "expert_bias"))}
        )
        if unwritten:
            raise ValueError(
                f"coldstart = {str(self.directory)!r}: {len(unwritten)} parameters were not loaded, "
                f"e.g. {unwritten[:3]}"
            )
        return copied


def load_checkpoint(directory: str | Path, cfg: ModelConfig) -> tuple[TaskTokenizer, HFCheckpoint]:
    """(tokenizer, lazily read weights) of the HF checkpoint in `directory` (its files confined, `check_links`)."""
    directory = Path(directory)
    check_links(directory)
    tok = TaskTokenizer.load(directory)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"coldstart = {str(directory)!r}: tokenizer has {tok.vocab_size} ids > model.vocab_size {cfg.vocab_size}"
        )
    return tok, HFCheckpoint(directory, cfg)
