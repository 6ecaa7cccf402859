"""Writing analysis outputs: every file through one atomic write, so a kill never leaves a half-written file under
its final name (a temporary name in the same directory, fsynced, then renamed; removed if the write fails); and
reading a run directory's small files without blocking on a FIFO or reading an outsized one whole (`read_regular`).

study/run/rundir.py holds the same contract for run directories; analysis/ imports nothing of study/ but its
dependency-free YAML/JSON reader (study/core/bounded.py), so it keeps its own copy of these few lines.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from study.core.bounded import read_bytes

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file next to `path`, fsync it, then rename it to `path` (mode by the umask,
    as an ordinary file would be: group-readable on a shared cluster where the umask says so)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write(path: Path, data: str | bytes) -> Path:
    """`data` to `path`, atomically: text as UTF-8, bytes as they are."""
    return write_text(path, data) if isinstance(data, str) else write_bytes(path, data)


def write_parquet(path: Path, df: Any) -> Path:
    """A pandas DataFrame to `path` as parquet (no index), atomically."""
    return atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def write_text(path: Path, text: str) -> Path:
    """`text` (UTF-8) to `path`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes(path: Path, data: bytes) -> Path:
    """`data` to `path`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


MAX_SMALL_BYTES = 16 << 20
"""Largest status.json, manifest.json or config file of a run read (a run's hold a few KB)."""


def read_regular(path: Path, limit: int = MAX_SMALL_BYTES) -> bytes:
    """The bytes of the regular file at `path`, opened without blocking (`study.core.bounded.read_bytes`): a FIFO, a
    device or a directory (a reader would wait for a writer forever) is refused, and so is a file over `limit`
    bytes (ValueError naming why); OSError as opening raises it (FileNotFoundError for none)."""
    return read_bytes(path, max_bytes=limit)


def check_regular(path: Path) -> Path:
    """`path`, when it is a regular file or absent (FileNotFoundError follows when it is read); ValueError when it
    is a FIFO, a directory or a device, which a table reader would block on or fail on obscurely."""
    if os.path.lexists(path) and not Path(path).is_file():
        raise ValueError("not a regular file")
    return path
