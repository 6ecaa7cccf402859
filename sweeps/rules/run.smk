# Resolve the study's configs, then one job per run id: `python -m study.launch` runs it (in-process, submitit's local
# executor or SLURM, blocking until it ends), and the run skips itself if finished and resumes if interrupted. Runs live
# under results/runs/{run_id}/, shared by every study that contains them.


rule resolve:
    output:
        expand(f"{STUDY_DIR}/configs/{{run_id}}.yaml", run_id=RUNS),
    log:
        f"{STUDY_DIR}/logs/resolve.log",
    params:
        python=PYTHON,
        sweep=config["sweep"],
        configs=configs_dir,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m sweeps.expand {params.sweep} --write-configs {params.configs} > {log} 2>&1"


rule run:
    input:
        # The run id is the hash of this file's content, so its mtime carries no information: another study
        # writing the same config must not make a finished run look outdated.
        ancient(f"{STUDY_DIR}/configs/{{run_id}}.yaml"),
    output:
        f"{RESULTS}/runs/{{run_id}}/status.json",
    log:
        f"{RESULTS}/runs/{{run_id}}/run.log",
    params:
        python=PYTHON,
        results=results_of_run,
    threads: run_threads
    resources:
        # Defaults run locally in this process; `--profile slurm` overrides them (--set-resources run:launcher=...).
        launcher="in-process",
        slurm_partition="",
        slurm_account="",
        gpus=0,
        runtime=120,
        mem_gb=16,
        # One per run: `--resources concurrent_runs=N` (the slurm profile) caps the runs in flight.
        concurrent_runs=1,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study.launch {input} --results {params.results} --launcher {resources.launcher} "
        "--partition '{resources.slurm_partition}' --account '{resources.slurm_account}' --gpus {resources.gpus} "
        "--time-min {resources.runtime} --mem-gb {resources.mem_gb} > {log} 2>&1"
