"""The one reader of YAML and JSON text: every config, sweep file, run record, checkpoint file and command-line
mapping the harness reads goes through `load_yaml` / `load_json` (or `read_yaml` / `read_json` for a file), so a
hostile document is refused before anything recurses on it.

Bounds, each a one-line error saying which:
- size: at most MAX_BYTES (8 MiB; a caller passes a larger `max_bytes` only for a file it knows is big, an HF
  tokenizer.json); a file's size is checked before it is read;
- depth: mappings and lists nested at most MAX_DEPTH (64) deep, checked on YAML's event stream before anything is
  built, and on JSON while it is parsed (the decoder's recursion refused, then the result walked without recursion);
- YAML aliases: at most MAX_NODES nodes once every alias is expanded (a "billion laughs" document is a few lines),
  and no alias inside the node it names (`&a {x: *a}` would build an object that contains itself);
- duplicate keys: a mapping with the same key twice is refused (YAML and JSON would keep the last silently).

YAML is parsed by yaml.SafeLoader (no Python objects); errors are yaml.YAMLError. JSON errors are ValueError:
json.JSONDecodeError for text that is not JSON, BoundError for a bound. tests/study/core/test_bounded.py fails if a
`yaml` or `json` load appears anywhere else in study/, sweeps/ or analysis/.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import yaml

MAX_DEPTH = 64
"""Deepest nesting of mappings and lists a document may have (a run config needs 3)."""

MAX_BYTES = 8 << 20
"""Largest document read, bytes."""

MAX_NODES = 1_000_000
"""Most YAML nodes a document may expand to through its aliases."""


class BoundError(ValueError):
    """A JSON document over a bound (size, depth, a duplicate key); the message says which."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {line}; first on line {seen[key]})", key_node.start_mark
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, *, max_bytes: int = MAX_BYTES) -> Any:
    """A YAML document, parsed safely and strictly: at most `max_bytes`, nested at most MAX_DEPTH deep and at most
    MAX_NODES nodes with its aliases expanded (both checked on the event stream, before any recursive step), no
    duplicate key. yaml.YAMLError on any violation."""
    if len(text) > max_bytes:
        raise yaml.YAMLError(f"larger than {max_bytes} bytes")
    total = 0  # nodes so far, every alias counted as the nodes it names
    opened: list[tuple[str | None, int]] = []  # (anchor, total at its start) of each open collection
    anchored: dict[str, int] = {}  # an anchored node's expanded size, for the aliases that name it
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(opened) == MAX_DEPTH:
                raise yaml.YAMLError(
                    f"nested deeper than {MAX_DEPTH} levels (line {event.start_mark.line + 1}); valid: a "
                    "mapping of config fields"
                )
            opened.append((event.anchor, total))
            total += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = opened.pop()
            if anchor is not None:
                anchored[anchor] = total - start
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in opened):
                raise yaml.YAMLError(
                    f"the alias *{event.anchor} stands inside its own anchor &{event.anchor} (line "
                    f"{event.start_mark.line + 1}): a document that contains itself; valid: aliases of finished nodes"
                )
            total += anchored.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor is not None:
                anchored[event.anchor] = 1
        if total > MAX_NODES:
            raise yaml.YAMLError(
                f"more than {MAX_NODES} values once its aliases are expanded (line {event.start_mark.line + 1})"
            )
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BoundError(f"duplicate key {key!r}")
        out[key] = value
    return out


def load_json(text: str | bytes, *, max_bytes: int = MAX_BYTES) -> Any:
    """A JSON document: at most `max_bytes`, nested at most MAX_DEPTH deep, no duplicate key. ValueError on any
    violation (json.JSONDecodeError with the line and column where the text stops being JSON, BoundError for a
    bound, UnicodeDecodeError for bytes that are not UTF-8)."""
    if len(text) > max_bytes:
        raise BoundError(f"larger than {max_bytes} bytes")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise BoundError(f"nested deeper than {MAX_DEPTH} levels") from None
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise BoundError(f"nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return data


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at `path`, opened without blocking: a FIFO, a device or a directory (a reader
    would wait for a writer forever, or never reach the end) is refused, and so is a file over `max_bytes`
    (BoundError saying which); OSError as opening raises it (FileNotFoundError for none)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
            raise BoundError(f"not a regular file ({kind})")
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise BoundError(f"{size} bytes, larger than {max_bytes} bytes")
        data = bytearray()
        while len(data) <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - len(data)))
            if not chunk:
                break
            data += chunk
        if len(data) > max_bytes:  # a file that grew while it was read
            raise BoundError(f"larger than {max_bytes} bytes")
        return bytes(data)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (`read_bytes`): BoundError past `max_bytes` or for a FIFO, device
    or directory, OSError where it cannot be read, UnicodeDecodeError where it is not UTF-8."""
    return read_bytes(path, max_bytes=max_bytes).decode("utf-8")


def read_json(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON document in `path` (`read_text`, then `load_json`); OSError or ValueError as those raise them."""
    return load_json(read_text(path, max_bytes=max_bytes), max_bytes=max_bytes)


def read_yaml(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> Any:
    """The YAML document in `path` (`read_text`, then `load_yaml`): yaml.YAMLError for a bound or text that is not
    YAML (UTF-8 included), OSError where it cannot be read."""
    try:
        text = read_text(path, max_bytes=max_bytes)
    except ValueError as err:  # BoundError, UnicodeDecodeError
        raise yaml.YAMLError(str(err)) from None
    return load_yaml(text, max_bytes=max_bytes)


def json_problem(err: ValueError) -> str:
    """Where and why a text is not JSON: `not valid JSON at line 2, column 12 (Expecting value)`."""
    if isinstance(err, json.JSONDecodeError):
        return f"not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})"
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text (byte {err.start}: {err.reason})"
    return f"not valid JSON ({err})"


def json_file_problem(err: OSError | ValueError) -> str:
    """Why `read_json` could not read a file: `unreadable (...)` for an OSError, else `json_problem`'s words."""
    if isinstance(err, OSError):
        return f"unreadable ({err})"
    return json_problem(err)
