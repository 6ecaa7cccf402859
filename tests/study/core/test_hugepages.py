"""The entry points' re-execution with malloc's tunables (study/core/hugepages.py: transparent huge pages, freed memory
kept): when it happens, what it keeps (the PID, the command line, the user's own tunables), and that a run's manifest
records which pages it ran on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from study.core import hugepages

LINUX = {"platform": "linux", "glibc": (2, 36), "mode": "madvise"}


ASKED = {}  # on unless STUDY_HUGEPAGES=0
OFF = {"STUDY_HUGEPAGES": "0"}
KEPT = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:glibc.malloc.top_pad=67108864"
"""The tunables that keep freed memory in the heap, as SETTINGS writes them after glibc.malloc.hugetlb=1."""


def test_it_re_executes_by_default_on_a_linux_glibc_with_transparent_huge_pages() -> None:
    assert hugepages.reason({}, **LINUX) is None
    assert hugepages.reason({"STUDY_HUGEPAGES": "1"}, **{**LINUX, "mode": "always"}) is None


@pytest.mark.parametrize(
    ("environ", "machine", "why"),
    [
        (OFF, {}, "turned off (STUDY_HUGEPAGES=0)"),
        ({**ASKED, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}, "already sets"),  # the user's value stands
        ({**ASKED, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {}, "already sets"),  # what ends the re-execution
        (ASKED, {"platform": "darwin"}, "not Linux"),
        (ASKED, {"glibc": (2, 31)}, "glibc 2.31; the tunable needs glibc >= 2.35"),
        (ASKED, {"glibc": None}, "another C library"),
        (ASKED, {"mode": "never"}, "are never"),
        (ASKED, {"mode": None}, "are absent"),
    ],
)
def test_it_stays_put_where_the_tunable_cannot_help_or_was_decided(environ, machine, why) -> None:  # type: ignore[no-untyped-def]
    assert why in (hugepages.reason(environ, **{**LINUX, **machine}) or "")


def test_the_users_own_tunables_are_kept_and_not_set_twice() -> None:
    env = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1:{KEPT}", "HOME": "/h"}
    assert hugepages.tunable_value(env) == "1"
    assert hugepages.environment({})["GLIBC_TUNABLES"] == f"glibc.malloc.hugetlb=1:{KEPT}"
    own = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1024"})["GLIBC_TUNABLES"]
    assert own.split(":") == [
        "glibc.malloc.trim_threshold=1024",  # the user's value, not ours after it
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.mmap_threshold=33554432",
        "glibc.malloc.top_pad=67108864",
    ]


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(mode) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") is None


PROBE = """
import os, sys
from study.core import hugepages
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.flags.dont_write_bytecode, sys.argv[1:], flush=True)
hugepages.reexec()
print("done", flush=True)
"""


def _machine_allows() -> bool:
    return hugepages.why_not(ASKED) is None


def _environ(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "STUDY_HUGEPAGES")}, **extra}


@pytest.mark.skipif(not _machine_allows(), reason=f"no re-execution here: {hugepages.why_not(ASKED)}")
def test_the_process_re_executes_once_keeping_pid_options_and_arguments() -> None:
    env = _environ(GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    out = subprocess.run(
        [sys.executable, "-B", "-c", PROBE, "a b", "--x"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, done = out.stdout.splitlines()
    assert before.split(" ", 2)[2] == "1 ['a b', '--x']" and before.split()[1] == "glibc.malloc.arena_max=4"
    assert after.split()[0] == before.split()[0], "exec keeps the PID (what SLURM and Snakemake watch)"
    assert after.split()[1] == f"glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1:{KEPT}"
    assert after.split(" ", 2)[2] == before.split(" ", 2)[2], "the interpreter's options and the arguments survive"
    assert done == "done"


NEAR_THE_LIMIT = "glibc.malloc.arena_max=4:" + "x" * (128 * 1024 - 100)
"""A GLIBC_TUNABLES that passes the kernel's limit on one environment string (128 KiB) once the settings are added."""


def test_a_glibc_tunables_the_settings_would_take_past_the_kernels_limit_stays_put() -> None:
    # before: the re-execution's execve failed with E2BIG and every entry point died with a traceback
    near = {"GLIBC_TUNABLES": NEAR_THE_LIMIT}
    assert "over the kernel's 131072" in (hugepages.reason(near, **LINUX) or "")
    assert hugepages.reason({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, **LINUX) is None


@pytest.mark.skipif(not _machine_allows(), reason=f"no re-execution here: {hugepages.why_not(ASKED)}")
def test_an_entry_point_with_a_huge_glibc_tunables_runs_on() -> None:
    env = _environ(GLIBC_TUNABLES=NEAR_THE_LIMIT)
    out = subprocess.run([sys.executable, "-B", "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    before, done = out.stdout.splitlines()
    assert before.split()[1] == env["GLIBC_TUNABLES"] and done == "done"


@pytest.mark.slow
@pytest.mark.parametrize("asked", [True, False])
def test_a_cli_run_records_its_memory_pages_in_the_manifest(tmp_path: Path, asked: bool) -> None:
    env = _environ() if asked else _environ(STUDY_HUGEPAGES="0")
    cmd = [sys.executable, "-m", "study", "run", "--preset", "tiny", "--results", str(tmp_path), "--quiet"]
    cmd += ["--set", "coldstart=scratch", "--set", "steps=1", "--set", "eval_every=0", "--set", "checkpoint_every=0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    pages = json.loads((run_dir / "manifest.json").read_text())["memory_pages"]
    if asked and _machine_allows():
        assert pages.startswith("huge pages (glibc.malloc.hugetlb=1, freed memory kept; THP "), pages
    else:
        assert pages.startswith("4 KiB pages ("), pages
