"""Nothing scored changes how anything else is scored. Hostile texts, from a user row (task=user: config validation
and the UserTask stream) and from a model response (tasks.score), try to rebind the scorer's builtins, forge or
shift the replies, read the harness's secrets and stat its files; after each, right answers still score 1 and wrong
ones 0. The arithmetic grammar reads ASCII digits only, as reasoning-gym does."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import reasoning_gym
from reasoning_gym.factory import get_score_answer_fn

from study.data import sandbox, tasks

VERIFIERS = ("bitwise_arithmetic", "string_insertion")

# Hostile Python, as a bitwise_arithmetic `problem` (evaluated; the row's answer is "0") or a string_insertion answer
# (evaluated, joined): each `{end}` makes the expression evaluate to 0 or to an empty list respectively.
REBIND_FLOAT = "__import__('builtins').__setattr__('float', lambda *a: 1.0) or {end}"
FORGE_THREE = "__import__('os').write(1, b'{{\"score\": 1.0}}\\n' * 3) and {end}"
FORGE_ONE = "__import__('os').write(1, b'{{\"score\": 1.0}}\\n') and {end}"
TOO_DEEP = "__import__('os').write(1, b'[' * 60000 + b'\\n') and {end}"
ENDS = {"bitwise_arithmetic": "0", "string_insertion": "[]"}


@pytest.fixture(scope="module")
def box() -> Iterator[sandbox.Sandbox]:
    """One sandbox serving both verifiers: what one scored text does must not reach the other's scores either."""
    b = sandbox.start(VERIFIERS, timeout_s=5)
    yield b
    b.close()


def _items(name: str, n: int = 3) -> list[tasks.TaskItem]:
    return [
        tasks.TaskItem(
            task="user",
            prompt=f"{name} {i}\n",
            solution=f"#### {e['answer']}",
            answer=e["answer"],
            verifier=name,
            metadata={**e["metadata"], "question": e["question"]},
        )
        for i, e in enumerate(reasoning_gym.create_dataset(name, seed=7, size=n))
    ]


def _wrong(item: tasks.TaskItem) -> str:
    return "0x1" if item.verifier == "bitwise_arithmetic" else item.answer + "A"


def _assert_scored_honestly(items: list[tasks.TaskItem]) -> None:
    """Wrong, right, wrong, right, ...: a forged score shows as a 1 where a 0 belongs, a shifted stream as both."""
    got = [tasks.score(item, f"#### {answer}") for item in items for answer in (_wrong(item), item.answer)]
    assert got == [0.0, 1.0] * len(items)


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _hostile_rows_then_stream(tmp_path: Path, problem: str) -> None:
    """A bitwise_arithmetic user file whose first row's problem is `problem`: validated (the row runs), then its
    UserTask stream scored (the row runs again between the clean rows); every clean row is scored honestly."""
    clean = _items("bitwise_arithmetic")
    rows = [{"prompt": "hostile\n", "answer": "0", "metadata": {"problem": problem}}]
    rows += [{"prompt": i.prompt, "answer": i.answer, "metadata": {"problem": i.metadata["problem"]}} for i in clean]
    loaded = []
    for k, row in enumerate(rows):  # one file a row, so a refused hostile row leaves the clean ones to load
        with contextlib.suppress(ValueError):
            loaded += tasks.load_user_data(_rows(tmp_path / f"rows{k}.jsonl", [row]), verifier="bitwise_arithmetic")
    assert [i.prompt for i in loaded if i.prompt != "hostile\n"] == [i.prompt for i in clean]
    stream = tasks.UserTask(items=tuple(loaded), seed=0)
    for item in stream.take(2 * len(loaded)):
        if item.prompt == "hostile\n":
            tasks.score(item, "#### 0")
        else:
            _assert_scored_honestly([item])
    _assert_scored_honestly(_items("string_insertion"))


# ------------------------------------------------------------------------------------ state across requests


def test_a_user_row_cannot_rebind_builtins_for_later_scores(box: sandbox.Sandbox, tmp_path: Path) -> None:
    tasks.take_scorer_failures()
    _hostile_rows_then_stream(tmp_path, REBIND_FLOAT.format(end="0"))
    assert tasks.take_scorer_failures() == 0


