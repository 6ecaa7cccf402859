"""One run directory read from disk (`read_run` -> `RunRecord`, metrics untouched), the fields of a run the
per-run table holds (its algorithm, collapse step and reason, error, steps), and the token samples read with a
bounded, seeded subset (`read_token_samples`). The files are runfiles' contract; analysis.runs.tidy stacks the records
into a study's tables."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.runs import vocab
from analysis.runs.columns import CONFIG_FILES, EMULATED, MAX_TOKEN_ROWS, START_STEP, STEP, TOKEN_COLUMNS, UNKNOWN_STATE
from runfiles import FAILURE, LAYERS, MANIFEST, METRICS, STATES, STATUS, TOKEN_SAMPLES, flatten
from runfiles.bounded import read_json, read_yaml


@dataclass
class RunRecord:
    """One run directory as read from disk (metrics untouched)."""

    run_id: str
    path: Path
    config: dict[str, Any]
    """Resolved config, flattened to dotted keys."""
    manifest: dict[str, Any]
    status: dict[str, Any]
    metrics: pa.Table | None
    layers: pa.Table | None
    read_errors: list[str] = field(default_factory=list)
    """Files of the contract that could not be read (reported in the runs table's `error`)."""
    tokens: dict[str, np.ndarray] | None = None
    """token_samples.parquet's columns, subsampled to at most MAX_TOKEN_ROWS rows (None: no file)."""
    sequences: dict[str, np.ndarray] | None = None
    """Per-sequence step, sample, n_tokens and seq_log_ratio from every token row (None: no file)."""

    @property
    def state(self) -> str:
        state = self.status.get("state")
        return state if state in STATES else UNKNOWN_STATE

    @property
    def algorithm(self) -> str | None:
        return _algorithm_of(self.config)

    @property
    def seed(self) -> int | None:
        value = self.seed_value
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def seed_value(self) -> Any:
        """The seed as recorded (config `seed`, `run.seed`, `train.seed` or a lone `*.seed`, else the manifest's),
        which `unreadable_reason` requires to be an integer."""
        for key in ("seed", "run.seed", "train.seed"):
            if key in self.config:
                return self.config[key]
        seeds = [v for k, v in self.config.items() if k.endswith(".seed")]
        if len(seeds) == 1:
            return seeds[0]
        return self.manifest.get("seed")

    @property
    def content(self) -> str:
        """A hash of what makes the run the run it is, whatever its directory or manifest.json calls it: its seed,
        its resolved config, its status and its metrics (every column's values). Two directories with the same
        content are one run under two names (a copy), which a study counts once (analysis.runs.tidy.load_study)."""
        recorded = [self.seed_value, self.config, self.status]
        digest = hashlib.sha256(json.dumps(recorded, sort_keys=True, default=str).encode())
        for name in sorted(self.metrics.column_names) if self.metrics is not None else ():
            column = self.metrics.column(name)
            numeric = (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)) and not column.null_count
            digest.update(f"{name}:{column.type}".encode())
            digest.update(column.to_numpy().tobytes() if numeric else repr(column.to_pylist()).encode())
        return digest.hexdigest()

    @property
    def precision_emulated(self) -> bool | None:
        """The manifest's precision_emulated, else whether a *_precision config value ends in "-emulated"."""
        value = self.manifest.get(EMULATED)
        if isinstance(value, bool):
            return value
        labels = [v for k, v in self.config.items() if k.endswith("_precision") and isinstance(v, str) and v]
        return any(v.endswith("-emulated") for v in labels) if labels else None


