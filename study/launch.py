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
4. A failed job raises `FailedJobError` carrying the remote traceback; it is printed verbatim to stderr (the Snakemake
   rule's log). submitit's logs (the run's stdout/stderr) live in RESULTS/runs/RUN_ID/submitit/.
5. SIGINT or SIGTERM cancels the job this process started (scancel for SLURM) before exiting.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from study.run.rundir import RunLocked, RunStateError, Stopped

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


def _slurm_requeue(self: Any, countdown: int) -> None:
    """submitit's SlurmJobEnvironment._requeue (`scontrol requeue JOB`, then a log line), through `requeue`."""
    from submitit.core.logger import get_logger

    ended = "" if requeue(["scontrol", "requeue", self.job_id]) else " (scontrol ended by the requeue's SIGTERM)"
    get_logger().info(f"Requeued job {self.job_id} ({countdown} remaining timeouts){ended}")


def _in_job() -> None:
    """Set up the job process: submitit's requeue through `requeue` (module docstring, point 3)."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    SlurmJobEnvironment._requeue = _slurm_requeue  # type: ignore[method-assign]


class Run:
    """The submitted callable: one run of a resolved config under `results` (identical in every launcher)."""

    def __init__(self, config: dict[str, Any], results: str, tracking: dict[str, Any] | None = None) -> None:
        """`tracking`: study.run.trackers.Tracking as a dict (trackers, study, tags), carried into the job so that a
        compute node logs to the trackers chosen where the job was submitted."""
        self.config = config
        self.results = results
        self.tracking = tracking

    def __call__(self) -> dict[str, Any]:
        from study import rl
        from study.run import rundir
        from study.run.config import RunConfig
        from study.run.trackers import Tracking

        _in_job()
        cfg = RunConfig.from_dict(self.config, where="launch")
        tracking = Tracking.from_dict(self.tracking) if self.tracking is not None else None
        run_dir = rl.run(cfg, self.results, progress=False, tracking=tracking)
        return {"run_dir": str(run_dir), **(rundir.read_status(run_dir) or {})}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on time-out/preemption: requeue the same run; it resumes from its own checkpoint dir."""
        return submitit.helpers.DelayedSubmission(Run(self.config, self.results, self.tracking))


class ColdStart:
    """The submitted callable of a cold start (`study.coldstart.ensure_coldstart`, not strict: an out-of-band result
    is kept and the runs stop on it with the reason), so that on a cluster it trains on a compute node too."""

    def __init__(self, model: str | dict[str, Any], task: str, results: str, threads: int = 1,
                 settings: dict[str, Any] | None = None) -> None:  # fmt: skip
        """`settings`: further ColdStartSettings fields (a run's band and task knobs, study.coldstart.store's
        `run_coldstart`)."""
        self.model, self.task, self.results, self.threads = model, task, results, threads
        self.settings = dict(settings or {})

    def __call__(self) -> dict[str, Any]:
        from study.coldstart import ensure_coldstart, read_record

        _in_job()
        directory = ensure_coldstart(self.model, self.task, self.results, threads=self.threads, strict=False,
                                     **self.settings)  # fmt: skip
        record = read_record(directory)
        return {"run_dir": str(directory), "state": "completed", "coldstart": record["status"],
                "pass_at_1": record["pass_at_1"]}  # fmt: skip

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
    gpus: int = 0
    time_min: int = 120
    mem_gb: float = 16.0
    cpus: int = 1
    max_timeouts: int = 3
    signal_delay_s: int = 90


def executor(launcher: str, folder: Path, res: Resources, job_name: str) -> submitit.Executor:
    """submitit's local or SLURM executor, chosen by name (never AutoExecutor's detection)."""
    if launcher == "local":
        ex: submitit.Executor = submitit.LocalExecutor(folder)
        ex.update_parameters(timeout_min=res.time_min, gpus_per_node=res.gpus, signal_delay_s=res.signal_delay_s)
        return ex
    if launcher == "slurm":
        ex = submitit.SlurmExecutor(folder, max_num_timeout=res.max_timeouts)
        params: dict[str, Any] = {
            "job_name": job_name,
            "time": res.time_min,
            "mem": f"{max(1, round(res.mem_gb * 1024))}M",
            "cpus_per_task": res.cpus,
            "ntasks_per_node": 1,
            "signal_delay_s": res.signal_delay_s,
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
        return (f"this job asks for {res.gpus} GPU(s), and no node of {where} has that many (sinfo gres: at most "
                f"{most[0]} GPUs a node); set `set-resources: {rule}: gpus` in {profile} to at most {most[0]}, or "
                "on a CPU cluster use `--profile slurm-cpu`")  # fmt: skip
    if res.mem_gb * 1024 > most[1] > 0:
        return (f"this job asks for {res.mem_gb:g} GB, and the largest node of {where} has {most[1] / 1024:.1f} GB; "
                f"set `set-resources: {rule}: mem_gb` in {profile} to at most {int(most[1] / 1024)}")  # fmt: skip
    if res.cpus > most[2] > 0:
        return (f"this job asks for {res.cpus} CPUs (the config's `threads`), and the largest node of {where} has "
                f"{most[2]}")  # fmt: skip
    return None


def check_cluster(res: Resources, rule: str) -> None:
    """Before submitting a SLURM job: ValueError when no node of the cluster could run it (`cluster_shortfall`), not
    a job that sbatch refuses with a bare gres error or that pends for ever. Skipped when sinfo does not answer."""
    if shutil.which("sinfo") is None:
        return
    cmd = ["sinfo", "-h", "-N", "-o", "%G|%m|%c", *(["-p", res.partition] if res.partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return
    why = cluster_shortfall(res, out.stdout.splitlines(), rule) if out.returncode == 0 else None
    if why:
        raise ValueError(f"SLURM: {why}")


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
    call = Run(cfg.to_dict(), str(results), tracking)
    return _submit_and_wait(call, launcher, Path(results) / "runs" / cfg.run_id / "submitit", res, cfg.run_id)


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
    settings = resolve_settings(model, task, threads=res.cpus, **extra)  # raises on an unknown preset, field or task
    name = settings.dirname
    call = ColdStart(settings.model, task, str(results), threads=res.cpus, settings=extra)
    return _submit_and_wait(call, launcher, Path(results) / "coldstart" / "submitit" / name, res, f"coldstart-{name}")


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
        return job.result()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m study.launch", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?",
                        help="YAML file of RunConfig fields (e.g. results/<study>/configs/RUN_ID.yaml)")  # fmt: skip
    parser.add_argument("--coldstart", nargs=2, metavar=("MODEL", "TASK"),
                        help="launch the cold start of a model and task instead of a run; MODEL: a preset "
                             "name or a YAML/JSON mapping '{preset: NAME, FIELD: VALUE, ...}'")  # fmt: skip
    parser.add_argument("--coldstart-settings", default="{}", metavar="JSON",
                        help="with --coldstart: further cold-start settings as a JSON mapping, e.g. "
                             "'{\"band\": [0.3, 0.7], \"knobs\": {\"terms\": [2, 3]}}'")  # fmt: skip
    parser.add_argument("--results", default="results", help="results directory (the run goes to RESULTS/runs/RUN_ID)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="in-process", help="where the run executes")
    parser.add_argument("--partition", default="", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--account", default="", help="SLURM account (default: the user's)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per run")
    parser.add_argument("--time-min", type=int, default=Resources.time_min, help="time limit per job, minutes")
    parser.add_argument("--mem-gb", type=float, default=Resources.mem_gb, help="memory per run, GB")
    parser.add_argument("--cpus", type=int, default=0, help="CPUs per run (default: the config's `threads`)")
    parser.add_argument("--max-timeouts", type=int, default=Resources.max_timeouts,
                        help="requeues after SLURM time-outs before giving up (preemptions: unlimited)")  # fmt: skip
    parser.add_argument("--signal-delay-s", type=int, default=Resources.signal_delay_s,
                        help="seconds before the time limit at which SLURM signals the job to checkpoint")  # fmt: skip
    parser.add_argument("--trackers", default=None, metavar="LIST",
                        help="live trackers besides TensorBoard (always on): tensorboard, wandb, mlflow, "
                        "comma-separated (default: the STUDY_TRACKERS variable); not part of the run id")  # fmt: skip
    parser.add_argument("--study", default=None,
                        help="the study the trackers group the run under (default: STUDY of a config at "
                        "RESULTS/STUDY/configs/RUN_ID.yaml, whose sibling configs give its axis values)")  # fmt: skip
    args = parser.parse_args(argv)
    if (args.config is None) == (args.coldstart is None):
        parser.error("give either CONFIG (a run) or --coldstart MODEL TASK")

    from study.run.config import load_config
    from study.run.trackers import parse_trackers, study_tracking

    coldstart = None
    tracking = None
    try:
        cfg = None if args.coldstart else load_config(args.config)
        if cfg is not None:
            tracking = study_tracking(args.config, parse_trackers(args.trackers), args.study).to_dict()
        res = Resources(partition=args.partition, account=args.account, gpus=args.gpus, time_min=args.time_min,
                        mem_gb=args.mem_gb, cpus=args.cpus or (cfg.threads if cfg else 1),
                        max_timeouts=args.max_timeouts, signal_delay_s=args.signal_delay_s)  # fmt: skip
        if args.coldstart:
            from study.coldstart import resolve_settings
            from study.coldstart.store import parse_model

            extra = json.loads(args.coldstart_settings)
            if not isinstance(extra, dict):
                raise ValueError(f"--coldstart-settings = {args.coldstart_settings!r}; valid: a JSON mapping")
            coldstart = (parse_model(args.coldstart[0]), args.coldstart[1])
            resolve_settings(*coldstart, threads=res.cpus, **extra)  # settings errors: before any job
        if args.launcher == "slurm":
            check_cluster(res, rule="coldstart" if args.coldstart else "run")
    except (ValueError, FileNotFoundError, argparse.ArgumentTypeError, json.JSONDecodeError) as err:  # no job yet
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
    except (RunLocked, RunStateError, ValueError) as err:  # in-process: another holder, damaged state, preflight
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{status['state']}: {status['run_dir']}")
    return 0 if status["state"] in ("completed", "collapsed") else 1


if __name__ == "__main__":
    # Run through the module's import name, so that the pickled `Run` is `study.launch.Run`, not `__main__.Run`.
    from study.launch import main as _main

    sys.exit(_main())
