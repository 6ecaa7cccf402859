"""A run's life around the loop (study/rl.py): what is checked before anything is written (`preflight`: the machine,
the cold start, the parallel layout against the launcher's world and the run's record), the run directory taken and
written (`claimed`: the lock, config.yaml, the manifest), every exit recorded (`recorded_exit`), and a killed run's
config read back for its resume (`resume_config`).

One process per run: a second one raises rundir.RunLocked naming the holder (rundir.run_lock). Under a parallel
layout every rank trains and rank 0 alone writes the run directory.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import algorithms
from study.core import precision as precision_mod
from study.core.model_config import ParallelLayout
from study.data.tokenizer import TaskTokenizer
from study.run import machine, rundir, trackers
from study.run.config import RunConfig

FINISHED = ("completed", "collapsed")


def is_rank0() -> bool:
    """Whether this process writes the run directory: rank 0 of a launcher's world, or the one process."""
    return int(os.environ.get("RANK", "0")) == 0


def finished(run_dir: Path) -> bool:
    """Whether the run has ended with a result (completed or collapsed): rerunning it does nothing."""
    status = rundir.read_status(run_dir)
    return status is not None and status["state"] in FINISHED


# -- before anything is written ---------------------------------------------------------------------------------------
def preflight(cfg: RunConfig, run_dir: Path, results: Path, *, here: bool = True) -> None:
    """What a config cannot say about itself, checked on the machine that runs it before anything is written
    (ValueError naming the field or the file): the results directory (rundir.check_results), the parallel layout
    (`check_layout`), the thread count against this machine's CPUs, the planner's memory estimate, a named cold
    start's files (a sweep may name one that a job before it makes, so RunConfig.validate leaves them to here), the
    prompts the run is known to use against its tokenizer and the model's length (`check_prompts`), and a resumed
    run's manifest.json and trackers.json. `here` False: only what holds wherever the run trains, not the layout
    against the launcher's world nor this machine's CPUs and memory (study.launch checks it before it asks for a
    job, whose folder is made under the run directory; the job checks everything again)."""
    rundir.check_results(run_dir, results)
    if here:
        check_layout(cfg, results)
        cpus = os.cpu_count() or 1
        if cfg.threads > cpus:
            raise ValueError(f"threads = {cfg.threads}: this machine has {cpus} CPUs; valid: 1..{cpus}")
        machine.check_fits(cfg)  # the planner's memory estimate against this machine, naming the field
    if cfg.coldstart not in ("auto", "scratch"):
        check_coldstart_dir(cfg)
    check_prompts(cfg)
    if (run_dir / "manifest.json").exists():  # a resume: the record of the layout the run last ran under
        try:
            recorded_layout(run_dir)
        except rundir.RunStateError as err:
            raise rundir.RunStateError(f"{err}; restore it, or {rundir.RESTART}") from None
    trackers.read_state(run_dir)  # a resume: the trackers' record (their runs, the study and tags), never replaced


def check_coldstart_dir(cfg: RunConfig) -> None:
    """A named cold start (`coldstart: DIR`): a cold-start directory (policy.pt, a state dict of tensors, checked
    without running anything it holds) or an HF checkpoint (study.coldstart.hf_import.check_files: every file it
    reads, no tensor read), with the tokenizer the run encodes with (tokenizer.json, its chat template rendered once
    under a time and memory limit)."""
    from study.coldstart import hf_import, read_policy_file

    directory = Path(cfg.coldstart)
    if not directory.is_dir():
        raise ValueError(
            f"coldstart = {cfg.coldstart!r}: no such directory; valid: 'auto', 'scratch', a "
            "cold-start directory (policy.pt) or an HF checkpoint directory"
        )
    for name in ("policy.pt", "config.json", "tokenizer.json"):
        if (directory / name).exists() and not (directory / name).is_file():  # a FIFO would be waited on for ever
            raise ValueError(
                f"coldstart = {cfg.coldstart!r}: {name} is not a regular file (a FIFO, device or directory); "
                "valid: a cold-start directory (policy.pt) or an HF checkpoint directory, each file a regular file"
            )
    policy = directory / "policy.pt"
    if not policy.is_file() and not hf_import.is_hf_checkpoint(directory):
        raise ValueError(
            f"coldstart = {cfg.coldstart!r}: neither a cold-start directory (policy.pt; "
            "`python -m study coldstart` makes one) nor an HF checkpoint (config.json + "
            "*.safetensors)"
        )
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(
            f"coldstart = {cfg.coldstart!r}: {directory / 'tokenizer.json'} is missing; the run encodes "
            "with the cold start's tokenizer (tokenizer.json, with tokenizer_config.json and "
            "special_tokens_map.json, as `python -m study coldstart` and `python -m study export` "
            "write them)"
        )
    if policy.is_file():
        try:
            read_policy_file(policy, mmap=True)  # the pickle read and checked; the weights mapped, not read
        except ValueError as err:
            raise ValueError(f"coldstart = {cfg.coldstart!r}: {err}") from None
        hf_import.check_tokenizer(directory)
    else:  # an HF checkpoint: its index, shard headers, tokenizer files and chat template, no tensor read
        hf_import.check_files(directory, cfg.model_config())


