"""Live experiment trackers: one logger fed by the metric vocabulary, fanned out to TensorBoard (always), Weights &
Biases and MLflow (optional extras, `pip install -e '.[trackers]'`).

Every row a run appends to metrics.parquet (study.run.metrics.STEP_METRICS, plus an algorithm's extra loss metrics)
goes to every chosen tracker as it is computed, each metric under its column name, at its `step` (the step-0 row of
the starting policy's evaluation included); a NaN (a metric that does not apply at that step, e.g. the eval columns
between evaluations) is not logged. Which trackers run is a runtime choice, never part of the run id: `--trackers
tensorboard,wandb,mlflow` on `python -m study run|resume` and `python -m study.launch`, else the STUDY_TRACKERS
environment variable (the workflow sets it from the Snakemake config key `trackers`), else TensorBoard alone.

    tensorboard  RUN_DIR/tensorboard/ event files (`tensorboard --logdir results/runs`); TensorBoard stores a
                 scalar as float32, so its values are metrics.parquet's rounded to float32
    wandb        offline by default (RUN_DIR/wandb/offline-run-*; upload with `wandb sync`); WANDB_MODE=online logs
                 live; project WANDB_PROJECT (default moe-rl-study), group = the study, tags = the axis values
    mlflow       MLFLOW_TRACKING_URI when set, else a file store at RESULTS/mlruns; experiment = the study, tags =
                 the axis values (`axis.NAME`)

RUN_DIR/trackers.json holds each tracker's run id and the last step it was sent, so `study resume` continues the
same W&B and MLflow runs, and every tracker ends with one value per metric and step. A resumed run recomputes the steps
after its checkpoint (bit for bit, but for the clock and memory readings wall_s, time_*_s, peak_rss_gb): TensorBoard
hides its earlier copy of them (purge_step) and takes the new one, as metrics.parquet does; W&B and MLflow, whose
histories cannot be rewound, keep the values first sent and are not sent those steps again.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import util
from pathlib import Path
from typing import Any

from runfiles import flatten
from study.run import rundir
from study.run.metrics import STEP_METRICS

TRACKERS = ("tensorboard", "wandb", "mlflow")
ALWAYS = "tensorboard"
ENV = "STUDY_TRACKERS"
STATE_FILE = "trackers.json"
TB_DIR = "tensorboard"
DEFAULT_PROJECT = "moe-rl-study"
_MODULES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


def parse_trackers(text: str | Iterable[str] | None, *, field_name: str = "--trackers") -> tuple[str, ...]:
    """The trackers named by a comma list (None or "": the STUDY_TRACKERS variable, else TensorBoard alone),
    TensorBoard always first. Unknown names and extras that are not installed are errors naming the field."""
    if text is None or text == "":
        text, field_name = os.environ.get(ENV, ""), ENV
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"{field_name} = {text!r}: unknown tracker {name!r}; valid: {', '.join(TRACKERS)}")
    chosen = tuple(dict.fromkeys([ALWAYS, *names]))
    for name in chosen:
        if util.find_spec(_MODULES[name]) is None:
            raise ValueError(
                f"{field_name} = {text!r}: tracker {name!r} needs the {_MODULES[name]} package, which is not "
                "installed; install it with `pip install -e '.[trackers]'` (or drop it from the list)"
            )
    return chosen


@dataclass(frozen=True)
class Tracking:
    """The runtime tracker settings of a run: which trackers, its study (the group) and its axis values (tags)."""

    trackers: tuple[str, ...] = (ALWAYS,)
    study: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"trackers": list(self.trackers), "study": self.study, "tags": dict(self.tags)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Tracking:
        data = dict(data or {})
        return cls(tuple(data.get("trackers") or (ALWAYS,)), str(data.get("study") or ""), dict(data.get("tags") or {}))


def axis_values(config: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The run's values of the config keys that differ among the study's runs (`others`, the run itself may be
    among them), algorithm and seed always included: a sweep's axes, read from its resolved configs."""
    mine = flatten(config)
    flat = [flatten(c) for c in others]
    keys = [k for k in mine if k in ("algorithm", "seed") or any(c.get(k) != mine[k] for c in flat)]
    return {k: _text(mine[k]) for k in keys}


