"""The one atomic file write of study/, sweeps/ and analysis/: a temporary file next to the target, fsynced, renamed
into place, so a crash or kill never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class WriteError(OSError):
    """A file could not be written (disk full, read-only, quota): the message names the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
"""The mode the process's umask gives an ordinary file."""


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary file next to `path`, fsync it, then rename it to `path`; returns `path`. The
    file gets the mode the umask gives an ordinary file (mkstemp's is 0600, unreadable
    by a group on a shared cluster)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path
    except (OSError, RuntimeError) as err:  # torch's writer raises RuntimeError on a full disk
        if isinstance(err, WriteError):
            _free(tmp)
            raise
        code = errno.EFBIG if _over_size_limit(err, tmp) else getattr(err, "errno", None) or errno.EIO
        _free(tmp)
        room = ""
        with contextlib.suppress(OSError):
            room = f"; {shutil.disk_usage(path.parent).free} bytes free on its filesystem"
        if code == errno.EFBIG:
            room = f"; the file size limit (ulimit -f) is {resource.getrlimit(resource.RLIMIT_FSIZE)[0]} bytes"
        failure = WriteError(f"{path}: could not be written ({_first_line(err)}{room})")
        failure.errno, failure.filename = code, str(path)
        raise failure from err
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> Path:
    """`text` (UTF-8) to `path`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes(path: Path, data: bytes) -> Path:
    """`data` to `path`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def write(path: Path, data: str | bytes) -> Path:
    """`data` to `path`, atomically: text as UTF-8, bytes as they are."""
    return write_text(path, data) if isinstance(data, str) else write_bytes(path, data)


def write_parquet(path: Path, df: Any) -> Path:
    """A pandas DataFrame to `path` as parquet (no index), atomically."""
    return atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def _over_size_limit(err: BaseException, tmp: Path) -> bool:
    """Whether a failed write hit the process's file size limit (ulimit -f, RLIMIT_FSIZE): EFBIG, or (torch's writer
    reports no errno) a temporary file that reached the limit."""
    if getattr(err, "errno", None) == errno.EFBIG:
        return True
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        return limit != resource.RLIM_INFINITY and tmp.stat().st_size >= limit
    except OSError:
        return False


def _free(tmp: Path) -> None:
    """Give back the space a failed temporary file holds, even while a writer still has it open (its handle lives on
    in the exception's traceback): truncate it, then remove it."""
    with contextlib.suppress(OSError):
        os.truncate(tmp, 0)
    tmp.unlink(missing_ok=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]
