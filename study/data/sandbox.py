"""Third-party scorers run in a clean, locked-down process per request, with a time limit.

reasoning-gym's scorers `eval` or sympy-parse the text they score (a model's answer, a user row's answer or problem).
Every verifier study.data.tasks cannot score with a grammar of its own runs here instead of in the harness's process.
What the sandbox promises, and how:

- Nothing scored changes how anything else is scored. One server process per set of verifiers, started on first
  use, imports reasoning-gym, builds the scorers and, before it reads any request, forks its zygote: the process
  every child is forked from, which never reads a request and never runs a scored text. Each request is scored in a
  child forked for that request alone (forked ahead, while earlier requests score), which locks itself down,
  reads its request, scores, replies and exits. What a text does to the interpreter (rebinding `float`, patching a
  scorer, filling a cache) dies with its child; the next child is a copy of the same clean zygote, and no text,
  reference answer or metadata scored before it is anywhere in its memory (its frames, `gc.get_objects()`, its heap).
- A reply is the server's, not the scored code's. The child holds no descriptor of the server's pipes: its stdin is
  its own request pipe, its stdout and stderr /dev/null, and it writes its result on a reply pipe of its own (fd 3).
  The server reads that pipe to its end (the child's exit), accepts exactly one JSON line of at most
  `_MAX_CHILD_REPLY` bytes holding a score or an error (anything else is an error: "malformed reply"), and answers
  the harness with the request's id. The harness takes exactly one reply per request, with that id, no longer than
  `_MAX_REPLY` bytes, no deeper than JSON's nesting allows; any other reply (bad JSON, a wrong id, extra lines, too
  deep, too big, none in time) kills and restarts the server and fails the request.
- The child computes in the dark: the server runs with an allow-listed environment (`server_env`: no secret of the
  harness reaches it) in `/`; the child enters an IPC namespace of its own (with a user namespace of its own where
  it runs unprivileged), so the System V shared memory, semaphores and message queues and the POSIX message queues a
  text creates die with it; it joins a fresh anonymous session keyring (the harness's keys are not its own); it
  switches to an unprivileged user when started as root, dies with its zygote, takes rlimits (no new files, no file
  growth, no processes, bounded memory) and a seccomp filter refusing every syscall that opens, creates, removes,
  renames or changes a file or reads any path's metadata (stat, access, readlink, xattrs, statfs: `os.stat` fails on
  every path), starts a process or program, opens a socket, signals, reads or writes another process, lifts a
  limit, touches a keyring or System V or POSIX IPC.
- The lock-down is named by what it reached, `FULL_LEVEL` ("seccomp+ipc-ns+keyring") where all of it holds. Where the
  filter or a namespace cannot be had, the sandbox refuses to score (`SandboxRefused`, one line naming what is
  missing and why) unless `STUDY_ALLOW_WEAK_SANDBOX=1` accepts the lower level; never a silent downgrade. `level`
  says what a verifier's children reach (a run's manifest records it).
- Each request has a time limit (`timeout_s`): a child that runs past it is killed. A request that times out, raises,
  crashes its child or gets a malformed reply raises `ScorerFailure` (study.data.tasks scores it 0 and counts it).

Code a text smuggles into a scorer still chooses its own reply (a score in [0, 1]) and nothing else; the
grammar-scored verifiers of study.data.tasks are the ones a policy under RL should be trained on.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import io
import itertools
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runfiles.bounded import load_json

TIMEOUT_S = 5.0
"""Default time limit of one scoring request, seconds."""

START_TIMEOUT_S = 120.0
"""Time limit for a server to import reasoning-gym, build its scorers and fork its first locked-down child."""

SERVER_SLACK_S = 5.0
"""How long past a request's time limit the harness waits for the server's answer before it kills the server."""

MEMORY_HEADROOM_BYTES = 2 << 30
"""Address space a child may grow by beyond its server's (a scorer building a huge integer gets MemoryError)."""

FULL_LEVEL = "seccomp+ipc-ns+keyring"
"""The lock-down of a child where every part of it holds (the module doc); anything less is refused by default."""

WEAK_ENV = "STUDY_ALLOW_WEAK_SANDBOX"
"""Set to 1, sandboxed verifiers score in children locked down below FULL_LEVEL (the level reached is recorded)."""

