# Tuning (a sweep with a `tune:` section; sweeps/tune.py): one Optuna study per algorithm with the same trial budget,
# one job each, then the tuned file that a comparison sweep names with `tuned:`.
#     snakemake tune --cores all --config sweep=sweeps/tune.yaml   -> results/tune/<name>/best.yaml
# The storage is the sweep's tune.storage; a profile may override it for both rules (set-resources: tune_algorithm:
# storage=URL and tune:storage=URL).
include: "tune_common.smk"


rule tune:
    input:
        tune_inputs,
    output:
        f"{TUNE_DIR}/best.yaml",
    log:
        f"{TUNE_DIR}/logs/best.log",
    params:
        python=PYTHON,
        sweep=config["sweep"],
        results=results_of_tune,
    resources:
        storage="",  # "": the sweep's tune.storage
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m sweeps.tune {params.sweep} --results {params.results} --best-only "
        "--storage '{resources.storage}' > {log} 2>&1"


rule tune_algorithm:
    input:
        ancient(coldstart_of_tuning),  # named by its settings' hash: its mtime carries no information
    output:
        f"{TUNE_DIR}/{{algorithm}}.yaml",
    log:
        f"{TUNE_DIR}/logs/{{algorithm}}.log",
    wildcard_constraints:
        algorithm="|".join(re.escape(name) for name in catalog.names()),
    params:
        python=PYTHON,
        sweep=config["sweep"],
        results=results_of_tune,
    threads: tune_threads
    resources:
        storage="",  # "": the sweep's tune.storage
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m sweeps.tune {params.sweep} --results {params.results} --algorithm {wildcards.algorithm} "
        "--storage '{resources.storage}' > {log} 2>&1"
