"""A checkpoint's Jinja chat template, rendered in jinja2's immutable sandbox (no attribute access to Python
internals, no mutation) and bounded: at most MAX_TEMPLATE_CHARS of template, at most MAX_RENDER_CHARS rendered.

A template is code from the checkpoint's files, and it never renders in the harness's process: every render runs in
a child process under an address-space limit (MEMORY_BYTES) and a time limit (TIMEOUT_S), so a template that loops
for hours (nested `range(99999)`) or builds a huge string is one ValueError line, never a hung or swapping run.
`check` renders it once with a sample prompt before a run writes anything; the preflight renders and encodes every
prompt the run is known to use the same way (study.data.tokenizer.prompt_lengths, through `run_child`); the run then
renders each prompt in a child of its own (`bounded_render`: one long-lived `Renderer` per template, each prompt
within TIMEOUT_S), so a template that loops only on prompts the checks did not see stops the run at that prompt with
one line.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runfiles.bounded import load_json

MAX_TEMPLATE_CHARS = 1 << 20
"""Longest chat template read (characters); real ones are a few KB."""

MAX_RENDER_CHARS = 1 << 20
"""Longest prompt a template may render (characters)."""

TIMEOUT_S = 10.0
"""Seconds a render may take: `check`'s, the child process's start included, and each of `Renderer`'s."""

MEMORY_BYTES = 2 << 30
"""Address space of a child process that renders."""

SAMPLE_PROMPT = "What is 12 + 30?\n"

_ROOT = str(Path(__file__).resolve().parents[2])
_MAX_LINE = 8 * max(MAX_TEMPLATE_CHARS, MAX_RENDER_CHARS) + 4096
"""Longest line a `Renderer` and its child send each other: a template, a prompt or a render, JSON-escaped."""
_limited = False
"""True in a child process `child_main` runs: it is under the limits already, so templates render in it directly."""


