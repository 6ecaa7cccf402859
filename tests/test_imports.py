"""The walls between the packages, read from the source: every import statement (module level and inside
functions) of study/, algorithms/ and analysis/, checked against the rules study/__init__.py states, and no import
circle anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runfiles", "study", "algorithms", "analysis", "sweeps")
ROOMS = (
    "study.core",
    "study.run",
    "study.data",
    "study.policy",
    "study.rollout",
    "study.coldstart",
    "study.kernels",
    "study.tools",
)
# The RL loop at study/'s top: rl.py over the modules it is made of (none imports rl.py; the rooms import none of them)
LOOP = (
    "study.rl",
    "study.parts",
    "study.batch",
    "study.measures",
    "study.record",
    "study.checkpoint",
    "study.lifecycle",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every module `path` imports, by absolute name: `from a import b` counts a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules
            out.update(subs if len(subs) == len(node.names) else {base, *subs})
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, plus any megatron or transformers import (kept by top name)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = _imports(path, name, set(files))
        graph[name] = {t for t in targets if t in files} | {
            t.split(".")[0] for t in targets if t.split(".")[0] in ("megatron", "transformers")
        }
    return graph


GRAPH = _graph()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(source: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _in(m, source)
        for t in targets
        if any(_in(t, f) for f in forbidden) and not any(_in(t, a) for a in allowed)
    )


def test_the_graph_sees_the_packages() -> None:
    """A walker that found nothing would pass every wall: it finds the rooms and known edges."""
    assert all(any(_in(m, room) for m in GRAPH) for room in ROOMS)
    assert "study.policy.model" in GRAPH["study.rl"] and "study.rollout" in GRAPH["study.parts"]
    assert {"study.checkpoint", "study.lifecycle", "study.record", "study.parts"} <= GRAPH["study.rl"]
    assert "megatron" in GRAPH["study.policy.layers"] and "transformers" in GRAPH["study.rollout.hf"]


@pytest.mark.parametrize(
    ("source", "forbidden", "allowed"),
    [
        ("study.kernels", ("study", "megatron", "transformers"), ("study.kernels",)),
        ("study.policy", ("study.rollout",), ()),
        ("study.rollout", ("study.policy",), ()),
        (
            "study.data",
            ("study.policy", "study.rollout", "study.coldstart", "study.kernels", "megatron", "transformers"),
            (),
        ),
        ("study.run", ("study.policy", "study.rollout", "study.coldstart", "study.kernels"), ()),
        ("algorithms", ("study",), ()),
        ("runfiles", ("study", "algorithms", "analysis", "sweeps", "megatron", "transformers"), ()),
        ("analysis", ("study", "sweeps"), ()),
        *((room, LOOP, ()) for room in ROOMS if room != "study.tools"),
        ("study.lifecycle", ("study.policy", "study.rollout", *LOOP), ()),
        ("study.checkpoint", ("study.rollout", "study.parts", "study.lifecycle", "study.rl"), ()),
        ("study.record", ("study.policy", "study.rollout", "study.coldstart", *LOOP), ()),
        ("study.batch", ("study.rollout", *LOOP), ()),
        ("study.parts", ("study.rl", "study.checkpoint", "study.record"), ()),
        ("study.data", ("study.run",), ()),
    ],
)
def test_walls(source: str, forbidden: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    assert _violations(source, forbidden, allowed) == []


def test_only_entry_points_and_tools_import_the_loop() -> None:
    """study/rl.py is on top: within study/ only the launchers and the one-shot tools import it."""
    users = {m for m, targets in GRAPH.items() if _in(m, "study") and "study.rl" in targets}
    assert all(m in ("study.launch", "study.__main__") or _in(m, "study.tools") for m in users), sorted(users)


def test_nothing_below_the_loop_imports_the_tools() -> None:
    """study/tools/ holds what is run, not what is imported: the rooms and the modules the loop is made of import
    none of it (the planner's arithmetic, the atomic write are libraries: study/run/plan.py, runfiles/atomic.py)."""
    below = (*(r for r in ROOMS if r != "study.tools"), *(m for m in LOOP if m != "study.rl"))
    assert [v for source in below for v in _violations(source, ("study.tools",))] == []


ANALYSIS_FLOORS = ("runs", "stats", "claims", "figures", "report")
"""analysis/'s layers, bottom up: reading runs, statistics, the claims, drawing, the report (the CLI on top)."""


def test_analysis_is_built_in_floors() -> None:
    """Each of analysis/'s modules sits in one of its floors' folders (or is the package or its CLI), and imports only
    from its own floor or the ones below: no arrow back up."""
    floor = {name: i for i, name in enumerate(ANALYSIS_FLOORS)}
    up = []
    for m, targets in GRAPH.items():
        if not _in(m, "analysis") or m in ("analysis", "analysis.__main__"):
            continue
        own = m.split(".")[1]
        assert own in floor, f"{m} is in no floor's folder ({', '.join(ANALYSIS_FLOORS)})"
        lower = ("analysis", "analysis.__main__")
        up += [
            f"{m} imports {t}"
            for t in targets
            if _in(t, "analysis") and t not in lower and floor[t.split(".")[1]] > floor[own]
        ]
    assert up == []
    assert all(any(_in(m, f"analysis.{f}") for m in GRAPH) for f in ANALYSIS_FLOORS)


def _room(module: str) -> str:
    """The package a module belongs to for layering: study's subpackages and top modules, the other packages."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "study" and len(parts) > 1 else parts[0]


def test_no_import_circles_between_packages() -> None:
    """The modules merged into their packages (study.run, study.data, ..., algorithms, sweeps): still no circle, so
    the packages stack in floors."""
    rooms: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        rooms.setdefault(_room(m), set()).update(_room(t) for t in targets if t in GRAPH and _room(t) != _room(m))
    assert {"study.run", "study.data", "study.core", "algorithms", "sweeps"} <= set(rooms)
    circles = []
    for a in sorted(rooms):
        seen, todo = set(), list(rooms[a])
        while todo:
            b = todo.pop()
            if b not in seen:
                seen.add(b)
                todo.extend(rooms[b])
        if a in seen:
            circles.append(a)
    assert circles == []


def test_core_imports_no_other_room() -> None:
    """study/core/ is the shared library: it imports no other room, so every room can import it."""
    assert _violations("study.core", tuple(r for r in ROOMS if r != "study.core")) == []


def test_science_modules_name_no_kernel() -> None:
    """Only the two places that choose the speed paths name a kernel module (study/kernels/__init__.py)."""
    choosers = {"study.policy.layers", "study.rollout.hf", "study.lifecycle"}  # lifecycle asks whether they built
    users = {
        m
        for m, targets in GRAPH.items()
        if not _in(m, "study.kernels") and any(_in(t, "study.kernels") for t in targets)
    }
    assert users <= choosers, sorted(users - choosers)


def test_no_import_circles() -> None:
    """No cycle among the project's own modules (package parents an import runs implicitly are not edges)."""
    # a module importing itself is `python -m study.launch` re-entering through its import name (so pickles name
    # study.launch.Run): not a circle between modules
    own = {m: {t for t in targets if t in GRAPH and t != m} for m, targets in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(own[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(own):
        if node not in state:
            visit(node, [node])
    assert cycles == []
