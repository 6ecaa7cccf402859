"""The GPU check on a machine that is not the developer's: a 64 MiB /dev/shm, a host name that resolves nowhere, a DNS
server that does not answer. Each is made in namespaces of its own (`unshare`: a mount namespace for /dev/shm and
/etc/resolv.conf, a UTS one for the host name, a network one with only loopback up, so that no packet leaves it),
and the check's preflight runs there as on such a machine: it fails only on what a run there would fail on."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from study.tools import gpu_check

ROOT = Path(__file__).resolve().parents[3]
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
UNROUTED_DNS = "10.255.255.1"
"""The unreachable DNS server: routed to loopback inside the namespace, where nothing answers and nothing leaves."""


def _unshare() -> list[str]:
    """The unshare command that gives this process mount, UTS and network namespaces (as root, or in a user
    namespace where unprivileged ones are allowed); the tests that need it skip, saying why, where none is."""
    missing = [tool for tool in ("unshare", "ip", "mount", "hostname") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the machine's conditions are made with unshare and ip")
    errors = []
    for cmd in (["unshare", "-m", "-u", "-n"], ["unshare", "-r", "-m", "-u", "-n"]):
        probe = subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"], capture_output=True)
        if probe.returncode == 0:
            return cmd
        errors.append(f"{' '.join(cmd)}: {probe.stderr.decode(errors='replace').strip()}")
    pytest.skip(f"mount, UTS and network namespaces are not permitted here ({'; '.join(errors)})")


def _machine(
    tmp_path: Path,
    parts: str,
    *,
    shm_mb: int | None = None,
    dns: str | None = None,
    env: dict[str, str] | None = None,
    child_selected: str | None = None,
) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """The check over `parts` in new namespaces: loopback up, /dev/shm a tmpfs of `shm_mb` MiB, and with `dns` a
    random host name (in no hosts file) and /etc/resolv.conf naming `dns` (127.0.0.1: refused at once; UNROUTED_DNS:
    no answer, a lookup waits out its timeout). Returns the process and the results file (with `child_selected`,
    one part's process alone, as the driver starts it for a check of those parts: its progress events)."""
    setup = ["ip link set lo up"]
    if shm_mb is not None:
        setup.append(f"mount -t tmpfs -o size={shm_mb}m tmpfs /dev/shm")
    if dns is not None:
        resolv = tmp_path / "resolv.conf"
        resolv.write_text(f"nameserver {dns}\n", encoding="utf-8")
        setup += [
            f"hostname gpu-check-{secrets.token_hex(6)}",
            f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf",
        ]
        if dns == UNROUTED_DNS:
            setup.append(f"ip route add {UNROUTED_DNS}/32 dev lo")
    out = tmp_path / "gpu_check.json"
    check = [sys.executable, "-m", "study.tools.gpu_check", "--parts", parts]
    if child_selected:
        out = tmp_path / "progress.jsonl"
        check += ["--child", str(out), "--selected", child_selected, "--dtype", "fp32"]
    else:
        check += ["--out", str(out)]
    script = " && ".join([*setup, "exec " + shlex.join(check)])
    base = {k: v for k, v in os.environ.items() if k not in LOOPBACK}  # the check's own choice, unless set
    full_env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    proc = subprocess.run(
        [*_unshare(), "bash", "-c", script], env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if child_selected:
        done = [json.loads(line) for line in out.read_text().splitlines() if '"done"' in line]
        return proc, {"parts": {e["part"]: e["entry"] for e in done}}
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_a_small_dev_shm_fails_no_check_without_an_engine(tmp_path: Path) -> None:
    """~35 s. /dev/shm of 64 MiB (a container's default): the engine's bucket and slack (320 MiB at the check's
    shape) do not fit, and no selected part starts an engine."""
    proc, results = _machine(tmp_path, "preflight", shm_mb=64)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pre = results["parts"]["preflight"]
    assert pre["status"] == "pass" and pre["shm_free_mb"] <= 64
    assert (pre["shm_need_mb"], pre["shm_for"]) == (0, [])


@pytest.mark.slow
def test_a_check_that_starts_the_engine_still_needs_its_shared_memory(tmp_path: Path) -> None:
    """~30 s. The same /dev/shm, the preflight's process of a check that starts the vLLM engine: it fails naming the
    need and the fix, where vLLM is installed (without vLLM the engine parts skip, and nothing needs /dev/shm)."""
    proc, results = _machine(tmp_path, "preflight", shm_mb=64, child_selected="preflight,vllm_parity")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pre = results["parts"]["preflight"]
    if gpu_check.has_vllm():
        assert pre["status"] == "fail" and "shared memory: the vllm engine needs" in pre["error"], pre
        assert "--shm-size" in pre["error"]
    else:
        assert pre["status"] == "pass" and pre["shm_for"] == []


def test_a_host_name_that_does_not_resolve_is_a_warning(tmp_path: Path) -> None:
    """A random host name, a DNS server that refuses: gloo binds loopback, the preflight passes and says so. The
    check sets the interface the environment leaves unset (GLOO_SOCKET_IFNAME) and keeps the one it names."""
    proc, results = _machine(tmp_path, "preflight", dns="127.0.0.1", env={"NCCL_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pre = results["parts"]["preflight"]
    assert pre["status"] == "pass" and results["interfaces_set_by_the_check"] == {"GLOO_SOCKET_IFNAME": "lo"}
    assert pre["network"]["GLOO_SOCKET_IFNAME"] == "lo" and "hostname_address" not in pre["network"]
    (warning,) = pre["warnings"]
    assert pre["network"]["hostname"] in warning and "does not resolve" in warning
    assert "gloo binds GLOO_SOCKET_IFNAME=lo" in warning
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("preflight:"))
    assert verdict.startswith("preflight: pass (warning: the host name"), verdict
    assert json.loads(proc.stdout.splitlines()[-1])["warnings"] == {"preflight": [warning]}


def test_a_dns_server_that_does_not_answer_delays_no_process_group(tmp_path: Path) -> None:
    """A random host name and a DNS server that never answers (a lookup waits ~10 s): the check binds loopback, so
    neither the world's group nor megatron's gloo groups look the host name up (each would wait the timeout);
    the preflight's own look-up gives up after HOSTNAME_LOOKUP_S with a warning."""
    proc, results = _machine(tmp_path, "preflight", dns=UNROUTED_DNS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pre = results["parts"]["preflight"]
    assert pre["status"] == "pass" and results["interfaces_set_by_the_check"] == LOOPBACK
    assert pre["network"]["interfaces_up"] == ["lo"] and pre["network"]["nccl_bootstrap"] == "lo"
    (warning,) = pre["warnings"]
    assert "did not resolve within 2 s" in warning  # HOSTNAME_LOOKUP_S
    assert pre["init_distributed_s"] < 5, pre  # one lookup of the host name takes ~10 s here


def test_each_part_process_destroys_its_process_groups(tmp_path: Path) -> None:
    """A part's process, its parts done: no torch.distributed group and no megatron parallel state left."""
    progress = tmp_path / "progress.jsonl"
    argv = ["--child", str(progress), "--parts", "preflight", "--dtype", "fp32"]  # a part's process, as the driver's
    code = (
        "import json, torch\n"
        "from megatron.core import parallel_state\n"
        "from study.tools import gpu_check\n"
        f"assert gpu_check.main({argv!r}) == 0\n"
        "print(json.dumps([torch.distributed.is_initialized(), parallel_state.model_parallel_is_initialized()]))\n"
    )
    env = {
        **os.environ,
        **LOOPBACK,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry = json.loads(progress.read_text().splitlines()[-1])["entry"]
    assert entry["status"] == "pass" and entry["backend"] == "gloo", entry  # the part created the groups
    assert json.loads(proc.stdout.splitlines()[-1]) == [False, False]


def test_the_parts_that_start_an_engine() -> None:
    assert gpu_check.engine_parts(gpu_check.PARTS, cuda=False, vllm=True) == ["vllm_parity", "weight_sync"]
    assert gpu_check.engine_parts(gpu_check.PARTS, cuda=True, vllm=True) == [
        "vllm_parity",
        "weight_sync",
        "r3_routes",
        "rl",
    ]
    assert gpu_check.engine_parts(gpu_check.PARTS, cuda=True, vllm=False) == []
    assert gpu_check.engine_parts(["preflight", "rl"], cuda=False, vllm=True) == []  # the hf engine on the CPU
