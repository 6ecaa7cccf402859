"""Shared test settings and fixtures: deterministic hypothesis runs without wall-clock deadlines (CI shares 2 cores),
one CPU thread per test (as the harness's runs use), what the environment must provide (STUDY_REQUIRE, checked at
the session's start), and the cold starts run tests start from, each trained once per session in a fresh process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.shared import REQUIREMENTS, ROOT, missing, require, required

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before any test where STUDY_REQUIRE names something this machine lacks, naming each; then, for the whole
    suite on pytest-xdist workers, start training the tiny default cold start (`_prebuild`)."""
    try:
        names = required()
    except ValueError as err:
        pytest.exit(str(err), returncode=pytest.ExitCode.USAGE_ERROR)
    gone = [f"{name}: {reason}" for name in sorted(names) if (reason := missing(name))]
    if gone:
        pytest.exit(f"STUDY_REQUIRE={os.environ['STUDY_REQUIRE']} but missing here: {'; '.join(gone)}", returncode=1)
    _prebuild(session.config)


def _requirement(name: str):  # type: ignore[no-untyped-def]
    @pytest.fixture(scope="session", name=f"requires_{name}")
    def fixture() -> None:
        require(name)

    return fixture


# `requires_vllm`, `requires_slurm`, ...: a test that uses one skips (or, under STUDY_REQUIRE, fails) without it
for _name in REQUIREMENTS:
    globals()[f"requires_{_name}"] = _requirement(_name)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test starts from the session's environment: an in-process vllm.LLM writes LD_PRELOAD (torch's libgomp),
    LD_LIBRARY_PATH, LOCAL_WORLD_SIZE and VLLM_* into os.environ, which every later child process would inherit."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------------
# Cold starts: each distinct one trained once per test run, by the harness's own entry point in a fresh process (the
# workflow's coldstart rule: python -m study.launch --coldstart), into one store keyed by the settings' hash (the
# directory name results/coldstart/{label}-{task}-{hash}). Under pytest-xdist the store lies in the directory common
# to the workers (the controller's base temp) and a file lock per cold start lets one worker train it while the others
# wait for it. Tests share it through symlinks (tests.shared.sharing_coldstart). The tests of the cold start itself
# (tests/study/coldstart) train their own.
# ---------------------------------------------------------------------------------------------------------------------
class ColdStarts:
    """The session's store of cold starts, `root`/coldstart/<dirname>."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.training: subprocess.Popen | None = None  # the training process while one runs

    def get(self, model: str = "tiny", task: str = "chain_sum", *, strict: bool = True, **settings: object) -> Path:
        """The directory of the cold start of `model` on `task` with further ColdStartSettings `settings` (band,
        knobs, ...; the defaults are a tiny run's with coldstart = auto), trained now unless the store has it."""
        from filelock import FileLock

        from study.coldstart import is_complete, read_record, resolve_settings

        name = resolve_settings(model, task, **settings).dirname
        directory = self.root / "coldstart" / name
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        with FileLock(self.root / "locks" / f"{name}.lock"):  # another worker may be training it: wait for it
            if not is_complete(directory):
                cmd = [
                    sys.executable,
                    "-m",
                    "study.launch",
                    "--coldstart",
                    model,
                    task,
                    "--results",
                    str(self.root),
                    "--coldstart-settings",
                    json.dumps(settings),
                ]
                env = {k: v for k, v in os.environ.items() if k != "STUDY_NATIVE"}  # the C kernels on, their default
                self.training = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
                try:
                    _, err = self.training.communicate(timeout=900)
                finally:
                    self.training.kill()  # (nothing when it has exited)
                    rc, self.training = self.training.wait(), None
                assert rc == 0 and is_complete(directory), f"{' '.join(cmd)}\n{err[-3000:]}"
        record = read_record(directory)
        assert not strict or record["status"] == "in_band", (directory, record["status"], record["pass_at_1"])
        return directory


def _prebuild_tiny(store: ColdStarts) -> None:
    with contextlib.suppress(Exception):  # a test that needs it trains it again, and reports why it failed
        store.get("tiny", "chain_sum")


def _prebuild(config: pytest.Config) -> None:
    """The whole suite on pytest-xdist workers (make test): the controller trains the tiny default cold start, which
    most run tests start from, in a thread from the start, so that no worker sits waiting for it."""
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None) or not whole_suite:
        return
    if getattr(config.option, "collectonly", False):
        return
    root = config._tmp_path_factory.getbasetemp() / "coldstarts"  # type: ignore[attr-defined]
    root.mkdir(exist_ok=True)
    store = ColdStarts(root)
    config.stash[_PREBUILT] = store
    threading.Thread(target=_prebuild_tiny, args=(store,), name="prebuild-tiny-coldstart", daemon=True).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    store = config.stash.get(_PREBUILT, None)
    if store is not None and store.training is not None:
        store.training.kill()  # a session ended before the training did


_PREBUILT = pytest.StashKey[ColdStarts]()


def store_root(factory: pytest.TempPathFactory) -> Path:
    """The cold-start store of this test run: under pytest-xdist in the controller's base temp, which holds every
    worker's (popen-gw0, popen-gw1, ...), so that the workers share it; else in the session's base temp."""
    base = factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "coldstarts"


@pytest.fixture(scope="session")
def coldstarts(tmp_path_factory: pytest.TempPathFactory) -> ColdStarts:
    root = store_root(tmp_path_factory)
    root.mkdir(exist_ok=True)
    return ColdStarts(root)


@pytest.fixture(scope="session")
def tiny_coldstart(coldstarts: ColdStarts) -> Path:
    """The tiny preset's default cold start on chain_sum: what a tiny run with coldstart = auto starts from (2-4 min
    to train, once per session)."""
    return coldstarts.get("tiny", "chain_sum")


@pytest.fixture(scope="session")
def easy_coldstart(coldstarts: ColdStarts) -> Path:
    """The tiny preset SFT'd on the default study's task (chain sums of 2-3 one-digit terms) until its held-out pass@1
    reaches 0.2 (~20 s): a start that earns reward in a few RL steps (the parallel-layout runs)."""
    return coldstarts.get("tiny", "chain_sum", band=[0.2, 0.9], knobs={"terms": [2, 3], "digits": 1})


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory, tiny_coldstart: Path) -> Path:
    """A results dir of the session holding the tiny cold start (symlinked from the store)."""
    root = tmp_path_factory.mktemp("results")
    (root / "coldstart").mkdir()
    (root / "coldstart" / tiny_coldstart.name).symlink_to(tiny_coldstart)
    return root


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """How many times this test run trained the tiny preset's default cold start (one: the shared store's). Under
    pytest-xdist this runs in the controller, whose base temp holds every worker's directories and the store."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or factory._basetemp is None:
        return
    from study.coldstart import resolve_settings

    name = resolve_settings("tiny", "chain_sum").dirname
    built = [Path(d) for d, _, files in os.walk(factory.getbasetemp()) if Path(d).name == name and "policy.pt" in files]
    if built:
        terminalreporter.write_line(f"tiny cold start {name}: trained {len(built)} time(s) in this session")
