# Resolve the study's configs, then one job per run id: `python -m study run` (which skips finished runs and resumes
# interrupted ones). Runs live under results/runs/{run_id}/, shared by every study that contains them.


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
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study run {input} --results {params.results} --quiet > {log} 2>&1"