_MAX_REPLY = 1 << 12
_MAX_CHILD_REPLY = 1 << 12
_ENV_ALLOWED = ("PYTHONHOME", "LANG", "LC_ALL", "LC_CTYPE")
"""Variables of the harness's environment the server inherits (besides the PYTHONPATH and thread caps it is given)."""


class ScorerFailure(RuntimeError):
    """A sandboxed scorer timed out, raised or crashed, its reply was malformed, or its server died or could not
    start; the message says which."""


class SandboxRefused(ScorerFailure):
    """The sandbox's children cannot reach FULL_LEVEL here and WEAK_ENV does not accept less; the message says what
    is missing, why, and how to accept it."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


HUGE_PAGES = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
"""The server's heap on transparent huge pages (study/core/hugepages.py; not where STUDY_HUGEPAGES=0 or the machine
has none): every object the server builds comes from malloc, which asks for 2 MiB pages, so the fork of each child
copies one page-table entry per 2 MiB instead of one per 4 KiB page of the ~90 MB of scorers, and its exit frees as
few. Measured on a loaded 2-core machine (benchmarks/bench_sandbox.py's verifiers): 4.8 -> 3.2 ms per score."""


def server_env() -> dict[str, str]:
    """The server's whole environment: the allow-listed variables of this one, this repository on PYTHONPATH,
    single-threaded numeric libraries, and the heap on huge pages (`HUGE_PAGES`) where the machine has them."""
    from study.core import hugepages

    root = str(Path(__file__).resolve().parents[2])
    env = {k: os.environ[k] for k in _ENV_ALLOWED if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    if hugepages.why_not({k: v for k, v in os.environ.items() if k == hugepages.OFF_VAR}) is None:
        env.update(HUGE_PAGES)
    return env


class Sandbox:
    """A server process scoring requests for the scorers of `verifiers` (reasoning-gym task names), each in a fresh
    child limited to `timeout_s` seconds. Thread-safe; `close` kills the server."""

    def __init__(self, verifiers: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> None:
        self.verifiers = tuple(dict.fromkeys(verifiers))
        self.timeout_s = float(timeout_s)
        self.level = ""
        """How the children are locked down (FULL_LEVEL, or less where WEAK_ENV accepts it); "" before the start."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ server lifecycle

    def _command(self) -> list[str]:
        """The server's command line: its verifiers, time limit and the level every child must reach ("": any)."""
        required = "" if os.environ.get(WEAK_ENV) == "1" else FULL_LEVEL
        return [
            sys.executable,
            "-P",
            "-m",
            "study.data.sandbox",
            json.dumps(self.verifiers),
            repr(self.timeout_s),
            required,
        ]

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            self._command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=server_env(),
            cwd="/",
            close_fds=True,
        )
        self._proc, self._buf = proc, b""
        reply = self._read(START_TIMEOUT_S, "start", 0)
        if "ready" not in reply:
            self._kill()
            raise ScorerFailure(f"sandbox server did not start: {str(reply.get('error', reply))[:300]}")
        self.level = str(reply["ready"])
        if self.level != FULL_LEVEL and os.environ.get(WEAK_ENV) != "1":
            self._kill()
            raise SandboxRefused(
                f"sandboxed verifiers refused: their scoring sandbox reaches {self.level} here, not {FULL_LEVEL} "
                f"({str(reply.get('why', ''))[:150]}); set {WEAK_ENV}=1 to score them with {self.level} only"
            )
        return proc

    def _running(self) -> None:
        """Start the server unless it runs (the caller holds the lock)."""
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """Kill the server (a later request starts a new one)."""
        with self._lock:
            self._kill()

    def _malformed(self, what: str, why: str) -> ScorerFailure:
        self._kill()
        return ScorerFailure(f"{what}: malformed reply from the sandbox server ({why}); server restarted")

    def _read(self, timeout_s: float, what: str, request_id: int) -> dict[str, Any]:
        """The server's one reply to request `request_id`; the server is killed (ScorerFailure) on anything else."""
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
                raise ScorerFailure(f"{what}: sandbox server died (exit status {code})")
            self._buf += chunk
            if len(self._buf) > _MAX_REPLY:
                raise self._malformed(what, f"longer than {_MAX_REPLY} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        if self._buf:
            raise self._malformed(what, "more than one line")
        try:
            reply = load_json(line)
        except ValueError as e:
            raise self._malformed(what, f"not JSON: {e}") from None
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            raise self._malformed(what, f"not an object with id {request_id}")
        return reply

    def started(self) -> str:
        """Start the server unless it runs; the level its children reach (SandboxRefused where it is below
        FULL_LEVEL and WEAK_ENV does not accept it)."""
        with self._lock:
            self._running()
            return self.level

    # ----------------------------------------------------------------------------------------------- scoring

    def score(self, verifier: str, answer: str | None, entry: Mapping[str, Any]) -> float:
        """reasoning-gym's score of `answer` for `entry` (question, answer, metadata) by `verifier`'s scorer, in
        [0, 1], computed in a fresh child; ScorerFailure when it times out, raises, crashes or replies malformed."""
        if verifier not in self.verifiers:
            raise ValueError(f"verifier {verifier!r} is not served by this sandbox; valid: {', '.join(self.verifiers)}")
        request = json.dumps({"verifier": verifier, "answer": answer, "entry": entry}, default=_jsonable)
        with self._lock:
            self._running()
            assert self._proc is not None and self._proc.stdin is not None
            request_id = next(self._ids)
            try:
                self._proc.stdin.write(f"{request_id} ".encode() + request.encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._kill()
                raise ScorerFailure(f"{verifier}: sandbox server died") from None
            reply = self._read(self.timeout_s + SERVER_SLACK_S, verifier, request_id)
        if "error" in reply:
            raise ScorerFailure(f"{verifier}: {str(reply['error'])[:300]}")
        value = reply.get("score")
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= float(value) <= 1.0:
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


def level(verifier: str) -> str:
    """How the children scoring `verifier` are locked down (FULL_LEVEL, or less where WEAK_ENV accepts it), its
    sandbox started if it is not running; SandboxRefused where the level is below FULL_LEVEL and not accepted."""
    return sandbox_for(verifier).started()


def start(verifiers: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> Sandbox:
    """One sandbox serving all of `verifiers` (one server instead of one each), used for them from now on."""
    box = Sandbox(verifiers, timeout_s=timeout_s)
    with _REGISTRY_LOCK:
        for verifier in box.verifiers:
            _SANDBOXES[verifier] = box
    return box


@atexit.register
def close_all() -> None:
    """Kill every sandbox server."""
    with _REGISTRY_LOCK:
        boxes = {id(b): b for b in _SANDBOXES.values()}.values()
        _SANDBOXES.clear()
    for box in boxes:
        box.close()


# ------------------------------------------------------------------------------------------------ server side

# Syscalls a child's seccomp filter refuses (EPERM), by architecture: whatever opens, creates, removes, renames or
# changes a file or reads its metadata, starts a process or program, opens a socket, signals, reads or writes
# another process, lifts a limit, touches a keyring, or makes or reaches a System V or POSIX IPC object.
_DENY: dict[str, str] = {
    "x86_64": (
        "open=2 openat=257 openat2=437 creat=85 open_by_handle_at=304 name_to_handle_at=303 unlink=87 "
        "unlinkat=263 rename=82 renameat=264 renameat2=316 mkdir=83 mkdirat=258 rmdir=84 link=86 linkat=265 "
        "symlink=88 symlinkat=266 mknod=133 mknodat=259 chmod=90 fchmod=91 fchmodat=268 fchmodat2=452 "
        "chown=92 fchown=93 lchown=94 fchownat=260 truncate=76 ftruncate=77 utime=132 utimes=235 "
        "utimensat=280 futimesat=261 setxattr=188 lsetxattr=189 fsetxattr=190 removexattr=197 "
        "lremovexattr=198 fremovexattr=199 stat=4 lstat=6 newfstatat=262 statx=332 access=21 faccessat=269 "
        "faccessat2=439 readlink=89 readlinkat=267 statfs=137 getxattr=191 lgetxattr=192 listxattr=194 "
        "llistxattr=195 chdir=80 inotify_add_watch=254 execve=59 execveat=322 fork=57 vfork=58 clone=56 "
        "clone3=435 socket=41 socketpair=53 connect=42 setrlimit=160 prlimit64=302 ptrace=101 kill=62 tkill=200 "
        "tgkill=234 rt_sigqueueinfo=129 rt_tgsigqueueinfo=297 pidfd_open=434 pidfd_getfd=438 "
        "pidfd_send_signal=424 process_vm_readv=310 process_vm_writev=311 io_uring_setup=425 mount=165 "
        "umount2=166 chroot=161 pivot_root=155 unshare=272 setns=308 quotactl=179 open_tree=428 move_mount=429 "
        "fsopen=430 fsmount=432 fspick=433 keyctl=250 add_key=248 request_key=249 shmget=29 shmat=30 shmctl=31 "
        "shmdt=67 semget=64 semop=65 semctl=66 semtimedop=220 msgget=68 msgsnd=69 msgrcv=70 msgctl=71 mq_open=240 "
        "mq_unlink=241 mq_timedsend=242 mq_timedreceive=243 mq_notify=244 mq_getsetattr=245 "
    ),
    "aarch64": (
        "openat=56 openat2=437 open_by_handle_at=265 name_to_handle_at=264 unlinkat=35 renameat=38 "
        "renameat2=276 mkdirat=34 linkat=37 symlinkat=36 mknodat=33 fchmod=52 fchmodat=53 fchmodat2=452 "
        "fchown=55 fchownat=54 truncate=45 ftruncate=46 utimensat=88 setxattr=5 lsetxattr=6 fsetxattr=7 "
        "removexattr=14 lremovexattr=15 fremovexattr=16 newfstatat=79 statx=291 faccessat=48 faccessat2=439 "
        "readlinkat=78 statfs=43 getxattr=8 lgetxattr=9 listxattr=11 llistxattr=12 chdir=49 "
        "inotify_add_watch=27 execve=221 execveat=281 clone=220 clone3=435 socket=198 socketpair=199 "
        "connect=203 setrlimit=164 prlimit64=261 ptrace=117 kill=129 tkill=130 tgkill=131 rt_sigqueueinfo=138 "
        "rt_tgsigqueueinfo=240 pidfd_open=434 pidfd_getfd=438 pidfd_send_signal=424 process_vm_readv=270 "
        "process_vm_writev=271 io_uring_setup=425 mount=40 umount2=39 chroot=51 pivot_root=41 unshare=97 "
        "setns=268 quotactl=60 open_tree=428 move_mount=429 fsopen=430 fsmount=432 fspick=433 keyctl=219 "
        "add_key=217 request_key=218 mq_open=180 mq_unlink=181 mq_timedsend=182 mq_timedreceive=183 mq_notify=184 "
        "mq_getsetattr=185 msgget=186 msgctl=187 msgrcv=188 msgsnd=189 semget=190 semctl=191 semtimedop=192 "
        "semop=193 shmget=194 shmctl=195 shmat=196 shmdt=197 "
    ),
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_NEWIPC, _CLONE_NEWUSER = 0x08000000, 0x10000000


_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06  # classic BPF: load seccomp_data word, jump if ==, if >=, return
_ALLOW, _KILL_PROCESS, _DENY_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM
_LEAF = 8
"""Most syscall numbers a leaf of the filter's search tree compares one by one."""


def _deny_filter(numbers: Sequence[int], audit_arch: int, *, x32: bool) -> list[tuple[int, int, int, int]]:
    """The child's seccomp program, (code, jt, jf, k) instructions: another ABI than `audit_arch` kills the process
    (its numbers differ: i386 on x86_64), a syscall number in `numbers` (sorted) fails with EPERM, any other is
    allowed; `x32`: numbers with bit 30 set (the x32 ABI's, which alias these) fail too. The numbers are found by a
    binary search (`>=` at each node, `==` in leaves of at most `_LEAF`): the kernel emulates a filter for every
    syscall number when it installs it (to cache the ones it always allows) and compiles it, so a search tree
    installs in 75 us where a chain of one comparison per number took 190 (x86_64, a 2-core VM; leaves of 4: 86 us,
    of 16: 81)."""

    def search(nums: Sequence[int]) -> list[tuple[int, int, int, int]]:
        if len(nums) <= _LEAF:  # each match jumps past the allow to the deny after it
            return [(_JEQ, len(nums) - i, 0, nr) for i, nr in enumerate(nums)] + [
                (_RET, 0, 0, _ALLOW),
                (_RET, 0, 0, _DENY_EPERM),
            ]
        half = len(nums) // 2
        high, low = search(nums[half:]), search(nums[:half])
        if len(high) > 255:  # a jump's offset is one byte
            raise ValueError(f"{len(nums)} syscall numbers: too many for one filter")
        return [(_JGE, 0, len(high), nums[half]), *high, *low]

    prog = [
        (_LD_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 1, 0, audit_arch),
        (_RET, 0, 0, _KILL_PROCESS),
        (_LD_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if x32:
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _DENY_EPERM)]
    return prog + search(list(numbers))


class _Kernel:
    """The kernel calls a child locks itself down with, prepared once in the server: the deny filter (`install` puts
    it on the calling process, irrevocable and inherited, and says whether it took), the namespaces
    (`own_namespaces`) and the session keyring (`own_keyring`)."""

    def __init__(self) -> None:
        import ctypes
        import platform

        self.prog: Any = None
        self.libc: Any = None
        arch = platform.machine()
        if arch not in _DENY or not sys.platform.startswith("linux"):
            return
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        self.libc.syscall.restype = ctypes.c_long
        self.errno = ctypes.get_errno
        calls = {name: int(nr) for name, nr in (pair.split("=") for pair in _DENY[arch].split())}
        self.keyctl = calls["keyctl"]

        class SockFilter(ctypes.Structure):
            _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

        prog = _deny_filter(sorted(set(calls.values())), _AUDIT_ARCH[arch], x32=arch == "x86_64")
        self._filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
        self._fprog = SockFprog(len(prog), self._filters)
        self.prog = ctypes.cast(ctypes.pointer(self._fprog), ctypes.c_void_p)

    def die_with_parent(self, parent: int) -> None:
        """Have the kernel kill this process when its parent (pid `parent`) exits; exit now if it already has."""
        if self.libc is not None:
            self.libc.prctl(1, signal.SIGKILL, None, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    def install(self) -> bool:
        if self.prog is None or self.libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return self.libc.prctl(22, 2, self.prog, 0, 0) == 0  # SECCOMP_MODE_FILTER

    def _failed(self, call: str) -> str:
        return f"{call}: {os.strerror(self.errno())}"

    def own_namespaces(self, flags: int) -> str:
        """Move this (single-threaded) process into new namespaces (`flags`: CLONE_NEW*); "" when it did, else why
        not."""
        if self.libc is None:
            return "no Linux namespaces here"
        return "" if self.libc.unshare(flags) == 0 else self._failed("unshare")

    def own_keyring(self) -> str:
        """Join a fresh anonymous session keyring in place of the inherited one; "" when it did (or the kernel has
        no keyrings), else why not."""
        if self.libc is None:
            return "no Linux keyrings here"
        if self.libc.syscall(self.keyctl, 1, None) >= 0 or self.errno() == errno.ENOSYS:
            return ""  # KEYCTL_JOIN_SESSION_KEYRING, no name: a new anonymous one
        return self._failed("keyctl")


def _lock_down(kernel: _Kernel, memory_bytes: int, parent: int) -> tuple[str, str]:
    """Lock this child down (see the module doc); (the level reached: its parts joined by "+", "rlimits" when none
    held; why each missing part is missing)."""
    ipc = kernel.own_namespaces(_CLONE_NEWIPC)  # root: no user namespace needed
    keyring = kernel.own_keyring()  # before dropping root: the key quota is root's
    if os.getuid() == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        except OSError:
            pass
    if ipc:  # unprivileged: a user namespace of its own owns the new IPC namespace
        ipc = kernel.own_namespaces(_CLONE_NEWUSER | _CLONE_NEWIPC)
    kernel.die_with_parent(parent)  # a change of user or capabilities clears the parent-death signal
    for limit, value in (
        (resource.RLIMIT_NOFILE, 4),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_AS, memory_bytes),
    ):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (value, value))
    seccomp = "" if kernel.install() else "the filter did not install (no seccomp for this kernel or platform)"
    parts = {"seccomp": seccomp, "ipc-ns": ipc, "keyring": keyring}
    level = "+".join(part for part, why in parts.items() if not why) or "rlimits"
    return level, "; ".join(f"no {part}: {why}" for part, why in parts.items() if why)


def _reap(pid: int, seconds: float) -> int | None:
    """The wait status of child `pid` once it exits, or None after killing it when `seconds` pass first (SIGCHLD is
    blocked in the caller)."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        signal.sigtimedwait({signal.SIGCHLD}, left)


class _Server:
    """The clean parent: scorers built, never a scored text run. Before it reads any request it forks its zygote,
    which forks every child (it never reads a request): two spare children are forked ahead, each locking itself
    down and then waiting for its request on a pipe of its own, so a request finds its child ready (its fork and its
    lock-down overlapped the requests before it) and only its scoring and exit are waited for. Every child must
    reach the level `required` ("": any)."""

    def __init__(self, scorers: Mapping[str, Any], required: str) -> None:
        self.scorers = scorers
        self.required = required
        os.chdir("/")
        os.closerange(3, 1 << 16)
        self.devnull = os.open(os.devnull, os.O_RDWR)
        with open("/proc/self/statm", "rb") as f:
            self.memory = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + MEMORY_HEADROOM_BYTES
        self.kernel = _Kernel()
        gc.freeze()  # the children's collections skip the server's objects: fewer copy-on-write pages
        self.zygote, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = os.getpid()
        if os.fork() == 0:
            self.zygote.close()
            self.kernel.die_with_parent(server)
            self._zygote(theirs)  # never returns
        theirs.close()
        self.zygote.send(b"fork")
        self.zygote.send(b"fork")  # the second spare: received by the first request (`serve`)
        self.spare = self._spare()

    def _zygote(self, sock: socket.socket) -> None:
        """The zygote's whole life: on b"fork", fork a child and send the server its pid with its request pipe's
        write end and its reply pipe's read end; on b"wait PID SECONDS", reap that child and send its wait status,
        b"timeout" when it was killed at the time limit; exit when the server does."""
        try:
            os.dup2(self.devnull, 0)  # no descriptor of the harness's pipes
            os.dup2(self.devnull, 1)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # waited for in _reap
            zygote = os.getpid()
            while command := sock.recv(64):
                if command == b"fork":
                    req_r, req_w = os.pipe()
                    rep_r, rep_w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        sock.close()
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                        self.kernel.die_with_parent(zygote)
                        self._child(req_r, rep_w, zygote)  # never returns
                    socket.send_fds(sock, [b"%d" % pid], [req_w, rep_r])
                    for fd in (req_r, req_w, rep_r, rep_w):
                        os.close(fd)
                else:
                    _, pid, seconds = command.split()
                    status = _reap(int(pid), float(seconds))
                    sock.send(b"timeout" if status is None else b"%d" % status)
        finally:
            os._exit(0)

    def _spare(self) -> tuple[int, int, int]:
        """The zygote's answer to b"fork": (pid, request pipe's write end, reply pipe's read end)."""
        msg, fds, _, _ = socket.recv_fds(self.zygote, 64, 2)
        if not msg or len(fds) != 2:
            raise RuntimeError("the zygote died")
        return int(msg), fds[0], fds[1]

    def _child(self, req_r: int, rep_w: int, parent: int) -> None:
        """A child's whole life: its request pipe on fd 0, /dev/null on 1 and 2, its reply pipe on 3, nothing else;
        lock down, read the request, score it, reply, exit."""
        try:
            os.dup2(req_r, 0)
            os.dup2(self.devnull, 1)
            os.dup2(self.devnull, 2)
            os.dup2(rep_w, 3)
            os.closerange(4, 1 << 16)
            sys.stdout = sys.stderr = io.StringIO()  # a scorer's prints go nowhere
            level, why = _lock_down(self.kernel, self.memory, parent)
            chunks = []
            while chunk := os.read(0, 1 << 16):
                chunks.append(chunk)
            request = b"".join(chunks)
            if request == b"probe":
                reply: dict[str, Any] = {"ready": level, "why": why}
            elif self.required and level != self.required:
                raise RuntimeError(f"this child is locked down to {level}, not {self.required} ({why})")
            else:
                req = load_json(request)
                scorer = self.scorers[req["verifier"]]
                if isinstance(scorer, str):
                    raise RuntimeError(f"scorer unavailable ({scorer})")
                reply = {"score": float(scorer(req["answer"], req["entry"]))}
        except BaseException as e:
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        try:
            os.write(3, json.dumps(reply).encode() + b"\n")
        finally:
            os._exit(0)

    def serve(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        """Score `request` in the spare child, the spare after next forked once it exits; the child's validated reply
        or an error."""
        pid, req_w, rep_r = self.spare
        deadline = time.monotonic() + timeout_s
        try:
            view = memoryview(request)
            while view:
                view = view[os.write(req_w, view) :]
        except OSError:
            pass  # the child died before it read its request: its exit status says how
        finally:
            os.close(req_w)
        # Reaped first, then the spare after next forked: the zygote's answers come in order, the spare forked in the
        # previous request's turn (received below, long ready), this child's exit status, then the new spare's.
        self.zygote.send(b"wait %d %f" % (pid, max(deadline - time.monotonic(), 0.0)))
        self.zygote.send(b"fork")
        data = b""
        try:
            while len(data) <= _MAX_CHILD_REPLY:
                # the zygote kills the child at its time limit, which ends the pipe; a second more, then stop reading
                left = deadline + 1.0 - time.monotonic()
                if left <= 0 or not select.select([rep_r], [], [], left)[0]:
                    break
                chunk = os.read(rep_r, 1 << 12)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(rep_r)
        self.spare = self._spare()
        status = self.zygote.recv(64)
        if not status:
            raise RuntimeError("the zygote died")
        return _child_reply(data, None if status == b"timeout" else int(status), timeout_s, probe=request == b"probe")


def _child_reply(data: bytes, status: int | None, timeout_s: float, *, probe: bool) -> dict[str, Any]:
    """What the server answers for a child that wrote `data` and exited with wait status `status` (None: it ran past
    `timeout_s` and was killed). Only one line holding {"score": number} or {"error": string} (the probe's:
    {"ready": level, "why": string}) is a reply."""
    if len(data) > _MAX_CHILD_REPLY:
        return {"error": f"malformed reply (longer than {_MAX_CHILD_REPLY} bytes)"}
    if status is None:
        return {"error": f"timed out after {timeout_s:g} s"}
    if os.WIFSIGNALED(status):
        return {"error": f"scorer crashed its process (signal {os.WTERMSIG(status)})"}
    if not data.endswith(b"\n") or data.count(b"\n") != 1:
        return {"error": "malformed reply (not exactly one line)"}
    try:
        reply = load_json(data)
    except ValueError:
        return {"error": "malformed reply (not JSON)"}
    ready = probe and isinstance(reply, dict) and set(reply) == {"ready", "why"}
    if ready and all(isinstance(value, str) for value in reply.values()):
        return {"ready": reply["ready"][:100], "why": reply["why"][:300]}
    if isinstance(reply, dict) and len(reply) == 1:
        key, value = next(iter(reply.items()))
        if key == "score" and not probe and isinstance(value, int | float) and not isinstance(value, bool):
            return {"score": float(value)}
        if key == "error" and isinstance(value, str):
            return {key: value[:300]}
    return {"error": "malformed reply (not a score or an error)"}


def _main(verifiers: Sequence[str], timeout_s: float, required: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness handles Ctrl-C and kills its servers

    def send(obj: dict[str, Any]) -> None:
        os.write(1, json.dumps(obj).encode() + b"\n")

    try:
        import numpy  # noqa: F401 - imported before any request, as every scorer's lazy import is
        import sympy
        import sympy.parsing.sympy_parser  # noqa: F401
        from reasoning_gym.factory import get_score_answer_fn
    except Exception as e:
        send({"id": 0, "error": f"import failed ({type(e).__name__}: {e})"})
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
    server = _Server(scorers, required)
    ready = server.serve(b"probe", START_TIMEOUT_S)
    send({"id": 0, **ready})
    if "ready" not in ready:
        return
    stdin = sys.stdin.buffer
    while line := stdin.readline():
        head, _, request = line.rstrip(b"\n").partition(b" ")
        send({"id": int(head), **server.serve(request, timeout_s)})


if __name__ == "__main__":
    _main(load_json(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
