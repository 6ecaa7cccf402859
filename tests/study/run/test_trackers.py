"""Live trackers (study/run/trackers.py): a tiny run stopped after a step past its checkpoint and resumed logs every
metric of metrics.parquet, under its column name, at its step, once, to TensorBoard (its event files read back here),
the W&B offline run and the MLflow file store, and the resumed process continues the same W&B and MLflow runs. W&B and
MLflow cannot rewind, so they keep the recomputed step as first sent: equal but for the clock readings."""

from __future__ import annotations

import glob
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from study import rl
from study.run import rundir
from study.run import trackers as T
from study.run.config import load_config
from tests.shared import require

SETS = ["coldstart=scratch", "steps=4", "eval_every=3", "checkpoint_every=2"]


class Stop(rundir.Stopped):
    """What a pruner raises (sweeps.tune.Pruned is a rundir.Stopped): the run stops, resumable."""


def tfrecords(path: str):
    """The records of a TFRecord file (length, crc, data, crc)."""
    data = Path(path).read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value as TensorBoard shows them: event files in order, a session START at step s hiding the
    values at steps >= s read before it (purge_step)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(str(directory / "events.out.tfevents.*"))):
        for record in tfrecords(path):
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = {tag: {s: v for s, v in series.items() if s < event.step} for tag, series in out.items()}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    series = out.setdefault(value.tag, {})
                    assert event.step not in series, f"{value.tag} logged twice at step {event.step}"
                    series[event.step] = value.simple_value
    return out


def wandb_records(path: str):
    """The protobuf records of a W&B offline run file (LevelDB log format: 32 KiB blocks of crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


STOP = 3  # the step the first process stops after; its checkpoint is at step 2
TIMINGS = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")
"""The columns a recomputed step does not repeat bit for bit (clock and memory readings)."""


def expected(path: Path) -> dict[str, dict[int, float]]:
    """A metrics.parquet as trackers should hold it: every metric but step, its non-NaN values by step."""
    frame = pd.read_parquet(path)
    return {
        c: {int(s): float(v) for s, v in zip(frame["step"], frame[c], strict=True) if not np.isnan(v)}
        for c in frame.columns
        if c != "step"
    }


def sent_once(run_dir: Path) -> dict[str, dict[int, float]]:
    """What a tracker that cannot rewind (W&B, MLflow) holds: each step as first sent. Steps up to STOP come from the
    first process (its metrics.parquet, kept by the fixture), later ones from the resumed process."""
    first, final = expected(run_dir / "first.parquet"), expected(run_dir / "metrics.parquet")
    out = {k: {**{s: v for s, v in final[k].items() if s > STOP}, **first.get(k, {})} for k in final}
    return {k: v for k, v in out.items() if v}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run with all three trackers, stopped at step 3 (its checkpoint is at step 2) and resumed."""
    require("trackers")
    results = tmp_path_factory.mktemp("trackers")
    cfg = load_config(preset="tiny", sets=SETS)
    tracking = T.Tracking(T.parse_trackers("wandb,mlflow"), "demo", {"algorithm": "grpo", "seed": "0"})

    def stop(step: int, row: dict) -> None:
        if step == STOP:
            raise Stop

    with pytest.raises(Stop):
        rl.run(cfg, results, progress=False, on_eval=stop, tracking=tracking)
    run_dir = results / "runs" / cfg.run_id
    assert T.read_state(run_dir)["wandb"]["last_step"] == STOP
    (run_dir / "first.parquet").write_bytes((run_dir / "metrics.parquet").read_bytes())
    rl.resume(run_dir, progress=False)  # the trackers and study recorded in trackers.json
    assert yaml.safe_load((run_dir / "status.json").read_text())["state"] == "completed"
    return run_dir


