"""Launch one run through submitit, blocking until it ends: in-process, submitit's local executor, or SLURM.

    python -m study.launch CONFIG.yaml --results results --launcher in-process        # debugging (pdb works)
    python -m study.launch CONFIG.yaml --results results --launcher local             # a child process
    python -m study.launch CONFIG.yaml --results results --launcher slurm --partition gpu --gpus 1 --time-min 240
    python -m study.launch --coldstart tiny chain_sum --results results --launcher slurm    # a cold start, likewise
    python -m study.launch --coldstart '{preset: default, num_experts: 32}' chain_sum    # a shape's cold start

1. The launcher is always named: submitit's AutoExecutor picks SLURM wherever `srun` is on PATH, cluster or not.
2. The same callable, `Run`, runs in every launcher: `study.rl.run` on the config, which skips a finished run and
   resumes an interrupted one from its last checkpoint (every `checkpoint_every` steps).
3. Requeue: on a SLURM time-out or preemption submitit calls `Run.checkpoint`, which returns the same run as a
   `DelayedSubmission`; submitit requeues the job (at most `--max-timeouts` times after a time-out) and the requeued
   job resumes the run, so its metrics equal those of an uninterrupted run. SLURM ends a job's processes when it
   requeues it, `scontrol requeue` among them when it has not exited yet; submitit takes that for a failed requeue
   and records the job as failed, although it was requeued. In the job, `scontrol requeue` ending by SIGTERM counts
   as requeued (`requeue`): a job that in fact was not requeued ends without a result, which the launcher reports.
   The job's own processes get that SIGTERM too: from the requeue on, it is passed over (`_slurm_requeue`).
4. A failed job raises `FailedJobError` carrying the remote traceback; it is printed verbatim to stderr (the Snakemake
   rule's log). submitit's logs (the run's stdout/stderr) live in RESULTS/runs/RUN_ID/submitit/.
5. SIGINT or SIGTERM cancels the job this process started (scancel for SLURM) before exiting.
6. Multi-node: `--nodes N --gpus G` (GPUs per node) asks SLURM for N nodes with G GPUs and one task (rank) per GPU
   (`--tasks-per-node` overrides the placement); in each task `distributed_env` exports the torch.distributed
   environment from SLURM's (MASTER_ADDR: the first node, MASTER_PORT from the job id below the kernel's ephemeral
   ports: `master_port`; RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; every GPU of the node stays visible to each
   rank). srun runs the tasks with `--kill-on-bad-exit=1`: a rank that fails ends the others at once, instead of
   leaving them waiting for it in the rendezvous or a collective until the process groups' timeout. A requeue
   (point 3) requeues the whole job: global rank 0 checkpoints and requeues, every rank starts again.
   `--rank-check` runs only the ranks' agreement check (an all_reduce over NCCL where the job sees CUDA, else gloo;
   `--rank-check-backend`), to try a cluster's placement without a run.
7. Before a GPU job is asked for, the run must fit: study.run.plan.check_run_fits with the job's GPUs (nodes x GPUs
   per node) of `--gpu-mem-gb` each; a job of several ranks must match the run's `parallel` layout (its world
   size; without `--nodes`/`--tasks-per-node` the job gets one task per rank of the layout, and the launcher
   returns rank 0's status).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from study.run.rundir import RunLocked, RunStateError, Stopped, Terminated

LAUNCHERS = ("in-process", "local", "slurm")


class Cancelled(Stopped):
    """SIGINT/SIGTERM while waiting for a job. A rundir.Stopped, so `rl.run` records the run `stopped`, resumable."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def requeue(cmd: list[str], timeout: float = 60) -> bool:
    """Run the requeue command; True when it exited 0, False when SIGTERM ended it (SLURM ending the job's processes
    for the requeue it asked for). Any other failure raises CalledProcessError."""
    try:
        subprocess.check_call(cmd, timeout=timeout)
    except subprocess.CalledProcessError as err:
        if err.returncode != -signal.SIGTERM:
            raise
        return False
    return True


