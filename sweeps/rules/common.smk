# Helpers: config validation, the sweep's runs and the cold starts they need, paths. Used by the other rule files.
import json
import os
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)  # the repository root: study, sweeps, analysis

from study.coldstart import resolve_settings  # noqa: E402
import runfiles  # noqa: E402
from runfiles.bounded import read_json  # noqa: E402
from study.coldstart.store import run_coldstart  # noqa: E402
from study.run.trackers import ENV as TRACKERS_ENV, parse_trackers  # noqa: E402
from sweeps.expand import load_sweep, write_config  # noqa: E402
from sweeps.schema import SweepError  # noqa: E402


validate(config, "../config.schema.yaml")

SWEEP_VARS = {"checkpoint": config["checkpoint"]} if config.get("checkpoint") else {}  # a sweep's {checkpoint}
try:
    if config.get("trackers"):  # the runs' live trackers (study/run/trackers.py): `study.launch` reads the variable
        os.environ[TRACKERS_ENV] = ",".join(parse_trackers(config["trackers"], field_name="config trackers"))
except ValueError as err:
    raise WorkflowError(str(err)) from None

try:
    SWEEP = load_sweep(config["sweep"], SWEEP_VARS)
    RUNS = SWEEP.expand()  # run id -> RunConfig, validated before any job starts
except SweepError as err:
    raise WorkflowError(str(err)) from None

PYTHON = sys.executable
RESULTS = config["results"]
STUDY = SWEEP.name
STUDY_DIR = f"{RESULTS}/{STUDY}"
REPORT = f"{STUDY_DIR}/report/index.html"
FIGURES = f"{STUDY_DIR}/figures"


def coldstart_name(cfg):
    """results/coldstart/<name> of a run with coldstart = "auto": the directory `study.parts.initial_policy` gets from
    ensure_coldstart(model, task, results) with its defaults; None for a run given a checkpoint (or "scratch")."""
    if cfg.coldstart != "auto":
        return None
    return resolve_settings(cfg.model, cfg.task, seed=0, threads=1, init=None, **run_coldstart(cfg)).dirname


RUN_COLDSTART = {run_id: coldstart_name(cfg) for run_id, cfg in RUNS.items()}  # run id -> cold start (or None)
COLDSTARTS = {  # cold-start directory name -> (model shape, task, band and knobs), one job per distinct cold start
    name: (cfg.model, cfg.task, run_coldstart(cfg))
    for cfg, name in zip(RUNS.values(), RUN_COLDSTART.values())
    if name is not None
}


wildcard_constraints:
    run_id=r"[A-Za-z0-9_]+-[0-9a-f]{12}",
    coldstart=r"[A-Za-z0-9_]+-[A-Za-z0-9_]+-[0-9a-f]{12}",


def sweep_var_args(wildcards):
    """The sweep's vars given on the command line, as `python -m sweeps.expand` reads them (shell-quoted)."""
    import shlex

    return " ".join(f"--var {shlex.quote(f'{k}={v}')}" for k, v in SWEEP_VARS.items())


_PLACEMENTS = {}


def run_placement(run_id):
    """(nodes, GPUs per node) of a run: the fewest GPUs, a power of two, on which study.run.plan fits it, on the
    config's cluster (gpus_per_node GPUs of gpu_mem_gb each); whole nodes beyond one (study.run.plan.place_run).
    Refused at parse time (before any job) when no cluster of up to 64 nodes fits it."""
    if run_id not in _PLACEMENTS:
        from study.run import plan

        try:
            _PLACEMENTS[run_id] = plan.place_run(
                RUNS[run_id], gpus_per_node=config["gpus_per_node"], gpu_mem_gb=config["gpu_mem_gb"]
            )
        except ValueError as err:
            raise WorkflowError(str(err)) from None
    return _PLACEMENTS[run_id]


def run_nodes(wildcards):
    return run_placement(wildcards.run_id)[0]


def run_gpus(wildcards):
    """GPUs per node of the run's job (the profile's `gpus:` overrides it)."""
    return run_placement(wildcards.run_id)[1]


def _profile_run_gpus():
    """The GPUs per node a profile forces on every run (`set-resources: run: gpus: N`), or None."""
    forced = workflow.resource_settings.overwrite_resources.get("run", {})
    value = forced.get("gpus") if hasattr(forced, "get") else None
    return getattr(value, "value", value)


def run_runtime(wildcards):
    """Minutes of the run's job (its SLURM time limit): the run's time plan (study.run.timing.plan_run: its steps,
    evaluations, checkpoints and start) on the config's GPU kind at the run's placement, or on one CPU where the
    profile asks for no GPU (`set-resources: run: gpus: 0`), times TIME_LIMIT_FACTOR plus TIME_LIMIT_PAD_MIN minutes
    (study/run/timing.py), at most the config's max_job_min (a longer run is requeued and resumes from its last
    checkpoint). A profile's `runtime:` overrides it."""
    from study.run import timing

    run = RUNS[wildcards.run_id]
    if _profile_run_gpus() == 0:
        planned = timing.plan_run(run, dev=timing.device("cpu"))
    else:
        nodes, per_node = run_placement(wildcards.run_id)
        planned = timing.plan_run(
            run,
            dev=timing.device(config["gpu"]),
            gpus=nodes * per_node,
            gpu_mem_gb=config["gpu_mem_gb"],
            gpus_per_node=config["gpus_per_node"],
        )
    return timing.time_limit_min(planned.seconds, most=config["max_job_min"])