def test_a_response_cannot_rebind_builtins_for_later_scores(box: sandbox.Sandbox) -> None:
    item = _items("string_insertion")[0]
    assert tasks.score(item, "#### " + REBIND_FLOAT.format(end="[]")) == 0.0
    _assert_scored_honestly(_items("string_insertion") + _items("bitwise_arithmetic"))


# ------------------------------------------------------------------------------------------- forged replies


@pytest.mark.parametrize("payload", [FORGE_THREE, FORGE_ONE, TOO_DEEP], ids=["three_lines", "one_line", "deep"])
def test_a_user_row_cannot_forge_or_shift_replies(box: sandbox.Sandbox, tmp_path: Path, payload: str) -> None:
    _hostile_rows_then_stream(tmp_path, payload.format(end="0"))


@pytest.mark.parametrize("payload", [FORGE_THREE, FORGE_ONE, TOO_DEEP], ids=["three_lines", "one_line", "deep"])
def test_a_response_cannot_forge_or_shift_replies(box: sandbox.Sandbox, payload: str) -> None:
    item = _items("string_insertion")[0]
    tasks.score(item, "#### " + payload.format(end="[]"))
    _assert_scored_honestly(_items("string_insertion") + _items("bitwise_arithmetic"))


# What a text can write on its own reply pipe (fd 3): a reply of its own, once; anything else is malformed, a failure.
OWN_PIPE_MALFORMED = {
    "extra_lines": "__import__('os').write(3, b'{{\"score\": 1.0}}\\n' * 3) and {end}",
    "too_big": "__import__('os').write(3, b'{{\"score\": 1.0}}' + b' ' * 5000 + b'\\n') and __import__('os')._exit(0)",
    "too_deep": "__import__('os').write(3, b'[' * 1000 + b'\\n') and __import__('os')._exit(0)",
    "not_json": "__import__('os').write(3, b'score 1\\n') and __import__('os')._exit(0)",
    "with_an_id": "__import__('os').write(3, b'{{\"id\": 9, \"score\": 1.0}}\\n') and __import__('os')._exit(0)",
}


@pytest.mark.parametrize("kind", sorted(OWN_PIPE_MALFORMED))
def test_a_malformed_reply_is_a_counted_failure_from_either_path(
    box: sandbox.Sandbox, tmp_path: Path, kind: str
) -> None:
    payload = OWN_PIPE_MALFORMED[kind]
    tasks.take_scorer_failures()
    assert tasks.score(_items("string_insertion")[0], "#### " + payload.format(end="[]")) == 0.0
    assert tasks.take_scorer_failures() == 1
    row = {"prompt": "p\n", "answer": "0", "metadata": {"problem": payload.format(end="0")}}
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: verifier 'bitwise_arithmetic' failed .*malformed reply"):
        tasks.load_user_data(_rows(tmp_path / "rows.jsonl", [row]), verifier="bitwise_arithmetic")
    _assert_scored_honestly(_items("string_insertion") + _items("bitwise_arithmetic"))
    assert tasks.take_scorer_failures() == 0


def test_a_long_error_in_any_script_keeps_its_message(box: sandbox.Sandbox, tmp_path: Path) -> None:
    """An honest failure's message, escaped for JSON at six bytes a character, still fits every reply limit."""
    problem = "(_ for _ in ()).throw(SystemExit('\u00e9' * 400))"
    rows = _rows(tmp_path / "rows.jsonl", [{"prompt": "p\n", "answer": "0", "metadata": {"problem": problem}}])
    with pytest.raises(ValueError, match=r"SystemExit: \u00e9{100}"):
        tasks.load_user_data(rows, verifier="bitwise_arithmetic")


def test_a_text_chooses_its_own_score_and_nothing_else(box: sandbox.Sandbox) -> None:
    """The sandbox's stated limit: code in a scored text can reply for itself (here 1.0), once."""
    own = "__import__('os').write(3, b'{\"score\": 1.0}\\n') and __import__('os')._exit(0)"
    assert tasks.score(_items("string_insertion")[0], f"#### {own}") == 1.0
    _assert_scored_honestly(_items("string_insertion") + _items("bitwise_arithmetic"))


