"""The names the tidy tables and the run reader share: column names, the step of the start's evaluation, the
precision keys, the bookkeeping keys that are never a swept axis, the config file names a run may have, the reading
limits of token samples, and the files a loaded study is written to (`Study.write`)."""

from __future__ import annotations

from analysis.runs import vocab

RUNS_SUBDIR = "runs"
TOKEN_COLUMNS = ("step", "sample", "pos", *vocab.TOKEN_LOGPS)
MAX_TOKEN_ROWS = 20_000
"""Token rows kept per run in `Study.tokens` (a seeded random subset beyond this; sequences use every row)."""
TOKEN_BUDGET = 2_000_000
"""Token rows kept over the whole study (~40 MB): the per-run cap shrinks to TOKEN_BUDGET / runs for big studies."""
PRECISION_KEYS = ("train_precision", "rollout_precision", "old_logp_source")
"""Config keys that define a precision configuration (joined to the token tables even when not swept)."""
EMULATED = "precision_emulated"
CONFIG_FILES = (
    "config.yaml",
    "config.yml",
    "config.json",
    "resolved_config.yaml",
    "resolved_config.yml",
    "resolved_config.json",
)
STEP, COMPUTE, WALL, LAYER = "step", "compute_flops", "wall_s", "layer"
START_STEP = 0
"""The step of the row that holds only the starting policy's evaluation (before any RL step; compute 0)."""
RUN_ID, ALGORITHM, SEED, METRIC, VALUE = "run_id", "algorithm", "seed", "metric", "value"
UNKNOWN_STATE = "unknown"  # a directory without a readable status.json
# Flattened config keys that are bookkeeping, never a swept axis (matched on the last dotted component).
NON_AXIS_KEYS = frozenset(
    {"run_id", "seed", "algorithm", "name", "results", "results_dir", "output_dir", "out_dir", "run_dir", "job_id"}
)
UNREADABLE_COLUMNS = ("run_id", "algorithm", "seed", "state", "reason", "path")
"""Study.unreadable's columns."""
OUTPUT_FILES = {
    "long": "tidy.parquet",
    "runs": "runs.parquet",
    "layers": "layers.parquet",
    "tokens": "tokens.parquet",
    "sequences": "sequences.parquet",
    "missing": "missing.json",
}
