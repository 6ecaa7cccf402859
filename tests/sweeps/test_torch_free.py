"""The workflow's planning does not import torch: Snakemake parses the rule files, expands the sweep and places its
runs in every dry run, so a module-level `import torch` on that path costs each plan seconds and a few hundred MB.
Here in a fresh interpreter what the rule files import and do at parse time, for every shipped sweep; the dry runs
of test_sweeps.py check the same of `snakemake -n` itself."""

from __future__ import annotations

from tests.sweeps.helpers import SWEEP_FILES, planning_probe, rule_file_imports


def test_the_probe_sees_the_rule_files_imports():
    """A parser that found nothing would pass: it finds the modules common.smk and tune_common.smk are known to use."""
    names = rule_file_imports()
    assert {"study.coldstart", "study.coldstart.store", "sweeps.expand", "study.run", "algorithms"} <= set(names)
    assert len(SWEEP_FILES) >= 8


def test_planning_the_workflow_imports_no_torch():
    out = planning_probe()
    chain = "\n  ".join(out["chain"] or [])
    assert not out["torch"], f"planning imported torch; first import from:\n  {chain}"
    assert {"grpo", "gspo"} <= set(out["algorithms"])
