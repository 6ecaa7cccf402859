"""The study workflow: a sweep file (sweeps/*.yaml) -> resolved run configs -> cold starts -> runs -> collect ->
figures -> report.

    snakemake --cores all                                   # the default study (sweeps/default.yaml)
    snakemake --cores all --config sweep=sweeps/smoke.yaml  # another study
    snakemake --report report.html                          # after a study: Snakemake's report of it (figures, stats)

Rules live in sweeps/rules/*.smk; experiment facts in the sweep file, runtime choices in profiles.
"""

from snakemake.utils import min_version

min_version("9.27")


configfile: "sweeps/config.yaml"


report: "sweeps/report/workflow.rst"


include: "sweeps/rules/common.smk"
include: "sweeps/rules/run.smk"
include: "sweeps/rules/report.smk"
include: "sweeps/rules/tune.smk"


rule all:
    default_target: True
    input:
        REPORT,
