"""Load a study's run directories into one tidy table (and a per-run table), written as parquet.

The run-directory contract is what this module reads, `results/runs/{run_id}/`:

- a resolved config (`config.yaml` / `config.yml` / `config.json`, or `resolved_config.*`): nested keys are flattened
  to dotted names (`model.num_layers`); the algorithm is `algorithm` (or `algorithm.name`), the seed `seed` (or any
  `*.seed`, else the manifest's `seed`);
- `manifest.json` (git sha, package versions, seed, host, ...): kept per run for the report's provenance;
- `status.json` with `state` in running / completed / collapsed / failed / stopped, plus the collapse step and
  reason or the error (field names read leniently: `collapse_step`/`step`, `reason`/`collapse_reason`,
  `error`/`message`); without it, `failure.json` (the record of a failed run whose status.json a workflow deleted:
  Snakemake removes a failed job's declared outputs);
- `metrics.parquet`, one row per step, with at least `step`, `compute_flops`, `wall_s` and any number of numeric
  metric columns (`reward_mean`, `clip_frac`, ...); runs that evaluate (eval_every > 0) start with a row at step 0
  (START_STEP) holding only the starting policy's evaluation (eval metrics, lr; compute_flops = wall_s = 0, every
  other metric NaN, so it adds rows to the long table for those metrics only); runs without one have none;
- optionally `routing_layers.parquet` (per-layer routing table: `step`, `layer` and numeric metric columns);
- optionally `token_samples.parquet` (one row per response token of a subset of rollouts: `step`, `sample`, `pos`,
  `trainer_logp` (the training engine's pi_old recompute), `engine_logp` (the rollout engine's log-prob)); runs
  written before the loop logged it have none, which is not an error.

Tables (pandas; `Study.write` stores each as parquet):

- `long`: run_id, algorithm, <every swept axis>, seed, step, compute_flops, wall_s, metric, value. One row per
  (run, step, metric) that was logged: a metric not logged at a step (evals every N steps) has no row; inf is kept.
  String-like columns are categorical so that 1,000 runs x 1,000 steps x 30 metrics stays in memory and is fast.
- `runs`: one row per run directory found: run_id, algorithm, <axes>, seed, state, collapse_step, collapse_reason,
  error, n_steps (RL steps logged: rows at step >= 1), start_eval (whether the run has the step-0 row), last_step,
  last_compute, path. Failed and collapsed runs are kept and labelled, never dropped.
- `layers`: the per-layer routing tables in long form (run_id, algorithm, <axes>, seed, step, layer, metric, value).
- `tokens`: token samples (run_id, algorithm, <axes>, seed, <precision keys>, precision_emulated, step, sample, pos,
  trainer_logp, engine_logp), at most min(`max_token_rows`, `token_budget` / runs) rows per run (a seeded random
  subset of the run's rows when it has more; float32 log-probs, int32 indices): what Figure 4b scatters.
- `sequences`: one row per sampled sequence, computed from *every* token row before any subsampling (run_id, ...,
  step, sample, n_tokens, seq_log_ratio = mean over the sequence's tokens of trainer_logp - engine_logp, i.e. the log
  of the GSPO length-normalised sequence ratio (pi_trainer(y|x) / pi_engine(y|x))^(1/|y|)).
- `missing`: the run ids a study asked for that have no directory (also warned about: nothing is dropped silently).
- `unreadable`: with `load_study(unreadable=...)`, the runs set aside because they cannot be read (run_id,
  algorithm, seed, state, reason, path; `unreadable_reason` says what that means), in none of the tables above;
  and, always, a run that repeats another's seed, config, status and metrics under a second name (counted once,
  the reason naming the run kept).

`runs.precision_emulated` says whether a run's low precision was emulated (the manifest's `precision_emulated`, else
a `*_precision` config value ending in "-emulated"; None when the run says nothing).

Swept axes are the flattened config keys whose value differs between the loaded runs (seed and algorithm excluded,
and bookkeeping keys such as paths); pass `axes=` to name them instead.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from analysis.runs.columns import (
    ALGORITHM,
    COMPUTE,
    CONFIG_FILES,
    EMULATED,
    LAYER,
    MAX_TOKEN_ROWS,
    METRIC,
    NON_AXIS_KEYS,
    OUTPUT_FILES,
    PRECISION_KEYS,
    RUN_ID,
    RUNS_SUBDIR,
    SEED,
    STEP,
    TOKEN_BUDGET,
    UNKNOWN_STATE,
    UNREADABLE_COLUMNS,
    VALUE,
    WALL,
)
from analysis.runs.rundir import (
    RunRecord,
    axis_value,
    collapse_reason,
    collapse_step,
    error_of,
    has_start,
    hashable,
    last,
    read_run,
    rl_steps,
)
from runfiles import FAILURE, MANIFEST, METRICS, STATES, STATUS
from runfiles import atomic as files
from runfiles.bounded import read_json


@dataclass
class Study:
    """A loaded study: the tidy tables, the swept axes and the runs that are missing."""

    long: pd.DataFrame
    runs: pd.DataFrame
    layers: pd.DataFrame
    axes: list[str]
    missing: list[str]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """run_id -> flattened resolved config."""
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    """run_id -> manifest (provenance for the report)."""
    tokens: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Token samples (trainer vs engine log-prob), subsampled per run; empty when no run wrote token_samples."""
    sequences: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Per-sequence mean log-ratio trainer - engine of every sampled sequence; empty when no run wrote any."""
    unreadable: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=UNREADABLE_COLUMNS))
    """The runs set aside because they cannot be read (UNREADABLE_COLUMNS), in none of the other tables."""

    @property
    def metrics(self) -> list[str]:
        """Metric names with at least one logged value in the long table (a column NaN at every step, as the eval
        columns of runs that never evaluate, is not logged)."""
        col = self.long[METRIC]
        present = np.unique(col.cat.codes.to_numpy())
        return [str(col.cat.categories[i]) for i in present if i >= 0]

    @property
    def group_cols(self) -> list[str]:
        """What identifies a configuration (every seed of it is one group): algorithm and the swept axes."""
        return [ALGORITHM, *self.axes]

    def metric(self, name: str) -> pd.DataFrame:
        """Rows of one metric (raises listing the valid names when absent)."""
        if name not in self.long[METRIC].cat.categories:
            raise KeyError(f"metric {name!r} not in this study; present: {', '.join(self.metrics)}")
        code = self.long[METRIC].cat.categories.get_loc(name)
        return self.long[self.long[METRIC].cat.codes.to_numpy() == code]

    def write(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """Write long/runs/layers/tokens/sequences as parquet and the missing ids as JSON (atomically)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {}
        for key in ("long", "runs", "layers", "tokens", "sequences"):
            paths[key] = files.write_parquet(out / OUTPUT_FILES[key], getattr(self, key))
        meta = {"missing": self.missing, "axes": self.axes, "unreadable": self.unreadable.to_dict(orient="records")}
        paths["missing"] = files.write_text(out / OUTPUT_FILES["missing"], json.dumps(meta, indent=2))
        return paths