def _slurm_requeue(self: Any, countdown: int, command: list[str] | None = None) -> None:
    """submitit's SlurmJobEnvironment._requeue (`scontrol requeue JOB`, then a log line), through `requeue`.

    From here on the job is ending for its requeue: the SIGTERM SLURM sends its processes for it is passed over, as
    submitit's own handler does, instead of raising the run's `Terminated` inside the requeue (the run guard's
    handler is the one installed while a run trains), which cut the requeue short before its log line.
    `command`: the requeue command (tests), `scontrol requeue JOB` by default."""
    from submitit.core.logger import get_logger

    def passed_over(signum: int, frame: Any) -> None:
        get_logger().warning(f"Bypassing signal {signal.Signals(signum).name}: the job is being requeued")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, passed_over)
    command = command or ["scontrol", "requeue", self.job_id]
    ended = "" if requeue(command) else " (scontrol ended by the requeue's SIGTERM)"
    get_logger().info(f"Requeued job {self.job_id} ({countdown} remaining timeouts){ended}")


def _in_job() -> None:
    """Set up the job process: submitit's requeue through `requeue` (module docstring, point 3)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    SlurmJobEnvironment._requeue = _slurm_requeue  # type: ignore[method-assign]


MASTER_PORTS = (20000, 32767)
"""The range a job's rendezvous port is drawn from: below Linux's default ephemeral ports (32768-60999), which the
node's outgoing connections hold at random. submitit draws from 20000-60000, and a port an outgoing connection held
failed rank 0's TCPStore with EADDRINUSE."""


def master_port(job_id: str) -> int:
    """The job's rendezvous port: the same on every rank and node (a hash of the job id, so a requeued job keeps it),
    in MASTER_PORTS."""
    low, high = MASTER_PORTS
    return low + zlib.crc32(job_id.encode()) % (high - low + 1)


