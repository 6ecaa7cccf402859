"""Every cross-reference the docs and the code's comments make resolves: a path names a file in the repository, a
dotted name (`study.rl.train`) a module and what it defines, a test named `file.py::test_x` a test in that file, a
relative markdown link a file. A module moved or renamed fails here instead of leaving a reader at a dead end."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("study", "algorithms", "analysis", "sweeps")
FOLDERS = (*PACKAGES, "tests", "benchmarks", "scripts", "docs", "slurm", "slurm-cpu")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, FOLDERS))})/[\w./-]*\w\.(?:py|md|yaml|sh|smk|c|rst))")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
TEST_ID = re.compile(r"([\w/]+\.py)::(\w+)")
LINK = re.compile(r"\]\(([^)#:\s]+\.md)(?:#[\w-]*)?\)")
# Named on purpose without being here: the variant the README shows a reader how to add, the cited projects' own
# files, a study name a test makes up, and a config key path in an expected error message.
NOT_HERE = {
    "README.md: algorithms/grpo_clip_higher.py",
    "docs/references.md: docs/about/performance-summary.md",
    "docs/references.md: scripts/run-qwen3-30B-A3B.sh",
    "tests/analysis/test_report.py: docs/studies/other.md",
    "tests/sweeps/test_tune.py: algorithms.grpo.hparams",
}


def _texts() -> dict[Path, str]:
    """The files whose prose may name other files: the docs, the READMEs, every source file, the sweep files."""
    files = [ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md"), *ROOT.joinpath("analysis").glob("*.md")]
    for folder in (*PACKAGES, "tests", "benchmarks", "scripts"):
        files += [p for p in ROOT.joinpath(folder).rglob("*") if p.suffix in (".py", ".sh", ".smk", ".yaml", ".md")]
    files += [ROOT / "Snakefile", ROOT / "Makefile", ROOT / "pyproject.toml"]
    this = Path(__file__).resolve()
    return {p: p.read_text() for p in files if p.is_file() and "__pycache__" not in p.parts and p != this}


@functools.cache
def _defined(module: Path) -> frozenset[str]:
    """The names a module defines at its top level, and `Class.attr` for its classes' attributes and methods."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
                    elif isinstance(item, ast.Assign):
                        names.update(f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names.update(t.id for t in elts if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _dotted_ok(name: str) -> bool:
    """`pkg.mod.Name.attr`: the module exists, and what follows it is defined there (a class's attribute checked, a
    function's not). `pkg.x` where x is neither a module nor a package is a variable of that name, not checked."""
    parts = name.split(".")
    if _module_file(parts[:2]) is None:
        return (
            not ROOT.joinpath(parts[0], parts[1]).exists() and not ROOT.joinpath(*parts[:2]).with_suffix(".py").exists()
        )
    for cut in range(len(parts), 1, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest or rest[0].isupper():  # the module itself, or a placeholder (`study.tools.NAME`)
            return True
        if _module_file([*parts[:cut], rest[0]]) is not None or ROOT.joinpath(*parts[:cut], rest[0]).is_dir():
            return False
        defined = _defined(module)
        return rest[0] in defined and (
            len(rest) == 1 or not _is_class(module, rest[0]) or ".".join(rest[:2]) in defined
        )
    return False


@functools.cache
def _is_class(module: Path, name: str) -> bool:
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.parse(module.read_text()).body)


def _broken() -> list[str]:
    out = []
    for path, text in _texts().items():
        where = path.relative_to(ROOT)
        for ref in PATH.findall(text):
            if "{" in ref or "*" in ref or "NAME" in ref or ref.startswith("results/"):
                continue
            if not (ROOT / ref).exists():
                out.append(f"{where}: {ref}")
        for ref in DOTTED.findall(text):
            if ref.endswith((".py", ".yaml", ".md")) or not ref.count("."):
                continue
            if not _dotted_ok(ref):
                out.append(f"{where}: {ref}")
        for file, test in TEST_ID.findall(text):
            target = ROOT / file if (ROOT / file).is_file() else None
            if target is not None and test not in _defined(target):
                out.append(f"{where}: {file}::{test}")
        if path.suffix == ".md":
            for link in LINK.findall(text):
                if not link.startswith("http") and not (path.parent / link).exists():
                    out.append(f"{where}: link {link}")
    return sorted(set(out) - NOT_HERE)


def test_every_cross_reference_resolves() -> None:
    broken = _broken()
    assert not broken, "references to nothing:\n" + "\n".join(broken)
