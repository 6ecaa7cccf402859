"""study.launch: the same run in-process, under submitit's local executor and on a real SLURM cluster; failures come
back with the remote traceback; Ctrl-C/SIGTERM cancels the SLURM job; a SLURM time-out requeues the run, which resumes
from its checkpoint to the metrics of an uninterrupted run; the smoke study runs through the CPU slurm profile as
the README types it; a job no node can run is refused before submission, naming the profile key."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from study import launch
from study.core import hugepages
from tests.shared import ROOT, needs_slurm, sharing_coldstart, smoke_config

# Columns that measure the machine, not the computation.
TIMING = ("wall_s", "time_rollout_s", "time_old_logp_s", "time_update_s", "time_sync_s", "peak_rss_gb")
LAUNCH = [sys.executable, "-m", "study.launch"]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def run_launch(config: Path, results: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [*LAUNCH, str(config), "--results", str(results), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def metrics(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "metrics.parquet").drop(columns=list(TIMING))


def state(run_dir: Path) -> str:
    return json.loads((run_dir / "status.json").read_text())["state"]


def sacct_states(job_id: str) -> list[str]:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True)
    return out.stdout.split()


ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def final_sacct_states(job_id: str, timeout: float = 120) -> list[str]:
    """The job's states once SLURM has finished it. The launcher returns as soon as submitit's result file exists,
    which the job writes before it exits: for a moment after that, sacct still reports it RUNNING (CI saw this)."""
    deadline = time.time() + timeout
    states = sacct_states(job_id)
    while time.time() < deadline and (not states or any(s.startswith(ACTIVE_STATES) for s in states)):
        time.sleep(1)
        states = sacct_states(job_id)
    return states


MISFIT = "size mismatch for embedding.word_embeddings.weight"


def bad_config(tmp_path: Path) -> Path:
    """A run that fails at its first line of compute (a cold start of another shape: its policy.pt does not fit the
    policy): the traceback must reach the caller. (A cold start that is not there, or lacks its tokenizer, is refused
    before the run directory is written.)"""
    from study.data.tokenizer import build_tokenizer

    broken = tmp_path / "another-shape"
    broken.mkdir()
    cfg = smoke_config(coldstart=str(broken))
    build_tokenizer(cfg.model_config().vocab_size, [cfg.task], n_per_task=50).save(broken)
    torch.save({"embedding.word_embeddings.weight": torch.zeros(3, 3)}, broken / "policy.pt")
    return write_config(cfg, tmp_path / "bad.yaml")


# --- fast tier -------------------------------------------------------------------------------------------------------


def test_the_launcher_is_always_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="launcher = 'auto'; valid: in-process, local, slurm"):
        launch.executor("auto", tmp_path, launch.Resources(), job_name="x")
    proc = run_launch(write_config(smoke_config(), tmp_path / "c.yaml"), tmp_path, "--launcher", "auto", timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'auto'" in proc.stderr


def test_checkpoint_requeues_the_same_run() -> None:
    run = launch.Run(smoke_config().to_dict(), "results")
    delayed = run.checkpoint()
    assert isinstance(delayed.function, launch.Run)
    assert delayed.function.config == run.config and delayed.function.results == run.results


def test_the_coldstart_takes_a_model_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--coldstart MODEL TASK`: MODEL a preset or a YAML/JSON shape mapping, validated before any job (errors name
    the field); the job gets the canonical shape and is named by its cold-start directory."""
    cmd = [*LAUNCH, "--coldstart", "{preset: tiny, moe_top_k: 9}", "chain_sum", "--results", str(tmp_path)]
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "error: model.moe_top_k = 9: valid range is [1, 4]" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "coldstart").exists()
    calls = []

    def submit(call, launcher, folder, res, job_name):
        calls.append((call, folder, job_name))
        return {"state": "completed", "run_dir": str(folder)}

    monkeypatch.setattr(launch, "_submit_and_wait", submit)
    shape = '{"preset": "tiny", "num_layers": 2, "num_experts": 8, "moe_top_k": 4}'  # num_layers: tiny's own
    assert launch.main(["--coldstart", shape, "chain_sum", "--results", str(tmp_path)]) == 0
    assert launch.main(["--coldstart", "tiny", "chain_sum", "--results", str(tmp_path)]) == 0
    (call, folder, job_name), (plain, _, plain_name) = calls
    assert call.model == {"preset": "tiny", "num_experts": 8, "moe_top_k": 4} and plain.model == "tiny"
    from study.coldstart import resolve_settings

    name = resolve_settings(call.model, "chain_sum").dirname
    assert name.startswith("tiny_e8_k4-chain_sum-") and job_name == f"coldstart-{name}" and folder.name == name
    assert plain_name == f"coldstart-{resolve_settings('tiny', 'chain_sum').dirname}" != job_name
    assert call.checkpoint().function.model == call.model  # a requeued cold start keeps its shape