def test_the_resumed_steps_repeat_the_first_attempts_metrics(resumed: Path) -> None:
    first, final = expected(resumed / "first.parquet"), expected(resumed / "metrics.parquet")
    assert max(first["reward_mean"]) == STOP and max(final["reward_mean"]) == 4
    for name, series in first.items():
        if name not in TIMINGS:
            assert series == {s: v for s, v in final[name].items() if s <= STOP}, name


def test_tensorboard_holds_every_metric_of_the_parquet(resumed: Path) -> None:
    want = expected(resumed / "metrics.parquet")
    got = tensorboard_scalars(resumed / T.TB_DIR)
    assert set(got) == {k for k, v in want.items() if v}  # every logged metric, under its own name
    assert {"reward_mean", "eval_in_dist", "clip_frac", "loss", "wall_s"} <= set(got)
    for name, series in want.items():  # TensorBoard stores float32
        assert got.get(name, {}) == {s: float(np.float32(v)) for s, v in series.items()}, name
    assert sorted(got["eval_in_dist"]) == [0, 3, 4] and sorted(got["reward_mean"]) == [1, 2, 3, 4]


def test_wandb_offline_run_is_one_run_continued(resumed: Path) -> None:
    files = sorted(glob.glob(str(resumed / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2  # the first process and the resumed one
    ids, got, runs = set(), {}, []
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run)
                ids.add(record.run.run_id)
            elif kind == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        series = got.setdefault(key, {})
                        assert step not in series, f"{key} sent twice at step {step}"
                        series[step] = float(item.value_json)
    assert ids == {T.read_state(resumed)["wandb"]["id"]}
    assert runs[0].run_group == "demo" and set(runs[0].tags) == {"algorithm=grpo", "seed=0"}
    assert runs[-1].resume  # the second process resumed the run, it did not start another
    assert got == sent_once(resumed)  # W&B keeps doubles: equal to the parquet's values


def test_mlflow_file_store_holds_one_run_equal_to_the_parquet(resumed: Path) -> None:
    from mlflow.tracking import MlflowClient

    state = T.read_state(resumed)["mlflow"]
    assert state["tracking_uri"] == (resumed.parent.parent / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    experiment = client.get_experiment_by_name("demo")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [state["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["axis.algorithm"] == "grpo"
    assert run.data.tags["state"] == "completed" and run.data.params["steps"] == "4"
    want = sent_once(resumed)
    assert set(run.data.metrics) == set(want)
    for name, series in want.items():
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == sorted(series.items()), name


def test_tracker_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert T.parse_trackers("") == ("tensorboard",)
    monkeypatch.setenv(T.ENV, "mlflow")
    assert T.parse_trackers(None) == ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match=r"--trackers = 'tensorbord'.*valid: tensorboard, wandb, mlflow"):
        T.parse_trackers("tensorbord")
    monkeypatch.setattr(T.util, "find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ValueError, match=r"needs the wandb package.*\.\[trackers\]"):
        T.parse_trackers("wandb")


def test_a_study_config_gives_the_study_and_axis_values(tmp_path: Path) -> None:
    configs = tmp_path / "results" / "routing" / "configs"
    configs.mkdir(parents=True)
    base = {"algorithm": "grpo", "seed": 0, "lr": 1e-3, "model": {"preset": "tiny", "num_experts": 4}}
    for i, (alg, experts) in enumerate([("grpo", 4), ("gspo", 4), ("grpo", 8)]):
        data = {**base, "algorithm": alg, "model": {"preset": "tiny", "num_experts": experts}}
        (configs / f"run{i}.yaml").write_text(yaml.safe_dump(data))
    tracking = T.study_tracking(configs / "run2.yaml", ("tensorboard",))
    assert tracking.study == "routing"
    assert tracking.tags == {"algorithm": "grpo", "seed": "0", "model.num_experts": "8"}
    elsewhere = tmp_path / "one.yaml"
    elsewhere.write_text(yaml.safe_dump(base))
    assert T.study_tracking(elsewhere, ("tensorboard",)) == T.Tracking(
        ("tensorboard",), "", {"algorithm": "grpo", "seed": "0"}
    )
