# Helpers of tune.smk (the tuning rules): the tuning sweep's algorithms, threads, paths.
import re

from algorithms import catalog  # noqa: E402

TUNE_DIR = f"{RESULTS}/tune/{STUDY}"
TUNE_ALGORITHMS = list(dict.fromkeys(cfg.algorithm for cfg in RUNS.values())) if SWEEP.tune is not None else []


def tune_inputs(wildcards):
    """Every algorithm's tuned part; a sweep without `tune:` fails here, before any job starts."""
    if SWEEP.tune is None:
        raise WorkflowError(
            f"{config['sweep']}: no `tune:` section, so the `tune` target has nothing to tune; valid: a tuning sweep "
            "such as --config sweep=sweeps/tune.yaml"
        )
    return expand(f"{TUNE_DIR}/{{algorithm}}.yaml", algorithm=TUNE_ALGORITHMS)


def coldstart_of_tuning(wildcards):
    """The finished cold starts of the algorithm's starting runs (the coldstart rule makes them once, before any
    trial), or nothing for runs given a checkpoint or "scratch"."""
    names = {RUN_COLDSTART[run_id] for run_id, cfg in RUNS.items() if cfg.algorithm == wildcards.algorithm}
    return [f"{RESULTS}/coldstart/{name}/coldstart.json" for name in sorted(names - {None})]


def tune_threads(wildcards):
    """torch threads of the algorithm's trials (its starting run's RunConfig.threads)."""
    return max(cfg.threads for cfg in RUNS.values() if cfg.algorithm == wildcards.algorithm)


def results_of_tune(wildcards, output):
    """The results root, from results/tune/<name>/<file>.yaml."""
    return os.path.dirname(os.path.dirname(os.path.dirname(output[0])))