# --- reading ----------------------------------------------------------------------------------------------------------
def _regular(path: Path) -> Path:
    """`path`, when it is a regular file or absent (FileNotFoundError follows when it is read); ValueError when it is
    a FIFO, a directory or a device, which a table reader would block on or fail on obscurely."""
    if os.path.lexists(path) and not Path(path).is_file():
        raise ValueError("not a regular file")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _read_config(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    for name in CONFIG_FILES:
        path = run_dir / name
        if not path.exists():
            continue
        try:
            data = _read_json(path) if path.suffix == ".json" else read_yaml(path) or {}
            return flatten(data), None
        except Exception as exc:  # reported per run, never fatal for the study
            return {}, f"{name}: {exc}"
    return {}, f"no resolved config (looked for {', '.join(CONFIG_FILES)})"


def read_token_samples(
    path: str | os.PathLike[str], *, max_rows: int = MAX_TOKEN_ROWS, seed: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """token_samples.parquet -> (token columns subsampled to `max_rows` rows, per-sequence table from every row).

    The subset is a seeded uniform random choice of rows, kept in file order. The per-sequence table has one row per
    (step, sample): n_tokens and seq_log_ratio = mean over its tokens of trainer_logp - engine_logp (float64).
    Raises ValueError when a column is missing.
    """
    t = pq.read_table(path)
    absent = [c for c in TOKEN_COLUMNS if c not in t.column_names]
    if absent:
        raise ValueError(f"missing column(s) {', '.join(absent)}; present: {', '.join(t.column_names)}")
    step = t.column("step").to_numpy().astype(np.int64)
    sample = t.column("sample").to_numpy().astype(np.int64)
    trainer = t.column(vocab.TRAINER_LOGP).cast(pa.float32()).to_numpy(zero_copy_only=False)
    engine = t.column(vocab.ENGINE_LOGP).cast(pa.float32()).to_numpy(zero_copy_only=False)
    # sequences: group rows by (step, sample) with one stable sort (files are written grouped, but do not rely on it)
    diff = trainer.astype(np.float64) - engine.astype(np.float64)
    order = np.lexsort((sample, step))
    key_s, key_i = step[order], sample[order]
    start = np.flatnonzero(np.r_[True, (np.diff(key_s) != 0) | (np.diff(key_i) != 0)]) if len(order) else order
    n_tok = np.diff(np.r_[start, len(order)])
    sums = np.add.reduceat(diff[order], start) if len(order) else np.zeros(0)
    sequences = {
        "step": key_s[start],
        "sample": key_i[start],
        "n_tokens": n_tok.astype(np.int64),
        "seq_log_ratio": sums / np.maximum(n_tok, 1),
    }
    n, keep = t.num_rows, slice(None)
    if n > max_rows:
        keep = np.sort(np.random.default_rng(seed).choice(n, size=max_rows, replace=False))
    pos = t.column("pos").to_numpy().astype(np.int64)
    tokens = {
        "step": step[keep].astype(np.int32),
        "sample": sample[keep].astype(np.int32),
        "pos": pos[keep].astype(np.int32),
        vocab.TRAINER_LOGP: trainer[keep],
        vocab.ENGINE_LOGP: engine[keep],
    }
    return tokens, sequences


def read_run(run_dir: str | os.PathLike[str], *, max_token_rows: int = MAX_TOKEN_ROWS) -> RunRecord:
    """Read one run directory. Unreadable files are recorded in `read_errors`, never raised."""
    path = Path(run_dir)
    errors: list[str] = []
    config, err = _read_config(path)
    if err:
        errors.append(err)
    docs: dict[str, dict[str, Any]] = {}
    for name in (STATUS, MANIFEST):
        try:
            docs[name] = _read_json(path / name)
        except FileNotFoundError:
            docs[name] = {}
            if name == STATUS and (path / FAILURE).is_file():  # a workflow deleted a failed job's output
                try:
                    docs[name] = _read_json(path / FAILURE)
                    continue
                except Exception as exc:
                    errors.append(f"{FAILURE}: {exc}")
            errors.append(f"{name}: missing")
        except Exception as exc:
            docs[name] = {}
            errors.append(f"{name}: {exc}")
    tables: dict[str, pa.Table | None] = {}
    for name in (METRICS, LAYERS):
        try:
            tables[name] = pq.read_table(_regular(path / name))
        except FileNotFoundError:
            tables[name] = None
            if name == METRICS:
                errors.append(f"{name}: missing")
        except Exception as exc:
            tables[name] = None
            errors.append(f"{name}: {exc}")
    metrics = tables[METRICS]
    if metrics is not None and STEP not in metrics.column_names:
        errors.append(f"{METRICS}: no '{STEP}' column")
        metrics = None
    tokens = sequences = None
    if (path / TOKEN_SAMPLES).exists():  # optional
        try:
            seed = zlib.crc32(path.name.encode())  # the same subset on every load
            tokens, sequences = read_token_samples(_regular(path / TOKEN_SAMPLES), max_rows=max_token_rows, seed=seed)
        except Exception as exc:
            errors.append(f"{TOKEN_SAMPLES}: {exc}")
    return RunRecord(
        run_id=path.name,
        path=path,
        config=config,
        manifest=docs[MANIFEST],
        status=docs[STATUS],
        metrics=metrics,
        layers=tables[LAYERS],
        read_errors=errors,
        tokens=tokens,
        sequences=sequences,
    )


# --- per-run fields ---------------------------------------------------------------------------------------------------
def _algorithm_of(config: Mapping[str, Any]) -> str | None:
    for key in ("algorithm", "algorithm.name", "alg", "run.algorithm"):
        value = config.get(key)
        if isinstance(value, str):
            return value
    found = [v for k, v in config.items() if k.endswith(".algorithm") and isinstance(v, str)]
    return found[0] if len(found) == 1 else None


def collapse_step(r: RunRecord) -> int | None:
    if r.state != "collapsed":
        return None
    for key in ("collapse_step", "step", "at_step"):
        if key in r.status:
            return _as_int(r.status[key])
    return None


def collapse_reason(r: RunRecord) -> str | None:
    if r.state != "collapsed":
        return None
    for key in ("reason", "collapse_reason", "message"):
        if r.status.get(key) is not None:
            return str(r.status[key])
    return None


def error_of(r: RunRecord) -> str | None:
    parts = []
    if r.state == "failed":
        err = r.status.get("error", r.status.get("message"))
        if isinstance(err, Mapping):
            err = ": ".join(str(err[k]) for k in ("type", "message") if k in err) or json.dumps(err)
        parts.append(str(err) if err is not None else "failed (no error recorded)")
    no_metrics_yet = r.state in ("failed", "running")  # no metrics file is expected there, not an error
    parts.extend(e for e in r.read_errors if not (no_metrics_yet and e == f"{METRICS}: missing"))
    return "; ".join(parts) if parts else None


def rl_steps(t: pa.Table | None) -> int:
    """Rows of RL steps (step >= 1): the step-0 evaluation row is not a step."""
    if t is None:
        return 0
    return int((t.column(STEP).to_numpy(zero_copy_only=False) > START_STEP).sum())


def has_start(t: pa.Table | None) -> bool:
    """Whether metrics.parquet has the step-0 row (the starting policy's evaluation)."""
    return t is not None and bool((t.column(STEP).to_numpy(zero_copy_only=False) == START_STEP).any())


def last(t: pa.Table | None, col: str) -> Any:
    if t is None or t.num_rows == 0 or col not in t.column_names:
        return None
    value = t.column(col)[-1].as_py()
    return value


def _as_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (list, dict, tuple)) else value


def axis_value(value: Any) -> Any:
    """Scalars as they are; lists/dicts as canonical JSON strings (so they group)."""
    return hashable(value)