def check_prompts(cfg: RunConfig) -> None:
    """The prompts the run is known to use, against its tokenizer, before anything is written. A named cold start's
    tokenizer renders and encodes each in a child process under the chat template's time and memory limits
    (study.data.tokenizer.prompt_lengths), so a template that loops or a split rule that backtracks or panics on one
    of them is one line naming it: a generated task's validation sets, test split and first step's prompts; task =
    "user"'s every prompt (the rows of `data`, the first eval_size of `eval_data`), which must also leave room for
    max_new_tokens within model.max_seq_len (ValueError naming the file and the row). `scratch`'s tokenizer
    (byte-level, no chat template) spends at most a token a byte plus <bos>, so it is trained here only when a
    prompt is longer than that bound."""
    from study.data import tasks
    from study.data.tokenizer import prompt_lengths

    named = cfg.coldstart not in ("auto", "scratch")
    where = f"coldstart = {cfg.coldstart!r}"
    if cfg.task != "user":
        if named:
            prompt_lengths(cfg.coldstart, [item.prompt for item in generated_prompts(cfg)], where=where)
        return
    limit = cfg.model_config().max_seq_len - cfg.max_new_tokens
    used = {"data": cfg.user_rows("data"), "eval_data": cfg.user_rows("eval_data")[: cfg.eval_size]}
    prompts = [item.prompt for rows in used.values() for item in rows]
    counts = iter(prompt_lengths(cfg.coldstart, prompts, where=where)) if named else None
    tok = None
    for name, rows in used.items():
        for i, item in enumerate(rows):
            if counts is not None:
                n = next(counts)
            elif len(item.prompt.encode()) + 1 <= limit:
                continue
            else:
                if tok is None:
                    tok = user_tokenizer(cfg)
                n = len(tok.encode_prompt(item.prompt))
            if n > limit:
                path = getattr(cfg, name)
                where = tasks._read_rows(Path(path))[i][0]  # the row's label as the loader's errors give it
                raise ValueError(
                    f"{name} = {path!r}: {where}: the prompt is {n} tokens, and with max_new_tokens = "
                    f"{cfg.max_new_tokens} a sequence needs {n + cfg.max_new_tokens} > model.max_seq_len = "
                    f"{cfg.model_config().max_seq_len}; valid: prompts of at most {limit} tokens (shorten or drop the "
                    "row), a smaller max_new_tokens or a larger model.max_seq_len"
                )


def generated_prompts(cfg: RunConfig) -> list[Any]:
    """The items of a generated task's run known before it starts: its first step's training prompts and what its
    first evaluation scores, the validation sets and the test split (RunConfig.task_data, RunConfig.eval_plan: as
    the run draws them)."""
    stream, validation = cfg.task_data()
    evaluated = [item for ev in cfg.eval_plan(validation, 0) for item in ev.items]
    return [*stream.take(cfg.prompts_per_step), *evaluated]


def user_tokenizer(cfg: RunConfig) -> TaskTokenizer:
    """The tokenizer a task = "user" run encodes with: its named cold start's, or for `scratch` the one trained on
    its training rows (prompt + solution), as the run builds it."""
    from study.data.tokenizer import train_tokenizer

    if cfg.coldstart == "scratch":
        train, _ = cfg.user_split()
        return train_tokenizer([it.prompt + it.solution for it in train], vocab_size=cfg.model_config().vocab_size)
    return TaskTokenizer.load(cfg.coldstart)


