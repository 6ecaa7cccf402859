"""The `study` console script (pyproject.toml's [project.scripts]), as installed beside the interpreter: the same
commands as `python -m study`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

COMMANDS = ("run", "resume", "coldstart", "status", "export", "plan")
SCRIPT = Path(sys.executable).parent / "study"


def _study(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), f"no {SCRIPT}: `pip install -e .` (make install) writes the console script"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_subcommands() -> None:
    proc = _study("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: study "), proc.stdout
    assert "{" + ",".join(COMMANDS) + "}" in proc.stdout, proc.stdout


def test_an_unknown_subcommand_fails_naming_the_valid_ones() -> None:
    proc = _study("train")
    assert proc.returncode == 2, proc.stderr
    assert "invalid choice: 'train'" in proc.stderr, proc.stderr
    assert all(f"'{command}'" in proc.stderr for command in COMMANDS), proc.stderr
