"""Nothing a scored text makes or finds outlives its child: System V and POSIX IPC objects it creates die with it
(they live in an IPC namespace of its own, and the filter refuses them), a secret in the harness's keyring is out of
its reach, and no request scored before it is in its frames or its objects. Where the lock-down cannot be had in
full, sandboxed verifiers are refused in one line naming why and the setting that accepts less, and the level a run
got is in its manifest.

Each hostile text replies 0.5 for itself once it has tried everything (a text may choose its own score): 0.5 shows
it ran to the end and found nothing; 1.0 that it found what it looked for."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from study.data import sandbox, tasks

ROOT = Path(__file__).resolve().parents[3]
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
ADD_KEY = {"x86_64": 248, "aarch64": 217}.get(platform.machine())
KEY_SPEC_SESSION_KEYRING = -3
KEYCTL_INVALIDATE = 21

pytestmark = pytest.mark.skipif(KEYCTL is None or not sys.platform.startswith("linux"), reason="Linux x86_64/aarch64")


@pytest.fixture(scope="module")
def box() -> Iterator[sandbox.Sandbox]:
    b = sandbox.start(("string_insertion",), timeout_s=30)  # the searches below take seconds on a loaded machine
    yield b
    b.close()


def _item(note: str = "") -> tasks.TaskItem:
    return tasks.TaskItem(
        task="user",
        prompt="insert\n",
        solution="#### abc",
        answer="abc",
        verifier="string_insertion",
        metadata={"note": note},
    )


def _text(source: str) -> str:
    """A response whose answer runs `source` in the string_insertion scorer (it evaluates the answer)."""
    return f"#### exec({source!r}, {{}})"


def _reply_half(source: str) -> str:
    """`source`, then the text's own reply: 1.0 where it set `found`, else 0.5."""
    return source + "\nos.write(3, b'{\"score\": 1.0}\\n' if found else b'{\"score\": 0.5}\\n')\nos._exit(0)\n"


# ---------------------------------------------------------------------------------------------- IPC objects


def _sysv(kind: str, key: int) -> list[int]:
    """Ids of the System V objects (`kind`: shm or msg) with `key`, as `ipcs -m` / `ipcs -q` list them."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return [int(line.split()[1]) for line in lines if int(line.split()[0]) == key]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _posix_queue_exists(name: bytes) -> bool:
    libc = _libc()
    fd = libc.mq_open(name, os.O_RDONLY)
    if fd >= 0:
        os.close(fd)
    return fd >= 0


def _remove_ipc(key: int, name: bytes) -> None:
    """Remove what a text left behind (where it could)."""
    libc = _libc()
    for ident in _sysv("shm", key):
        libc.shmctl(ident, 0, None)  # IPC_RMID
    for ident in _sysv("msg", key):
        libc.msgctl(ident, 0, None)
    libc.mq_unlink(name)


MAKE_IPC = """
import os, ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
made = []
shm = libc.shmget({key}, 1 << 20, 0o1600)
if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    if addr not in (None, ctypes.c_void_p(-1).value):
        ctypes.memset(addr, 7, 1 << 20)
        libc.shmdt(ctypes.c_void_p(addr))
    made.append('shm')
if libc.msgget({key}, 0o1600) >= 0:
    made.append('msg')
os.close(0)  # a descriptor for the queue under the child's limit of four
if libc.mq_open({name!r}, os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:
    made.append('mq')
"""


def test_ipc_objects_a_text_makes_die_with_its_child(box: sandbox.Sandbox) -> None:
    key, name = secrets.randbelow(1 << 30) + 1, f"/score{secrets.token_hex(6)}".encode()
    assert not _sysv("shm", key) and not _sysv("msg", key) and not _posix_queue_exists(name)
    try:
        source = _reply_half(MAKE_IPC.format(key=key, name=name) + "found = False")
        assert tasks.score(_item(), _text(source), partial_credit=True) == 0.5
        left = {"shm": _sysv("shm", key), "msg": _sysv("msg", key), "mq": _posix_queue_exists(name)}
        assert left == {"shm": [], "msg": [], "mq": False}, f"the text's IPC objects outlived it: {left}"
    finally:
        _remove_ipc(key, name)


# The child's own namespaces and keyring, without the filter (where a run accepts a weaker sandbox they are what is
# left): made in a child locked down as the sandbox locks its children down, its filter left off.
NAMESPACES_ALONE = """
import ctypes, json, os, sys
from study.data import sandbox
key, name, serial = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
kernel = sandbox._Kernel()
kernel.install = lambda: False
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
r, w = os.pipe()
parent = os.getpid()
pid = os.fork()
if pid == 0:
    os.close(r)
    os.dup2(w, 3)
    level, why = sandbox._lock_down(kernel, 1 << 40, parent)
    made = [libc.shmget(key, 4096, 0o1600) >= 0, libc.msgget(key, 0o1600) >= 0]
    os.close(0)
    made.append(libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)
    buf = ctypes.create_string_buffer(256)
    read = libc.syscall(kernel.keyctl, 11, ctypes.c_long(serial), buf, ctypes.c_long(256))
    out = {"level": level, "why": why, "made": made, "read": buf.raw[: max(read, 0)].decode()}
    os.write(3, json.dumps(out).encode())
    os._exit(0)
os.close(w)
out = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.fixture
def harness_key() -> Iterator[tuple[int, str, bytes]]:
    """A secret in this process's session keyring (as `keyctl add user NAME SECRET @s` puts it): (serial, secret,
    NAME)."""
    secret, description = f"harness-secret-{secrets.token_hex(8)}", f"score-test-{secrets.token_hex(4)}".encode()
    libc = _libc()
    serial = libc.syscall(
        ctypes.c_long(ADD_KEY),
        b"user",
        description,
        secret.encode(),
        ctypes.c_size_t(len(secret)),
        ctypes.c_long(KEY_SPEC_SESSION_KEYRING),
    )
    if serial < 0:
        pytest.skip(f"no session keyring here ({os.strerror(ctypes.get_errno())})")
    yield serial, secret, description
    libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(KEYCTL_INVALIDATE), ctypes.c_long(serial))