def check_layout(cfg: RunConfig, results: Path) -> None:
    """What the loop runs under a layout, and the world the launcher started. A resume under another layout than the
    one the manifest records is resharded from the checkpoint (study/checkpoint.py)."""
    layout = cfg.layout
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout.world_size != world:
        raise ValueError(
            f"parallel = {cfg.parallel} needs {layout.world_size} ranks, the launcher started {world} "
            "(torchrun --nproc_per_node, or the launcher's tasks_per_node)"
        )
    if layout == ParallelLayout():
        return
    alg = algorithms.get(cfg.algorithm)
    rows = cfg.prompts_per_step * cfg.group_size // cfg.minibatches
    why = (
        f"{cfg.algorithm} drops groups (dynamic sampling): the minibatches' sizes vary"
        if alg.dynamic_sampling
        else f"a minibatch of {rows} sequences does not split evenly over parallel.data = {layout.data}"
        if rows % layout.data
        else "router_lr_scale != 1 (one optimizer group)"
        if cfg.router_lr_scale != 1.0
        else "fp16 (loss scaling)"
        if cfg.train_dtype == "fp16"
        else "emulated precision"
        if cfg.precisions[0].emulated
        else "coldstart = 'scratch' and parallel.expert > 1 (megatron draws each rank's experts from one RNG "
        "stream: not the one-process run's initial weights)"
        if cfg.coldstart == "scratch" and layout.expert > 1
        else ""
    )
    if why:
        raise ValueError(f"parallel = {cfg.parallel}: the RL loop does not run this layout with {why}")
    if cfg.coldstart == "auto":
        from study.coldstart import is_complete, resolve_settings
        from study.coldstart.store import run_coldstart

        settings = resolve_settings(cfg.model, cfg.task, **run_coldstart(cfg))
        if not is_complete(Path(results) / "coldstart" / settings.dirname):
            raise ValueError(
                f"parallel = {cfg.parallel}: the cold start is trained by one process; make it "
                "first (python -m study coldstart, or the same run with parallel = {})"
            )


def record_refusal(cfg: RunConfig, run_dir: Path, err: Exception) -> None:
    """A run refused before it started (its preflight), in a run directory a workflow made for the run's log
    (Snakemake makes RUN_DIR for run.log) and holding no record: config.yaml and failure.json with the reason, so
    that the workflow names the failed run and the study's report lists it as failed with why. Nothing is written
    where there is no such directory (a run started by hand writes nothing before its preflight passes), or where
    the run has a record of its own (status.json)."""
    if not run_dir.is_dir() or run_dir.is_symlink() or (run_dir / "status.json").exists():
        return
    try:
        rundir.check_no_links(run_dir)
        rundir.write_yaml(run_dir / "config.yaml", cfg.to_dict())
        rundir.write_json(
            run_dir / rundir.FAILURE_FILE,
            {"state": "failed", "step": 0, "time": time.time(), "error": f"refused before it started: {err}"},
        )
    except (OSError, rundir.RunStateError) as why:
        print(f"warning: the refusal of run {run_dir.name} could not be recorded ({why})", file=sys.stderr)