@pytest.mark.parametrize("launcher", ["in-process", "local"])
def test_a_failing_run_surfaces_its_traceback(launcher: str, tmp_path: Path) -> None:
    proc = run_launch(bad_config(tmp_path), tmp_path / "results", "--launcher", launcher, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "RuntimeError: Error(s) in loading state_dict" in proc.stderr and MISFIT in proc.stderr
    assert "in load_initial" in proc.stderr and "model.load_state_dict(init_state, strict=False)" in proc.stderr
    (run_dir,) = (tmp_path / "results" / "runs").iterdir()
    assert state(run_dir) == "failed"
    if launcher == "local":  # the job's own stdout/stderr, under the run directory
        (err_log,) = (run_dir / "submitit").glob("*_log.err")
        assert MISFIT in err_log.read_text()


def test_the_cpu_profile_differs_from_the_gpu_one_only_in_what_a_job_asks_for() -> None:
    gpu, cpu = (yaml.safe_load((ROOT / name / "config.yaml").read_text()) for name in ("slurm", "slurm-cpu"))
    for rule in ("run", "coldstart"):
        gpus = gpu["set-resources"][rule].pop("gpus", None)  # a run's GPUs and nodes are planned (study.run.plan)
        assert (gpus is None if rule == "run" else gpus >= 1) and cpu["set-resources"][rule].pop("gpus") == 0
        assert gpu["set-resources"][rule].pop("mem_gb") > cpu["set-resources"][rule].pop("mem_gb")
    assert gpu == cpu


def test_a_job_no_node_can_run_names_the_profile_key() -> None:
    cpu_node = ["(null)|22000|2"]  # `sinfo -h -N -o '%G|%m|%c'` of the one-machine cluster (scripts/slurm/start.sh)
    why = launch.cluster_shortfall(launch.Resources(gpus=1, mem_gb=64), cpu_node, "run")
    assert "asks for 1 GPU(s)" in why and "`set-resources: run: gpus`" in why and "--profile slurm-cpu" in why
    why = launch.cluster_shortfall(launch.Resources(gpus=0, mem_gb=64), cpu_node, "coldstart")
    assert "asks for 64 GB" in why and "has 21.5 GB" in why and "`set-resources: coldstart: mem_gb`" in why
    assert launch.cluster_shortfall(launch.Resources(gpus=0, mem_gb=4), cpu_node, "run") is None
    gpu_nodes = ["gpu:a100:4(S:0-1)|512000|64", "gpu:2|100000|16"]
    assert launch.cluster_shortfall(launch.Resources(gpus=4, mem_gb=64), gpu_nodes, "run") is None
    assert "at most 4 GPUs a node" in launch.cluster_shortfall(launch.Resources(gpus=8), gpu_nodes, "run")


@needs_slurm
def test_the_gpu_profile_on_a_cpu_cluster_is_refused_before_submission(tmp_path: Path) -> None:
    """What the README's one-machine trial hit with the GPU profile: a clear error, not sbatch's gres error."""
    config = write_config(smoke_config(), tmp_path / "run.yaml")
    proc = run_launch(config, tmp_path / "results", "--launcher", "slurm", "--gpus", "1", "--mem-gb", "64")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr.startswith("error: SLURM: this job asks for 1 GPU(s)") and "set-resources: run: gpus" in proc.stderr
    )
    assert not (tmp_path / "results").exists()


