# Helpers: config validation, the sweep's runs, paths. Imported names are used by run.smk and report.smk.
import os
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)  # the repository root: study, sweeps, analysis

from sweeps.expand import load_sweep, write_config  # noqa: E402
from sweeps.schema import SweepError  # noqa: E402


validate(config, "../config.schema.yaml")

try:
    SWEEP = load_sweep(config["sweep"])
    RUNS = SWEEP.expand()  # run id -> RunConfig, validated before any job starts
except SweepError as err:
    raise WorkflowError(str(err)) from None

PYTHON = sys.executable
RESULTS = config["results"]
STUDY = SWEEP.name
STUDY_DIR = f"{RESULTS}/{STUDY}"
REPORT = f"{STUDY_DIR}/report/index.html"


wildcard_constraints:
    run_id=r"[A-Za-z0-9_]+-[0-9a-f]{12}",


def run_threads(wildcards):
    """torch threads of the run (RunConfig.threads) = the cores Snakemake reserves for it."""
    return RUNS[wildcards.run_id].threads


def status_files(wildcards):
    return [f"{RESULTS}/runs/{run_id}/status.json" for run_id in RUNS]


def configs_dir(wildcards, output):
    """results/<study>/configs, from the first resolved config's path."""
    return os.path.dirname(output[0])


def results_of_run(wildcards, output):
    """The results root, from results/runs/{run_id}/status.json."""
    return os.path.dirname(os.path.dirname(os.path.dirname(output[0])))


def results_of_report(wildcards, output):
    """The results root, from results/<study>/report/index.html."""
    return os.path.dirname(os.path.dirname(os.path.dirname(output[0])))
