# collect: the study's run ids (what `python -m analysis report --study` reads); report: the study's HTML report.


rule collect:
    input:
        status_files,
    output:
        f"{STUDY_DIR}/run_ids.txt",
    log:
        f"{STUDY_DIR}/logs/collect.log",
    params:
        python=PYTHON,
        sweep=config["sweep"],
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m sweeps.expand {params.sweep} --run-ids {output} > {log} 2>&1"


rule report:
    input:
        f"{STUDY_DIR}/run_ids.txt",
    output:
        REPORT,
    log:
        f"{STUDY_DIR}/logs/report.log",
    params:
        python=PYTHON,
        results=results_of_report,
        study=STUDY,
    conda:
        "../envs/study.yaml"
    shell:
        "{params.python} -m analysis report {params.results} --study {params.study} > {log} 2>&1"


onsuccess:
    print(f"report: {REPORT}")
