"""`python -m study export RUN_DIR [--step N] --hf OUT`: a run's policy as a Hugging Face checkpoint.

OUT gets what `transformers.AutoModelForCausalLM.from_pretrained(OUT)` / `AutoTokenizer.from_pretrained(OUT)` load and
what vLLM serves (`vllm serve OUT`, `vllm.LLM(model=OUT)`): `model.safetensors` (the Megatron weights under Qwen3-MoE's
names, study/core/weights.py, fp32), `config.json` (Qwen3MoeForCausalLM of the run's model shape), the run's tokenizer
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`: the cold start's, which the run trained with),
`generation_config.json` (the run's sampling temperature and max_new_tokens, its <bos>/<eos>/<pad> ids) and
`moe_rl_study.json` (run id, algorithm, step, state, git sha: where the weights came from). A prompt is encoded as
the run encoded it: the tokenizer adds <bos>.

The weights are those of the run's checkpoint (RUN_DIR/checkpoint/, the latest one a run keeps: its last step for a
finished run): state.pt's one-process form, or for a layout run too large for it, megatron's distributed checkpoint
resharded to one process (`distributed_weights`). `--step N` names the step that is wanted and fails, listing the
valid steps, when the run has none there; `--step 0` exports the cold start the run started from. OUT must not exist
or be empty; it is written to a temporary folder beside it and renamed into place, so an interrupted export never
leaves a complete-looking folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from runfiles.bounded import read_json, read_yaml

CHECKPOINT = Path("checkpoint") / "state.pt"


def _load_state(path: Path) -> dict[str, Any]:
    """The run checkpoint, loaded with weights_only=True (tensors and plain values; no code runs)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(
            f"{path}: not a readable checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None


def run_config(run_dir: Path) -> Any:
    from study.run.config import RunConfig

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"RUN_DIR = {str(run_dir)!r}: no config.yaml; valid: a run directory, RESULTS/runs/RUN_ID")
    try:
        data = read_yaml(path)
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping of config fields")
    return RunConfig.from_dict(data, where=str(path))


def coldstart_dir(cfg: Any, results: Path) -> Path | None:
    """The folder of the run's cold start (policy.pt or an HF checkpoint, and its tokenizer); None for `scratch`."""
    if cfg.coldstart == "scratch":
        return None
    if cfg.coldstart == "auto":
        from study.coldstart import resolve_settings
        from study.coldstart.store import run_coldstart

        name = resolve_settings(cfg.model, cfg.task, seed=0, threads=1, init=None, **run_coldstart(cfg)).dirname
        return results / "coldstart" / name
    return Path(cfg.coldstart)


def tokenizer_of(cfg: Any, results: Path) -> Any:
    """The tokenizer the run trained with: its cold start's (never re-trained here), or for `scratch` the
    deterministic one a run builds."""
    from study.data.tokenizer import TaskTokenizer

    directory = coldstart_dir(cfg, results)
    if directory is None:
        from study.parts import initial_policy

        return initial_policy(cfg, results)[0]
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"the run's cold start {directory} has no tokenizer.json (moved or deleted?); the export "
            "needs the tokenizer the run trained with"
        )
    return TaskTokenizer.load(directory)


def policy_state(cfg: Any, run_dir: Path, results: Path, step: int | None) -> tuple[dict[str, torch.Tensor], int]:
    """(Megatron state dict, its step): the checkpoint's, or for step 0 the cold start's."""
    path = run_dir / CHECKPOINT
    state = _load_state(path) if path.is_file() else None
    have = [] if state is None else [int(state["step"])]
    start = coldstart_dir(cfg, results)
    if start is not None and (start / "policy.pt").is_file():
        have.insert(0, 0)
    if step is None:
        if state is None:
            raise ValueError(
                f"{path}: no checkpoint (the run has not reached its first checkpoint); valid: "
                f"{'--step 0 (its cold start)' if have else 'export after a checkpoint'}"
            )
        return _full_model(cfg, state, path), int(state["step"])
    if step not in have:
        raise ValueError(
            f"--step = {step}: {run_dir.name} keeps its latest checkpoint only; valid: "
            f"{', '.join(map(str, have)) or 'none'}"
        )
    if step == 0:
        from study.coldstart import read_policy_file

        return read_policy_file(start / "policy.pt"), 0
    return _full_model(cfg, state, path), step


