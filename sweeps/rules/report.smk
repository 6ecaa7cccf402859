# collect: the run ids of the study's run directories (what `python -m analysis figures|report --study` read);
# figures: the paper's figures (registered for `snakemake --report`); report: the study's own HTML report.


rule collect:
    input:
        run_markers,
    output:
        f"{STUDY_DIR}/run_ids.txt",
    log:
        f"{STUDY_DIR}/logs/collect.log",
    params:
        python=PYTHON,
        study=STUDY,
    conda:
        "../envs/study.yaml"
    shell:
        # The ids are the parents of the input markers: exactly the runs this workflow ran.
        "{params.python} -m analysis collect {input} --study {params.study} --out {output} > {log} 2>&1"


rule figures:
    input:
        f"{STUDY_DIR}/run_ids.txt",
    output:
        # Which figures a study gets depends on its data (a figure without its metric or axis is skipped, with the
        # reason in figures.json), so the rule's output is the directory and the report picks up its PNGs.
        report(
            directory(FIGURES),
            patterns=["{figure}.png"],
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
    log:
        f"{STUDY_DIR}/logs/figures.log",
    params:
        python=PYTHON,
        results=results_of_figures,
        study=STUDY,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m analysis figures {params.results} --study {params.study} --out {output} > {log} 2>&1"


rule report:
    input:
        ids=f"{STUDY_DIR}/run_ids.txt",
        figures=FIGURES,
        # the cold start's pass@1 per generation budget (rule coldstart_budgets; a length study only), read by the
        # report from results/<study>/coldstart_budgets/
        budgets=BUDGET_TABLES,
        # emulated vs real low precision on this machine (rule precision_parity; a study that emulates only)
        parity=PARITY_TABLES,
    output:
        # The report embeds the figures rule's files and tables (copied, not drawn again: --figures).
        report(REPORT, caption="../report/report.rst", category="Report"),
        report(f"{STUDY_DIR}/report/tables/scorecard.csv", caption="../report/scorecard.rst", category="Report"),
    log:
        f"{STUDY_DIR}/logs/report.log",
    params:
        python=PYTHON,
        results=results_of_report,
        study=STUDY,
        sweep=config["sweep"],
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m analysis report {params.results} --study {params.study} --figures {input.figures} "
        "--sweep {params.sweep:q} > {log} 2>&1"


onsuccess:
    if os.path.exists(REPORT):  # not after a target without one (`snakemake tune`)
        print(f"report: {REPORT}")


onerror:
    # A failed run keeps its record (RESULTS/runs/RUN_ID/status.json and failure.json, error and traceback): the run
    # rule's output is the workflow's marker, which a failed run never gets. Name the study's failed runs, then write
    # the report of what there is (python -m analysis report, which lists them with their error) when the study's
    # configs were resolved.
    failed = [
        run_id for run_id in RUNS
        if os.path.exists(f"{RESULTS}/runs/{run_id}/failure.json") and run_state(run_id) in ("failed", None)
    ]
    for run_id in failed:
        try:
            error = read_json(f"{RESULTS}/runs/{run_id}/failure.json").get("error", "?")
        except (OSError, ValueError, AttributeError) as err:
            error = f"failure.json unreadable: {err}"
        print(f"run {run_id} failed: {error} (record: {RESULTS}/runs/{run_id}/failure.json)", file=sys.stderr)
    if failed and os.path.isdir(f"{STUDY_DIR}/configs"):
        import subprocess

        log = f"{STUDY_DIR}/logs/report-after-failure.log"
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as fh:
            done = subprocess.run([PYTHON, "-m", "analysis", "report", RESULTS, "--study", STUDY, "--sweep",
                                   config["sweep"]], stdout=fh, stderr=subprocess.STDOUT).returncode == 0
        where = f"{STUDY_DIR}/report/index.html" if done else f"not written, see {log}"
        print(f"report of the study so far, with the failed run(s): {where}", file=sys.stderr)