def test_paper_dry_run_plans_multi_node_jobs(tmp_path: Path) -> None:
    """sweeps/paper.yaml through the slurm profile: the planner sizes each Qwen3-30B-A3B run for the config's
    cluster (8 GPUs of 80 GB per node): 2 nodes x 8 GPUs, in the job plan and on the launch command."""
    cmd = [
        *SNAKEMAKE,
        "-n",
        "--profile",
        "slurm",
        "--config",
        "sweep=sweeps/paper.yaml",
        f"results={tmp_path}",
        "checkpoint=/data/Qwen3-30B-A3B-Base",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches = [line for line in proc.stdout.splitlines() if "-m study.launch" in line]
    assert len(launches) == 12 and all("--gpus 8 --nodes 2" in line for line in launches), proc.stdout[-3000:]
    assert "gpus=8, nodes=2" in proc.stdout
    assert "--var checkpoint=/data/Qwen3-30B-A3B-Base" in proc.stdout  # the resolve job gets the same value


# --- slow tier: real runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_in_process_and_local_run_the_same_run(results: Path, tmp_path: Path) -> None:
    config = write_config(smoke_config(), tmp_path / "smoke.yaml")
    proc = run_launch(config, results, "--launcher", "in-process")
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = results / "runs" / smoke_config().run_id
    assert proc.stdout.strip() == f"completed: {run_dir}"

    other = sharing_coldstart(results, tmp_path / "other")
    local = run_launch(config, other, "--launcher", "local", "--time-min", "20")
    assert local.returncode == 0, local.stderr[-4000:]
    local_dir = other / "runs" / run_dir.name
    assert state(local_dir) == "completed"
    assert list((local_dir / "submitit").glob("*_log.out")), "submitit's logs belong under the run directory"
    pd.testing.assert_frame_equal(metrics(local_dir), metrics(run_dir), check_exact=True)


def test_a_requeue_ended_by_sigterm_counts_as_requeued() -> None:
    """SLURM ends a job's processes when it requeues the job, `scontrol requeue` too if it has not exited: that
    SIGTERM means requeued; any other failure of the command still raises."""
    py = [sys.executable, "-c"]
    assert launch.requeue([*py, "pass"]) is True
    assert launch.requeue([*py, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) is False
    for failing in ("raise SystemExit(1)", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"):
        with pytest.raises(subprocess.CalledProcessError):
            launch.requeue([*py, failing])
    from submitit.slurm.slurm import SlurmJobEnvironment

    launch._in_job()  # what Run and ColdStart do first in the job
    assert SlurmJobEnvironment._requeue is launch._slurm_requeue


def test_the_requeues_sigterm_to_the_job_itself_does_not_cut_the_requeue_short(caplog) -> None:
    """While a run trains, the run guard's handler turns SIGTERM into `Terminated`; the SIGTERM SLURM sends the job's
    processes for the requeue they asked for arrives while `scontrol requeue` runs. It must be passed over, so that
    the requeue completes and logs (the old handler raised Terminated out of `requeue`'s wait, racing the log line)."""
    import logging
    import os
    from types import SimpleNamespace

    from study.run import rundir

    previous = {s: signal.signal(s, rundir._terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        # the requeue command signals this process, as SLURM does, then goes on a while before exiting 0
        command = [sys.executable, "-c", f"import os, time; os.kill({os.getpid()}, 15); time.sleep(0.5)"]
        with caplog.at_level(logging.INFO):
            launch._slurm_requeue(SimpleNamespace(job_id="7"), 3, command=command)
        assert "Requeued job 7 (3 remaining timeouts)" in caplog.text
        assert "Bypassing signal SIGTERM" in caplog.text
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- SLURM tier: the real cluster of scripts/slurm/start.sh ---------------------------------------------------------


@needs_slurm
def test_sigterm_cancels_the_slurm_job(tmp_path: Path) -> None:
    cfg = smoke_config(coldstart="scratch", steps=500, eval_every=0)
    config = write_config(cfg, tmp_path / "long.yaml")
    cmd = [*LAUNCH, str(config), "--results", str(tmp_path), "--launcher", "slurm", "--mem-gb", "1", "--time-min", "10"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = proc.stderr.readline()  # "submitted slurm job N; logs: ..."
    job_id = re.match(r"submitted slurm job (\d+)", first).group(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, first + err
    assert f"cancelling slurm job {job_id}" in err
    states = final_sacct_states(job_id)
    assert any(s.startswith("CANCELLED") for s in states), states


@needs_slurm
def test_a_failing_slurm_job_surfaces_the_remote_traceback(tmp_path: Path) -> None:
    proc = run_launch(bad_config(tmp_path), tmp_path / "results", "--launcher", "slurm", "--mem-gb", "1", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "failed during processing with trace:" in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr and MISFIT in proc.stderr
    assert "study/rl.py" in proc.stderr and "in load_initial" in proc.stderr  # frames of the remote process


@needs_slurm
@pytest.mark.slow
def test_the_coldstart_launches_as_a_slurm_job(results: Path, tmp_path: Path) -> None:
    """`python -m study.launch --coldstart` (the coldstart rule under --profile slurm) runs ensure_coldstart in a
    SLURM job; here the cold start exists already, so the job finds and reports it without training."""
    other = sharing_coldstart(results, tmp_path / "other")
    cfg = smoke_config()
    cmd = [*LAUNCH, "--coldstart", cfg.model, cfg.task, "--results", str(other), "--launcher", "slurm", "--mem-gb", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stderr.split("submitted slurm job ")[1].split(";")[0]
    assert final_sacct_states(job_id) == ["COMPLETED"]
    from study.coldstart import resolve_settings

    directory = other / "coldstart" / resolve_settings(cfg.model, cfg.task).dirname
    assert proc.stdout.strip() == f"completed: {directory}"
    assert list((other / "coldstart" / "submitit" / directory.name).glob(f"{job_id}_0_log.out"))


@needs_slurm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smoke_study_through_the_cpu_slurm_profile_as_typed(results: Path, tmp_path: Path) -> None:
    """The smoke study with the repository's CPU profile, as the README types it (`--profile slurm-cpu`; the results
    directory is this test's)."""
    study = sharing_coldstart(results, tmp_path / "results")
    cmd = [*SNAKEMAKE, "--profile", "slurm-cpu", "--config", "sweep=sweeps/smoke.yaml", f"results={study}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (study / "smoke" / "report" / "index.html").is_file()
    run_dirs = sorted((study / "runs").iterdir())
    assert len(run_dirs) == 2 and all(state(d) == "completed" for d in run_dirs)
    for run_dir in run_dirs:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        job_id = manifest["job_id"]
        assert job_id and final_sacct_states(job_id) == ["COMPLETED"], (run_dir, job_id)
        # huge pages unless STUDY_HUGEPAGES=0 or the machine rules them out (study/core/hugepages.py), as recorded
        expected = "huge pages (" if hugepages.why_not(os.environ) is None else "4 KiB pages ("
        assert manifest["memory_pages"].startswith(expected), manifest["memory_pages"]
        assert (run_dir / "submitit" / f"{job_id}_0_log.out").is_file()
        assert "submitted slurm job" in (run_dir / "run.log").read_text()


@needs_slurm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_two_rank_run_through_snakemake_and_the_cpu_slurm_profile(results: Path, tmp_path: Path) -> None:
    """A study whose run spans two ranks (expert parallel 2 over data parallel 2), as a user types it (`snakemake
    --profile slurm-cpu`): one SLURM job of two tasks, one per rank of the layout, which sacct reports COMPLETED;
    rank 0 writes the run directory, each rank its shards of megatron's distributed checkpoint; the manifest records
    the layout and the job."""
    study = sharing_coldstart(results, tmp_path / "results")
    sweep = tmp_path / "two_ranks.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "name": "two_ranks",
                "description": "CI: one run on two ranks through SLURM.",
                "preset": "tiny",
                "base": {
                    "steps": 2,
                    "eval_every": 2,
                    "eval_size": 4,
                    "eval_samples": 1,
                    "checkpoint_every": 1,
                    "prompts_per_step": 4,
                    "minibatches": 2,
                    "parallel": {"expert": 2, "data": 2},
                },
                "axes": {"algorithm": ["grpo_rr"], "seed": [0]},
                "mode": "grid",
            }
        )
    )
    cmd = [*SNAKEMAKE, "--profile", "slurm-cpu", "--config", f"sweep={sweep}", f"results={study}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (study / "two_ranks" / "report" / "index.html").is_file()
    (run_dir,) = sorted((study / "runs").iterdir())
    assert state(run_dir) == "completed" and len(metrics(run_dir)) == 3  # step 0's evaluation and 2 steps
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["parallel"]["expert"] == 2 and manifest["parallel"]["data"] == 2
    job_id = manifest["job_id"]
    assert job_id and final_sacct_states(job_id) == ["COMPLETED"], (run_dir, job_id)
    tasks = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "NTasks,AllocNodes"], capture_output=True, text=True
    ).stdout.split()
    logs = sorted(p.name for p in (run_dir / "submitit").glob(f"{job_id}_*_log.out"))
    assert logs == [f"{job_id}_0_log.out", f"{job_id}_1_log.out"], (logs, tasks)  # one task per rank
    assert "dist-step2" in {p.name for p in (run_dir / "checkpoint").iterdir()}
    dist = run_dir / "checkpoint" / "dist-step2"
    assert len(list(dist.glob("__0_*.distcp"))) >= 1 and len(list(dist.glob("__1_*.distcp"))) >= 1  # both ranks'


# --- SLURM time-outs. Both time-out tests wait for SLURM: the time-limit warning comes from slurmctld's time-limit
# sweep, every 30 s, which signals a job once less than its signal delay + 30 s is left, i.e. with a 1-minute limit and
# a 5-s delay 25-55 s into the job (1 minute is the smallest limit SLURM takes). The two-task job is submitted first,
# from a module fixture, so that its wait overlaps the one-task run's; CI's test cluster (scripts/slurm/start.sh with
# SLURM_CPUS=8) has CPUs for both jobs, and a KillWait of 5 s, which a requeue waits for the tasks that ignore SIGTERM.
TIMEOUT_SLURM = {"time_min": 1, "signal_delay_s": 5}

TWO_TASK_TIMEOUT = """
import json, sys
from study import launch
res = launch.Resources(tasks_per_node=2, time_min={time_min}, signal_delay_s={signal_delay_s}, mem_gb=1,
                       max_timeouts=3)
print(json.dumps(launch.launch_rank_check(sys.argv[1], "slurm", res, hold_s=600)))
""".format(**TIMEOUT_SLURM)


@pytest.fixture(scope="module")
def two_task_timeout(requires_slurm: None, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The two-task rank check whose first attempt holds past its time limit, submitted now in its own process
    (launch_rank_check blocks, and takes SIGTERM to cancel its job): (process, results dir)."""
    root = tmp_path_factory.mktemp("two-task-timeout")
    proc = subprocess.Popen(
        [sys.executable, "-c", TWO_TASK_TIMEOUT, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    yield proc, root
    if proc.poll() is None:
        proc.terminate()  # cancels the job
        proc.communicate(timeout=60)


@needs_slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm-timeouts")
@pytest.mark.timeout(900)
def test_a_slurm_timeout_requeues_and_finishes_identically(two_task_timeout, results: Path, tmp_path: Path) -> None:
    """A run longer than its 1-minute limit: SLURM signals it, submitit calls Run.checkpoint and requeues the job, the
    requeued job resumes from the run's last checkpoint; the metrics equal those of an uninterrupted run."""
    # The run must outlast the first job's signal (55 s into the job at the latest) whatever this machine's speed, so
    # its steps are sized from a measured short run: ~70 s of steps (600 at least, 4,000 at most), more than the job
    # can do before its signal even at 1.5 times the measured speed. Once the job has been signalled, its limit is
    # raised to 10 minutes, so that the requeued job finishes the run instead of being signalled again every minute.
    from study import rl

    probe = rl.run(
        smoke_config(steps=60, eval_every=0, checkpoint_every=0),
        sharing_coldstart(results, tmp_path / "probe"),
        progress=False,
    )
    per_step = float(pd.read_parquet(probe / "metrics.parquet")["wall_s"].max()) / 60
    steps = int(min(4000, max(600, 70 / per_step)))
    cfg = smoke_config(steps=steps, eval_every=600, checkpoint_every=10)
    config = write_config(cfg, tmp_path / "long.yaml")
    other = sharing_coldstart(results, tmp_path / "other")
    slurm_args = [
        "--launcher",
        "slurm",
        "--time-min",
        str(TIMEOUT_SLURM["time_min"]),
        "--signal-delay-s",
        str(TIMEOUT_SLURM["signal_delay_s"]),
        "--max-timeouts",
        "5",
        "--mem-gb",
        "2",
    ]
    run_dir = other / "runs" / cfg.run_id

    def log() -> str:
        return "".join(p.read_text() for p in sorted((run_dir / "submitit").glob("*_log.*")))

    procs = {}  # the SLURM job and the uninterrupted reference, on both cores
    try:
        for name, root, args in (("slurm", other, slurm_args), ("reference", results, ["--launcher", "in-process"])):
            with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
                procs[name] = subprocess.Popen(
                    [*LAUNCH, str(config), "--results", str(root), *args], stdout=out, stderr=err, text=True, cwd=ROOT
                )
        deadline = time.time() + 600
        while "Calling checkpoint method" not in log() and procs["slurm"].poll() is None:  # signalled: requeueing
            assert time.time() < deadline, "no time-out signal in 10 minutes"
            time.sleep(1)
        if procs["slurm"].poll() is None:
            (job_id,) = {p.name.split("_")[0] for p in (run_dir / "submitit").glob("*_log.*")}
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True, timeout=60)
        for name, proc in procs.items():
            assert proc.wait(timeout=700) == 0, (tmp_path / f"{name}.err").read_text()[-4000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()  # the launcher cancels its SLURM job
                proc.wait(timeout=60)
    assert state(run_dir) == "completed"
    text = log()
    assert "this job is timed-out" in text and "Calling checkpoint method" in text, text[-4000:]
    assert re.search(r"Requeued job \d+ \(\d+ remaining timeouts\)", text), text[-4000:]
    assert text.count("Starting with JobEnvironment") >= 2  # the requeued job started again
    pd.testing.assert_frame_equal(metrics(run_dir), metrics(results / "runs" / cfg.run_id), check_exact=True)


@needs_slurm
@pytest.mark.slow
@pytest.mark.xdist_group("slurm-timeouts")
@pytest.mark.timeout(600)
def test_a_two_task_job_requeues_whole_after_a_timeout(two_task_timeout) -> None:
    """Both ranks of a two-task job hold past the 1-minute limit: rank 0 checkpoints and requeues the job, and both
    ranks start again (attempt 1) and agree on the env again."""
    proc, root = two_task_timeout
    out, err = proc.communicate(timeout=540)
    assert proc.returncode == 0, err[-3000:]
    views = json.loads(out.strip().splitlines()[-1])
    assert [v["attempt"] for v in views] == [1, 1] and [v["rank"] for v in views] == [0, 1]
    assert all(v["sum"] == 3.0 for v in views)
    log = "".join(p.read_text() for p in sorted((root / "rank-check" / "submitit").glob("*_log.*")))
    assert "this job is timed-out" in log and "Calling checkpoint method" in log, log[-3000:]
    assert re.search(r"Requeued job \d+", log), log[-3000:]


# --- multi-node placement: nodes x tasks per node, the torch.distributed env, the fit check -------------------------


def test_the_placement_reaches_sbatch(tmp_path: Path) -> None:
    res = launch.Resources(gpus=8, nodes=2, gpu_mem_gb=80)
    assert (res.ranks_per_node, res.world_size) == (8, 16)  # one rank per GPU
    ex = launch.executor("slurm", tmp_path, res, job_name="x")
    text = ex._make_submission_file_text("python -c pass", "uid")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --gpus-per-node=8" in text
    cpu = launch.executor("slurm", tmp_path, launch.Resources(), job_name="x")._make_submission_file_text("c", "u")
    assert "#SBATCH --nodes=1" in cpu and "#SBATCH --ntasks-per-node=1" in cpu and "gpus-per-node" not in cpu
    with pytest.raises(ValueError, match="nodes = 0: must be an integer >= 1"):
        launch.Resources(nodes=0)
    with pytest.raises(ValueError, match="nodes = 2: the local launcher runs on this machine; valid: 1"):
        launch.executor("local", tmp_path, launch.Resources(nodes=2), job_name="x")


def test_a_run_that_cannot_fit_is_refused_before_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """study.run.plan's check, and the run's parallel layout's rank count, before any job is asked for (exit 2, no
    job)."""
    monkeypatch.setattr(launch, "_submit_and_wait", lambda *a, **k: pytest.fail("a job was submitted"))
    big = smoke_config(
        model="qwen3-30b-a3b",
        coldstart="scratch",
        train_precision="bf16",
        rollout_precision="bf16",
        max_new_tokens=4096,
    )
    config = write_config(big, tmp_path / "big.yaml")
    args = [str(config), "--results", str(tmp_path), "--launcher", "slurm", "--gpus", "1", "--gpu-mem-gb", "80"]
    assert launch.main(args) == 2
    assert launch.main([*args[:-4], "--gpus", "8", "--nodes", "2", "--gpu-mem-gb", "80"]) == 2  # fits, but 16 ranks
    with pytest.raises(ValueError, match=r"does not fit on 1 GPU\(s\) of 80 GB"):
        launch.check_resources(big, "slurm", launch.Resources(gpus=1, gpu_mem_gb=80))
    with pytest.raises(ValueError, match=r"2 x 8 = 16 ranks, but the run's parallel layout \{\} has 1"):
        launch.check_resources(big, "slurm", launch.Resources(gpus=8, nodes=2, gpu_mem_gb=80))
    launch.check_resources(smoke_config(), "slurm", launch.Resources(gpus=1, gpu_mem_gb=80))  # tiny fits


def test_outside_a_job_the_env_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert launch.distributed_env()["WORLD_SIZE"] == "1"


@needs_slurm
def test_two_tasks_on_one_node_agree_on_the_distributed_env(tmp_path: Path) -> None:
    """The CI cluster's one node, two tasks: each rank gets SLURM's placement as the torch env (RANK, WORLD_SIZE,
    LOCAL_RANK, one MASTER_ADDR:PORT) and a gloo all_reduce over both succeeds."""
    cmd = [
        *LAUNCH,
        "--rank-check",
        "--launcher",
        "slurm",
        "--tasks-per-node",
        "2",
        "--results",
        str(tmp_path),
        "--mem-gb",
        "1",
        "--time-min",
        "5",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "2 ranks agree" in proc.stdout, proc.stdout + proc.stderr
    views = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [v["rank"] for v in views] == [0, 1] and all(v["sum"] == 3.0 for v in views)
    assert [v["env"]["LOCAL_RANK"] for v in views] == ["0", "1"]
    assert len({(v["env"]["MASTER_ADDR"], v["env"]["MASTER_PORT"], v["env"]["WORLD_SIZE"]) for v in views}) == 1
    assert 20000 <= int(views[0]["env"]["MASTER_PORT"]) < 32768, "below the kernel's ephemeral ports"
    (script,) = (tmp_path / "rank-check" / "submitit").glob("*_submission.sh")
    assert "--kill-on-bad-exit=1" in script.read_text(), "a failed rank ends the job's other tasks"


def test_the_rendezvous_port_is_the_job_ids_below_the_ephemeral_ports() -> None:
    # submitit's own draw (20000-60000) lands in Linux's ephemeral range (32768-60999) for most job ids, where an
    # outgoing connection on the node can hold the port: rank 0's TCPStore then fails with EADDRINUSE.
    ports = [launch.master_port(str(job_id)) for job_id in range(1, 5001)]
    assert min(ports) >= 20000 and max(ports) <= 32767
    assert len(set(ports)) > 4000, "job ids spread over the range"
    assert launch.master_port("8") == launch.master_port("8") != launch.master_port("9")
    assert launch.master_port("123_4") != launch.master_port("123_5"), "array tasks differ"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_parallel_run_is_one_local_job_of_two_tasks(tmp_path: Path, easy_coldstart) -> None:
    # A run at EP 2 through submitit's local executor: one job, two tasks (ranks), rank 0's status returned, and the
    # run directory written by rank 0 with the ranks' distributed checkpoint.
    from study.run.config import load_config

    (tmp_path / "start").mkdir()
    cfg = load_config(
        preset="tiny",
        sets=[
            "steps=1",
            "eval_every=0",
            "prompts_per_step=2",
            "minibatches=2",
            "max_new_tokens=8",
            f"coldstart={easy_coldstart}",
            "parallel.expert=2",
            "parallel.data=2",
        ],
    )
    proc = run_launch(write_config(cfg, tmp_path / "ep2.yaml"), tmp_path / "r", "--launcher", "local")
    run_dir = tmp_path / "r" / "runs" / cfg.run_id
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == f"completed: {run_dir}" and state(run_dir) == "completed"
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["dist-step1", "state.pt"]
    assert len(list((run_dir / "submitit").glob("*_1_log.out"))) == 1  # the second task's own log