def environment() -> Any:
    """The sandboxed Jinja environment a template is compiled in (transformers' settings for chat templates)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"tokenizer chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def render(template: Any, prompt: str, specials: Mapping[str, str | None]) -> str:
    """`prompt` as one user message with the generation prompt appended; ValueError past MAX_RENDER_CHARS. In this
    process: for a child under the limits (`bounded_render` is what the harness calls)."""
    parts, n = [], 0
    for part in template.generate(
        messages=[{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        bos_token=specials.get("bos_token") or "",
        eos_token=specials.get("eos_token") or "",
    ):
        n += len(part)
        if n > MAX_RENDER_CHARS:
            raise ValueError(f"tokenizer chat template: renders more than {MAX_RENDER_CHARS} characters")
        parts.append(part)
    return "".join(parts)


# -- a child process under the limits ------------------------------------------------------------------------------


def _command(entry: str) -> list[str]:
    module, function = entry.split(":")
    return [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, {_ROOT!r}); from {module} import {function}; {function}()",
    ]


def run_child(
    entry: str, request: dict[str, Any], *, where: str, subject: str, task: str, valid: str
) -> dict[str, Any]:
    """Run `entry` ("module:function", a function that calls `child_main`) in a child process with `request` (its
    `timeout_s` the limit) on its stdin, and return its reply. ValueError naming `where`, saying that `subject` did
    not or could not `task` and why, when the child runs past the limit (`valid` then says what would pass), runs out
    of memory, dies or replies an error."""
    timeout_s = float(request["timeout_s"])
    try:
        done = subprocess.run(
            _command(entry), input=json.dumps(request), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"{where}: {subject} did not {task} within {timeout_s:g} s; valid: {valid}") from None
    try:
        reply = load_json(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = "it ran out of memory" if "MemoryError" in done.stderr else f"exit status {done.returncode}"
        raise ValueError(
            f"{where}: {subject} could not {task} ({why}, limits: {MEMORY_BYTES >> 30} GiB, {timeout_s:g} s)"
        ) from None
    if "error" in reply:
        raise ValueError(f"{where}: {subject} could not {task} ({reply['error']})")
    return reply


def _die_with_parent(parent: int) -> None:
    """Be killed when `parent` dies (Linux's PR_SET_PDEATHSIG), so a render that loops never outlives the harness."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):  # not Linux: the parent's kill on timeout is the bound
        return
    if os.getppid() != parent:
        os._exit(1)


def one_line(err: BaseException) -> str:
    """`Type: message` of `err` on one line of at most 300 characters of message."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _limit(memory_bytes: int, cpu_s: float | None) -> None:
    import resource

    global _limited
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if cpu_s is not None:
        cpu = int(cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    _limited = True


def child_main(handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The body of a `run_child` entry: reads the request (stdin), limits this process (MEMORY_BYTES, the
    request's timeout_s of CPU), replies `handler(request)` as one JSON line; an error of the handler is the reply's
    `error`, in one line (a Rust panic of the tokenizers library included)."""
    request = load_json(sys.stdin.read(), max_bytes=1 << 31)  # the parent's own request
    _limit(MEMORY_BYTES, float(request["timeout_s"]))
    try:
        reply = handler(request)
    except MemoryError:
        reply = {"error": f"it ran out of memory (limit {MEMORY_BYTES >> 30} GiB)"}
    except Exception as err:  # a syntax error, raise_exception, a sandbox refusal: reported in one line
        reply = {"error": one_line(err)}
    print(json.dumps(reply))


# -- checks before a run --------------------------------------------------------------------------------------------


def check(template: str, specials: Mapping[str, str | None], *, where: str, timeout_s: float | None = None) -> None:
    """Render `template` with SAMPLE_PROMPT in a child process under the limits above (`timeout_s`: TIMEOUT_S);
    ValueError naming `where` (the file) and why when it is too long, does not compile, raises, or runs past a
    limit."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(
            f"{where}: the chat template is {len(template)} characters; valid: at most {MAX_TEMPLATE_CHARS}"
        )
    request = {"template": template, "specials": dict(specials), "timeout_s": timeout_s}
    run_child(
        "study.data.chat_template:_child",
        request,
        where=where,
        subject="the chat template",
        task="render a prompt",
        valid="a template that renders in well under a second",
    )


def _child() -> None:
    """`check`'s child: renders the template of the request with SAMPLE_PROMPT."""
    child_main(
        lambda request: {
            "chars": len(render(environment().from_string(request["template"]), SAMPLE_PROMPT, request["specials"]))
        }
    )


# -- renders at run time --------------------------------------------------------------------------------------------


class Renderer:
    """One template rendered in a long-lived child process of its own (under MEMORY_BYTES), one prompt at a time,
    each within TIMEOUT_S: a render that runs past it, runs out of memory or raises is a ValueError naming the
    prompt, and the child is killed (the next render starts a fresh one). A process forked from the one that
    started the child starts its own."""

    def __init__(self, template: str, specials: Mapping[str, str | None]) -> None:
        self._template, self._specials = template, dict(specials)
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                _command("study.data.chat_template:_serve"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            self._owner = os.getpid()
            self._send(json.dumps({"template": self._template, "specials": self._specials, "parent": self._owner}))
        return self._proc

    def _send(self, line: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line.encode() + b"\n")
        self._proc.stdin.flush()

    def _reply(self, timeout_s: float) -> bytes | None:
        """The child's next line, None when it gives none within `timeout_s` (or dies)."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, data, deadline = self._proc.stdout.fileno(), b"", time.monotonic() + timeout_s
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk or len(data) > _MAX_LINE:  # dead, or no reply a render can give
                return None
            data += chunk
        return data

    def render(self, prompt: str) -> str:
        """`prompt` as one user message with the generation prompt appended, rendered in the child."""
        with self._lock:
            try:
                self._started()
                self._send(json.dumps({"prompt": prompt}))
                line = self._reply(TIMEOUT_S)
            except OSError:  # the child died before it read the request
                line = None
            if line is None:
                self.close()
                shown = prompt if len(prompt) <= 80 else f"{prompt[:80]}..."
                raise ValueError(
                    f"tokenizer chat template: did not render the prompt {shown!r} within {TIMEOUT_S:g} s "
                    f"(limits: {MEMORY_BYTES >> 30} GiB, {TIMEOUT_S:g} s a prompt); valid: a template that renders "
                    "in well under a second"
                )
        reply = load_json(line, max_bytes=_MAX_LINE)
        if "error" in reply:
            raise ValueError(f"tokenizer chat template: could not render a prompt ({reply['error']})")
        return str(reply["text"])

    def close(self) -> None:
        """Kill the child (a render in flight included)."""
        proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def _serve() -> None:
    """`Renderer`'s child: the template and specials on the first line, then one prompt a line, one reply a line
    (`text`, or `error` in one line)."""
    first = load_json(sys.stdin.readline(), max_bytes=_MAX_LINE)
    _die_with_parent(int(first["parent"]))
    _limit(MEMORY_BYTES, None)
    try:
        template: Any = environment().from_string(first["template"])
    except Exception as err:  # a template that does not compile: every request says so
        template = err
    for line in sys.stdin:
        try:
            if isinstance(template, Exception):
                raise template
            prompt = load_json(line, max_bytes=_MAX_LINE)["prompt"]
            reply: dict[str, Any] = {"text": render(template, prompt, first["specials"])}
        except MemoryError:
            reply = {"error": f"it ran out of memory (limit {MEMORY_BYTES >> 30} GiB)"}
        except Exception as err:
            reply = {"error": one_line(err)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


_RENDERERS: dict[tuple[str, tuple[tuple[str, str | None], ...]], Renderer] = {}
_COMPILED: dict[str, Any] = {}
_RENDERERS_LOCK = threading.Lock()


def bounded_render(template: str, prompt: str, specials: Mapping[str, str | None]) -> str:
    """`prompt` rendered with `template` under the limits: by the template's `Renderer` (started on its first
    render), or in this process where it is a child under the limits already (`child_main`'s)."""
    with _RENDERERS_LOCK:
        if _limited:
            if template not in _COMPILED:
                _COMPILED[template] = environment().from_string(template)
            compiled = _COMPILED[template]
        else:
            key = (template, tuple(sorted(specials.items())))
            if key not in _RENDERERS:
                _RENDERERS[key] = Renderer(template, specials)
            renderer = _RENDERERS[key]
    return render(compiled, prompt, specials) if _limited else renderer.render(prompt)


@atexit.register
def close_all() -> None:
    """Kill every renderer's child."""
    with _RENDERERS_LOCK:
        renderers = list(_RENDERERS.values())
        _RENDERERS.clear()
    for renderer in renderers:
        renderer.close()
