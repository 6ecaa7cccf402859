"""The workflow's planning does not import torch: Snakemake parses the rule files, expands the sweep and places its
runs in every dry run, so a module-level `import torch` on that path costs each plan seconds and a few hundred MB.
Here in a fresh interpreter what the rule files import and do at parse time, for every shipped sweep; the dry runs
of test_sweeps.py check the same of `snakemake -n` itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.shared import ROOT

RULE_FILES = sorted((ROOT / "sweeps" / "rules").glob("*.smk"))
SWEEP_FILES = [
    p for p in sorted((ROOT / "sweeps").glob("*.yaml")) if p.name not in ("config.yaml", "config.schema.yaml")
]

# Run in a fresh interpreter: a finder that records the import stack of torch's first import, then what the rule
# files do while Snakemake plans (their imports, every shipped sweep expanded, each run's cold start and placement).
PROBE = r"""
import importlib, importlib.abc, json, sys, traceback

class Watch(importlib.abc.MetaPathFinder):
    chain = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Watch.chain is None:
            Watch.chain = [f"{f.filename}:{f.lineno} {f.line}" for f in traceback.extract_stack()
                           if "importlib" not in f.filename and f.filename != "<string>"]
        return None

sys.meta_path.insert(0, Watch())
sys.path[:0] = json.loads(sys.argv[3])  # the algorithms package's root, then the repository's
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)

from algorithms import catalog
from study.coldstart import resolve_settings
from study.coldstart.store import run_coldstart
from study.run import plan
from sweeps.expand import load_sweep

for path in json.loads(sys.argv[2]):
    for cfg in load_sweep(path).expand().values():
        if cfg.coldstart == "auto":
            resolve_settings(cfg.model, cfg.task, seed=0, threads=1, init=None, **run_coldstart(cfg)).dirname
        try:
            plan.check_run_fits(cfg, gpus=8, gpu_mem_gb=80, gpus_per_node=8)
        except ValueError:
            pass
print(json.dumps({"torch": "torch" in sys.modules, "chain": Watch.chain, "algorithms": catalog.names()}))
"""


def rule_file_imports() -> list[str]:
    """Every module an import statement of the rule files names (at any indentation), and the sweeps package's own
    modules (the tune rules and jobs import sweeps.tune)."""
    pattern = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)
    names = {m[1] or m[2] for path in RULE_FILES for m in pattern.finditer(path.read_text())}
    names |= {f"sweeps.{p.stem}" for p in (ROOT / "sweeps").glob("*.py") if p.stem != "__init__"}
    return sorted(names)


def test_the_probe_sees_the_rule_files_imports():
    """A parser that found nothing would pass: it finds the modules common.smk and tune_common.smk are known to use."""
    names = rule_file_imports()
    assert {"study.coldstart", "study.coldstart.store", "sweeps.expand", "study.run", "algorithms"} <= set(names)
    assert len(SWEEP_FILES) >= 8


def planning_probe(algorithms_root: Path = ROOT) -> dict[str, Any]:
    """The probe's findings: torch imported or not, the stack of its first import, the variants planning saw. The
    `algorithms` package is the one under `algorithms_root` (the repository's, or a copy holding a new variant)."""
    paths = list(dict.fromkeys([str(algorithms_root), str(ROOT)]))
    args = [json.dumps(rule_file_imports()), json.dumps([str(p) for p in SWEEP_FILES]), json.dumps(paths)]
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_planning_the_workflow_imports_no_torch():
    out = planning_probe()
    chain = "\n  ".join(out["chain"] or [])
    assert not out["torch"], f"planning imported torch; first import from:\n  {chain}"
    assert {"grpo", "gspo"} <= set(out["algorithms"])
