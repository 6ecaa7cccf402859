"""Third-party scorers run in a locked-down worker process with a time limit.

reasoning-gym's scorers `eval` or sympy-parse the text they score (a model's answer, a user row's answer or problem).
Every verifier study.data.tasks cannot score with a grammar of its own runs here instead of in the harness's process:

- one worker process per set of verifiers, started on first use; it imports reasoning-gym and builds the scorers,
  then locks itself down before it reads the first request: no file descriptor beyond its request pipe (stdin), its
  reply pipe (stdout) and /dev/null (stderr); an unprivileged user when started as root; rlimits (no new files, no
  file growth, no processes, bounded memory); and a seccomp filter refusing every syscall that opens, creates,
  removes, renames or changes a file, starts a process or program, opens a socket, signals another process or lifts
  a limit. Code an answer smuggles into a scorer can compute, but it cannot write outside its pipe.
- each request has a time limit (`timeout_s`); a scorer that runs past it is killed with its worker (the next request
  starts a fresh one), one that raises or crashes its worker is reported the same way: `ScorerFailure`.
- requests and replies are JSON lines; nothing the worker sends is unpickled.

Code that runs inside the worker can still choose its own reply (a score in [0, 1]); the grammar-scored verifiers of
study.data.tasks are the ones a policy under RL should be trained on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from study.core.bounded import load_json

TIMEOUT_S = 5.0
"""Default time limit of one scoring request, seconds."""

START_TIMEOUT_S = 120.0
"""Time limit for a worker to import reasoning-gym, build its scorers and lock down."""

MEMORY_HEADROOM_BYTES = 2 << 30
"""Address space a worker may grow by after its imports (a scorer building a huge integer gets MemoryError)."""

_MAX_REPLY = 1 << 16


class ScorerFailure(RuntimeError):
    """A sandboxed scorer timed out, raised, or its worker died or could not start; the message says which."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