def run_threads(wildcards):
    """torch threads of the run (RunConfig.threads) = the cores Snakemake reserves for it."""
    return RUNS[wildcards.run_id].threads


def run_state(run_id):
    """The state in the run's status.json; None without a readable one."""
    try:
        return read_json(f"{RESULTS}/runs/{run_id}/{runfiles.STATUS}").get("state")
    except (OSError, ValueError, AttributeError):
        return None


def run_markers(wildcards):
    """Every run's workflow.done (runfiles.DONE): there once its job ended with the run finished."""
    return [f"{RESULTS}/runs/{run_id}/{runfiles.DONE}" for run_id in RUNS]


def coldstart_of_run(wildcards):
    """The finished cold start the run starts from (coldstart.json is written last), or nothing."""
    name = RUN_COLDSTART[wildcards.run_id]
    return [] if name is None else [f"{RESULTS}/coldstart/{name}/coldstart.json"]


def coldstart_model(wildcards):
    """The cold start's model as `python -m study.launch --coldstart` reads it: a preset name, or the shape as a
    compact JSON mapping (the rule quotes it for the shell)."""
    model = COLDSTARTS[wildcards.coldstart][0]
    return model if isinstance(model, str) else json.dumps(model, separators=(",", ":"))


def coldstart_task(wildcards):
    return COLDSTARTS[wildcards.coldstart][1]


def coldstart_settings(wildcards):
    """The cold start's settings from its runs (study.coldstart.store.run_coldstart: band, task knobs and, for runs
    with a test split, held_out_test) as `python -m study.launch --coldstart-settings` reads them (JSON)."""
    extra = COLDSTARTS[wildcards.coldstart][2]
    return json.dumps({**extra, "band": list(extra["band"])}, separators=(",", ":"))


def configs_dir(wildcards, output):
    """results/<study>/configs, from the first resolved config's path."""
    return os.path.dirname(output[0])


def results_of_run(wildcards, output):
    """The results root, from results/runs/{run_id}/workflow.done (or results/coldstart/{coldstart}/coldstart.json)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(output[0])))


def results_of_report(wildcards, output):
    """The results root, from results/<study>/report/index.html."""
    return os.path.dirname(os.path.dirname(os.path.dirname(output[0])))


def results_of_figures(wildcards, output):
    """The results root, from results/<study>/figures."""
    return os.path.dirname(os.path.dirname(output[0]))


def _budget_plan():
    """cold start -> (task, knobs, budgets, eval_size, eval_samples) for the cold starts whose runs sweep
    max_new_tokens (two or more budgets): the length study's cold-start table (rule coldstart_budgets)."""
    plan = {}
    for run_id, cfg in RUNS.items():
        name = RUN_COLDSTART[run_id]
        if name is None:
            continue
        task, knobs, budgets, size, samples = plan.get(name, (cfg.task, cfg.task_knobs, set(), 0, 0))
        plan[name] = (task, knobs, budgets | {cfg.max_new_tokens}, max(size, cfg.eval_size),
                      max(samples, cfg.eval_samples))  # fmt: skip
    return {name: p for name, p in plan.items() if len(p[2]) > 1}


BUDGET_PLAN = _budget_plan()
BUDGET_TABLES = [f"{STUDY_DIR}/coldstart_budgets/{name}.csv" for name in BUDGET_PLAN]


def budget_args(wildcards):
    """`python -m study.tools.budgets` arguments of one cold start: task, knobs (JSON), budgets, eval size and samples."""
    task, knobs, budgets, size, samples = BUDGET_PLAN[wildcards.coldstart]
    knobs = json.dumps(knobs, separators=(",", ":"))
    return f"--task {task} --knobs '{knobs}' --budgets {' '.join(map(str, sorted(budgets)))} " \
        f"--eval-size {size} --eval-samples {samples}"


def _emulated_formats():
    """The low-precision formats the study emulates (train or rollout precision `NAME-emulated`), sorted."""
    names = set()
    for cfg in RUNS.values():
        for spec in (cfg.train_precision, cfg.rollout_precision):
            if spec.endswith("-emulated") and spec != "fp32-emulated":
                names.add(spec.removesuffix("-emulated"))
    return sorted(names)


EMULATED_FORMATS = _emulated_formats()
PARITY_TABLES = [f"{STUDY_DIR}/precision_parity.csv"] if EMULATED_FORMATS else []