class _Misbehaving(sandbox.Sandbox):
    """The harness's reader against a server that answers each request with `reply(id)` (the real server cannot be
    made to misbehave by a scored text: these are the replies the reader must refuse all the same)."""

    def __init__(self, reply: str) -> None:
        super().__init__(["bitwise_arithmetic"])
        self.reply = reply

    def _command(self) -> list[str]:
        script = (
            "import os, sys, json\n"
            f'os.write(1, b\'{{"id": 0, "ready": "{sandbox.FULL_LEVEL}"}}\\n\')\n'
            "for line in sys.stdin.buffer:\n"
            "    i = int(line.split(b' ', 1)[0])\n"
            f"    os.write(1, ({self.reply}).encode())\n"
        )
        return [sys.executable, "-c", script]


SERVER_MALFORMED = {
    "bad_json": "'score 1.0\\n'",
    "wrong_id": "json.dumps({'id': i + 1, 'score': 1.0}) + '\\n'",
    "extra_line": "json.dumps({'id': i, 'score': 1.0}) + '\\n' + json.dumps({'id': i + 1, 'score': 1.0}) + '\\n'",
    "too_deep": "'[' * 2000 + ']' * 2000 + '\\n'",
    "too_big": "json.dumps({'id': i, 'score': 1.0, 'pad': 'x' * 60000}) + '\\n'",
    "sixty_thousand_deep": "'[' * 60000 + '\\n'",
}