class Sandbox:
    """A worker process serving the scorers of `verifiers` (reasoning-gym task names), each request limited to
    `timeout_s` seconds. Thread-safe; `close` kills the worker."""

    def __init__(self, verifiers: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> None:
        self.verifiers = tuple(dict.fromkeys(verifiers))
        self.timeout_s = float(timeout_s)
        self.level = ""
        """How the running worker is locked down: "seccomp" (filter, rlimits, fds) or "rlimits" (no seccomp here)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ worker lifecycle

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "study.data.sandbox", json.dumps(self.verifiers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._proc, self._buf = proc, b""
        reply = self._read(START_TIMEOUT_S, "start")
        if "ready" not in reply:
            self._kill()
            raise ScorerFailure(f"sandbox worker did not start: {reply.get('error', reply)}")
        self.level = str(reply["ready"])
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """Kill the worker (a later request starts a new one)."""
        with self._lock:
            self._kill()

    def _read(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._kill()
                raise ScorerFailure(f"{what} timed out after {timeout_s:g} s")
            chunk = os.read(fd, 1 << 14)
            if not chunk:
                code = self._proc.wait()
                self._kill()
                raise ScorerFailure(f"{what}: sandbox worker died (exit status {code})")
            self._buf += chunk
            if len(self._buf) > _MAX_REPLY:
                self._kill()
                raise ScorerFailure(f"{what}: reply longer than {_MAX_REPLY} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = load_json(line)
        except ValueError:
            self._kill()
            raise ScorerFailure(f"{what}: malformed reply from the sandbox worker") from None
        if not isinstance(reply, dict):
            self._kill()
            raise ScorerFailure(f"{what}: malformed reply from the sandbox worker")
        return reply

    # ----------------------------------------------------------------------------------------------- scoring

    def score(self, verifier: str, answer: str | None, entry: Mapping[str, Any]) -> float:
        """reasoning-gym's score of `answer` for `entry` (question, answer, metadata) by `verifier`'s scorer, in
        [0, 1]; ScorerFailure when it times out, raises or its worker dies."""
        if verifier not in self.verifiers:
            raise ValueError(f"verifier {verifier!r} is not served by this sandbox; valid: {', '.join(self.verifiers)}")
        request = json.dumps({"verifier": verifier, "answer": answer, "entry": entry}, default=_jsonable)
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(request.encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._kill()
                raise ScorerFailure(f"{verifier}: sandbox worker died") from None
            reply = self._read(self.timeout_s, verifier)
        if "error" in reply:
            raise ScorerFailure(f"{verifier}: {str(reply['error'])[:300]}")
        value = reply.get("score")
        if not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
            raise ScorerFailure(f"{verifier}: score {str(value)[:50]} outside [0, 1]")
        return float(value)


_SANDBOXES: dict[str, Sandbox] = {}
_REGISTRY_LOCK = threading.Lock()


def sandbox_for(verifier: str) -> Sandbox:
    """The sandbox serving `verifier`: one started by `start` for it, else a new one for it alone."""
    with _REGISTRY_LOCK:
        if verifier not in _SANDBOXES:
            _SANDBOXES[verifier] = Sandbox((verifier,))
        return _SANDBOXES[verifier]


def start(verifiers: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> Sandbox:
    """One sandbox serving all of `verifiers` (one worker instead of one each), used for them from now on."""
    box = Sandbox(verifiers, timeout_s=timeout_s)
    with _REGISTRY_LOCK:
        for verifier in box.verifiers:
            _SANDBOXES[verifier] = box
    return box


@atexit.register
def close_all() -> None:
    """Kill every sandbox worker."""
    with _REGISTRY_LOCK:
        boxes = {id(b): b for b in _SANDBOXES.values()}.values()
        _SANDBOXES.clear()
    for box in boxes:
        box.close()


# ------------------------------------------------------------------------------------------------ worker side

# Syscalls the worker's seccomp filter refuses (EPERM), by architecture: whatever opens, creates, removes, renames or
# changes a file, starts a process or program, opens a socket, signals or inspects another process, or lifts a limit.
_DENY: dict[str, str] = {
    "x86_64": (
        "open=2 openat=257 openat2=437 creat=85 open_by_handle_at=304 name_to_handle_at=303 unlink=87 "
        "unlinkat=263 rename=82 renameat=264 renameat2=316 mkdir=83 mkdirat=258 rmdir=84 link=86 linkat=265 "
        "symlink=88 symlinkat=266 mknod=133 mknodat=259 chmod=90 fchmod=91 fchmodat=268 fchmodat2=452 "
        "chown=92 fchown=93 lchown=94 fchownat=260 truncate=76 ftruncate=77 utime=132 utimes=235 "
        "utimensat=280 futimesat=261 setxattr=188 lsetxattr=189 fsetxattr=190 removexattr=197 "
        "lremovexattr=198 fremovexattr=199 execve=59 execveat=322 fork=57 vfork=58 clone=56 clone3=435 "
        "socket=41 socketpair=53 connect=42 setrlimit=160 prlimit64=302 ptrace=101 kill=62 tkill=200 "
        "tgkill=234 rt_sigqueueinfo=129 rt_tgsigqueueinfo=297 pidfd_open=434 pidfd_getfd=438 "
        "pidfd_send_signal=424 process_vm_writev=311 io_uring_setup=425 mount=165 umount2=166 chroot=161 "
        "pivot_root=155 unshare=272 setns=308 "
    ),
    "aarch64": (
        "openat=56 openat2=437 open_by_handle_at=265 name_to_handle_at=264 unlinkat=35 renameat=38 "
        "renameat2=276 mkdirat=34 linkat=37 symlinkat=36 mknodat=33 fchmod=52 fchmodat=53 fchmodat2=452 "
        "fchown=55 fchownat=54 truncate=45 ftruncate=46 utimensat=88 setxattr=5 lsetxattr=6 fsetxattr=7 "
        "removexattr=14 lremovexattr=15 fremovexattr=16 execve=221 execveat=281 clone=220 clone3=435 "
        "socket=198 socketpair=199 connect=203 setrlimit=164 prlimit64=261 ptrace=117 kill=129 tkill=130 "
        "tgkill=131 rt_sigqueueinfo=138 rt_tgsigqueueinfo=240 pidfd_open=434 pidfd_getfd=438 "
        "pidfd_send_signal=424 process_vm_writev=271 io_uring_setup=425 mount=40 umount2=39 chroot=51 "
        "pivot_root=41 unshare=97 setns=268 "
    ),
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def _seccomp() -> bool:
    """Install the deny filter on this process (irrevocable, inherited); False where seccomp is unavailable."""
    import ctypes
    import errno
    import platform

    arch = platform.machine()
    if arch not in _DENY or not sys.platform.startswith("linux"):
        return False

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, kill_process, deny = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM
    numbers = sorted({int(pair.split("=")[1]) for pair in _DENY[arch].split()})
    prog: list[tuple[int, int, int, int]] = [
        (ld_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, _AUDIT_ARCH[arch]),
        (ret, 0, 0, kill_process),  # another ABI (i386 on x86_64): its numbers differ
        (ld_abs, 0, 0, 0),  # seccomp_data.nr
    ]
    checks = [(jge, 0x40000000)] if arch == "x86_64" else []  # the x32 ABI's numbers alias these with bit 30 set
    checks += [(jeq, nr) for nr in numbers]
    deny_at = len(prog) + len(checks) + 1  # after the checks and the allow
    prog += [(code, deny_at - (len(prog) + i) - 1, 0, k) for i, (code, k) in enumerate(checks)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p), 0, 0) == 0  # SECCOMP_MODE_FILTER


def _lock_down() -> str:
    """Lock this worker down (see the module doc); the level reached: "seccomp" or "rlimits"."""
    import resource

    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    if os.getuid() == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        except OSError:
            pass
    with open("/proc/self/statm", "rb") as f:
        vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    for limit, value in (
        (resource.RLIMIT_NOFILE, 3),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_AS, vm_bytes + MEMORY_HEADROOM_BYTES),
    ):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (value, value))
    return "seccomp" if _seccomp() else "rlimits"


def _worker(verifiers: Sequence[str]) -> None:
    import io
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills its workers

    def send(obj: dict[str, Any]) -> None:
        os.write(1, json.dumps(obj).encode() + b"\n")

    try:
        import numpy  # noqa: F401 - imported before the lock-down, as every scorer's lazy import is
        import sympy
        import sympy.parsing.sympy_parser  # noqa: F401
        from reasoning_gym.factory import get_score_answer_fn
    except Exception as e:
        send({"error": f"import failed ({type(e).__name__}: {e})"})
        return
    scorers: dict[str, Any] = {}
    for name in verifiers:
        try:
            scorers[name] = get_score_answer_fn(name)
        except Exception as e:
            scorers[name] = f"{type(e).__name__}: {e}"
            continue
        with contextlib.suppress(Exception):  # warm lazy imports inside the scorer
            scorers[name]("0", {"question": "", "answer": "0", "metadata": {}})
    level = _lock_down()
    sys.stdout = sys.stderr = io.StringIO()  # a scorer's prints must not reach the reply pipe
    send({"ready": level})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        sys.stdout = sys.stderr = io.StringIO()
        try:
            req = load_json(line)
            scorer = scorers[req["verifier"]]
            if isinstance(scorer, str):
                raise RuntimeError(f"scorer unavailable ({scorer})")
            value = float(scorer(req["answer"], req["entry"]))
            reply: dict[str, Any] = {"score": value if 0.0 <= value <= 1.0 else -1.0}
        except BaseException as e:
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        send(reply)


if __name__ == "__main__":
    _worker(load_json(sys.argv[1]))