# -- the run directory ------------------------------------------------------------------------------------------------
@contextmanager
def claimed(cfg: RunConfig, run_dir: Path) -> Iterator[bool]:
    """The run directory, held by this process for the body (rundir.run_lock): yields False when another process
    finished the run before the lock was taken (nothing to do), else writes config.yaml, the manifest (once) and the
    status `running` at the step the run had reached (a resume restores its checkpoint's step next, not step 0), and
    yields True with every exit of the body recorded (`recorded_exit`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with rundir.run_lock(run_dir):
        status = rundir.read_status(run_dir)
        if status is not None and status["state"] in FINISHED:
            yield False
            return
        rundir.write_yaml(run_dir / "config.yaml", cfg.to_dict())
        if not (run_dir / "manifest.json").exists():
            rundir.write_json(run_dir / "manifest.json", manifest(cfg))
        rundir.set_status(run_dir, "running", step=(status or {}).get("step", 0))
        with recorded_exit(run_dir):
            yield True


@contextmanager
def recorded_exit(run_dir: Path) -> Iterator[None]:
    """Any exit of the body recorded in status.json (rundir.recorded): a deliberate stop (rundir.Stopped, Ctrl-C,
    SIGTERM or SIGHUP, SystemExit) as `stopped`, every other exception, BaseExceptions such as a native library's panic
    included, as `failed` with its traceback (status.json and failure.json), after the temporary files of failed
    writes are removed; re-raised. A body that returns clears an earlier attempt's failure.json (the loop records
    `completed` or `collapsed` itself)."""
    with rundir.recorded(run_dir, lambda: rundir.last_step(run_dir)):
        yield
    (run_dir / rundir.FAILURE_FILE).unlink(missing_ok=True)


def manifest(cfg: RunConfig) -> dict:
    """The run's manifest (rundir.manifest: git sha, packages, seed, host, job id), with its run id (analysis
    tells a copied run directory by it), which engine ran emulated
    (study/core/precision.py), whether the optional C kernels ran, how its verifier's scoring is sandboxed
    (`scoring_sandbox`), and the parallel layout (a runtime choice, not in the run id)."""
    return {
        **rundir.manifest(cfg.seed, cfg.threads),
        "run_id": cfg.run_id,
        **precision_mod.labels(*cfg.precisions),
        "native_kernels": _kernels_available(),
        "scoring_sandbox": _sandbox_level(cfg),
        "parallel": cfg.layout.to_dict(),
    }


def _sandbox_level(cfg: RunConfig) -> str | None:
    """The lock-down of the children scoring the run's verifier (study.data.sandbox.level, e.g.
    "seccomp+ipc-ns+keyring"); None when it is scored on a grammar of study.data.tasks, in process."""
    from study.data import sandbox, tasks

    if cfg.task != "user" or cfg.verifier in tasks.NATIVE_VERIFIERS:
        return None
    return sandbox.level(cfg.verifier)


def recorded_layout(run_dir: Path) -> ParallelLayout | None:
    """The layout the run's manifest records as its latest (None: a fresh run)."""
    path = run_dir / "manifest.json"
    if not path.exists():
        return None
    record = rundir.read_json(path)
    resumed = record.get("parallel_resumed") or []
    recorded = resumed[-1]["parallel"] if resumed else record.get("parallel")
    return None if recorded is None else ParallelLayout.from_mapping(recorded)


def record_layout(cfg: RunConfig, run_dir: Path, resumed_step: int | None) -> None:
    """A run resumed under another layout than its manifest's: from the checkpoint's step on (`parallel_resumed`),
    or all of it when it starts again from step 0 (`resumed_step` None). Rank 0 only; nothing when unchanged."""
    if (recorded_layout(run_dir) or cfg.layout) == cfg.layout:
        return
    record = rundir.read_json(run_dir / "manifest.json")
    if resumed_step is None:
        record["parallel"] = cfg.layout.to_dict()
    else:
        resumed = {"step": resumed_step, "parallel": cfg.layout.to_dict()}
        record["parallel_resumed"] = [*record.get("parallel_resumed", []), resumed]
    rundir.write_json(run_dir / "manifest.json", record)


def _kernels_available() -> bool:
    """Whether the optional C kernels are on and built here (study/kernels/; results agree with the torch paths to
    ~1e-6): the manifest's `native_kernels`."""
    try:
        from study import kernels
    except ImportError:
        return False
    return kernels.available()


# -- resume -----------------------------------------------------------------------------------------------------------
def resume_config(run_dir: Path) -> RunConfig:
    """The config of a killed run, read from its directory: RunStateError naming the file when it is missing,
    unreadable, or edited (it no longer hashes to the directory's run id)."""
    import yaml

    from runfiles.bounded import read_yaml

    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise rundir.RunStateError(f"{run_dir}: no such run directory (RESULTS/runs/RUN_ID)")
    if not path.is_file():
        raise rundir.RunStateError(f"{run_dir}: not a run directory (no config.yaml); give RESULTS/runs/RUN_ID")
    try:
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ValueError("not a mapping of config fields")
        cfg = RunConfig.from_dict(data, where=str(path))
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise rundir.RunStateError(
            f"{path}: cannot be read as this run's config ({err}); restore it, or {rundir.RESTART}"
        ) from None
    if cfg.run_id != run_dir.name:
        raise rundir.RunStateError(
            f"{path} was edited: it hashes to run {cfg.run_id}, not to {run_dir.name}; restore it, or run the edited "
            f"config as a new run (`python -m study run {path} --results {run_dir.parent.parent}`)"
        )
    return cfg
