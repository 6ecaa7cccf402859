"""The registered variants' metadata (`Spec`: names, routing, ratio level, hyper-parameters and their ranges), read
without importing torch into this process: what the workflow's planning reads.

A variant file may import torch at module level, so the variants are imported in a child process (`python -m
algorithms --json`) and their metadata kept in the package's __pycache__/ under a hash of the package's sources: the
first plan after a change pays one torch import (about 2 s), every later one reads a file. A process that has
imported torch already (a run, a test) reads its own registry instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from types import MappingProxyType
from typing import Any

from algorithms import registry
from algorithms.registry import Range, Spec, UnknownAlgorithmError


def spec_document(spec: Spec) -> dict[str, Any]:
    """A Spec as JSON-ready data (ranges as their bounds)."""
    doc = {f: getattr(spec, f) for f in Spec.__dataclass_fields__}
    doc["hparams"] = dict(spec.hparams)
    doc["ranges"] = {k: {b: getattr(r, b) for b in ("ge", "gt", "le", "lt")} for k, r in spec.ranges.items()}
    return doc


def _spec(doc: dict[str, Any]) -> Spec:
    return Spec(
        **{
            **doc,
            "hparams": MappingProxyType(doc["hparams"]),
            "ranges": MappingProxyType({k: Range(**r) for k, r in doc["ranges"].items()}),
        }
    )


@functools.cache
def sources_hash() -> str:
    """A hash of every module of the package (read once a process): a new, changed or removed variant file changes
    it."""
    digest = hashlib.sha256()
    for path in sorted(registry.PACKAGE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def specs() -> dict[str, Spec]:
    """name -> Spec of every registered variant, in the registry's order."""
    if "torch" in sys.modules:  # the variants cost this process nothing more: its registry is the truth
        return {name: registry.get(name).spec for name in registry.names()}
    return _read(sources_hash())


def names() -> list[str]:
    """The registered variants' names, in the registry's order."""
    return list(specs())


def spec(name: str) -> Spec:
    """The Spec of `name`; an unknown name raises listing the valid ones."""
    known = specs()
    if name not in known:
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; valid names: {', '.join(known)}")
    return known[name]


@functools.cache
def _read(key: str) -> dict[str, Spec]:
    cache = registry.PACKAGE / "__pycache__" / f"specs-{key}.json"
    if cache.is_file():
        try:
            docs = json.loads(cache.read_text())
        except ValueError as err:
            raise ValueError(f"{cache}: not the variants' metadata ({err}); delete it, it is remade") from None
        return {name: _spec(doc) for name, doc in docs.items()}
    root = registry.PACKAGE.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "algorithms", "--json"], cwd=root, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"importing the variants of {registry.PACKAGE} failed:\n{tail}")
    docs = json.loads(proc.stdout)
    try:
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(docs))
        os.replace(tmp, cache)
    except OSError:  # a read-only checkout: every plan imports the variants in a child process
        pass
    return {name: _spec(doc) for name, doc in docs.items()}