def read_study(out_dir: str | os.PathLike[str]) -> Study:
    """Read back what `Study.write` wrote (configs/manifests are not stored there: reload runs for those)."""
    out = Path(out_dir)
    meta = read_json(out / OUTPUT_FILES["missing"])
    tables = {
        key: pd.read_parquet(out / OUTPUT_FILES[key]) for key in ("long", "runs", "layers", "tokens", "sequences")
    }
    return Study(
        **tables,
        axes=list(meta["axes"]),
        missing=list(meta["missing"]),
        unreadable=pd.DataFrame(meta["unreadable"], columns=UNREADABLE_COLUMNS),
    )


def runs_dir(results_dir: str | os.PathLike[str]) -> Path:
    """`results_dir/runs` when it exists (the contract), else `results_dir` itself."""
    root = Path(results_dir)
    return root / RUNS_SUBDIR if (root / RUNS_SUBDIR).is_dir() else root


def load_study(
    results_dir: str | os.PathLike[str],
    run_ids: Iterable[str] | None = None,
    *,
    axes: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    workers: int | None = None,
    warn_missing: bool = True,
    max_token_rows: int = MAX_TOKEN_ROWS,
    token_budget: int = TOKEN_BUDGET,
    unreadable: Callable[[RunRecord], str | None] | None = None,
) -> Study:
    """Load every run under `results_dir` (or just `run_ids`, reporting those without a directory as missing).

    `axes` names the swept config keys (dotted); by default they are inferred as the keys that differ between runs.
    `metrics` restricts the long table to those metric columns (default: every numeric column).
    `max_token_rows` bounds the token samples kept per run, and `token_budget` those of the whole study (the per-run
    cap becomes min(max_token_rows, token_budget // runs)); Study.sequences always uses every token row.
    `unreadable(record)`, when given, says why a run cannot be read (e.g. `unreadable_reason`) or None: such runs are
    set aside in `Study.unreadable` with the reason, in none of the other tables; without it every run is read. A run
    with the seed, config, status and metrics of another (RunRecord.content: a copy under a second name, whatever its
    manifest.json says) is set aside the same way, its reason naming the run it repeats, so it counts once.
    """
    base = runs_dir(results_dir)
    if run_ids is None:
        wanted = (
            sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.is_dir() else []
        )
        missing: list[str] = []
    else:
        wanted, missing = [], []
        for rid in dict.fromkeys(run_ids):  # keep order, drop duplicates
            (wanted if (base / rid).is_dir() else missing).append(rid)
    if missing and warn_missing:
        warnings.warn(
            f"{len(missing)} run(s) of the study have no directory under {base}: {', '.join(missing)}", stacklevel=2
        )
    n_workers = workers or min(8, (os.cpu_count() or 1) * 2)
    per_run = min(max_token_rows, token_budget // max(1, len(wanted)))

    def read(rid: str) -> RunRecord:
        return read_run(base / rid, max_token_rows=per_run)

    if n_workers > 1 and len(wanted) > 8:
        with ThreadPoolExecutor(n_workers) as pool:  # parquet/JSON reads release the GIL
            records = list(pool.map(read, wanted))
    else:
        records = [read(rid) for rid in wanted]
    why = [unreadable(r) if unreadable is not None else None for r in records]
    why = _copies(records, why)
    aside = [
        {
            "run_id": r.run_id,
            "algorithm": r.algorithm,
            "seed": r.seed,
            "state": r.state,
            "reason": w,
            "path": str(r.path),
        }
        for r, w in zip(records, why, strict=True)
        if w
    ]
    records = [r for r, w in zip(records, why, strict=True) if not w]
    study = build_study(records, axes=axes, metrics=metrics, missing=missing)
    study.unreadable = pd.DataFrame(aside, columns=UNREADABLE_COLUMNS)
    return study


def _copies(records: Sequence[RunRecord], why: Sequence[str | None]) -> list[str | None]:
    """`why` with a reason for every run that has the content (RunRecord.content: seed, config, status, metrics) of
    another run kept: one run under a second name, counted once. The one kept is the first whose manifest.json names
    its own directory, else the first; runs already set aside take no part."""
    content = [None if w else r.content for r, w in zip(records, why, strict=True)]
    kept: dict[str, int] = {}
    for i in sorted(range(len(records)), key=lambda i: records[i].manifest.get("run_id") != records[i].run_id):
        if content[i] is not None:
            kept.setdefault(content[i], i)
    out = list(why)
    for i, c in enumerate(content):
        if c is not None and kept[c] != i:
            first = records[kept[c]].run_id
            out[i] = (
                f"the same run as {first} (the same seed, config, status and metrics): one run under a second name, "
                f"counted once (as {first})"
            )
    return out


def unreadable_reason(record: RunRecord, algorithms: Collection[str] | None = None) -> str | None:
    """Why run `record` cannot be read, or None: its resolved config cannot be read or names no algorithm (or one
    not in `algorithms`, when given), its status.json (or failure.json) cannot be read or holds no known state, or
    its metrics.parquet cannot be read (a missing one only for a run that says it stepped: completed, collapsed or
    stopped), its seed is not an integer, or its manifest.json names another run id than its directory's (a copied
    run directory, which would count as one more seed). A damaged optional file (routing_layers, token_samples) does
    not make a run unreadable: it is in the runs table's `error`."""
    config_names = (*CONFIG_FILES, "no resolved config")
    reasons = [e for e in record.read_errors if e.startswith(config_names)]
    if not reasons:
        if record.algorithm is None:
            reasons.append("the config names no algorithm")
        elif algorithms is not None and record.algorithm not in algorithms:
            reasons.append(
                f"algorithm {record.algorithm!r} in the config is not a registered algorithm (valid: "
                f"{', '.join(sorted(algorithms))})"
            )
    if record.state == UNKNOWN_STATE:
        errs = [e for e in record.read_errors if e.startswith((STATUS, FAILURE))]
        state = record.status.get("state")
        reasons += errs or [f"{STATUS}: state {state!r} is not one of {', '.join(STATES)}"]
    seed = record.seed_value
    if seed is not None and record.seed is None:
        reasons.append(f"seed {seed!r} is not an integer")
    copy_of = record.manifest.get("run_id")
    if isinstance(copy_of, str) and copy_of != record.run_id:
        reasons.append(
            f"{MANIFEST} names run {copy_of}, not {record.run_id}: a copy of another run's directory "
            "(a run's directory is named by its config's hash), not a run of its own"
        )
    for e in record.read_errors:
        if e.startswith(METRICS) and not (e == f"{METRICS}: missing" and record.state in ("failed", "running")):
            reasons.append(e)
    return "; ".join(reasons) or None


def infer_axes(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Flattened keys whose value differs between configs (bookkeeping keys excluded), sorted. An empty config (a run
    directory without a readable config yet, e.g. one being created) takes no part: it would make every key "swept".
    A key that varies only with the algorithm (one value per algorithm, as a sweep's `per_algorithm` clip ranges) is
    part of what the algorithm is, not an axis."""
    configs = [c for c in configs if c]
    keys = sorted({k for c in configs for k in c})
    algorithms = {hashable(c.get("algorithm")) for c in configs}
    out = []
    for key in keys:
        if key.rsplit(".", 1)[-1] in NON_AXIS_KEYS or key == "algorithm.name":
            continue
        values = {hashable(c.get(key)) for c in configs}
        per_algorithm = {(hashable(c.get("algorithm")), hashable(c.get(key))) for c in configs}
        if len(values) > 1 and not (len(algorithms) > 1 and len(per_algorithm) == len(algorithms)):
            out.append(key)
    return out


def build_study(
    records: Sequence[RunRecord],
    *,
    axes: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
    missing: Sequence[str] = (),
) -> Study:
    """Assemble the tidy tables from runs already read."""
    axes = list(axes) if axes is not None else infer_axes([r.config for r in records])
    run_ids = [r.run_id for r in records]
    algs = [r.algorithm for r in records]
    seeds = [r.seed for r in records]
    axis_values = {a: [axis_value(r.config.get(a)) for r in records] for a in axes}

    runs = pd.DataFrame(
        {
            RUN_ID: run_ids,
            ALGORITHM: algs,
            **axis_values,
            SEED: pd.array(seeds, dtype="Int64"),
            "state": [r.state for r in records],
            "collapse_step": pd.array([collapse_step(r) for r in records], dtype="Int64"),
            "collapse_reason": [collapse_reason(r) for r in records],
            "error": [error_of(r) for r in records],
            "n_steps": [rl_steps(r.metrics) for r in records],
            "start_eval": [has_start(r.metrics) for r in records],
            "last_step": pd.array([last(r.metrics, STEP) for r in records], dtype="Int64"),
            "last_compute": [last(r.metrics, COMPUTE) for r in records],
            EMULATED: pd.array([r.precision_emulated for r in records], dtype="boolean"),
            "path": [str(r.path) for r in records],
        }
    )
    # Constant per-run columns become categoricals whose codes are repeated once per row.
    run_cols = {RUN_ID: run_ids, ALGORITHM: algs, **axis_values, SEED: seeds}
    long = _long_table([r.metrics for r in records], run_cols, index=(STEP, COMPUTE, WALL), metrics=metrics)
    layers = _long_table([r.layers for r in records], run_cols, index=(STEP, LAYER), metrics=None)
    token_cols = {
        **run_cols,
        **{k: [axis_value(r.config.get(k)) for r in records] for k in PRECISION_KEYS if k not in run_cols},
        EMULATED: [r.precision_emulated for r in records],
    }
    tokens = _stack([r.tokens for r in records], token_cols)
    sequences = _stack([r.sequences for r in records], token_cols)
    return Study(
        long=long,
        runs=runs,
        layers=layers,
        axes=axes,
        missing=list(missing),
        configs={r.run_id: r.config for r in records},
        manifests={r.run_id: r.manifest for r in records},
        tokens=tokens,
        sequences=sequences,
    )


def _stack(per_run: Sequence[Mapping[str, np.ndarray] | None], run_cols: Mapping[str, Sequence[Any]]) -> pd.DataFrame:
    """Concatenate per-run column dicts, with the per-run constants as categorical columns (empty: no columns)."""
    present = [(i, d) for i, d in enumerate(per_run) if d is not None]
    if not present:
        return pd.DataFrame()
    rows = np.array([0 if d is None else len(next(iter(d.values()))) for d in per_run], dtype=np.int64)
    out: dict[str, Any] = {}
    for col, values in run_cols.items():
        out[col] = _categorical_by_run(values, rows)
    for name in present[0][1]:
        out[name] = np.concatenate([d[name] for _, d in present])
    return pd.DataFrame(out, copy=False)


def _long_table(
    tables: Sequence[pa.Table | None],
    run_cols: Mapping[str, Sequence[Any]],
    *,
    index: Sequence[str],
    metrics: Sequence[str] | None,
) -> pd.DataFrame:
    """Melt per-run wide tables into one long table with numpy (no per-run pandas work).

    Two passes: per run a (metrics, steps) matrix and its logged-mask, then every output column is filled in place
    in one preallocated array (the table is ~10^7 rows: copies, not Python, are what cost).
    """
    if metrics is None:
        names: dict[str, None] = {}
        for t in tables:
            if t is None:
                continue
            for f in t.schema:
                if f.name not in index and (pa.types.is_floating(f.type) or pa.types.is_integer(f.type)):
                    names[f.name] = None
        metric_names = list(names)
    else:
        metric_names = list(metrics)
    per_run: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]] | None] = []
    run_rows = np.zeros(len(tables), dtype=np.int64)
    for i, t in enumerate(tables):
        if t is None or t.num_rows == 0:
            per_run.append(None)
            continue
        n = t.num_rows
        present = [j for j, m in enumerate(metric_names) if m in t.column_names]
        mat = np.empty((len(present), n), dtype=np.float64)  # (metrics, steps)
        for row, j in enumerate(present):
            mat[row] = _column(t, metric_names[j], n)
        keep = ~np.isnan(mat)
        full = bool(keep.all())
        run_rows[i] = mat.size if full else int(keep.sum())
        per_run.append(
            (n, np.asarray(present, dtype=np.int64), mat, None if full else keep, {c: _column(t, c, n) for c in index})
        )

    total = int(run_rows.sum())
    metric_codes = np.empty(total, dtype=_code_dtype(len(metric_names)))
    value = np.empty(total, dtype=np.float64)
    idx_out = {c: np.empty(total, dtype=np.int32 if c in (STEP, LAYER) else np.float64) for c in index}
    offset = 0
    for item, rows in zip(per_run, run_rows, strict=True):
        if item is None:
            continue
        n, present, mat, keep, idx_cols = item
        sl = slice(offset, offset + int(rows))
        if keep is None:  # every metric logged at every step: plain reshapes
            value[sl] = mat.ravel()
            metric_codes[sl] = np.repeat(present, n)
            for c in index:
                idx_out[c][sl].reshape(len(present), n)[:] = idx_cols[c]
        else:
            value[sl] = mat[keep]
            metric_codes[sl] = np.repeat(present, keep.sum(axis=1))
            for c in index:
                idx_out[c][sl] = np.broadcast_to(idx_cols[c], mat.shape)[keep]
        offset += int(rows)

    out: dict[str, Any] = {}
    for col, values in run_cols.items():
        out[col] = _categorical_by_run(values, run_rows)
    out.update(idx_out)
    out[METRIC] = pd.Categorical.from_codes(metric_codes, categories=pd.Index(metric_names, dtype=object))
    out[VALUE] = value
    return pd.DataFrame(out, copy=False)


def _code_dtype(n: int) -> type:
    return np.int8 if n < 127 else np.int16 if n < 32767 else np.int32


def _categorical_by_run(per_run: Sequence[Any], run_rows: np.ndarray) -> pd.Categorical:
    """A categorical column with one value per run, repeated `run_rows[i]` times for run i."""
    values = [None if v is None or (isinstance(v, float) and np.isnan(v)) else v for v in per_run]
    uniq = list(dict.fromkeys(v for v in values if v is not None))
    try:
        uniq_sorted = sorted(uniq)
    except TypeError:
        uniq_sorted = sorted(uniq, key=str)
    lookup = {v: k for k, v in enumerate(uniq_sorted)}
    codes = np.array([lookup[v] if v is not None else -1 for v in values], dtype=_code_dtype(len(uniq_sorted)))
    cats = pd.Index(uniq_sorted) if uniq_sorted else pd.Index([], dtype=object)
    if cats.dtype.kind not in "biuf":
        cats = pd.Index(uniq_sorted, dtype=object)
    return pd.Categorical.from_codes(np.repeat(codes, run_rows), categories=cats)


def _column(t: pa.Table, name: str, n: int) -> np.ndarray:
    if name not in t.column_names:
        return np.full(n, np.nan)
    col = t.column(name)
    if pa.types.is_integer(col.type) and col.null_count == 0:
        return col.to_numpy()
    return col.cast(pa.float64()).to_numpy(zero_copy_only=False)
