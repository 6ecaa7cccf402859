"""`python -m study status [RESULTS] [--study NAME] [--watch] [--json]`: what is running, what failed, how far along.

One line per run: id, algorithm, axis values (the config keys that differ between runs of one algorithm, dotted as a
sweep's axes name them), state, step / steps, last reward (reward_mean), last held-out evaluation (eval_in_dist /
eval_hard), elapsed (the run's step seconds, metrics.parquet's wall_s, evaluations excluded), estimated time left (a
running run's seconds per step so far times the steps left) and the reason of a failure, collapse or stop (a running
run: how long ago it last recorded a step, which tells a live run from a killed one); then a line per state. Read from
the run directories' status.json, config.yaml and metrics.parquet (rewritten every 30 s while a run runs), nothing
else.

RESULTS: the results root (default `results`). --study NAME: the study's runs, those of RESULTS/NAME/configs/ (written
before any run starts, so runs not started yet are listed as `pending`) and RESULTS/NAME/run_ids.txt; without it,
every run under RESULTS/runs. Exit status 1 when any run failed, 2 on bad arguments, else 0. --watch redraws every
--interval seconds until no run is running or pending.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runfiles import METRICS, flatten
from runfiles.bounded import load_json, load_yaml
from study.run.rundir import CRASH_FILE, FAILURE_FILE, LOCK_FILE, STATES, lock_held, read_regular

PENDING = "pending"
"""A run the study lists that has no run directory yet."""
UNREADABLE = "unreadable"
"""A run directory without a readable status.json or config.yaml."""
DIED = "died"
"""A run recorded `running` whose lock no process holds any more (killed with SIGKILL, out of memory, a native
crash): resumable with `python -m study resume RUN_DIR`."""
ORDER = (*STATES, DIED, PENDING, UNREADABLE)
NOT_AXES = ("algorithm", "checkpoint_every", "threads")


@dataclass
class RunLine:
    run_id: str
    algorithm: str | None
    state: str
    step: int | None
    steps: int | None
    reward: float | None = None
    eval_in_dist: float | None = None
    eval_hard: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    reason: str | None = None
    updated_ago_s: float | None = None
    axes: dict[str, str] = field(default_factory=dict)
    path: str = ""


def study_run_ids(results: Path, study: str) -> list[str]:
    """The run ids of study `study`: RESULTS/STUDY/configs/*.yaml, then any more in RESULTS/STUDY/run_ids.txt."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", study) or study in ("runs", "coldstart"):
        raise ValueError(f"--study = {study!r}: not a study name; valid: {', '.join(studies(results)) or 'none'}")
    base = results / study
    ids = [p.stem for p in sorted((base / "configs").glob("*.yaml"))] if (base / "configs").is_dir() else []
    listed = base / "run_ids.txt"
    if listed.is_file():
        ids += [ln.strip() for ln in listed.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if not ids:
        raise ValueError(
            f"--study = {study!r}: no {base}/configs/ or run_ids.txt; valid: "
            f"{', '.join(studies(results)) or f'none (no study under {results})'}"
        )
    return list(dict.fromkeys(ids))


def studies(results: Path) -> list[str]:
    """The studies under RESULTS: folders holding configs/ or run_ids.txt."""
    if not results.is_dir():
        return []
    return sorted(
        p.name for p in results.iterdir() if p.is_dir() and ((p / "configs").is_dir() or (p / "run_ids.txt").is_file())
    )


MAX_CONFIG_BYTES = 1 << 20
"""A config.yaml larger than this is reported unreadable instead of parsed."""
MAX_STATUS_BYTES = 1 << 20
"""A status.json larger than this is reported unreadable instead of read (a run's holds a few KB)."""


def _read_yaml(path: Path) -> tuple[dict[str, Any], str | None]:
    """(the YAML mapping at `path`, None), or ({}, why it cannot be read); ({}, None) when there is no file."""
    if not path.exists() and not path.is_symlink():
        return {}, None
    try:
        data = load_yaml(read_regular(path, MAX_CONFIG_BYTES).decode())
    except Exception as exc:  # unreadable, not UTF-8, not YAML, nested past the parser's depth: reported, never raised
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return {}, f"{path.name} unreadable: {type(exc).__name__}: {first}"
    if not isinstance(data, dict):
        return {}, f"{path.name} unreadable: not a mapping of config fields"
    return data, None


def _float(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _last(frame: Any, column: str) -> float | None:
    if frame is None or column not in frame.columns:
        return None
    values = frame[column].dropna()
    return _float(values.iloc[-1]) if len(values) else None


def read_line(run_dir: Path, run_id: str, config: dict[str, Any], now: float) -> RunLine:
    """One run's line from its directory (a pending one when there is none)."""
    steps = config.get("steps")
    line = RunLine(
        run_id, config.get("algorithm"), PENDING, None, steps if isinstance(steps, int) else None, path=str(run_dir)
    )
    if not run_dir.is_dir():
        return line
    held: bool | None = None
    try:
        status, held = _read_status(run_dir)
        line.state = str(status["state"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        status = {}
        line.state, line.reason = UNREADABLE, f"status.json: {type(exc).__name__}: {exc}"
    frame = None
    if (run_dir / METRICS).exists():
        import pandas as pd

        try:
            if not (run_dir / METRICS).is_file():  # a FIFO would block the reader
                raise ValueError("not a regular file")
            frame = pd.read_parquet(run_dir / METRICS)
        except Exception as exc:  # a damaged file is reported on the line, not raised
            line.reason = f"metrics.parquet unreadable: {type(exc).__name__}: {exc}"
    line.step = status.get("step") if isinstance(status.get("step"), int) else None
    if frame is not None and "step" in frame.columns and len(frame):
        line.step = max(line.step or 0, int(frame["step"].max()))
    if line.state == "completed" and line.steps is not None:
        line.step = line.steps
    line.reward = _last(frame, "reward_mean")
    line.eval_in_dist, line.eval_hard = _last(frame, "eval_in_dist"), _last(frame, "eval_hard")
    line.elapsed_s = _last(frame, "wall_s")
    rl_steps = 0 if frame is None or "step" not in frame.columns else int((frame["step"] >= 1).sum())
    if line.state == "running" and line.elapsed_s and rl_steps and line.steps is not None and line.step is not None:
        line.eta_s = line.elapsed_s / rl_steps * max(line.steps - line.step, 0)
    if line.state in ("failed", "collapsed", "stopped"):
        why = status.get("reason") or status.get("error") or ""
        line.reason = str(why).strip().splitlines()[-1] if str(why).strip() else line.reason
    elif line.state == "running" and held is False:  # the kernel released its lock: the process is gone
        line.state = DIED
        crashed = (run_dir / CRASH_FILE).is_file() and (run_dir / CRASH_FILE).stat().st_size > 0
        how = f"a native crash, its stack in {CRASH_FILE}" if crashed else "killed, e.g. kill -9 or out of memory"
        line.reason = (
            f"its process ended without recording an exit ({how}); resumable: python -m study resume {run_dir}"
        )
    elif line.state == "running" and status.get("starting"):
        line.reason = "starting: its lock is taken, status.json not yet written"
    elif line.state == "running" and isinstance(status.get("time"), int | float):
        line.updated_ago_s = max(now - float(status["time"]), 0.0)
        line.reason = line.reason or f"last step recorded {_duration(line.updated_ago_s)} ago"
    return line


def _read_status(run_dir: Path) -> tuple[dict[str, Any], bool | None]:
    """(status.json, whether a live process holds the run's lock), the lock read first: a run records its exit before
    it releases its lock, so a `running` read after a released lock is a run that died. failure.json is read where a
    workflow deleted a failed job's status.json; either is read as a regular file of at most MAX_STATUS_BYTES without
    blocking (rundir.read_regular). A run makes its directory, takes its lock, then writes status.json (atomically,
    never seen half-written): one without status.json whose lock is held is starting (`running`), and one whose lock
    file is not held after a few tries was killed before it wrote status.json."""
    path = run_dir / "status.json"
    if not path.exists() and (run_dir / FAILURE_FILE).is_file():  # Snakemake deleted a failed job's output
        path = run_dir / FAILURE_FILE
    for attempt in range(3):
        held = lock_held(run_dir)
        try:
            status = load_json(read_regular(path, MAX_STATUS_BYTES))
        except FileNotFoundError:
            if held is not False or (attempt == 2 and (run_dir / LOCK_FILE).exists()):
                return {"state": "running", "step": 0, "starting": True}, held
            if attempt == 2:
                raise
            time.sleep(0.1)  # a lock being taken, or status.json being written
            continue
        if not isinstance(status, dict):
            raise TypeError(f"a JSON {type(status).__name__}, not an object")
        return status, held
    raise AssertionError("unreachable")


def collect(results: str | Path, study: str | None = None) -> list[RunLine]:
    """Every run of the study (or under RESULTS/runs), in the study's order (else by id), with axis values."""
    results = Path(results)
    runs = results / "runs"
    if study:
        ids = study_run_ids(results, study)
    else:
        if not results.is_dir():
            raise ValueError(f"RESULTS = {str(results)!r}: no such directory")
        ids = (
            sorted(p.name for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")) if runs.is_dir() else []
        )
    configs, unreadable = {}, {}
    for run_id in ids:
        config, why = _read_yaml(runs / run_id / "config.yaml")
        if not config and study:
            config, why2 = _read_yaml(results / study / "configs" / f"{run_id}.yaml")
            why = why or why2
        configs[run_id] = config
        if why:
            unreadable[run_id] = why
    flat = {run_id: flatten(c) for run_id, c in configs.items()}
    axes = study_axes(list(flat.values()))
    now = time.time()
    lines = []
    for run_id in ids:
        line = read_line(runs / run_id, run_id, configs[run_id], now)
        if run_id in unreadable:
            line.state, line.reason = UNREADABLE, unreadable[run_id]
        line.axes = {k: _text(flat[run_id].get(k)) for k in axes}
        lines.append(line)
    return lines


def study_axes(configs: Sequence[dict[str, Any]]) -> list[str]:
    """The dotted config keys (as a sweep's axes name them: `seed`, `hparams.eps_low`) whose values differ between two
    runs of the same algorithm. A key that differs only between algorithms (a sweep's `per_algorithm` or tuned values)
    belongs to the algorithm column; an empty mapping counts as absent; `NOT_AXES` never count."""
    by_algorithm: dict[Any, list[dict[str, Any]]] = {}
    for config in configs:
        if config:
            by_algorithm.setdefault(config.get("algorithm"), []).append(config)
    keys = sorted({k for c in configs for k in c if k.split(".")[0] not in NOT_AXES})

    def value(config: dict[str, Any], key: str) -> str:
        v = config.get(key)
        return json.dumps(None if v == {} else v, sort_keys=True, default=str)

    return [k for k in keys if any(len({value(c, k) for c in group}) > 1 for group in by_algorithm.values())]


def summary(lines: Sequence[RunLine]) -> dict[str, int]:
    counts = Counter(line.state for line in lines)
    return {state: counts[state] for state in [*ORDER, *sorted(set(counts) - set(ORDER))] if counts[state]}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(lines: Sequence[RunLine]) -> str:
    """The lines as aligned text, then a line per state."""
    header = ("run", "algorithm", "axes", "state", "step", "reward", "eval in/hard", "elapsed", "left", "reason")
    rows = [header]
    for ln in lines:
        step = f"{'-' if ln.step is None else ln.step}/{'-' if ln.steps is None else ln.steps}"
        evals = f"{_num(ln.eval_in_dist)}/{_num(ln.eval_hard)}"
        axes = " ".join(f"{k}={v}" for k, v in ln.axes.items()) or "-"
        rows.append(
            (
                ln.run_id,
                ln.algorithm or "-",
                axes,
                ln.state,
                step,
                _num(ln.reward),
                evals,
                _duration(ln.elapsed_s),
                _duration(ln.eta_s),
                ln.reason or "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    out = ["  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip() for r in rows]
    counts = summary(lines)
    out += [f"{state}: {n}" for state, n in counts.items()] or ["no runs"]
    return "\n".join(out)


def exit_code(lines: Sequence[RunLine]) -> int:
    return 1 if any(line.state == "failed" for line in lines) else 0


def watch(results: Path, study: str | None, *, interval: float, as_json: bool, rounds: int | None = None) -> int:
    """Redraw every `interval` s until no run is running or pending (or after `rounds` redraws); the last exit code."""
    done = 0
    while True:
        lines = collect(results, study)
        if as_json:
            print(json.dumps(document(lines)), flush=True)
        else:
            clear = "\033[2J\033[H" if sys.stdout.isatty() else ""
            print(f"{clear}{time.strftime('%H:%M:%S')}  {results}{f' --study {study}' if study else ''}")
            print(table(lines), flush=True)
        done += 1
        if not any(ln.state in ("running", PENDING) for ln in lines) or (rounds is not None and done >= rounds):
            return exit_code(lines)
        time.sleep(interval)


def document(lines: Sequence[RunLine]) -> dict[str, Any]:
    return {"runs": [asdict(line) for line in lines], "summary": summary(lines)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m study status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="?", default="results", help="results root (default: results)")
    parser.add_argument("--study", default=None, help="a study's runs (RESULTS/NAME/configs, run_ids.txt)")
    parser.add_argument("--watch", action="store_true", help="redraw until no run is running or pending")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between redraws with --watch")
    parser.add_argument("--json", action="store_true", help="one JSON document (per redraw) for scripts")
    args = parser.parse_args(argv)
    results = Path(args.results)
    try:
        if not (math.isfinite(args.interval) and args.interval > 0):  # nan > 0 is false, and so is nan <= 0
            raise ValueError(f"--interval = {args.interval}: valid: a finite number of seconds > 0")
        if args.watch:
            return watch(results, args.study, interval=args.interval, as_json=args.json)
        lines = collect(results, args.study)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(document(lines), indent=1) if args.json else table(lines))
    return exit_code(lines)
