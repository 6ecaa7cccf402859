"""The heap's pages: the entry points re-execute themselves once with glibc malloc tunables that put the heap on
transparent huge pages and keep the memory it frees (STUDY_HUGEPAGES=0 turns it off):

- `glibc.malloc.hugetlb=1`: malloc asks the kernel for 2 MiB pages (madvise MADV_HUGEPAGE);
- `glibc.malloc.mmap_threshold` 32 MiB (glibc's largest), `glibc.malloc.trim_threshold` 16 GiB and
  `glibc.malloc.top_pad` 64 MiB: a freed buffer stays in the heap for the next one instead of going back to the
  kernel, so a step's activations and gradients stop being faulted in afresh at every minibatch.

Why, measured on this project's CI machine kind (2-core VM, one thread per run; docs/performance.md, "Memory
pages"): the policy update at the routing study's shape (48M parameters, 64 experts, ~20 rows per expert per
minibatch) is memory-bound, and on a virtual machine a 4 KiB page's TLB miss is a nested page walk and its fault a
trip through the hypervisor. Huge pages alone made the update faster but phases that allocate and free large buffers
(the pi_old forward, the weight sync) slower: every fresh huge page is faulted in and zeroed again. Keeping freed
memory removes that: together, a step of the confirmation sweep's shape was 26% faster in a pair of runs started
together, page faults 17x fewer, peak RSS the same. The numbers a run computes are the same bit for bit (the same
kernels on the same values).

A tunable is read when the process starts, so it cannot be switched on from inside Python: `reexec` replaces the
process by the same command line with the tunables in its environment (same PID, so SLURM, submitit and Snakemake
see the same job), and its children inherit them. It does nothing where it cannot help or was decided already: not
Linux or not glibc >= 2.35 (older glibc ignores the hugetlb tunable), the kernel's THP mode `never`, or GLIBC_TUNABLES
already naming `glibc.malloc.hugetlb` (the user's choice stands; this also ends the re-execution). A malloc tunable
the user names is kept and not set again. Python code that calls study.rl.run itself sets the variable before
starting Python (`GLIBC_TUNABLES=$(python -c "from study.core import hugepages; print(hugepages.tunables({}))")`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
SETTINGS = (
    (TUNABLE, "1"),
    ("glibc.malloc.mmap_threshold", str(32 << 20)),
    ("glibc.malloc.trim_threshold", str(16 << 30)),
    ("glibc.malloc.top_pad", str(64 << 20)),
)
"""What the re-execution adds to GLIBC_TUNABLES (the module doc says why), hugetlb first."""
OFF_VAR = "STUDY_HUGEPAGES"
"""STUDY_HUGEPAGES=0: 4 KiB pages and malloc's defaults; unset or anything else: the tunables where the machine
allows."""
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_GLIBC = (2, 35)
MAX_ENV_STRING = 32 * 4096
"""The kernel's limit on one "NAME=value" string of a new process's environment (MAX_ARG_STRLEN, NUL included):
a GLIBC_TUNABLES that the tunables would take past it could not be passed to the re-executed process."""


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library's glibc, None for another C library or platform."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None where the kernel has none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    picked = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return picked[0] if picked else None


def items(environ: Mapping[str, str]) -> list[str]:
    """GLIBC_TUNABLES's items, "name=value" each, in order."""
    return [item for item in environ.get("GLIBC_TUNABLES", "").split(":") if item]


def tunable_value(environ: Mapping[str, str]) -> str | None:
    """The value GLIBC_TUNABLES gives glibc.malloc.hugetlb, None when it names none."""
    for item in items(environ):
        key, _, value = item.partition("=")
        if key == TUNABLE:
            return value
    return None


def why_not(environ: Mapping[str, str]) -> str | None:
    """Why this process should not re-execute with the tunable on this machine, or None when it should."""
    return reason(environ, platform=sys.platform, glibc=glibc_version(), mode=thp_mode())


def reason(environ: Mapping[str, str], *, platform: str, glibc: tuple[int, int] | None, mode: str | None) -> str | None:
    """`why_not` for a given platform, glibc (major, minor) and kernel THP mode."""
    if environ.get(OFF_VAR, "") == "0":
        return f"turned off ({OFF_VAR}=0)"
    if tunable_value(environ) is not None:
        return f"GLIBC_TUNABLES already sets {TUNABLE}"
    if platform != "linux":
        return f"not Linux ({platform})"
    if glibc is None or glibc < MIN_GLIBC:
        found = "another C library" if glibc is None else "glibc {}.{}".format(*glibc)
        return f"{found}; the tunable needs glibc >= {MIN_GLIBC[0]}.{MIN_GLIBC[1]}"
    if mode not in ("always", "madvise"):
        return f"the kernel's transparent huge pages are {mode or 'absent'}"
    size = len(f"GLIBC_TUNABLES={tunables(environ)}".encode(errors="surrogateescape")) + 1
    if size > MAX_ENV_STRING:
        return f"GLIBC_TUNABLES with the tunables would be {size} bytes, over the kernel's {MAX_ENV_STRING}"
    return None


def tunables(environ: Mapping[str, str]) -> str:
    """GLIBC_TUNABLES with SETTINGS added: the user's tunables first and kept, none of SETTINGS set twice."""
    own = items(environ)
    named = {item.partition("=")[0] for item in own}
    return ":".join([*own, *(f"{key}={value}" for key, value in SETTINGS if key not in named)])


def environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with SETTINGS added to GLIBC_TUNABLES (`tunables`; `reason` has made sure it names no
    glibc.malloc.hugetlb of its own)."""
    return {**environ, "GLIBC_TUNABLES": tunables(environ)}


def reexec(argv: Sequence[str] | None = None) -> None:
    """Replace this process by `argv` (default: its own command line, interpreter options included) with the
    tunables set, where `why_not` finds no reason against it (STUDY_HUGEPAGES=0 among them); otherwise return. An
    exec the kernel refuses (an environment too large to pass on) returns too, saying so on stderr: the process goes
    on with 4 KiB pages, as `describe` then records."""
    if why_not(os.environ) is not None:
        return
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, environment(os.environ))
    except OSError as err:
        print(f"huge pages: not re-executed with the malloc tunables ({err.strerror}); 4 KiB pages", file=sys.stderr)


def describe(environ: Mapping[str, str] = os.environ) -> str:
    """How this process's heap is paged, for a run's manifest: "huge pages (glibc.malloc.hugetlb=1, freed memory kept;
    THP madvise)", or "4 KiB pages (<why>)"."""
    value = tunable_value(environ)
    if value not in (None, "0") and sys.platform == "linux":
        named = {item.partition("=")[0] for item in items(environ)}
        kept = all(key in named for key, _ in SETTINGS[1:])
        return f"huge pages ({TUNABLE}={value}{', freed memory kept' if kept else ''}; THP {thp_mode() or 'absent'})"
    return f"4 KiB pages ({why_not(environ) or 'GLIBC_TUNABLES not set'})"
