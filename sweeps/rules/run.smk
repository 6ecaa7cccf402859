# Resolve the study's configs; make each cold start the runs need (one job per distinct checkpoint); then one job per
# run id: `python -m study.launch` runs it (in-process, submitit's local executor or SLURM, blocking until it ends), and
# the run skips itself if finished and resumes if interrupted. Runs live under results/runs/{run_id}/ and cold starts
# under results/coldstart/{model}-{task}-{hash}/ ({model}: the shape's label, `default` or `default_e32_k8`; the hash
# holds the whole shape), both shared by every study that contains them.


rule resolve:
    output:
        expand(f"{STUDY_DIR}/configs/{{run_id}}.yaml", run_id=RUNS),
    log:
        f"{STUDY_DIR}/logs/resolve.log",
    params:
        python=PYTHON,
        sweep=config["sweep"],
        configs=configs_dir,
        vars=sweep_var_args,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m sweeps.expand {params.sweep} {params.vars} --write-configs {params.configs} > {log} 2>&1"


rule coldstart:
    # The cold start of runs with coldstart = "auto" (study.coldstart.ensure_coldstart, which a run would otherwise
    # call itself, under a lock): made once, before the runs, through the same launcher as the runs (`python -m
    # study.launch --coldstart`: in-process here, a SLURM job under `--profile slurm`, not the submit host), with the
    # settings a run would use, so the directory (named by its settings' hash, which leaves the thread count out) is
    # the one the runs reuse. Two torch threads (Snakemake caps them at --cores): nothing else can run until the cold
    # start is done, so one thread would leave the second core of a 2-core machine idle. Not strict: a cold start
    # that missed its pass@1 band is kept, not deleted as a failed job's output; the runs then stop on it with the
    # reason (ensure_coldstart is strict there). One job per distinct model shape x task: the model is passed as a
    # preset name or, for a shape with overrides, as a JSON mapping (`:q` quotes it for the shell).
    output:
        f"{RESULTS}/coldstart/{{coldstart}}/coldstart.json",
    log:
        f"{STUDY_DIR}/logs/coldstart/{{coldstart}}.log",
    params:
        python=PYTHON,
        results=results_of_run,
        model=coldstart_model,
        task=coldstart_task,
        settings=coldstart_settings,
    threads: 2
    resources:
        launcher="in-process",
        slurm_partition="",
        slurm_account="",
        gpus=0,
        runtime=120,
        mem_gb=16,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study.launch --coldstart {params.model:q} {params.task} "
        "--coldstart-settings {params.settings:q} --results {params.results} "
        "--launcher {resources.launcher} --partition '{resources.slurm_partition}' "
        "--account '{resources.slurm_account}' --gpus {resources.gpus} --time-min {resources.runtime} "
        "--mem-gb {resources.mem_gb} --cpus {threads} > {log} 2>&1"


rule run:
    input:
        # The run id is the hash of this file's content, so its mtime carries no information: another study
        # writing the same config must not make a finished run look outdated.
        config=ancient(f"{STUDY_DIR}/configs/{{run_id}}.yaml"),
        # Likewise the cold start: its directory is named by the hash of its settings.
        coldstart=ancient(coldstart_of_run),
    output:
        # The workflow's marker, made once the launcher returned 0 (the run completed or collapsed): a run stopped
        # part-way keeps its status.json (stopped, resumable) and no marker, so the next invocation resumes it.
        touch(f"{RESULTS}/runs/{{run_id}}/{runfiles.DONE}"),
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
        # GPUs per node and nodes: what study.run.plan needs for the run on the config's cluster (gpus_per_node x
        # gpu_mem_gb); 1 x 1 for the presets. A profile's `gpus:` overrides them. In-process runs ignore them.
        gpus=run_gpus,
        nodes=run_nodes,
        tasks_per_node=0,  # ranks per node; 0: one per GPU
        gpu_mem_gb=config["gpu_mem_gb"],  # the fit check study.launch makes before it asks SLURM for the job
        # Minutes: the run's time plan x 2 + 10 (study.run.timing, on the config's `gpu` kind; on the CPU under a
        # profile that asks for no GPU). A profile's `runtime:` overrides it.
        runtime=run_runtime,
        mem_gb=16,
        # One per run: `--resources concurrent_runs=N` (the slurm profile) caps the runs in flight.
        concurrent_runs=1,
        # The vllm engine's runtime settings (JSON over the config's rollout_runtime; not in the run id).
        rollout_runtime="",
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study.launch {input.config} --results {params.results} --launcher {resources.launcher} "
        "--partition '{resources.slurm_partition}' --account '{resources.slurm_account}' --gpus {resources.gpus} "
        "--nodes {resources.nodes} --tasks-per-node {resources.tasks_per_node} --gpu-mem-gb {resources.gpu_mem_gb} "
        "--time-min {resources.runtime} --mem-gb {resources.mem_gb} --rollout-runtime={resources.rollout_runtime:q} "
        "> {log} 2>&1"


rule coldstart_budgets:
    # The length study's first table: the cold start's held-out pass@1 at each max_new_tokens its runs use (one row
    # per budget; study/tools/budgets.py), before any RL, so the report shows whether a longer budget helps at the start.
    # Only for cold starts whose runs sweep max_new_tokens (BUDGET_PLAN).
    input:
        ancient(f"{RESULTS}/coldstart/{{coldstart}}/coldstart.json"),
    output:
        f"{STUDY_DIR}/coldstart_budgets/{{coldstart}}.csv",
    log:
        f"{STUDY_DIR}/logs/coldstart_budgets/{{coldstart}}.log",
    params:
        python=PYTHON,
        args=budget_args,
    threads: 1
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study.tools.budgets $(dirname {input}) {params.args} --out {output} > {log} 2>&1"


rule precision_parity:
    # A study that emulates low precision: how the emulation's log-prob deltas compare with real low precision on
    # this machine (study/tools/parity.py: the tiny model's trainer, engine and cross-engine mismatch, real vs emulated),
    # shown in the report next to C5.
    output:
        f"{STUDY_DIR}/precision_parity.csv",
    log:
        f"{STUDY_DIR}/logs/precision_parity.log",
    params:
        python=PYTHON,
        formats=" ".join(EMULATED_FORMATS),
    threads: 1
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m study.tools.parity --precisions {params.formats} --seqs 64 --out {output} > {log} 2>&1"
