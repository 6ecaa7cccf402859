"""What the sweeps tests share: the shipped sweep files; Snakemake in a child process that says on leaving whether it
imported torch, a dry run's job counts and the cold starts a sweep needs; and the probe of what planning the workflow
imports (tests/sweeps/test_torch_free.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from study.coldstart import resolve_settings
from study.coldstart.store import run_coldstart
from sweeps.expand import load_sweep
from tests.shared import ROOT

SWEEP_FILES = [
    p for p in sorted((ROOT / "sweeps").glob("*.yaml")) if p.name not in ("config.yaml", "config.schema.yaml")
]

# `python -m snakemake` that says on leaving whether it imported torch: planning a workflow must not (its dry runs
# would each load torch; tests/sweeps/test_torch_free.py names the import chain when one does)
SNAKEMAKE = [
    sys.executable,
    "-c",
    "import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
    "sys.argv[0] = 'snakemake'; from snakemake.cli import main; main()",
]


def snakemake(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Snakemake (SNAKEMAKE) with `args` in `cwd`, its output captured."""
    return subprocess.run([*SNAKEMAKE, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def planned_without_torch(proc: subprocess.CompletedProcess) -> bool:
    """Whether a `snakemake` process said on leaving that it never imported torch."""
    return "torch imported: False" in proc.stderr.splitlines()


def job_counts(stdout: str) -> dict[str, int]:
    """The "Job stats" table of a dry run: rule -> number of jobs."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", stdout, re.M) if m[1] != "total"}


def expected_coldstarts(path: Path) -> set[str]:
    """results/coldstart/<name> of the sweep's runs with coldstart = "auto" (what study.rl makes them use)."""
    runs = load_sweep(path).expand().values()
    return {coldstart_dir(c) for c in runs if c.coldstart == "auto"}


def coldstart_dir(cfg) -> str:
    """results/coldstart/<name> of a run with coldstart = "auto": its shape, task, band and task knobs."""
    return resolve_settings(cfg.model, cfg.task, **run_coldstart(cfg)).dirname


# ---------------------------------------------------------------------------------------------------------------------
# What planning the workflow imports
# ---------------------------------------------------------------------------------------------------------------------
RULE_FILES = sorted((ROOT / "sweeps" / "rules").glob("*.smk"))

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


def planning_probe(algorithms_root: Path = ROOT) -> dict[str, Any]:
    """The probe's findings: torch imported or not, the stack of its first import, the variants planning saw. The
    `algorithms` package is the one under `algorithms_root` (the repository's, or a copy holding a new variant)."""
    paths = list(dict.fromkeys([str(algorithms_root), str(ROOT)]))
    args = [json.dumps(rule_file_imports()), json.dumps([str(p) for p in SWEEP_FILES]), json.dumps(paths)]
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