def study_tracking(config_path: str | Path, trackers: tuple[str, ...], study: str | None = None) -> Tracking:
    """Tracking for a resolved config of a study, RESULTS/STUDY/configs/RUN_ID.yaml (what the workflow's run rule
    launches): the study's name from the path (unless given) and the run's axis values from its sibling configs. A
    config anywhere else has no study unless one is given, and its algorithm and seed as tags."""
    import yaml

    from runfiles.bounded import read_yaml

    path = Path(config_path)
    config = read_yaml(path) or {}
    siblings: list[Mapping[str, Any]] = []
    if path.parent.name == "configs":
        study = study or path.parent.parent.name
        for other in sorted(path.parent.glob("*.yaml")):
            try:
                loaded = read_yaml(other)
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(loaded, dict):
                siblings.append(loaded)
    return Tracking(trackers, study or "", axis_values(config, siblings))


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/trackers.json: per tracker its run id and the last step sent, plus the run's study and tags ({} when
    there is none). A damaged one is a rundir.RunStateError naming it and the choice (restore it, or delete it and
    lose what it recorded), never silently replaced."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        return {}
    fix = (
        "restore it, or delete it to go on without it (the trackers then start new runs, and the study and tags "
        "it recorded are lost)"
    )
    state = rundir.read_record(path, fix)
    if not isinstance(state, dict):
        raise rundir.RunStateError(f"{path}: a JSON {type(state).__name__}, not the trackers' record; {fix}")
    return state


