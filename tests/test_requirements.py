"""What the environment must provide (tests/shared.py `require`): where STUDY_REQUIRE names something missing, the
session stops at its start naming it; elsewhere the tests that need it skip with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared import ROOT, required


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest (with `args`) on two tests of tests/study/rollout/test_vllm_engine.py with vLLM hidden (a `vllm`
    package on PYTHONPATH whose import fails, as a broken install's does)."""
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("hidden by tests/test_requirements.py")\n')
    env = {**os.environ, "PYTHONPATH": str(shadow.parent), **env}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *args,
        "-k",
        "own_process",
        "tests/study/rollout/test_vllm_engine.py",
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_required_vllm_that_does_not_import_stops_the_session(tmp_path: Path, workers: list[str]) -> None:
    proc = _pytest(tmp_path, *workers, STUDY_REQUIRE="vllm")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "missing here: vllm: `import vllm` fails (ImportError: hidden by tests/test_requirements.py)" in out, out


def test_an_unrequired_vllm_skips_with_the_reason(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, STUDY_REQUIRE="")
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr
    assert "SKIPPED [1]" in proc.stdout and "vllm: `import vllm` fails" in proc.stdout, proc.stdout


def test_an_unknown_requirement_is_an_error_naming_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUDY_REQUIRE", "vllm, gpu")
    with pytest.raises(
        ValueError, match="STUDY_REQUIRE = 'vllm, gpu': unknown gpu; valid: vllm, slurm, chromium, trackers"
    ):
        required()
    monkeypatch.setenv("STUDY_REQUIRE", " vllm,,slurm ")
    assert required() == {"vllm", "slurm"}