def _full_model(cfg: Any, state: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's one-process weights: state.pt's one-process form, or for a layout run too large for that form
    (state.pt without it) its distributed checkpoint resharded to one process (`distributed_weights`)."""
    if state["model"] is not None:
        return state["model"]
    directory = path.parent / str(state.get("distributed"))
    if not state.get("distributed") or not directory.is_dir():
        raise ValueError(
            f"{path}: names the distributed checkpoint {state.get('distributed')!r}, which "
            f"{path.parent} does not hold; valid: --step 0 (the cold start), or resume the "
            "run"
        )
    return distributed_weights(cfg, directory)


def distributed_weights(cfg: Any, directory: Path) -> dict[str, torch.Tensor]:
    """The one-process megatron weights (names, shapes and storage dtype of a one-process run's state.pt) of a layout
    run's distributed checkpoint `directory`: the policy built at one process and megatron's dist_checkpointing
    resharding the saved shards into it (the model only; the optimizer's states are not read). The whole model is in
    this process's memory once (2-4 bytes a parameter: ~122 GB in fp32 for Qwen3-30B-A3B, a large host's job); the
    file's metadata is checked first (it names nothing but torch DCP's classes)."""
    from megatron.core import dist_checkpointing

    from study.policy.model import build_policy
    from study.policy.parallel import check_checkpoint_metadata

    check_checkpoint_metadata(directory)
    train_precision, _ = cfg.precisions
    model = build_policy(cfg.model_config(), seed=0, dtype=train_precision.storage_dtype)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
    model.load_state_dict(loaded["model"])
    return model.state_dict()  # as a one-process run's state.pt holds it


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> Path:
    """Write RUN_DIR's policy at `step` (default: its checkpoint) as an HF checkpoint folder `out`; returns it."""
    from study.core.weights import export_hf
    from study.run import rundir

    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--hf = {str(out)!r}: exists and is not an empty folder; valid: a new path")
    cfg = run_config(run_dir)
    results = run_dir.resolve().parent.parent
    state, got = policy_state(cfg, run_dir, results, step)
    tok = tokenizer_of(cfg, results)
    mcfg = cfg.model_config()
    status = rundir.read_status(run_dir) or {}
    manifest = rundir.read_json(run_dir / "manifest.json") if (run_dir / "manifest.json").is_file() else {}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise ValueError(
            f"--hf = {str(out)!r}: cannot write in {out.parent} ({_write_reason(err)}); valid: a "
            f"writable folder with room for about {_size(state)}"
        ) from None
    writing = "model.safetensors"  # what export_hf writes first
    try:
        export_hf(state, mcfg, tmp)
        writing = "tokenizer.json"
        tok.save(tmp, model_max_length=mcfg.max_seq_len)
        generation = {
            "bos_token_id": tok.bos_id,
            "eos_token_id": tok.eos_id,
            "pad_token_id": tok.pad_id,
            "do_sample": True,
            "temperature": cfg.temperature,
            "top_k": 0,
            "top_p": 1.0,
            "max_new_tokens": cfg.max_new_tokens,
        }
        writing = "generation_config.json"
        (tmp / writing).write_text(json.dumps(generation, indent=2) + "\n")
        source = {
            "run_id": run_dir.name,
            "algorithm": cfg.algorithm,
            "step": got,
            "steps": cfg.steps,
            "state": status.get("state"),
            "git_sha": manifest.get("git_sha"),
            "model": cfg.model,
            "task": cfg.task,
            "prompt_format": "<bos> + prompt, as the run encoded it",
        }
        writing = "moe_rl_study.json"
        (tmp / writing).write_text(json.dumps(source, indent=2, default=str) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700: the mode the umask gives a folder
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except Exception as err:
        if not _is_write_error(err):
            raise
        name = Path(getattr(err, "filename", None) or writing).name
        name = writing if name.startswith(".") else name  # a temporary file's: the file it was to become
        raise ValueError(
            f"--hf = {str(out)!r}: {out / name} could not be written ({_write_reason(err)}); the "
            "partial export was removed; valid: a writable folder with room for about "
            f"{_size(state)}"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export's partial folder, which frees its space
    return out


def _is_write_error(err: BaseException) -> bool:
    """An OSError of the export's writes, or safetensors' own error for one (it reports I/O errors as text)."""
    return isinstance(err, OSError) or (type(err).__name__ == "SafetensorError" and "I/O error" in str(err))


def _write_reason(err: BaseException) -> str:
    """`No space left on device`, `Read-only file system`, ...: the OS's words for a failed write."""
    if isinstance(err, OSError) and err.errno:
        return os.strerror(err.errno)
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text.split("I/O error: ")[-1].split(" (os error")[0]


def _size(state: dict[str, torch.Tensor]) -> str:
    """The fp32 weights' size (what model.safetensors holds): `1.3 MB`, `122.1 GB`."""
    size = sum(4 * t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m study export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", help="the run directory, RESULTS/runs/RUN_ID")
    parser.add_argument("--hf", required=True, metavar="OUT", help="output folder (must not exist, or be empty)")
    parser.add_argument(
        "--step", type=int, default=None, help="the step to export (default: the run's checkpoint; 0: its cold start)"
    )
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.hf, step=args.step)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    source = read_json(out / "moe_rl_study.json")
    print(f"exported {source['run_id']} at step {source['step']} -> {out}")
    return 0