def test_the_namespaces_and_keyring_hold_without_the_filter(harness_key: tuple[int, str, bytes]) -> None:
    serial, secret, _ = harness_key
    key, name = secrets.randbelow(1 << 30) + 1, f"/score{secrets.token_hex(6)}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", NAMESPACES_ALONE, str(key), name, str(serial)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout)
        assert out["level"] == "ipc-ns+keyring", out
        assert out["made"] == [True, True, True], out  # made, in the child's own namespace
        assert secret not in out["read"] and out["read"] == "", out
        assert not _sysv("shm", key) and not _sysv("msg", key) and not _posix_queue_exists(name.encode())
    finally:
        _remove_ipc(key, name.encode())


# --------------------------------------------------------------------------------------------------- keyring

READ_KEYS = """
import os, ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(256)
ids = [{serial}]
for ring in (-3, -4, -5):  # the session, user and user-session keyrings
    found = libc.syscall({keyctl}, 10, ctypes.c_long(ring), b'user', {description!r}, ctypes.c_long(0))
    if found > 0:
        ids.append(found)
found = any(libc.syscall({keyctl}, 11, ctypes.c_long(k), buf, ctypes.c_long(256)) > 0 for k in ids)
"""


def test_no_scored_text_reads_the_harness_keyring(
    harness_key: tuple[int, str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    serial, _, description = harness_key
    b = sandbox.Sandbox(("string_insertion",), timeout_s=30)  # started while the harness holds the key
    monkeypatch.setitem(sandbox._SANDBOXES, "string_insertion", b)
    try:
        source = _reply_half(READ_KEYS.format(serial=serial, keyctl=KEYCTL, description=description))
        assert tasks.score(_item(), _text(source), partial_credit=True) == 0.5
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ earlier requests

FIND_EARLIER = """
import os, sys, gc
m = ''.join({parts!r})  # built at run time: the text holds no copy of it
mb = m.encode()
def hit(v):
    if isinstance(v, str):
        return v is not m and m in v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return v is not mb and mb in bytes(v)
    return False
def inside(v):
    if isinstance(v, dict):
        return any(hit(x) for x in v) or any(hit(x) for x in v.values())
    return isinstance(v, (list, tuple, set, frozenset)) and any(hit(x) for x in v)
found = False
f = sys._getframe()
while f is not None:
    found = found or any(hit(v) or inside(v) for v in list(f.f_locals.values()))
    f = f.f_back
found = found or any(hit(o) or inside(o) for o in gc.get_objects())
"""


def test_no_scored_text_sees_the_request_before_it(box: sandbox.Sandbox) -> None:
    parts = ["earlier", "-request-", secrets.token_hex(6)]
    marker = "".join(parts)
    earlier = _item(note=marker)  # its metadata, and its response, hold the marker
    assert tasks.score(earlier, f"#### {marker}") == 0.0
    assert tasks.score(_item(), _text(_reply_half(FIND_EARLIER.format(parts=parts))), partial_credit=True) == 0.5


# ------------------------------------------------------------------------------------------ refusal and level

# The harness under a filter refusing unshare and keyctl (as a container's may): its sandbox's children cannot have
# their namespace or keyring.
NO_NAMESPACES = """
import json, os, platform, sys
from study.data import sandbox, tasks
arch = platform.machine()
table = dict(pair.split("=") for pair in sandbox._DENY[arch].split())
real = sandbox._DENY
sandbox._DENY = {arch: f"unshare={table['unshare']} keyctl={table['keyctl']}"}
assert sandbox._Kernel().install()
sandbox._DENY = real
out = {}
try:
    sandbox.level("bitwise_arithmetic")
except sandbox.SandboxRefused as e:
    out["refused"] = str(e)
try:
    tasks.load_user_data(sys.argv[1], verifier="bitwise_arithmetic")
except sandbox.SandboxRefused as e:
    out["load"] = str(e)
from study.run.config import load_config
try:
    sets = ["task=user", f"data={sys.argv[1]}", "verifier=bitwise_arithmetic", "coldstart=scratch"]
    load_config(preset="tiny", sets=sets)
except ValueError as e:
    out["config"] = str(e)
os.environ[sandbox.WEAK_ENV] = "1"
out["level"] = sandbox.level("bitwise_arithmetic")
out["items"] = len(tasks.load_user_data(sys.argv[1], verifier="bitwise_arithmetic"))
print(json.dumps(out))
"""


def test_a_sandbox_below_the_full_level_is_refused_unless_accepted(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p\n", "answer": "7", "metadata": {"problem": "(3 | 4)"}}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != sandbox.WEAK_ENV}
    done = subprocess.run(
        [sys.executable, "-c", NO_NAMESPACES, str(rows)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    refused = out.get("refused", "")
    for part in ("seccomp", sandbox.FULL_LEVEL, "no ipc-ns: unshare: Operation not permitted", "no keyring: keyctl"):
        assert part in refused, refused
    assert f"set {sandbox.WEAK_ENV}=1" in refused and "\n" not in refused, refused
    assert out.get("load") == refused, out  # the refusal itself, before any row: not "failed on this row"
    assert out.get("config") == f"verifier = 'bitwise_arithmetic': {refused}", out
    assert out["level"] == "seccomp" and out["items"] == 1, out


def test_the_full_level_holds_here(box: sandbox.Sandbox) -> None:
    assert box.started() == sandbox.FULL_LEVEL == sandbox.level("string_insertion")


def test_the_manifest_records_the_level(tmp_path: Path) -> None:
    from study import lifecycle
    from study.run.config import load_config

    rows = tmp_path / "rows.jsonl"
    row = {"prompt": "p\n", "answer": "7", "metadata": {"problem": "(3 | 4)"}}
    rows.write_text("".join(json.dumps({**row, "prompt": f"p{i}\n"}) + "\n" for i in range(6)))
    sets = ["task=user", f"data={rows}", "verifier=bitwise_arithmetic", "eval_size=2", "coldstart=scratch"]
    assert lifecycle.manifest(load_config(preset="tiny", sets=sets))["scoring_sandbox"] == sandbox.FULL_LEVEL
    assert lifecycle.manifest(load_config(preset="tiny", sets=["coldstart=scratch"]))["scoring_sandbox"] is None


# ------------------------------------------------------------------------------------------------------ filter


def _verdict(prog: list[tuple[int, int, int, int]], arch: int, nr: int) -> int:
    """What the classic BPF program `prog` returns for a syscall `nr` of ABI `arch` (its loads, jumps and returns)."""
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == sandbox._LD_ABS:
            acc, pc = (arch if k == 4 else nr), pc + 1
        elif code in (sandbox._JEQ, sandbox._JGE):
            taken = acc == k if code == sandbox._JEQ else acc >= k
            pc += 1 + (jt if taken else jf)
        else:
            assert code == sandbox._RET, code
            return k


@pytest.mark.parametrize("arch", sorted(sandbox._DENY))
def test_the_filter_refuses_exactly_its_syscalls(arch: str) -> None:
    """Every syscall number of the deny list fails with EPERM, every other one is allowed (x86_64's x32 numbers, bit
    30 set, all fail), and another ABI's call kills the process; on this machine, that program is the one installed."""
    numbers = sorted({int(pair.split("=")[1]) for pair in sandbox._DENY[arch].split()})
    audit = sandbox._AUDIT_ARCH[arch]
    prog = sandbox._deny_filter(numbers, audit, x32=arch == "x86_64")
    assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in prog)
    for nr in range(1024):
        expected = sandbox._DENY_EPERM if nr in numbers else sandbox._ALLOW
        assert _verdict(prog, audit, nr) == expected, nr
        x32 = sandbox._DENY_EPERM if arch == "x86_64" else sandbox._ALLOW  # aarch64 has no such ABI
        assert _verdict(prog, audit, nr | 0x40000000) == x32, nr
        assert _verdict(prog, 0x40000003, nr) == sandbox._KILL_PROCESS  # i386
    if arch == platform.machine():
        installed = [(f.code, f.jt, f.jf, f.k) for f in sandbox._Kernel()._filters]
        assert installed == prog
