"""Optuna tuning: per algorithm, one Optuna study over its sensitive hyper-parameters with the same trial budget for
every algorithm, so that the comparison is fair; the best values go to a tuned file that a comparison sweep
references with `tuned:`.

    python -m sweeps.tune sweeps/tune.yaml                     # tune every algorithm of the sweep, write best.yaml
    python -m sweeps.tune sweeps/tune.yaml --workers 2         # two worker processes sharing the storage
    python -m sweeps.tune sweeps/tune.yaml --algorithm grpo    # one algorithm's study (Snakemake's tune_algorithm)
    python -m sweeps.tune sweeps/tune.yaml --best-only         # write best.yaml from the storage, running nothing
    snakemake tune --cores all --config sweep=sweeps/tune.yaml # the same through the workflow (sweeps/rules/tune.smk)

A tuning sweep is a sweep file with a `tune:` section (sweeps/tune.yaml):

    name: tune
    preset: tiny
    base: {steps: 4, eval_every: 2}         # every trial's fixed fields
    axes: {algorithm: [grpo, gspo]}         # the algorithms to tune: one run each, the search's starting point
    tune:
      trials: 4                # trials per algorithm, the same for every algorithm (pruned trials count)
      objective: eval_in_dist  # held-out eval maximised (eval_in_dist | eval_hard), its value at the last step
      spread: 10               # default interval of a starting value v: [v / spread, v * spread], log scale
      space:                   # optional overrides; keys: lr, weight_decay, grad_clip or a hyper-parameter name
        lr: {low: 1e-5, high: 1e-3}         # log scale unless `log: false`; integer hyper-parameters get integers
        eps_low: fixed                      # not searched: keeps its starting value
      pruner: {name: median, startup_trials: 2, warmup_steps: 0}  # median | percentile (+ percentile) |
                                                                  # threshold (+ lower) | none
      sampler: {name: tpe, seed: 0}         # tpe | random
      storage: sqlite          # sqlite (default) | journal | journal:PATH | an RDB URL; `--storage` overrides it

1. Search space, from the registry: unless `space` says otherwise, `lr` and every float hyper-parameter of the
   algorithm whose starting value (the sweep's, else the registry default) is positive, each searched log-uniformly
   over [v / spread, v * spread] clipped to the hyper-parameter's `Range`. A new variant file is tuned with no edit
   here. Explicit bounds are checked against the Range (errors name the field and the valid range).
2. Equal budget: one Optuna study per algorithm, `<name>.<algorithm>`, with exactly `trials` trials. A worker claims
   a trial under a lock (RESULTS/tune/<name>/<algorithm>.claim.lock, Optuna's NFS-safe open lock) only while fewer
   than `trials` trials are waiting, running or finished, so any number of parallel workers creates exactly `trials`
   trials and loses none. Trial 0 is the starting point itself, so tuning never ranks the untuned values out. A failed
   trial (a crash; the command exits 1) does not count: the next invocation runs a new one. A RUNNING trial whose
   worker died on this host is failed and its parameters queued again, so its run resumes from its checkpoint.
3. A trial is an ordinary run (`study.rl.run` into RESULTS/runs/{run_id}/): an identical run that exists is reused,
   a finished one without computing anything. Every held-out eval (each `eval_every` steps) is reported to Optuna
   (`trial.report`) and the pruner decides (`trial.should_prune`) before the last step. A pruned run stops there, its
   directory kept and resumable (status `stopped` at that step, the pruner named in `reason`); the trial is PRUNED
   with user attribute outcome=pruned. A collapsed run (status `collapsed`) is PRUNED with outcome=collapsed. Neither
   can be best. Samplers are seeded per (seed, algorithm, trial number), so one worker is reproducible and parallel
   workers do not propose the same point.
4. Storage: `sqlite` is sqlite:///RESULTS/tune/<name>/optuna.db (one machine); `journal` is a JournalStorage file,
   RESULTS/tune/<name>/journal.log (workers on several nodes sharing RESULTS over NFS); an RDB URL
   (postgresql://..., mysql+pymysql://...) serves a cluster. Workers on several hosts share RESULTS (run directories,
   claim locks) in every case.
5. Output, once every algorithm has all its trials finished: RESULTS/tune/<name>/best.yaml (schema:
   sweeps.schema.tuned_file_schema): per algorithm the best complete trial's RunConfig fields (`config`) and
   hyper-parameters (`hparams`), its value, trial number and run id, the trial counts and the search space; plus the
   objective, the budget, the storage and provenance (sweep file, git sha, time). trials.csv beside it lists every
   trial. `--algorithm A` writes RESULTS/tune/<name>/A.yaml, the same format with A alone. A comparison sweep names a
   tuned file with `tuned: PATH` (sweeps/expand.py merges it into each run of the algorithm); the shipped
   sweeps/compare_tuned.yaml reads sweeps/tuned/tune.yaml, a committed copy of this command's best.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from algorithms import Spec, catalog
from runfiles import METRICS
from study.run.config import RunConfig
from study.run.rundir import Stopped
from sweeps.expand import Sweep, load_sweep
from sweeps.schema import OBJECTIVES, TUNABLE_FIELDS, TUNED_FORMAT, SweepError, validate_tuned_file

DEFAULTS: dict[str, Any] = {
    "objective": "eval_in_dist",
    "spread": 10.0,
    "pruner": {"name": "median", "startup_trials": 2, "warmup_steps": 0},
    "sampler": {"name": "tpe", "seed": 0},
    "storage": "sqlite",
}
LOCK_GRACE_S = 120  # a claim takes well under a second; a lock older than this was left by a dead worker


class TuneError(RuntimeError):
    """A tuning run that cannot go on (a trial's run crashed, no trial completed)."""


class Pruned(Stopped):
    """Raised from the run's on_eval hook to stop a pruned trial. A rundir.Stopped (a BaseException), so `rl.run`
    records the run "stopped", resumable, instead of failed; the trial then writes its reason."""

    def __init__(self, step: int) -> None:
        super().__init__(f"pruned at step {step}")
        self.step = step


# -- the plan: what to tune, validated before any run ------------------------------------------------------------------
@dataclass(frozen=True)
class Dim:
    """One searched value: a RunConfig field (lr, weight_decay, grad_clip) or a hyper-parameter of the algorithm."""

    name: str
    low: float
    high: float
    log: bool = True
    integer: bool = False

    def suggest(self, trial: Any) -> float | int:
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def contains(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and self.low <= value <= self.high

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "log": self.log, **({"integer": True} if self.integer else {})}


@dataclass(frozen=True)
class Plan:
    """A validated tuning sweep: per algorithm its starting run and search space, the budget and the storage."""

    name: str
    source: str
    results: Path
    trials: int
    objective: str
    spread: float
    pruner: dict[str, Any]
    sampler: dict[str, Any]
    storage: str
    starts: dict[str, RunConfig]
    spaces: dict[str, dict[str, Dim]]

    @property
    def dir(self) -> Path:
        return self.results / "tune" / self.name

    @property
    def best_path(self) -> Path:
        return self.dir / "best.yaml"

    def study_name(self, algorithm: str) -> str:
        return f"{self.name}.{algorithm}"

    def config(self, algorithm: str, params: dict[str, Any]) -> RunConfig:
        """The trial's run: the starting run with the sampled values."""
        start = self.starts[algorithm]
        fields = {k: v for k, v in params.items() if k in TUNABLE_FIELDS}
        hparams = {k: v for k, v in params.items() if k not in TUNABLE_FIELDS}
        return start.replace(**fields, hparams={**start.hparams, **hparams})


def _number(value: Any, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise SweepError(f"{where} = {value!r}: must be a number") from None
    if not math.isfinite(out):
        raise SweepError(f"{where} = {value!r}: must be a finite number")
    return out


def _starting_values(cfg: RunConfig) -> dict[str, Any]:
    alg = catalog.spec(cfg.algorithm)
    return {**{f: getattr(cfg, f) for f in TUNABLE_FIELDS}, **alg.check_hparams(cfg.hparams)}


def _default_dim(name: str, value: float, spread: float, alg: Spec) -> Dim | None:
    """Log-uniform [value / spread, value * spread], inside the hyper-parameter's Range."""
    low, high = float(f"{value / spread:.6g}"), float(f"{value * spread:.6g}")  # readable bounds, then the Range
    bounds = alg.ranges.get(name)
    if bounds is not None:
        if bounds.ge is not None:
            low = max(low, bounds.ge)
        if bounds.gt is not None:
            low = max(low, math.nextafter(bounds.gt, math.inf))
        if bounds.le is not None:
            high = min(high, bounds.le)
        if bounds.lt is not None:
            high = min(high, math.nextafter(bounds.lt, -math.inf))
    return Dim(name, low, high) if 0 < low < high else None


def _space(cfg: RunConfig, tune: dict[str, Any], spread: float, where: str) -> dict[str, Dim]:
    alg = catalog.spec(cfg.algorithm)
    start = _starting_values(cfg)
    dims: dict[str, Dim] = {}
    for name, value in start.items():  # the defaults: lr and every positive float hyper-parameter
        searched = name == "lr" or (name in alg.hparams and type(alg.hparams[name]) is float)
        if searched and isinstance(value, (int, float)) and value > 0:
            dim = _default_dim(name, float(value), spread, alg)
            if dim is not None:
                dims[name] = dim
    for name, spec in (tune.get("space") or {}).items():
        if name not in start:
            continue  # another tuned algorithm's hyper-parameter (unknown names are refused in `plan`)
        if spec == "fixed":
            dims.pop(name, None)
            continue
        field = f"{where}.space.{name}"
        low, high = _number(spec["low"], f"{field}.low"), _number(spec["high"], f"{field}.high")
        log = bool(spec.get("log", True))
        if not low < high:
            raise SweepError(f"{field}: low = {low} must be < high = {high} (use `{name}: fixed` to keep one value)")
        if log and low <= 0:
            raise SweepError(f"{field}.low = {low}: a log-scale interval needs low > 0; valid: low > 0, or log: false")
        integer = name in alg.hparams and type(alg.hparams[name]) is int
        if integer and (low != int(low) or high != int(high)):
            raise SweepError(f"{field}: {cfg.algorithm}.{name} is an integer; valid: integer low and high")
        for end, value in (("low", low), ("high", high)):
            try:
                if name in TUNABLE_FIELDS:
                    cfg.replace(**{name: value})
                else:
                    alg.check_hparams({name: int(value) if integer else value})
            except ValueError as err:
                raise SweepError(f"{field}.{end}: {err}") from None
        dims[name] = Dim(name, int(low) if integer else low, int(high) if integer else high, log, integer)
    return dims


def plan(sweep: str | Path | Sweep, results: str | Path = "results", *, storage: str | None = None) -> Plan:
    """Validate a tuning sweep (errors name the field and the valid values) and resolve its search spaces."""
    sweep = sweep if isinstance(sweep, Sweep) else load_sweep(sweep)
    where = sweep.source
    if sweep.tune is None:
        raise SweepError(
            f"{where}: no `tune:` section, so nothing to tune; valid: add one, e.g. `tune: {{trials: 4}}` "
            "(see sweeps/tune.yaml and `python -m sweeps.tune --help`)"
        )
    tune = {**DEFAULTS, **sweep.tune}
    runs = sweep.expand()
    starts: dict[str, RunConfig] = {}
    for cfg in runs.values():
        if cfg.algorithm in starts:
            varying = sorted(k for k, v in cfg.to_dict().items() if v != getattr(starts[cfg.algorithm], k))
            raise SweepError(
                f"{where}: a tuning sweep has one run per algorithm (a trial's starting point), but {cfg.algorithm} "
                f"has several (differing in {', '.join(varying)}); valid: axes.algorithm only, fixed fields in base"
            )
        starts[cfg.algorithm] = cfg
    objective = tune["objective"]
    for cfg in starts.values():
        if cfg.eval_every < 1:
            raise SweepError(
                f"{where}: base.eval_every = {cfg.eval_every}: trials are scored and pruned on held-out "
                "eval; valid: >= 1"
            )
        if cfg.eval_test_size:  # the test split judges the design; tuning chooses it on the validation sets
            raise SweepError(
                f"{where}: base.eval_test_size = {cfg.eval_test_size}: tuning reads the validation sets only, and "
                f"its trials never score the test split; valid: eval_test_size = 0 (objective: {', '.join(OBJECTIVES)})"
            )
        if cfg.task == "user" and objective != "eval_in_dist":
            raise SweepError(
                f"{where}: tune.objective = {objective!r}: task = 'user' has one held-out set; valid: eval_in_dist"
            )
    spread = _number(tune["spread"], f"{where}: tune.spread")
    if not spread > 1:
        raise SweepError(f"{where}: tune.spread = {spread}: must be > 1 (the interval is [v / spread, v * spread])")
    known = set(TUNABLE_FIELDS) | {h for cfg in starts.values() for h in catalog.spec(cfg.algorithm).hparams}
    unknown = sorted(set(tune.get("space") or {}) - known)
    if unknown:
        raise SweepError(
            f"{where}: tune.space: unknown name(s) {unknown}; valid: {', '.join(sorted(known))} "
            "(RunConfig fields and the tuned algorithms' hyper-parameters)"
        )
    pruner = {**DEFAULTS["pruner"], **(sweep.tune.get("pruner") or {})}
    if pruner["name"] == "threshold" and "lower" not in pruner:
        raise SweepError(f"{where}: tune.pruner.name = 'threshold' needs tune.pruner.lower (prune below it)")
    spaces = {alg: _space(cfg, tune, spread, f"{where}: tune") for alg, cfg in starts.items()}
    for alg, dims in spaces.items():
        if not dims:
            raise SweepError(f"{where}: tune.space leaves nothing to search for {alg}; valid: remove a `fixed`")
    return Plan(
        name=sweep.name,
        source=where,
        results=Path(results),
        trials=int(tune["trials"]),
        objective=objective,
        spread=spread,
        pruner=pruner,
        sampler={**DEFAULTS["sampler"], **(sweep.tune.get("sampler") or {})},
        storage=storage or tune["storage"],
        starts=starts,
        spaces=spaces,
    )


# -- storage, samplers, pruners, locks ------------------------------------------------------------------------------
@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive between processes and hosts sharing the folder (Optuna's open lock: O_EXCL create, NFSv3+)."""
    from optuna.storages.journal import JournalFileOpenLock

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = JournalFileOpenLock(str(path), grace_period=LOCK_GRACE_S)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def storage_url(p: Plan, *, shown: bool = False) -> str:
    """The storage as a URL (sqlite:///ABSOLUTE, journal:ABSOLUTE or the RDB URL); `shown`: for the provenance,
    paths relative to the working directory when under it and an RDB URL's password hidden."""

    def path(local: Path) -> str:
        local = local.resolve()
        return str(local.relative_to(Path.cwd())) if shown and local.is_relative_to(Path.cwd()) else str(local)

    if p.storage == "sqlite":
        return f"sqlite:///{path(p.dir / 'optuna.db')}"
    if p.storage == "journal" or p.storage.startswith("journal:"):
        file = Path(p.storage.removeprefix("journal:")) if p.storage != "journal" else p.dir / "journal.log"
        return f"journal:{path(file)}"
    if "://" in p.storage:
        from sqlalchemy.engine import make_url

        return make_url(p.storage).render_as_string(hide_password=True)
    raise SweepError(f"storage = {p.storage!r}; valid: sqlite, journal, journal:PATH, or an RDB URL (dialect://...)")


def open_storage(p: Plan) -> Any:
    """The Optuna storage of the plan (created under a lock: SQLite's table creation is not safe to race)."""
    import optuna

    url = storage_url(p)
    with _lock(p.dir / "storage"):
        if url.startswith("journal:"):
            path = url.removeprefix("journal:")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            backend = optuna.storages.journal.JournalFileBackend(
                path, lock_obj=optuna.storages.journal.JournalFileOpenLock(path)
            )
            return optuna.storages.JournalStorage(backend)
        if url.startswith("sqlite:"):
            p.dir.mkdir(parents=True, exist_ok=True)
            # concurrent writers wait for SQLite's lock instead of failing after the 5 s default
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
        return optuna.storages.RDBStorage(p.storage, engine_kwargs={"pool_pre_ping": True})


def _sampler(p: Plan, algorithm: str, number: int) -> Any:
    import optuna

    from study.parts import derive_seed

    seed = derive_seed("tune", p.sampler["seed"], algorithm, number) % 2**32
    if p.sampler["name"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, p.trials // 3))


def _pruner(p: Plan) -> Any:
    import optuna

    spec = p.pruner
    common = {"n_warmup_steps": spec["warmup_steps"]}
    if spec["name"] == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=spec["startup_trials"], **common)
    if spec["name"] == "percentile":
        return optuna.pruners.PercentilePruner(
            spec.get("percentile", 25.0), n_startup_trials=spec["startup_trials"], **common
        )
    if spec["name"] == "threshold":
        return optuna.pruners.ThresholdPruner(lower=spec["lower"], **common)
    return optuna.pruners.NopPruner()


def _study(p: Plan, storage: Any, algorithm: str, number: int = 0) -> Any:
    import optuna

    return optuna.create_study(
        storage=storage,
        study_name=p.study_name(algorithm),
        direction="maximize",
        sampler=_sampler(p, algorithm, number),
        pruner=_pruner(p),
        load_if_exists=True,
    )


# -- one worker ---------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(p: Plan, storage: Any, algorithm: str) -> tuple[Any, Any] | None:
    """(study, trial) of the next trial of `algorithm`, or None when its budget is claimed."""
    from optuna.trial import TrialState

    with _lock(p.dir / f"{algorithm}.claim"):
        study = _study(p, storage, algorithm)
        trials = study.get_trials(deepcopy=False)
        if not trials:  # trial 0: the starting point itself
            start = _starting_values(p.starts[algorithm])
            dims = p.spaces[algorithm]
            study.enqueue_trial(
                {k: start[k] for k, dim in dims.items() if dim.contains(start[k])}, user_attrs={"start": True}
            )
            trials = study.get_trials(deepcopy=False)
        host = socket.gethostname()
        for t in trials:  # a worker on this host died mid-trial: fail it and queue its parameters again
            if t.state == TrialState.RUNNING and t.user_attrs.get("host") == host and not _alive(t.user_attrs["pid"]):
                study.tell(t.number, state=TrialState.FAIL)
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
                trials = study.get_trials(deepcopy=False)
        counted = [t for t in trials if t.state != TrialState.FAIL]
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if not waiting and len(counted) >= p.trials:
            return None
        study.sampler = _sampler(p, algorithm, len(trials))
        trial = study.ask()
        trial.set_user_attr("host", host)
        trial.set_user_attr("pid", os.getpid())
        params = {name: dim.suggest(trial) for name, dim in p.spaces[algorithm].items()}
        trial.set_user_attr("run_id", p.config(algorithm, params).run_id)
        return study, trial


def _evals(run_dir: Path, objective: str) -> list[tuple[int, float]]:
    """(step, value) of the held-out evals a run directory already holds, up to its recorded step."""
    import pandas as pd

    from study.run import rundir

    status = rundir.read_status(run_dir)
    if status is None or not (run_dir / METRICS).exists():
        return []
    frame = pd.read_parquet(run_dir / METRICS, columns=["step", objective])
    # training evals only: step 0 is the start's evaluation, not a step a pruner judges
    frame = frame[(frame["step"] > 0) & (frame["step"] <= status.get("step", 0))].dropna()
    return [(int(s), float(v)) for s, v in zip(frame["step"], frame[objective], strict=True)]


def _run_trial(p: Plan, algorithm: str, study: Any, trial: Any) -> str:
    """Run one claimed trial to its end; returns its outcome: complete, pruned or collapsed."""
    from optuna.trial import TrialState

    from study import rl
    from study.run import rundir

    cfg = p.config(algorithm, trial.params)
    run_dir = p.results / "runs" / cfg.run_id
    reported: set[int] = set()

    def prune_after(step: int, value: float) -> bool:
        if step in reported or not math.isfinite(value):
            return False
        trial.report(value, step)
        reported.add(step)
        return step < cfg.steps and trial.should_prune()

    def pruned(step: int, outcome: str = "pruned", **attrs: Any) -> str:
        for key, value in {"outcome": outcome, "stopped_at_step": step, **attrs}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, state=TrialState.PRUNED)
        return outcome

    for step, value in _evals(run_dir, p.objective):  # a reused run: its recorded evals, as if they came live
        if prune_after(step, value):
            return pruned(step, reused=True)

    def on_eval(step: int, row: dict[str, float]) -> None:
        if prune_after(step, float(row[p.objective])):
            raise Pruned(step)

    try:
        rl.run(cfg, p.results, progress=False, on_eval=on_eval)
    except Pruned as stop:
        reason = f"pruned by {type(study.pruner).__name__} at step {stop.step} (tuning trial {trial.number})"
        rundir.set_status(run_dir, "stopped", step=stop.step, reason=reason)  # resumable, like "running"
        return pruned(stop.step)
    except Exception as err:
        trial.set_user_attr("outcome", "failed")
        trial.set_user_attr("error", f"{type(err).__name__}: {err}")
        study.tell(trial, state=TrialState.FAIL)
        raise TuneError(f"{p.study_name(algorithm)} trial {trial.number}: run {run_dir} failed: {err}") from err
    status = rundir.read_status(run_dir) or {}
    if status.get("state") == "collapsed":
        return pruned(int(status.get("step", 0)), "collapsed", reason=str(status.get("reason", "")))
    evals = dict(_evals(run_dir, p.objective))
    if cfg.steps not in evals:
        trial.set_user_attr("outcome", "failed")
        study.tell(trial, state=TrialState.FAIL)
        raise TuneError(f"{run_dir}: state {status.get('state')!r} without a {p.objective} at step {cfg.steps}")
    trial.set_user_attr("outcome", "complete")
    study.tell(trial, evals[cfg.steps])
    return "complete"


def work(p: Plan, algorithms_: list[str] | None = None, *, log: Any = print) -> dict[str, int]:
    """One worker: claim and run trials, round-robin over the algorithms, until every budget is claimed. Returns the
    number of trials this worker ran per algorithm."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = algorithms_ or list(p.starts)
    storage = open_storage(p)
    ran = dict.fromkeys(names, 0)
    active = list(names)
    while active:
        for algorithm in list(active):
            claimed = _claim(p, storage, algorithm)
            if claimed is None:
                active.remove(algorithm)
                continue
            study, trial = claimed
            t0 = time.perf_counter()
            outcome = _run_trial(p, algorithm, study, trial)
            ran[algorithm] += 1
            log(
                f"{p.study_name(algorithm)} trial {trial.number}: {outcome} {trial.params} "
                f"({time.perf_counter() - t0:.0f} s, run {trial.user_attrs.get('run_id')})"
            )
    return ran


# -- results ------------------------------------------------------------------------------------------------------
def summary(p: Plan, algorithms_: list[str] | None = None, storage: Any = None) -> dict[str, Any]:
    """Per algorithm: trial counts, and the best complete trial (None while trials are unfinished)."""
    from optuna.trial import TrialState

    storage = storage or open_storage(p)
    out: dict[str, Any] = {}
    for algorithm in algorithms_ or list(p.starts):
        trials = _study(p, storage, algorithm).get_trials(deepcopy=False)
        counts = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
        done = counts["complete"] + counts["pruned"]
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        best = max(complete, key=lambda t: (t.value, -t.number)) if complete else None  # ties: the earlier trial
        out[algorithm] = {
            "counts": counts,
            "finished": done >= p.trials and not counts["running"] + counts["waiting"],
            "best": best,
            "trials": trials,
        }
    return out


def _git_sha() -> str:
    from study.run.rundir import git_sha

    return git_sha()


def best_document(p: Plan, algorithms_: list[str] | None = None, storage: Any = None) -> dict[str, Any]:
    """The tuned file's content (sweeps.schema.tuned_file_schema), from the storage; raises TuneError while an
    algorithm has unfinished trials or none complete."""
    state = summary(p, algorithms_, storage)
    entries: dict[str, Any] = {}
    for algorithm, s in state.items():
        if not s["finished"]:
            c = s["counts"]
            raise TuneError(
                f"{p.study_name(algorithm)}: {c['complete'] + c['pruned']} of {p.trials} trials finished "
                f"({c['running']} running, {c['waiting']} waiting); run `python -m sweeps.tune "
                f"{p.source}` to finish them"
            )
        best = s["best"]
        if best is None:
            raise TuneError(
                f"{p.study_name(algorithm)}: no trial completed ({s['counts']['pruned']} pruned or "
                "collapsed); valid: a gentler pruner, a narrower tune.space, or more trials"
            )
        alg = catalog.spec(algorithm)
        cfg = p.config(algorithm, best.params)
        entries[algorithm] = {
            "config": {f: getattr(cfg, f) for f in TUNABLE_FIELDS if f in best.params or f == "lr"},
            "hparams": alg.check_hparams(cfg.hparams),
            "value": float(best.value),
            "trial": best.number,
            "run_id": cfg.run_id,
            "trials": {k: v for k, v in s["counts"].items() if v},
            "space": {name: dim.to_dict() for name, dim in p.spaces[algorithm].items()},
        }
    doc = {
        "format": TUNED_FORMAT,
        "study": p.name,
        "source": p.source,
        "objective": {"metric": p.objective, "direction": "maximize", "at": "the run's last step"},
        "budget": {"trials_per_algorithm": p.trials, "pruner": p.pruner, "sampler": p.sampler, "spread": p.spread},
        "storage": storage_url(p, shown=True),
        "provenance": {
            "git_sha": _git_sha(),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "optuna": _optuna_version(),
        },
        "algorithms": entries,
    }
    validate_tuned_file(doc, where="best file")
    return doc


def _optuna_version() -> str:
    import optuna

    return optuna.__version__


def write_best(p: Plan, out: Path | None = None, algorithms_: list[str] | None = None) -> Path:
    """Write the tuned file (and trials.csv, every trial of the written algorithms) atomically."""
    import pandas as pd

    from runfiles.atomic import atomic_write
    from study.run.rundir import write_text

    storage = open_storage(p)
    doc = best_document(p, algorithms_, storage)
    out = out or p.best_path
    header = (
        f"# Tuned hyper-parameters of {p.source}, written by `python -m sweeps.tune`. Reference this file from "
        "a sweep as `tuned: PATH`.\n"
    )
    write_text(out, header + yaml.safe_dump(doc, sort_keys=False))
    rows = []
    for algorithm, s in summary(p, algorithms_, storage).items():
        for t in s["trials"]:
            rows.append(
                {
                    "algorithm": algorithm,
                    "trial": t.number,
                    "state": t.state.name.lower(),
                    "value": t.value,
                    "outcome": t.user_attrs.get("outcome"),
                    "run_id": t.user_attrs.get("run_id"),
                    **{f"param_{k}": v for k, v in t.params.items()},
                }
            )
    frame = pd.DataFrame(rows)
    csv = out.with_name("trials.csv" if out.stem == "best" else f"{out.stem}.trials.csv")
    atomic_write(csv, lambda tmp: frame.to_csv(tmp, index=False))
    return out


# -- command line -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.tune",
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sweep", help="a tuning sweep: a sweep file with a `tune:` section (sweeps/tune.yaml)")
    parser.add_argument("--results", default="results", help="results root: runs/ and tune/<name>/")
    parser.add_argument("--storage", help="sqlite | journal | journal:PATH | an RDB URL (default: the sweep's)")
    parser.add_argument(
        "--algorithm",
        help="tune only this algorithm; writes RESULTS/tune/<name>/<algorithm>.yaml "
        "(its part of best.yaml) instead of best.yaml",
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the storage")
    parser.add_argument("--best-only", action="store_true", help="write the tuned file from the storage, run nothing")
    parser.add_argument("--no-best", action="store_true", help="run trials only (a worker among several)")
    args = parser.parse_args(argv)
    try:
        p = plan(args.sweep, args.results, storage=args.storage)
        if args.algorithm is not None and args.algorithm not in p.starts:
            raise SweepError(f"--algorithm = {args.algorithm!r}: not tuned by {p.source}; valid: {', '.join(p.starts)}")
        only = [args.algorithm] if args.algorithm else None
        if args.workers < 1:
            raise SweepError(f"--workers = {args.workers}: must be >= 1")
        storage_url(p)  # a bad --storage fails here, before any trial
        if not args.best_only:
            others = []
            for _ in range(args.workers - 1):
                cmd = [sys.executable, "-m", "sweeps.tune", args.sweep, "--results", str(p.results), "--no-best"]
                cmd += ["--storage", p.storage, *([f"--algorithm={args.algorithm}"] if only else [])]
                others.append(subprocess.Popen(cmd))
            try:
                ran = work(p, only)
            finally:  # the other workers finish their trials either way
                failed = sum(proc.wait() != 0 for proc in others)
            print(f"{p.name}: this worker ran {ran}" + (f"; {failed} other worker(s) failed" if failed else ""))
            if failed:
                return 1
        if args.no_best:
            return 0
        out = p.dir / f"{args.algorithm}.yaml" if only else None
        print(f"tuned file: {write_best(p, out, only)}")
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
