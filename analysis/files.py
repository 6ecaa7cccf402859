"""Writing analysis outputs: every file through one atomic write, so a kill never leaves a half-written file under
its final name (a temporary name in the same directory, fsynced, then renamed; removed if the write fails).

study/run/rundir.py holds the same contract for run directories; analysis/ imports nothing of study/ but its
dependency-free YAML/JSON reader (study/core/bounded.py), so it keeps its own copy of these few lines.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
