"""A checkpoint's Jinja chat template, rendered in jinja2's immutable sandbox (no attribute access to Python
internals, no mutation) and bounded: at most MAX_TEMPLATE_CHARS of template, at most MAX_RENDER_CHARS rendered.

A template is code from the checkpoint's files: `check` renders it once with a sample prompt in a child process
under a time limit (TIMEOUT_S), an address-space limit and a CPU-time limit, so a template that loops for hours
(nested `range(99999)`) or builds a huge string is refused with one line before a run writes anything, never run
in the harness's process. The run then renders each prompt in-process (`environment().from_string`, `render`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_TEMPLATE_CHARS = 1 << 20
"""Longest chat template read (characters); real ones are a few KB."""

MAX_RENDER_CHARS = 1 << 20
"""Longest prompt a template may render (characters)."""

TIMEOUT_S = 10.0
"""Seconds the check's render may take, the child process's start included."""

MEMORY_BYTES = 2 << 30
"""Address space of the check's child process."""

SAMPLE_PROMPT = "What is 12 + 30?\n"


def environment() -> Any:
    """The sandboxed Jinja environment a template is compiled in (transformers' settings for chat templates)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"tokenizer chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def render(template: Any, prompt: str, specials: dict[str, str | None]) -> str:
    """`prompt` as one user message with the generation prompt appended; ValueError past MAX_RENDER_CHARS."""
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


def check(template: str, specials: dict[str, str | None], *, where: str, timeout_s: float | None = None) -> None:
    """Render `template` with SAMPLE_PROMPT in a child process under the limits above (`timeout_s`: TIMEOUT_S);
    ValueError naming `where` (the file) and why when it is too long, does not compile, raises, or runs past a
    limit."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(
            f"{where}: the chat template is {len(template)} characters; valid: at most {MAX_TEMPLATE_CHARS}"
        )
    root = str(Path(__file__).resolve().parents[2])
    request = json.dumps({"template": template, "specials": specials, "timeout_s": timeout_s})
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {root!r}); from study.data.chat_template import _child; _child()",
            ],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"{where}: the chat template did not render a prompt within {timeout_s:g} s; valid: a "
            "template that renders in well under a second"
        ) from None
    from runfiles.bounded import load_json

    try:
        reply = load_json(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = "it ran out of memory" if "MemoryError" in done.stderr else f"exit status {done.returncode}"
        raise ValueError(
            f"{where}: the chat template could not render a prompt ({why}, limits: "
            f"{MEMORY_BYTES >> 30} GiB, {timeout_s:g} s)"
        ) from None
    if "error" in reply:
        raise ValueError(f"{where}: the chat template could not render a prompt ({reply['error']})")


def _child() -> None:
    """The check's child: limits itself, renders the template of the request on stdin, replies one JSON line."""
    import resource

    from runfiles.bounded import load_json

    request = load_json(sys.stdin.read(), max_bytes=4 * MAX_TEMPLATE_CHARS + 4096)  # the parent's own request
    cpu = int(request["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    try:
        text = render(environment().from_string(request["template"]), SAMPLE_PROMPT, request["specials"])
        reply: dict[str, Any] = {"chars": len(text)}
    except MemoryError:
        reply = {"error": f"it ran out of memory (limit {MEMORY_BYTES >> 30} GiB)"}
    except Exception as err:  # a syntax error, raise_exception, a sandbox refusal: reported in one line
        reply = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    print(json.dumps(reply))