def saved_tracking(run_dir: str | Path, trackers: tuple[str, ...] | None) -> Tracking:
    """The tracking a run directory recorded (RUN_DIR/trackers.json: its trackers, study and tags), with `trackers`
    instead of the recorded ones when given; TensorBoard alone for a directory that recorded none. A damaged
    trackers.json raises (`read_state`)."""
    saved = read_state(run_dir)
    names = trackers or tuple(dict.fromkeys([ALWAYS, *(n for n in saved if n in TRACKERS)]))
    return Tracking(names, str(saved.get("study") or ""), dict(saved.get("tags") or {}))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def metric_items(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's metrics as trackers get them: vocabulary order, extras after, `step` left out (it is the x-axis),
    NaN (does not apply at this step) dropped."""
    names = [k for k in STEP_METRICS if k in row] + sorted(k for k in row if k not in STEP_METRICS)
    out = {}
    for name in names:
        if name == "step":
            continue
        try:
            value = float(row[name])
        except (TypeError, ValueError):
            continue
        if not math.isnan(value):
            out[name] = value
    return out


class TensorBoard:
    """tensorboardX event files in RUN_DIR/tensorboard, one scalar (float32) per metric and step."""

    name = "tensorboard"

    def __init__(
        self, run_dir: Path, tracking: Tracking, config: Mapping[str, Any], start_step: int, state: dict[str, Any]
    ) -> None:
        from tensorboardX import SummaryWriter

        # purge_step: events at or after it that an earlier process logged (after the checkpoint it resumes from, or
        # all of them when the run starts again from step 0) are hidden; this process logs those steps again
        directory = run_dir / TB_DIR
        purge = start_step + 1 if start_step else (0 if any(directory.glob("events.out.tfevents.*")) else None)
        self.writer = SummaryWriter(str(directory), purge_step=purge, flush_secs=30)
        if not start_step:
            lines = [f"study: {tracking.study or '-'}", *(f"{k}: {v}" for k, v in tracking.tags.items())]
            self.writer.add_text("run", "  \n".join([f"run_id: {run_dir.name}", *lines]), 0)
        self.state: dict[str, Any] = {"dir": str(run_dir / TB_DIR)}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, state: str) -> None:
        self.writer.close()


class WandB:
    """A W&B run (offline unless WANDB_MODE says otherwise) in RUN_DIR/wandb, resumed by its stored id."""

    name = "wandb"

    def __init__(
        self, run_dir: Path, tracking: Tracking, config: Mapping[str, Any], start_step: int, state: dict[str, Any]
    ) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")
        kwargs: dict[str, Any] = {"id": state["id"], "resume": "allow"} if state.get("id") else {}
        self.run = wandb.init(
            project=state.get("project") or os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            dir=str(run_dir),
            mode=mode,
            group=tracking.study or None,
            name=run_dir.name,
            job_type=str(config.get("algorithm", "")) or None,
            tags=[f"{k}={v}"[:64] for k, v in tracking.tags.items()],
            config={**flatten(config), "study": tracking.study, "run_dir": str(run_dir)},
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", save_code=False, x_disable_stats=True),
            **kwargs,
        )
        self.state = {"id": self.run.id, "project": self.run.project, "mode": mode, "dir": str(run_dir / "wandb")}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def flush(self) -> None:
        pass

    def close(self, state: str) -> None:
        self.run.summary["state"] = state
        self.run.finish(exit_code=0 if state in ("completed", "collapsed") else 1)


class MLflow:
    """An MLflow run in experiment = the study, on MLFLOW_TRACKING_URI or the file store RESULTS/mlruns."""

    name = "mlflow"

    def __init__(
        self, run_dir: Path, tracking: Tracking, config: Mapping[str, Any], start_step: int, state: dict[str, Any]
    ) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = (
            state.get("tracking_uri")
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (run_dir.resolve().parent.parent / "mlruns").as_uri()
        )
        if uri.startswith("file:"):  # MLflow 3.18 refuses its file store (in maintenance, still supported) unasked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = tracking.study or DEFAULT_PROJECT
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                try:
                    exp_id = self.client.create_experiment(experiment)
                except Exception:  # another run of the study created it first
                    exp_id = self.client.get_experiment_by_name(experiment).experiment_id
            else:
                exp_id = found.experiment_id
            tags = {
                "study": tracking.study,
                "run_dir": str(run_dir),
                **{f"axis.{k}": v for k, v in tracking.tags.items()},
            }
            run = self.client.create_run(exp_id, tags=tags, run_name=run_dir.name)
            self.run_id = run.info.run_id
            params = [Param(k, _text(v)[:6000]) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100], tags=[RunTag("run_id", run_dir.name)])
        self.state = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def flush(self) -> None:
        pass

    def close(self, state: str) -> None:
        self.client.set_tag(self.run_id, "state", state)
        status = {"completed": "FINISHED", "collapsed": "FINISHED", "failed": "FAILED"}.get(state, "KILLED")
        self.client.set_terminated(self.run_id, status=status)


_CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class RunLogger:
    """The one logger a run writes to: every metric row to every chosen tracker, under the same names.

    `start_step`: the step the run resumes after (0: fresh). Each tracker's id and last step sent live in
    RUN_DIR/trackers.json, written at `flush` (the run calls it with its metric files) and at `close`."""

    def __init__(self, run_dir: str | Path, tracking: Tracking, config: Mapping[str, Any], start_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        saved = read_state(self.run_dir)  # checked by the preflight: a damaged one stops the run before it writes
        if start_step == 0:
            saved = {}  # a run from step 0 (new, or restarted without a checkpoint) starts its tracker runs afresh
        self.tracking = tracking
        self.last: dict[str, int] = {}
        self.trackers = []
        for name in tracking.trackers:
            prev = saved.get(name) or {}
            self.trackers.append(_CLASSES[name](self.run_dir, tracking, config, start_step, prev))
            self.last[name] = int(prev.get("last_step", -1))
        self.flush()

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        metrics = metric_items(row)
        for tracker in list(self.trackers):
            again = tracker.name == ALWAYS or step > self.last[tracker.name]  # TensorBoard purged them: logs again
            if again and self._call(tracker, "log", step, metrics):
                self.last[tracker.name] = max(self.last[tracker.name], step)

    def flush(self) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "flush")
        state = {t.name: {**t.state, "last_step": self.last[t.name]} for t in self.trackers}
        rundir.write_json(
            self.run_dir / STATE_FILE, {**state, "study": self.tracking.study, "tags": self.tracking.tags}
        )

    def close(self, state: str) -> None:
        self.flush()
        for tracker in list(self.trackers):
            self._call(tracker, "close", state)

    def _call(self, tracker: Any, method: str, *args: Any) -> bool:
        """A tracker that fails mid-run (a full disk, a lost network) is reported once and dropped: the run and its
        metric files, the record analysis reads, go on."""
        try:
            getattr(tracker, method)(*args)
            return True
        except Exception as exc:
            import sys

            print(
                f"warning: tracker {tracker.name} failed ({type(exc).__name__}: {exc}); it logs no more for "
                f"run {self.run_dir.name}; metrics.parquet has every step",
                file=sys.stderr,
            )
            self.trackers.remove(tracker)
            return False
