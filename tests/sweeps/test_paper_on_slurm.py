"""The `paper` sweep as typed on a cluster (`snakemake --profile slurm --config sweep=sweeps/paper.yaml`) resolves into
jobs that pass every check study.launch makes before it asks SLURM for one: the run's parallel layout against the
job's ranks, the trainer and the vllm engine fitting the GPUs (study.tools.plan), the engine's layout against the
model. No GPU and no SLURM: the dry run's shell commands, each taken through launch's own checks."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

from study import launch
from study.run.rollout_runtime import EngineSettings
from sweeps.expand import load_sweep
from tests.shared import ROOT


def _jobs(tmp_path) -> list[list[str]]:
    env = {**os.environ, "PATH": f"{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["snakemake", "-n", "-p", "--profile", "slurm", "--config", "sweep=sweeps/paper.yaml", f"results={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmds = [
        shlex.split(line.split(">")[0])
        for line in proc.stdout.splitlines()
        if "-m study.launch" in line and "--coldstart" not in line
    ]
    return [cmd[cmd.index("study.launch") + 1 :] for cmd in cmds]


def _option(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)


def test_every_paper_job_passes_the_checks_before_submission(tmp_path):
    runs = load_sweep(ROOT / "sweeps" / "paper.yaml").expand()
    jobs = _jobs(tmp_path)
    assert len(jobs) == len(runs) == 12
    for args in jobs:
        run_id = re.search(r"configs/(.+)\.yaml", args[0]).group(1)
        cfg = runs[run_id]
        runtime = _option(args, "--rollout-runtime")
        if runtime.strip():
            cfg = cfg.replace(rollout_runtime={**cfg.rollout_runtime, **json.loads(runtime)})
        EngineSettings.parse(cfg.rollout_runtime)
        res = launch.Resources(
            gpus=int(_option(args, "--gpus")),
            nodes=int(_option(args, "--nodes")),
            tasks_per_node=int(_option(args, "--tasks-per-node")),
            gpu_mem_gb=float(_option(args, "--gpu-mem-gb")),
            cpus=cfg.threads,
        )
        res = launch.layout_ranks(cfg, res)
        assert res.world_size == cfg.layout.world_size == 16 and (res.nodes, res.gpus) == (2, 8)
        launch.check_resources(cfg, "slurm", res)  # raises what launch would print before any job


def test_the_planner_and_the_engine_speak_one_layout():
    """The planner's engine layout for the paper's model is one the engine's settings express, and back."""
    from study.core.model_config import PRESETS
    from study.tools import plan

    cfg = PRESETS["qwen3-30b-a3b"]
    engine = plan.default_engine(cfg, 16)
    settings = EngineSettings.parse(engine.runtime())
    assert plan.EngineLayout.from_settings(settings) == engine and engine.check(cfg, 8) is None
    assert (engine.tp, engine.ep, engine.dp) == (4, 4, 2)