@pytest.mark.parametrize("kind", sorted(SERVER_MALFORMED))
def test_a_malformed_server_reply_kills_the_server_and_is_counted(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Misbehaving(SERVER_MALFORMED[kind])
    monkeypatch.setitem(sandbox._SANDBOXES, "bitwise_arithmetic", fake)
    item = _items("bitwise_arithmetic")[0]
    tasks.take_scorer_failures()
    for _ in range(2):  # the second request starts a new server
        with pytest.raises(sandbox.ScorerFailure, match="malformed reply"):
            fake.score("bitwise_arithmetic", item.answer, {"metadata": item.metadata})
        assert fake._proc is None
    assert tasks.score(item, f"#### {item.answer}") == 0.0
    assert tasks.take_scorer_failures() == 1
    fake.close()


# ---------------------------------------------------------------------------------- environment and files

SECRET = "fake-secret-7c1e9b04d2"


@pytest.fixture
def secret_box(monkeypatch: pytest.MonkeyPatch) -> Iterator[sandbox.Sandbox]:
    """A sandbox started while the harness's environment holds secrets."""
    for name in ("WANDB_API_KEY", "HF_TOKEN", "H45_SECRET"):
        monkeypatch.setenv(name, SECRET)
    b = sandbox.start(VERIFIERS, timeout_s=5)
    yield b
    b.close()


def test_the_server_environment_is_an_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from study.core import hugepages

    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.check=3:{SECRET}")  # the harness's own: never passed on
    env = sandbox.server_env()
    assert SECRET not in "".join(env.values())
    assert set(env) <= {
        *sandbox._ENV_ALLOWED,
        *sandbox.HUGE_PAGES,
        "PYTHONPATH",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "PYTHONDONTWRITEBYTECODE",
    }
    if hugepages.why_not({}) is None:  # Linux, glibc >= 2.35, transparent huge pages
        assert {k: env[k] for k in sandbox.HUGE_PAGES} == sandbox.HUGE_PAGES
    monkeypatch.setenv(hugepages.OFF_VAR, "0")
    assert not set(sandbox.server_env()) & set(sandbox.HUGE_PAGES)


def test_no_scored_text_reads_the_harness_environment(secret_box: sandbox.Sandbox, tmp_path: Path) -> None:
    # reads: a row whose problem is 1 when the secret is visible is refused (its answer is 0)
    reads = "int('WANDB_API_KEY' in __import__('os').environ or 'HF_TOKEN' in __import__('os').environ)"
    rows = _rows(tmp_path / "reads.jsonl", [{"prompt": "p\n", "answer": "0", "metadata": {"problem": reads}}])
    assert len(tasks.load_user_data(rows, verifier="bitwise_arithmetic")) == 1
    # prints: an exception carrying the secret, past the scorer's `except Exception`, into the error text
    leak = "(_ for _ in ()).throw(SystemExit(__import__('os').environ.get('WANDB_API_KEY', 'unset')))"
    rows = _rows(tmp_path / "leak.jsonl", [{"prompt": "p\n", "answer": "0", "metadata": {"problem": leak}}])
    with pytest.raises(ValueError, match="SystemExit: unset") as refused:
        tasks.load_user_data(rows, verifier="bitwise_arithmetic")
    assert SECRET not in str(refused.value)
    item = _items("string_insertion")[0]
    with pytest.raises(sandbox.ScorerFailure, match="SystemExit: unset") as failed:
        secret_box.score("string_insertion", leak, {"answer": item.answer, "metadata": item.metadata})
    assert SECRET not in str(failed.value)
    tasks.take_scorer_failures()
    assert tasks.score(item, f"#### {leak}") == 0.0
    assert tasks.take_scorer_failures() == 1


PROBES = [
    "__import__('os').path.exists({p!r})",
    "__import__('os').path.lexists({p!r})",
    "__import__('os').access({p!r}, 0)",
    "__import__('os').path.isdir({p!r})",
]


@pytest.mark.parametrize("path", ["/", sandbox.__file__])
@pytest.mark.parametrize("probe", PROBES)
def test_no_scored_text_sees_file_metadata(box: sandbox.Sandbox, tmp_path: Path, probe: str, path: str) -> None:
    expr = probe.format(p=path)
    # data path: the row's problem is 1 when the file is visible; its answer is 0
    rows = _rows(tmp_path / "rows.jsonl", [{"prompt": "p\n", "answer": "0", "metadata": {"problem": f"int({expr})"}}])
    assert len(tasks.load_user_data(rows, verifier="bitwise_arithmetic")) == 1
    # model path: string_insertion's partial credit (0.1) for a list of the answer's characters, when visible
    item = _items("string_insertion")[0]
    response = f"#### list({item.answer!r} if {expr} else '')"
    assert tasks.score(item, response, partial_credit=True) == 0.0
    assert tasks.score(item, f"#### list({item.answer!r})", partial_credit=True) == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------------- digits

FOREIGN_DIGITS = ["１+２+３", "١+٢+٣", "(１)+2+3", "1+2+３"]


@pytest.mark.parametrize("answer", FOREIGN_DIGITS)
def test_countdown_reads_ascii_digits_only_as_reasoning_gym_does(answer: str, tmp_path: Path) -> None:
    meta = {"numbers": [1, 2, 3], "target": 6}
    item = tasks.TaskItem(
        task="user",
        prompt="countdown 6 from 1,2,3\n",
        solution="#### 1+2+3",
        answer="1+2+3",
        verifier="countdown",
        metadata=meta,
    )
    rg = get_score_answer_fn("countdown")(answer, {"metadata": meta})
    assert rg == 0.01
    assert tasks.score(item, f"#### {answer}", partial_credit=True) == rg
    assert tasks.score(item, f"#### {answer}") == 0.0
    assert tasks.score(item, "#### 1+2+3") == 1.0
    rows = _rows(tmp_path / "rows.jsonl", [{"prompt": "p\n", "answer": answer, "metadata": meta}])
    with pytest.raises(ValueError, match="does not accept"):
        tasks.load_user_data(rows, verifier="countdown")


@pytest.mark.parametrize("answer", ["(１+２+３)*4", "2*3*4*１", "4*6*1*١"])
def test_puzzle24_reads_ascii_digits_only_as_reasoning_gym_does(answer: str) -> None:
    item = tasks.TaskItem(task="user", prompt="p\n", solution="", answer="24", verifier="puzzle24", metadata={})
    assert tasks.score(item, f"#### {answer}", partial_credit=True) == get_score_answer_fn("puzzle24")(answer, {})
    assert tasks.score(item, f"#### {answer}") == 0.0
