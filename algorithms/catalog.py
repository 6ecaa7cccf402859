"""The registered variants' metadata (`Spec`: names, routing, ratio level, hyper-parameters and their ranges), read
without importing torch into this process: what the workflow's planning reads.

A variant file may import torch at module level, so a process that has not imported torch reads the variants from a
child process, `python -m algorithms --json`, once (about 0.2 s; 2 s more when a variant file imports torch). A
process that has imported torch already (a run, a test) reads its own registry.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import MappingProxyType

from algorithms import registry
from algorithms.registry import Range, Spec


def specs() -> dict[str, Spec]:
    """name -> Spec of every registered variant, in the registry's order."""
    if "torch" in sys.modules:  # the variants cost this process nothing more: its registry is the truth
        return {name: registry.get(name).spec for name in registry.names()}
    return _child_specs()


def names() -> list[str]:
    """The registered variants' names, in the registry's order."""
    return list(specs())


def spec(name: str) -> Spec:
    """The Spec of `name`; an unknown name raises listing the valid ones."""
    return registry.lookup(specs(), name)


@functools.cache
def _child_specs() -> dict[str, Spec]:
    root = registry.PACKAGE.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "algorithms", "--json"], cwd=root, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"importing the variants of {registry.PACKAGE} failed:\n{tail}")
    return {
        name: Spec(
            **{
                **doc,
                "hparams": MappingProxyType(doc["hparams"]),
                "ranges": MappingProxyType({k: Range(**bounds) for k, bounds in doc["ranges"].items()}),
            }
        )
        for name, doc in json.loads(proc.stdout).items()
    }
