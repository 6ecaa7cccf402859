"""Building and loading the kernels: study/kernels/csrc/*.c compiled on first use, loaded with ctypes.

At the tiny presets' sizes a torch op is a few microseconds of dispatch around a few of work, so the hot loops that
are many small ops (the rollout's decode step, the policy's RMSNorms, RoPE, core attention and loss) run as one C
call each where they can (study/kernels/__init__.py says when).

A shared object is built with the system's `cc` (`$CC`) into `$XDG_CACHE_HOME/moe-rl-study/` (default `~/.cache`),
named by a hash of its source, the flags and this CPU's model and flags, so a cluster's nodes of different CPU kinds
never load each other's build; it is written under a temporary name and renamed, so concurrent runs never load a
half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fopenmp-simd",
    "-std=gnu11",
    "-shared",
    "-fPIC",
)
LIBS = ("-lmvec", "-lm")  # glibc's vector math (expf over 16 lanes), libm


def _cpu_id() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """study/kernels/csrc/`name`.c compiled (once per source, flags and CPU kind) and loaded; None, with a warning,
    where it cannot be built."""
    source = CSRC / f"{name}.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        warnings.warn(f"no C compiler (cc, gcc or $CC): {name} runs as torch ops", stacklevel=2)
        return None
    key = hashlib.sha256(
        "\0".join([source.read_text(), cc, *FLAGS, *LIBS, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-rl-study"
    target = cache / f"{name}-{key}.so"
    if not target.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                part = Path(tmp) / target.name
                cmd = [*shlex.split(cc), *FLAGS, str(source), "-o", str(part), *LIBS]  # $CC may be "ccache gcc"
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                os.replace(part, target)  # atomic: a concurrent build or load sees all of it or nothing
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            warnings.warn(f"building {source.name} failed ({detail}); {name} runs as torch ops", stacklevel=2)
            return None
    return ctypes.CDLL(str(target))


PTR, I64, F64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
"""ctypes argument types of the kernels' signatures: pointers, int64_t, double, int."""


def bind(name: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """`load(name)` with each function's (argtypes, restype) from `signatures` declared; None where it does not
    load. Callers cache it (`functools.cache` on their `library()`)."""
    lib = load(name)
    if lib is None:
        return None
    for fn, (argtypes, restype) in signatures.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = restype
    return lib


def available() -> bool:
    """Whether every kernel of the package builds and loads here (what a run's manifest records)."""
    return all(load(p.stem) is not None for p in sorted(CSRC.glob("*.c")))
