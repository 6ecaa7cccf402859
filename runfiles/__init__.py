"""The run-files contract: what a run directory holds, and the one way its files (and every config and sweep file)
are read and written. study/ writes runs through it, sweeps/ and analysis/ read them through it; it imports nothing
of the project and no torch, so every package can import it.

    results/runs/{run_id}/
        config.yaml              the resolved RunConfig (CONFIG)
        manifest.json            run id, git sha, package versions, seed, host, threads, memory pages, job id (MANIFEST)
        status.json              {"state": one of STATES, "step": ..., "reason"/"error": ...} (STATUS)
        failure.json             the last failure's record, beside status.json; a workflow that deletes a failed
                                 job's outputs (Snakemake) leaves it (FAILURE)
        metrics.parquet          one row per step (METRICS)
        routing_layers.parquet   per-layer routing volatility, one row per (step, layer) (LAYERS)
        token_samples.parquet    trainer vs engine log-probs of sampled response tokens (TOKEN_SAMPLES)
        workflow.done            written by the workflow's run rule once the run's job ended with the run finished
                                 (completed or collapsed): the rule's output, so a run stopped or killed part-way is
                                 run again (resumed) by the next invocation, whatever its status.json says (DONE)
        run.lock, crash.txt, log.txt, checkpoint/, tensorboard/, trackers.json: the run's own (study/run/rundir.py)

Modules: `bounded` (the one reader of YAML and JSON, bounded in size, depth and alias expansion, refusing duplicate
keys, never blocking on a FIFO), `atomic` (the one atomic write: temporary file, fsync, rename). Here: the file names
and `flatten`, the dotted view of a nested config that trackers, sweeps and analysis all use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONFIG = "config.yaml"
MANIFEST = "manifest.json"
STATUS = "status.json"
FAILURE = "failure.json"
METRICS = "metrics.parquet"
LAYERS = "routing_layers.parquet"
TOKEN_SAMPLES = "token_samples.parquet"
DONE = "workflow.done"
STATES = ("running", "completed", "collapsed", "failed", "stopped")
"""status.json's `state`: stopped is halted on purpose before its last step (resumable), e.g. a pruned trial."""


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config mappings as dotted keys: {"model": {"num_experts": 4}} -> {"model.num_experts": 4}; lists and
    empty mappings are kept as values."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
