"""The one bounded YAML/JSON reader (runfiles/bounded.py): its bounds, and that nothing in study/, sweeps/ or
analysis/ loads YAML or JSON around it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from runfiles import bounded

ROOT = Path(__file__).resolve().parents[2]
LOADS = {
    "yaml": {
        "load",
        "safe_load",
        "full_load",
        "unsafe_load",
        "load_all",
        "safe_load_all",
        "full_load_all",
        "unsafe_load_all",
        "compose",
        "compose_all",
        "parse",
    },
    "json": {"load", "loads"},
}
ALLOWED = {
    ("runfiles/bounded.py", "yaml.parse"),
    ("runfiles/bounded.py", "yaml.load"),
    ("runfiles/bounded.py", "json.loads"),
    ("algorithms/catalog.py", "json.loads"),
}
"""The loader itself: its event-stream depth check, its strict SafeLoader, its JSON decoder; and the variant catalog
(algorithms/ may not import study/), which reads only what its own `python -m algorithms --json` child wrote."""


def _direct_loads(path: Path, source: str) -> list[str]:
    """`module.function` of every call of a yaml/json load in `source`, the modules under any name they are imported
    as (`import json as j`, `from yaml import safe_load`)."""
    tree = ast.parse(source, str(path))
    modules: dict[str, str] = {}  # local name -> yaml | json
    functions: dict[str, str] = {}  # local name -> yaml.safe_load ...
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in LOADS:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in LOADS:
            for alias in node.names:
                if alias.name in LOADS[node.module]:
                    functions[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            module = modules[func.value.id]
            if func.attr in LOADS[module]:
                found.append(f"{module}.{func.attr}")
        elif isinstance(func, ast.Name) and func.id in functions:
            found.append(functions[func.id])
    return found


def _sources() -> list[tuple[str, str]]:
    """(path, Python source) of every module of runfiles/, study/, sweeps/, analysis/ and algorithms/, and of the
    Snakemake rules (Python with rule blocks: the Python lines that load are found by a pattern)."""
    out = []
    for package in ("runfiles", "study", "sweeps", "analysis", "algorithms"):
        out += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / package).rglob("*.py"))]
    return out


def test_no_yaml_or_json_load_outside_the_bounded_reader() -> None:
    sources = _sources()
    assert len(sources) > 100 and any(path == "study/run/config.py" for path, _ in sources)  # it sees the tree
    found = sorted((path, call) for path, source in sources for call in _direct_loads(Path(path), source))
    assert [f for f in found if f not in ALLOWED] == [], "load through runfiles.bounded instead"
    assert set(found) == ALLOWED, "the allow-list names a load that is gone: drop it"
    snakemake = [p for p in (ROOT / "sweeps").rglob("*.smk")] + [ROOT / "Snakefile"]
    pattern = re.compile(r"\b(yaml\.(safe_|full_|unsafe_)?load|json\.loads?)\s*\(")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in snakemake
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == [], "load through runfiles.bounded instead"


def test_the_scan_finds_every_spelling() -> None:
    """A scanner that finds nothing passes: it finds each way a load can be written."""
    source = (
        "import json, yaml\nimport json as j\nfrom yaml import safe_load as sl\nfrom json import loads\n"
        "json.loads('1'); j.load(f); yaml.safe_load(t); sl(t); loads(t); yaml.load(t, Loader=L); json.dumps(1)\n"
    )
    assert sorted(_direct_loads(Path("x.py"), source)) == sorted(
        ["json.loads", "json.load", "yaml.safe_load", "yaml.safe_load", "json.loads", "yaml.load"]
    )


@pytest.mark.parametrize("depth", [5000, 900, bounded.MAX_DEPTH + 1])
def test_json_nested_too_deep_is_refused(depth: int) -> None:
    with pytest.raises(bounded.BoundError, match=f"nested deeper than {bounded.MAX_DEPTH} levels"):
        bounded.load_json("[" * depth + "]" * depth)
    with pytest.raises(bounded.BoundError, match="nested deeper"):
        bounded.load_json('{"a": ' * depth + "1" + "}" * depth)


def test_json_at_the_bounds_loads() -> None:
    depth = bounded.MAX_DEPTH
    assert bounded.load_json("[" * depth + "]" * depth) is not None
    assert bounded.load_json('{"a": {"b": [1, 2]}, "c": null}') == {"a": {"b": [1, 2]}, "c": None}
    assert bounded.load_json(b'{"a": 1}') == {"a": 1}


def test_json_duplicate_keys_and_size_are_refused(tmp_path: Path) -> None:
    with pytest.raises(bounded.BoundError, match="duplicate key 'lr'"):
        bounded.load_json('{"lr": 1, "x": {"y": 2}, "lr": 2}')
    with pytest.raises(bounded.BoundError, match="duplicate key 'y'"):
        bounded.load_json('{"x": {"y": 1, "y": 2}}')
    with pytest.raises(bounded.BoundError, match="larger than 10 bytes"):
        bounded.load_json('{"a": 123456789}', max_bytes=10)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # a sparse file: its size is refused before a byte is read
        f.truncate(bounded.MAX_BYTES + 1)
    with pytest.raises(bounded.BoundError, match=f"{bounded.MAX_BYTES + 1} bytes, larger than {bounded.MAX_BYTES}"):
        bounded.read_json(big)
    with pytest.raises(yaml.YAMLError, match="larger than"):
        bounded.read_yaml(big)


def test_yaml_bounds() -> None:
    with pytest.raises(yaml.YAMLError, match="nested deeper than 64 levels"):
        bounded.load_yaml("a: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(yaml.YAMLError, match="duplicate key 'lr'"):
        bounded.load_yaml("lr: 1\nseed: 2\nlr: 3\n")
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )  # 10^9 values in nine lines
    with pytest.raises(yaml.YAMLError, match=f"more than {bounded.MAX_NODES} values once its aliases are expanded"):
        bounded.load_yaml(laughs)
    assert bounded.load_yaml("base: &b {lr: 1}\nrun: *b\n") == {"base": {"lr": 1}, "run": {"lr": 1}}


def test_json_that_is_not_json_keeps_its_position() -> None:
    with pytest.raises(json.JSONDecodeError) as err:
        bounded.load_json('{"a": 1,,}')
    assert (err.value.lineno, err.value.colno) == (1, 9)


@pytest.mark.parametrize(
    "text",
    ["&a {x: *a}", "&a [1, *a]", "base: &a {runs: [{inner: *a}]}\n", "vars: &v\n  self: *v\n"],
)
def test_yaml_that_contains_itself_is_refused(text: str, tmp_path: Path) -> None:
    """A self-referencing alias builds an object that contains itself: every reader would recurse forever on it."""
    with pytest.raises(yaml.YAMLError, match=r"the alias \*\w stands inside its own anchor"):
        bounded.load_yaml(text)
    (tmp_path / "sweep.yaml").write_text(text)
    with pytest.raises(yaml.YAMLError, match="inside its own anchor"):
        bounded.read_yaml(tmp_path / "sweep.yaml")
    assert bounded.load_yaml("a: &a [1]\nb: [*a, *a]\n") == {"a": [1], "b": [[1], [1]]}  # an alias of a finished node