def distributed_env() -> dict[str, str]:
    """In a job's task: export the torch.distributed env:// variables from SLURM's (submitit's
    TorchDistributedEnvironment) and return them; outside a multi-task job, nothing is exported and WORLD_SIZE 1 is
    returned. Every GPU of the node stays visible (the trainer picks LOCAL_RANK's, the engine may use several).
    MASTER_PORT is `master_port`'s unless the job's environment sets one."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    try:
        job = submitit.JobEnvironment()
        tasks = job.num_tasks
    except RuntimeError:  # not in a submitit job
        tasks = 1
    if tasks > 1:
        os.environ.setdefault("MASTER_PORT", str(master_port(job.job_id)))  # submitit's export reads it
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return {k: os.environ[k] for k in keys}
    return {k: os.environ.get(k, default) for k, default in zip(keys, ("", "", "0", "1", "0", "1"), strict=True)}


class RankCheck:
    """The submitted callable of `--rank-check`: every rank exports the distributed env, joins a group of `backend`
    ("auto": NCCL where the job sees CUDA, as a run's ranks join; or gloo / nccl) and all-reduces (rank + 1), and
    all-gathers what each rank was told; returns the rank's view, with the backend. `hold_s`: seconds the first
    attempt waits afterwards (a time-out test: the requeued attempt does not wait)."""

    def __init__(self, hold_s: float = 0.0, attempt: int = 0, backend: str = "auto") -> None:
        self.hold_s, self.attempt, self.backend = hold_s, attempt, backend

    def __call__(self) -> dict[str, Any]:
        import socket
        import time

        import torch
        import torch.distributed as dist

        from study.policy.model import dist_backend, dist_timeout, local_device_index

        _in_job()
        env = distributed_env()
        backend = dist_backend(self.backend)
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", local_device_index())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", timeout=dist_timeout())
        try:
            total = torch.tensor([float(dist.get_rank() + 1)], device=device)
            dist.all_reduce(total)
            seen: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, {"env": env, "host": socket.gethostname()})
        finally:
            dist.destroy_process_group()
        if self.hold_s and not self.attempt:
            time.sleep(self.hold_s)
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "sum": float(total),
            "env": env,
            "views": seen,
            "attempt": self.attempt,
            "backend": backend,
        }

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission(RankCheck(self.hold_s, self.attempt + 1, self.backend))


class Run:
    """The submitted callable: one run of a resolved config under `results` (identical in every launcher)."""

    def __init__(self, config: dict[str, Any], results: str, tracking: dict[str, Any] | None = None) -> None:
        """`tracking`: study.run.trackers.Tracking as a dict (trackers, study, tags), carried into the job so that a
        compute node logs to the trackers chosen where the job was submitted."""
        self.config = config
        self.results = results
        self.tracking = tracking

    def __call__(self) -> dict[str, Any]:
        from study import lifecycle, rl
        from study.run import rundir
        from study.run.config import RunConfig
        from study.run.trackers import Tracking

        _in_job()
        distributed_env()  # the torch.distributed environment of a multi-rank job (module docstring, point 6)
        cfg = RunConfig.from_dict(self.config, where="launch")
        tracking = Tracking.from_dict(self.tracking) if self.tracking is not None else None
        try:
            run_dir = rl.run(cfg, self.results, progress=False, tracking=tracking)
        except ValueError as err:  # refused before it started: the preflight, damaged state
            lifecycle.record_refusal(cfg, Path(self.results) / "runs" / cfg.run_id, err)
            raise
        return {"run_dir": str(run_dir), **(rundir.read_status(run_dir) or {})}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on time-out/preemption: requeue the same run; it resumes from its own checkpoint dir."""
        return submitit.helpers.DelayedSubmission(Run(self.config, self.results, self.tracking))


class ColdStart:
    """The submitted callable of a cold start (`study.coldstart.ensure_coldstart`, not strict: an out-of-band result
    is kept and the runs stop on it with the reason), so that on a cluster it trains on a compute node too."""

    def __init__(
        self,
        model: str | dict[str, Any],
        task: str,
        results: str,
        threads: int = 1,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """`settings`: further ColdStartSettings fields (a run's band and task knobs, study.coldstart.store's
        `run_coldstart`)."""
        self.model, self.task, self.results, self.threads = model, task, results, threads
        self.settings = dict(settings or {})

    def __call__(self) -> dict[str, Any]:
        from study.coldstart import ensure_coldstart, read_record

        _in_job()
        directory = ensure_coldstart(
            self.model, self.task, self.results, threads=self.threads, strict=False, **self.settings
        )
        record = read_record(directory)
        return {
            "run_dir": str(directory),
            "state": "completed",
            "coldstart": record["status"],
            "pass_at_1": record["pass_at_1"],
        }

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Time-out/preemption: requeue; an unfinished cold start is trained again (it has no mid-way checkpoint)."""
        return submitit.helpers.DelayedSubmission(
            ColdStart(self.model, self.task, self.results, self.threads, self.settings)
        )


@dataclass(frozen=True)
class Resources:
    """What one job asks for. Empty partition/account: the cluster's defaults."""

    partition: str = ""
    account: str = ""
    gpus: int = 0  # per node
    nodes: int = 1
    tasks_per_node: int = 0  # ranks per node; 0: one per GPU (one for a CPU job)
    gpu_mem_gb: float = 0.0  # memory of one GPU, for the fit check before submission (0: no check)
    time_min: int = 120
    mem_gb: float = 16.0
    cpus: int = 1
    max_timeouts: int = 3
    signal_delay_s: int = 90

    def __post_init__(self) -> None:
        lowest = {
            "gpus": 0,
            "nodes": 1,
            "tasks_per_node": 0,
            "time_min": 1,
            "cpus": 1,
            "max_timeouts": 0,
            "signal_delay_s": 0,
        }
        for name, low in lowest.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} = {value!r}: must be an integer >= {low}")
        if not math.isfinite(self.gpu_mem_gb) or self.gpu_mem_gb < 0:
            raise ValueError(f"gpu_mem_gb = {self.gpu_mem_gb!r}: must be a finite number >= 0 (0: no fit check)")
        if not math.isfinite(self.mem_gb) or self.mem_gb <= 0:
            raise ValueError(f"mem_gb = {self.mem_gb!r}: must be a finite number > 0")

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or max(1, self.gpus)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def executor(launcher: str, folder: Path, res: Resources, job_name: str) -> submitit.Executor:
    """submitit's local or SLURM executor, chosen by name (never AutoExecutor's detection)."""
    if launcher == "local":
        ex: submitit.Executor = submitit.LocalExecutor(folder)
        if res.nodes != 1:
            raise ValueError(f"nodes = {res.nodes}: the local launcher runs on this machine; valid: 1")
        ex.update_parameters(
            timeout_min=res.time_min,
            gpus_per_node=res.gpus,
            tasks_per_node=res.ranks_per_node,
            signal_delay_s=res.signal_delay_s,
        )
        return ex
    if launcher == "slurm":
        check_slurm_commands()  # not submitit's traceback
        ex = submitit.SlurmExecutor(folder, max_num_timeout=res.max_timeouts)
        params: dict[str, Any] = {
            "job_name": job_name,
            "time": res.time_min,
            "mem": f"{max(1, round(res.mem_gb * 1024))}M",
            "cpus_per_task": res.cpus,
            "nodes": res.nodes,
            "ntasks_per_node": res.ranks_per_node,
            "signal_delay_s": res.signal_delay_s,
            "srun_args": ["--kill-on-bad-exit=1"],  # one rank's failure ends the job (module doc, point 6)
        }
        if res.gpus:
            params["gpus_per_node"] = res.gpus
        if res.partition:
            params["partition"] = res.partition
        if res.account:
            params["account"] = res.account
        ex.update_parameters(**params)
        return ex
    raise ValueError(f"launcher = {launcher!r}; valid: {', '.join(LAUNCHERS)}")


def cluster_shortfall(res: Resources, nodes: list[str], rule: str) -> str | None:
    """Why no node of the cluster can run a job asking for `res`, or None. `nodes`: `sinfo -h -N -o '%G|%m|%c'` lines
    (generic resources, memory in MB, CPUs, one node a line). The message names the resource, what the nodes have and
    the profile key that asks for it (`set-resources: RULE: KEY`)."""
    have = []
    for line in nodes:
        gres, mem, cpus = [*line.split("|"), "", "", ""][:3]
        gpus = sum(int(m[1] or 1) for m in re.finditer(r"gpu(?::[^:,(]+)?(?::(\d+))?", gres))
        have.append((gpus, int(re.sub(r"\D", "", mem) or 0), int(re.sub(r"\D", "", cpus) or 0)))
    if not have:
        return None
    where = f"partition {res.partition!r}" if res.partition else "the default partition"
    profile = "the profile (slurm/config.yaml or slurm-cpu/config.yaml)"
    most = [max(h[i] for h in have) for i in range(3)]
    if res.gpus > most[0]:
        return (
            f"this job asks for {res.gpus} GPU(s), and no node of {where} has that many (sinfo gres: at most "
            f"{most[0]} GPUs a node); set `set-resources: {rule}: gpus` in {profile} to at most {most[0]}, or "
            "on a CPU cluster use `--profile slurm-cpu`"
        )
    if res.mem_gb * 1024 > most[1] > 0:
        return (
            f"this job asks for {res.mem_gb:g} GB, and the largest node of {where} has {most[1] / 1024:.1f} GB; "
            f"set `set-resources: {rule}: mem_gb` in {profile} to at most {int(most[1] / 1024)}"
        )
    if res.cpus > most[2] > 0:
        return (
            f"this job asks for {res.cpus} CPUs (the config's `threads`), and the largest node of {where} has {most[2]}"
        )
    return None


NO_SLURM_FIX = (
    "valid: run where SLURM's client commands reach a controller (a cluster's login node; "
    "scripts/slurm/start.sh starts a one-machine cluster), or --launcher local / in-process on this "
    "machine"
)


def check_cluster(res: Resources, rule: str) -> None:
    """Before submitting a SLURM job (and before anything is written): SLURM answers here (`slurm_nodes`), and some
    node of the cluster could run the job, else ValueError (`cluster_shortfall`), not a job that sbatch refuses with
    a bare gres error or that pends for ever."""
    why = cluster_shortfall(res, slurm_nodes(res.partition), rule)
    if why:
        raise ValueError(f"SLURM: {why}")


def slurm_nodes(partition: str = "") -> list[str]:
    """The cluster's nodes as `sinfo -h -N -o '%G|%m|%c'` lines; ValueError naming the launcher and the fix when
    there is no SLURM here (its client commands not on PATH) or its controller does not answer."""
    check_slurm_commands()
    cmd = ["sinfo", "-h", "-N", "-o", "%G|%m|%c", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"--launcher slurm: the SLURM controller did not answer `sinfo` within 30 s; {NO_SLURM_FIX}"
        ) from None
    except OSError as err:
        raise ValueError(f"--launcher slurm: `sinfo` could not run ({err}); {NO_SLURM_FIX}") from None
    if out.returncode != 0:
        said = next((ln.strip() for ln in out.stderr.splitlines() if ln.strip()), f"exit status {out.returncode}")
        raise ValueError(
            f"--launcher slurm: the SLURM controller does not answer (`sinfo`: {said[:300]}); {NO_SLURM_FIX}"
        )
    return out.stdout.splitlines()


def check_slurm_commands() -> None:
    """ValueError naming the launcher and the fix when SLURM's client commands are not on PATH."""
    missing = [cmd for cmd in ("sbatch", "srun", "sinfo") if shutil.which(cmd) is None]
    if missing:
        raise ValueError(
            f"--launcher slurm: no SLURM on this machine ({', '.join(missing)} not on PATH); {NO_SLURM_FIX}"
        )


def json_mapping(option: str, text: str, *, valid: dict[str, str] | None = None) -> dict[str, Any]:
    """A JSON mapping given as a command-line option; ValueError naming the option and where the text stops being
    JSON, or the key whose number has more digits than Python reads and its valid values (`valid`: by key)."""
    from runfiles.bounded import load_json
    from study.run.rundir import json_problem

    try:
        value = load_json(text)
    except ValueError as err:
        found = LONG_JSON_NUMBER.search(text)
        if found is not None and not isinstance(err, json.JSONDecodeError):  # Python's limit on an int's digits
            key, digits = found["key"], len(found["number"].lstrip("-"))
            values = (valid or {}).get(key, f"a number of at most {sys.get_int_max_str_digits()} digits")
            raise ValueError(f"{option}: {key} = a {digits}-digit number; valid: {values}") from None
        raise ValueError(
            f"{option} = {clip_value(text)}: {json_problem(err)}; valid: a JSON mapping, e.g. '{{\"tp\": 2}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} = {clip_value(text)}: a JSON {type(value).__name__}; valid: a JSON mapping")
    return value


LONG_JSON_NUMBER = re.compile(
    r'"(?P<key>[^"\\]{1,200})"\s*:\s*(?P<number>-?\d{' + str(sys.get_int_max_str_digits() + 1) + ",})"
)
"""A JSON member `"key": <an integer of more digits than Python reads>` (json.loads raises a bare ValueError)."""


def clip_value(text: str, limit: int = 200) -> str:
    """`text` quoted, or its start and length when it is longer than `limit`."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def launch(
    config: dict[str, Any],
    results: str | Path,
    launcher: str,
    res: Resources,
    tracking: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `config` through `launcher` and block until it ends; returns the run's status (plus "run_dir").
    `tracking`: the run's trackers, study and tags (study.run.trackers.Tracking.to_dict()).

    Raises FailedJobError (remote traceback in its message) or UncompletedJobError (e.g. timed out too often)."""
    from study.run.config import RunConfig

    cfg = RunConfig.from_dict(config, where="launch")
    res = layout_ranks(cfg, res)
    check_resources(cfg, launcher, res)
    run_dir = Path(results) / "runs" / cfg.run_id
    if launcher != "in-process":  # the job's folder goes under the run directory: refuse first what a job would
        check_run(cfg, run_dir, Path(results), here=launcher == "local" and cfg.layout.world_size == 1)
    call = Run(cfg.to_dict(), str(results), tracking)
    return _submit_and_wait(call, launcher, run_dir / "submitit", res, cfg.run_id)


def check_run(cfg: Any, run_dir: Path, results: Path, *, here: bool) -> None:
    """The job's preflight (study.lifecycle.preflight) before the job is asked for, so that a run it refuses leaves
    the results directory as it was (no job folder, no log): whole where the job runs here as one process (`here`:
    the local launcher, one rank), else the checks that hold wherever the run trains. A refusal is recorded as the
    job's preflight records it (lifecycle.record_refusal: only in a run directory a workflow made for the run's log).
    A finished run is not checked: the job skips it."""
    from study import lifecycle

    if lifecycle.finished(run_dir):
        return
    try:
        lifecycle.preflight(cfg, run_dir, results, here=here)
    except ValueError as err:
        lifecycle.record_refusal(cfg, run_dir, err)
        raise


def layout_ranks(cfg: Any, res: Resources) -> Resources:
    """`res` with one task per rank of the run's `parallel` layout when it asks for one rank (no --nodes or
    --tasks-per-node placement given); otherwise `res` (check_resources compares the two)."""
    if res.world_size == 1 and cfg.layout.world_size > 1:
        return dataclasses.replace(res, tasks_per_node=cfg.layout.world_size)
    return res


def check_resources(cfg: Any, launcher: str, res: Resources) -> None:
    """Refuse, before any job is asked for, a run that cannot fit on the job's GPUs (study.run.plan) or whose ranks
    do not match its parallel layout (module docstring, point 7). ValueError naming the resource."""
    from study.run import plan

    layout = getattr(cfg, "layout", None)
    if layout is not None and launcher != "in-process" and res.world_size != layout.world_size:
        raise ValueError(
            f"nodes x tasks per node = {res.nodes} x {res.ranks_per_node} = {res.world_size} ranks, but the run's "
            f"parallel layout {cfg.parallel or '{}'} has {layout.world_size}; valid: as many tasks as the layout's "
            "ranks (tensor x data)"
        )
    if launcher != "in-process" and res.gpus and res.gpu_mem_gb:
        plan.check_run_fits(cfg, gpus=res.nodes * res.gpus, gpu_mem_gb=res.gpu_mem_gb, gpus_per_node=res.gpus)


def launch_rank_check(
    results: str | Path, launcher: str, res: Resources, hold_s: float = 0.0, backend: str = "auto"
) -> list[dict]:
    """Submit RankCheck (of `backend`) with `res`'s nodes and tasks and block; returns every rank's view (rank
    order)."""
    folder = Path(results) / "rank-check" / "submitit"
    if launcher not in ("local", "slurm"):
        raise ValueError(f"launcher = {launcher!r}: the rank check starts a job's tasks; valid: local, slurm")
    previous = {sig: signal.signal(sig, _raise_cancelled) for sig in (signal.SIGINT, signal.SIGTERM)}
    job = None
    try:
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--rank-check-backend = {backend!r}; valid: auto, gloo, nccl")
        job = executor(launcher, folder, res, job_name="rank-check").submit(RankCheck(hold_s, backend=backend))
        print(f"submitted {launcher} job {job.job_id}; logs: {folder}", file=sys.stderr, flush=True)
        return job.results()
    except Cancelled:
        if job is not None:
            job.cancel(check=False)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch_coldstart(
    model: str | dict[str, Any],
    task: str,
    results: str | Path,
    launcher: str,
    res: Resources,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Make (or reuse) the cold start of (model, task) through `launcher`, blocking; returns its status. `model`: a
    preset name or a model mapping {preset: NAME, FIELD: VALUE, ...}; `extra`: further ColdStartSettings fields (a
    run's band and task knobs)."""
    from study.coldstart import resolve_settings

    extra = dict(extra or {})
    res = dataclasses.replace(res, nodes=1, tasks_per_node=1)  # the cold start trains on one rank
    from study.run.rundir import check_results

    settings = resolve_settings(model, task, threads=res.cpus, **extra)  # raises on an unknown preset, field or task
    name = settings.dirname
    folder = Path(results) / "coldstart" / "submitit" / name
    check_results(folder, results)  # before the job's folder is made
    call = ColdStart(settings.model, task, str(results), threads=res.cpus, settings=extra)
    return _submit_and_wait(call, launcher, folder, res, f"coldstart-{name}")


def _submit_and_wait(call: Any, launcher: str, folder: Path, res: Resources, job_name: str) -> dict[str, Any]:
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher = {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if launcher == "in-process":
        return call()
    # Handlers first: a signal that arrives once the job id is printed must cancel the job, not kill us.
    previous = {sig: signal.signal(sig, _raise_cancelled) for sig in (signal.SIGINT, signal.SIGTERM)}
    job = None
    try:
        job = executor(launcher, folder, res, job_name=job_name).submit(call)
        print(f"submitted {launcher} job {job.job_id}; logs: {folder}", file=sys.stderr, flush=True)
        return job.results()[0]  # rank 0's (the task that writes the run directory)
    except Cancelled:
        if job is not None:
            print(f"cancelling {launcher} job {job.job_id}", file=sys.stderr, flush=True)
            job.cancel(check=False)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_cancelled(signum: int, frame: Any) -> None:
    raise Cancelled(signum)


def _resources(args: argparse.Namespace, *, cpus: int, gpu_mem_gb: float = 0.0) -> Resources:
    """The job's Resources from the command line's options (Resources validates them): each field the option of its
    name (--time-min: time_min), but `cpus` and `gpu_mem_gb`, which the caller resolves."""
    options = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Resources) if f.name not in ("cpus", "gpu_mem_gb")
    }
    return Resources(**options, cpus=cpus, gpu_mem_gb=gpu_mem_gb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.launch", description=__doc__.split("\n")[0])
    parser.add_argument(
        "config", nargs="?", help="YAML file of RunConfig fields (e.g. results/<study>/configs/RUN_ID.yaml)"
    )
    parser.add_argument(
        "--coldstart",
        nargs=2,
        metavar=("MODEL", "TASK"),
        help="launch the cold start of a model and task instead of a run; MODEL: a preset "
        "name or a YAML/JSON mapping '{preset: NAME, FIELD: VALUE, ...}'",
    )
    parser.add_argument(
        "--coldstart-settings",
        default="{}",
        metavar="JSON",
        help="with --coldstart: further cold-start settings as a JSON mapping, e.g. "
        '\'{"band": [0.3, 0.7], "knobs": {"terms": [2, 3]}}\'',
    )
    parser.add_argument("--results", default="results", help="results directory (the run goes to RESULTS/runs/RUN_ID)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="in-process", help="where the run executes")
    parser.add_argument("--partition", default="", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--account", default="", help="SLURM account (default: the user's)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes per run")
    parser.add_argument(
        "--tasks-per-node", type=int, default=0, help="ranks per node (default 0: one per GPU, one for a CPU job)"
    )
    parser.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=0.0,
        help="memory of one GPU: a GPU run that does not fit is refused before submission (0: off)",
    )
    parser.add_argument(
        "--rank-check",
        action="store_true",
        help="instead of a run: start the ranks and check they agree on the distributed env",
    )
    parser.add_argument(
        "--rank-check-backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="the rank check's process group: auto (NCCL where the job sees CUDA, as a run's ranks; "
        "else gloo), gloo or nccl",
    )
    parser.add_argument("--time-min", type=int, default=Resources.time_min, help="time limit per job, minutes")
    parser.add_argument("--mem-gb", type=float, default=Resources.mem_gb, help="memory per run, GB")
    parser.add_argument("--cpus", type=int, default=0, help="CPUs per run (default: the config's `threads`)")
    parser.add_argument(
        "--rollout-runtime",
        default="",
        metavar="JSON",
        help="the vllm engine's runtime settings over the config's rollout_runtime (a JSON mapping, "
        'e.g. \'{"tp": 2, "placement": "separate"}\'; study/run/rollout_runtime.py); '
        "not in the run id; ignored by runs of another engine",
    )
    parser.add_argument(
        "--max-timeouts",
        type=int,
        default=Resources.max_timeouts,
        help="requeues after SLURM time-outs before giving up (preemptions: unlimited)",
    )
    parser.add_argument(
        "--signal-delay-s",
        type=int,
        default=Resources.signal_delay_s,
        help="seconds before the time limit at which SLURM signals the job to checkpoint",
    )
    parser.add_argument(
        "--trackers",
        default=None,
        metavar="LIST",
        help="live trackers besides TensorBoard (always on): tensorboard, wandb, mlflow, "
        "comma-separated (default: the STUDY_TRACKERS variable); not part of the run id",
    )
    parser.add_argument(
        "--study",
        default=None,
        help="the study the trackers group the run under (default: STUDY of a config at "
        "RESULTS/STUDY/configs/RUN_ID.yaml, whose sibling configs give its axis values)",
    )
    args = parser.parse_args(argv)
    if args.rank_check:
        try:
            res = _resources(args, cpus=args.cpus or 1)  # no run: no fit check
            if args.launcher == "slurm":
                slurm_nodes(res.partition)
            views = launch_rank_check(args.results, args.launcher, res, backend=args.rank_check_backend)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except (FailedJobError, UncompletedJobError) as err:
            print(str(err), file=sys.stderr)
            return 1
        for view in views:
            print(json.dumps({k: view[k] for k in ("rank", "world_size", "sum", "env", "backend")}))
        n = len(views)
        agree = all(v["sum"] == n * (n + 1) / 2 and v["world_size"] == n for v in views)
        print(f"{n} ranks {'agree' if agree else 'DISAGREE'}")
        return 0 if agree else 1
    if (args.config is None) == (args.coldstart is None):
        parser.error("give either CONFIG (a run) or --coldstart MODEL TASK")

    from study.run.config import load_config
    from study.run.trackers import parse_trackers, study_tracking

    coldstart = None
    tracking = None
    try:
        cfg = None if args.coldstart else load_config(args.config)
        if cfg is not None and args.rollout_runtime.strip():  # a profile's: checked always, applied to vllm runs
            from study.run.rollout_runtime import EngineSettings

            runtime = json_mapping("--rollout-runtime", args.rollout_runtime)
            EngineSettings.parse(runtime, field="--rollout-runtime")
            if cfg.rollout_engine == "vllm":
                cfg = cfg.replace(rollout_runtime={**cfg.rollout_runtime, **runtime})  # validated; same run id
        if cfg is not None:
            tracking = study_tracking(args.config, parse_trackers(args.trackers), args.study).to_dict()
        res = _resources(args, cpus=args.cpus or (cfg.threads if cfg else 1), gpu_mem_gb=args.gpu_mem_gb)
        if cfg is not None:
            res = layout_ranks(cfg, res)
            check_resources(cfg, args.launcher, res)  # before any job is asked for
        if args.coldstart:
            from study.coldstart import resolve_settings
            from study.coldstart.sft import MAX_SEED
            from study.coldstart.store import parse_model

            valid = {"seed": f"an integer in 0..{MAX_SEED}"}  # a number past Python's digits names its range
            extra = json_mapping("--coldstart-settings", args.coldstart_settings, valid=valid)
            coldstart = (parse_model(args.coldstart[0]), args.coldstart[1])
            resolve_settings(*coldstart, threads=res.cpus, **extra)  # settings errors: before any job
        if args.launcher == "slurm":
            check_cluster(res, rule="coldstart" if args.coldstart else "run")
    except (ValueError, FileNotFoundError, argparse.ArgumentTypeError) as err:  # no job yet
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if coldstart is not None:
            status = launch_coldstart(*coldstart, args.results, args.launcher, res, extra)
        else:
            status = launch(cfg.to_dict(), args.results, args.launcher, res, tracking)
    except FailedJobError as err:  # the remote traceback, verbatim
        print(str(err), file=sys.stderr)
        return 1
    except UncompletedJobError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Cancelled as sig:
        return 128 + sig.signum
    except (Stopped, KeyboardInterrupt) as err:  # in-process: SIGTERM/SIGHUP, Ctrl-C; recorded `stopped` by the run
        run_dir = Path(args.results) / "runs" / cfg.run_id if cfg is not None else None
        where = f"{run_dir}; resume with `python -m study resume {run_dir}`" if run_dir is not None else "the job"
        print(f"stopped ({err or type(err).__name__}): {where}", file=sys.stderr)
        return 128 + err.signum if isinstance(err, Terminated) else 130
    except (RunLocked, RunStateError, ValueError) as err:  # in-process: another holder, damaged state, preflight
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{status['state']}: {status['run_dir']}")
    return 0 if status["state"] in ("completed", "collapsed") else 1


if __name__ == "__main__":
    # Run through the module's import name, so that the pickled `Run` is `study.launch.Run`, not `__main__.Run`.
    from study.core.hugepages import reexec
    from study.launch import main as _main

    reexec()  # once, with the malloc tunables of study/core/hugepages.py (STUDY_HUGEPAGES=0: not); jobs inherit it
    sys.exit(_main())
