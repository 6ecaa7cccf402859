"""The cold-start store: `results/coldstart/{model}-{task}-{hash}/`, built once under a lock, and its CLI.

`{model}` is the label of the model's shape (`default`, `default_e32_k8`) and the hash covers the whole shape, so runs
of two shapes never share a cold start (study/coldstart/sft.py, point 4).

A directory is trained (study/coldstart/sft.py) into a temporary sibling and renamed into place under an exclusive
lock, so a killed or racing builder never leaves a partial directory under the final name; `coldstart.json` is
written last and marks it complete, so a complete directory is simply reused.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from runfiles.bounded import load_yaml, read_json
from study.coldstart.sft import MAX_SEED, ColdStartSettings, read_policy_file, resolve_settings, train_coldstart
from study.core.model_config import PRESETS, SHAPE_FIELDS, ModelSpec
from study.data import tasks
from study.run.rundir import check_results, json_problem


# ---------------------------------------------------------------------------------------------------------------------
# The content-addressed directory
# ---------------------------------------------------------------------------------------------------------------------
class ColdStartError(RuntimeError):
    """The cold start ended outside its band (the directory is complete; its coldstart.json says how it ended)."""


def is_complete(directory: Path) -> bool:
    """Whether `directory` is a finished cold start (coldstart.json, written last, is there)."""
    return (directory / "coldstart.json").is_file()


def read_record(directory: str | Path) -> dict[str, Any]:
    """The coldstart.json of a finished cold-start directory."""
    path = Path(directory) / "coldstart.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a finished cold start (no coldstart.json)")
    try:
        return read_json(path)
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(
            f"{path}: {json_problem(err)}; restore it, or delete {directory} to make the cold start again"
        ) from None


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (released by the kernel if the holder dies)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def run_coldstart(cfg: Any) -> dict[str, Any]:
    """The cold-start arguments of a run with coldstart = "auto" (a study.run.config.RunConfig), as keywords of
    `ensure_coldstart` and `resolve_settings` besides the model and task: its band and its task knobs. The one place
    that says which cold start a run starts from (the RL loop and the Snakemake workflow both ask here)."""
    out: dict[str, Any] = {"band": tuple(cfg.coldstart_band), "knobs": dict(cfg.task_knobs)}
    if getattr(cfg, "eval_test_size", 0):  # its SFT stream never shows the run's test split
        out["held_out_test"] = True
    return out


def ensure_coldstart(
    model: ModelSpec,
    task: str,
    results: str | Path,
    *,
    band: tuple[float, float] = (0.1, 0.5),
    seed: int = 0,
    threads: int = 1,
    init: str | Path | None = None,
    strict: bool = True,
    progress: bool = False,
    **overrides: Any,
) -> Path:
    """The directory `results/coldstart/{label}-{task}-{hash}/` of a finished cold start, trained now unless a
    complete one with the same settings exists (then it is returned untouched, without training).

    `model` is a preset name or a model mapping {preset: NAME, FIELD: VALUE, ...} (a run's `model`). `overrides`
    are further ColdStartSettings fields (batch_size, lr, max_steps, eval_every, ...; see PRESET_DEFAULTS for each
    preset's recipe, which a shape takes from its base preset). Racing callers serialise on a lock file next to the
    directory; the directory appears under its final name only when complete. With `strict` (default), a cold start
    that ended outside the band (status overshoot or budget) raises ColdStartError naming the directory, reused or
    not.
    """
    settings = resolve_settings(
        model, task, band=band, seed=seed, threads=threads, init=None if init is None else str(init), **overrides
    )
    root = Path(results) / "coldstart"
    directory = root / settings.dirname
    check_results(directory, results)  # a file in the path: one line naming --results, before any training
    if not is_complete(directory):
        with _exclusive(root / f".{settings.dirname}.lock"):
            if not is_complete(directory):  # another process may have finished it while we waited
                _build(settings, directory, progress=progress)
    record = read_record(directory)
    if strict and record["status"] != "in_band":
        lo, hi = record["band"]
        raise ColdStartError(
            f"cold start {directory} ended with status {record['status']!r}: pass@1 {record['pass_at_1']:.3f} after "
            f"{record['steps_trained']} SFT steps, band [{lo}, {hi}]. Change lr / eval_every (overshoot) or "
            "max_steps (budget), or pass strict=False to use the closest checkpoint."
        )
    return directory


def _build(settings: ColdStartSettings, directory: Path, *, progress: bool) -> None:
    """Train into a temporary sibling directory and rename it to `directory` (called under the lock)."""
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by a killed builder
        shutil.rmtree(stale, ignore_errors=True)
    if directory.exists():  # incomplete (cannot normally happen: only complete directories are renamed in)
        shutil.rmtree(directory)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    try:
        train_coldstart(settings, tmp, progress=progress)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The `python -m study coldstart` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m study coldstart",
        description="SFT the MoE policy on task solutions until its in-distribution pass@1 enters a band; writes "
        "(or reuses) results/coldstart/{model}-{task}-{hash}/. The model is a preset or a preset plus field "
        "overrides: `--model default --set num_experts=32 --set moe_top_k=8`, or the same as one YAML/JSON mapping, "
        "`--model '{preset: default, num_experts: 32, moe_top_k: 8}'` (a run config's `model`).",
    )
    p.add_argument(
        "--model",
        default="tiny",
        type=parse_model,
        help=f"model preset ({', '.join(PRESETS)}) or a YAML/JSON mapping {{preset: NAME, FIELD: VALUE, "
        "...}} (default: tiny)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override a field of the model's shape (repeatable; `model.FIELD=VALUE` too): {', '.join(SHAPE_FIELDS)}",
    )
    p.add_argument("--task", default="chain_sum", help=f"task: {', '.join(tasks.TASKS)} (default: chain_sum)")
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument(
        "--band",
        type=float,
        nargs=2,
        default=(0.1, 0.5),
        metavar=("LOW", "HIGH"),
        help="target pass@1 band (default: 0.1 0.5)",
    )
    p.add_argument("--seed", type=parse_seed, default=0, help=f"seed, 0..{MAX_SEED} (default: 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--max-steps", type=int, default=None, help="SFT step budget (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step (default: the preset's)")
    p.add_argument("--eval-every", type=int, default=None, help="SFT steps between checks (default: the preset's)")
    p.add_argument("--init", default=None, help="start from this checkpoint (directory with policy.pt, or a .pt)")
    p.add_argument("--no-strict", action="store_true", help="exit 0 even when the band was missed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def parse_model(text: str) -> ModelSpec:
    """A model on the command line: a preset name, or a YAML (or JSON) mapping {preset: NAME, FIELD: VALUE, ...}.
    Validated where it is used (study.core.model_config.model_spec), so errors name the field."""
    text = text.strip()
    if not text.startswith("{"):
        return text
    shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} characters)"
    try:
        value = load_yaml(text)
    except yaml.YAMLError as err:
        problem = " ".join(str(getattr(err, "problem", None) or err).split())[:300]
        raise argparse.ArgumentTypeError(f"model = {shown}: not a YAML mapping ({problem})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"model = {shown}: not a mapping {{preset: NAME, FIELD: VALUE, ...}}")
    return value


def parse_seed(text: str) -> int:
    """The --seed option: an integer in 0..MAX_SEED; argparse.ArgumentTypeError naming the valid range (a number of
    more digits than Python reads is named by its length, not printed)."""
    digits = text.strip().lstrip("+-")
    shown = f"a {len(digits)}-digit number" if len(text) > 40 else repr(text)
    if not digits.isdigit() or len(digits) > 40 or not 0 <= int(text) <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed = {shown}; valid: an integer in 0..{MAX_SEED}")
    return int(text)


def with_sets(model: ModelSpec, sets: Sequence[str]) -> ModelSpec:
    """`model` with `FIELD=VALUE` (or `model.FIELD=VALUE`) overrides of its shape on top, in order."""
    if not sets:
        return model
    spec = {"preset": model} if isinstance(model, str) else dict(model)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, FIELD one of {', '.join(SHAPE_FIELDS)}")
        key = key.removeprefix("model.")
        try:
            spec[key] = load_yaml(raw) if raw else ""
        except yaml.YAMLError as err:
            shown = repr(item) if len(item) <= 200 else f"{item[:200]!r}... ({len(item)} characters)"
            why = " ".join(str(err).split())[:300]
            raise ValueError(f"--set {shown}: the value is not valid YAML ({why})") from None
    return spec


def coldstart_main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: make or reuse the cold start, print its directory and outcome; exit status 1 when it ended
    outside the band (unless --no-strict), 2 on a settings error."""
    args = build_parser().parse_args(argv)
    try:
        model = with_sets(args.model, args.sets)
        directory = ensure_coldstart(
            model,
            args.task,
            args.results,
            band=tuple(args.band),
            seed=args.seed,
            threads=args.threads,
            init=args.init,
            strict=False,
            progress=not args.quiet,
            max_steps=args.max_steps,
            lr=args.lr,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"coldstart: {exc}", file=sys.stderr)
        return 2
    record = read_record(directory)
    print(
        f"{directory}\nstatus {record['status']}: pass@1 {record['pass_at_1']:.3f} (band {record['band']}) at "
        f"step {record['step']} of {record['steps_trained']}, {record['timings']['total_s']:.1f} s"
    )
    return 0 if record["status"] == "in_band" or args.no_strict else 1


__all__ = [
    "ColdStartError",
    "build_parser",
    "coldstart_main",
    "ensure_coldstart",
    "is_complete",
    "parse_model",
    "read_policy_file",
    "read_record",
    "with_sets",
]

if __name__ == "__main__":
    raise SystemExit(coldstart_main())
