"""Nothing a model's response or a user's row says runs, and no verifier hangs: every shipped verifier (the registry:
exact, numeric and every reasoning-gym task) is fed code that would create a marker file, as a model answer and as
user data; the marker never appears, the run-side `score` returns 0 without raising, and a failure is counted."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
from reasoning_gym.factory import DATASETS as RG_DATASETS
from reasoning_gym.factory import get_score_answer_fn

from study.data import arith, sandbox, tasks

VERIFIERS = sorted({*tasks.USER_VERIFIERS, *RG_DATASETS})


def _payloads(marker: Path) -> list[str]:
    """Answers that create `marker` if anything evaluates them as Python (or sympy, which evaluates Python)."""
    return [
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w').write('x')",
        f"__import__('pathlib').Path('{marker}').touch()",
        f"__import__('subprocess').run(['touch', '{marker}'])",
        f"1 if __import__('os').system('touch {marker}') else 24",
    ]


@pytest.fixture(scope="module")
def box() -> Iterator[sandbox.Sandbox]:
    """One sandbox worker serving every sandboxed verifier (one import of reasoning-gym for the whole module)."""
    b = sandbox.start([v for v in VERIFIERS if v not in tasks.NATIVE_VERIFIERS], timeout_s=5)
    yield b
    b.close()


def _item(verifier: str, answer: str, **metadata: object) -> tasks.TaskItem:
    meta = {"problem": answer, "numbers": [1, 2, 3, 4], "target": 24, "expression": answer, **metadata}
    return tasks.TaskItem(
        task="user", prompt="q\n", solution=f"#### {answer}", answer=answer, verifier=verifier, metadata=meta
    )


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_model_output_never_runs(verifier: str, box: sandbox.Sandbox, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)  # writable by the worker's unprivileged user too: only the lock-down keeps it out
    marker = tmp_path / "marker"
    for payload in _payloads(marker):
        item = _item(verifier, "24")
        assert tasks.score(item, f"work\n#### {payload}") in (0.0, 1.0)  # returns, never raises (a lenient
        assert 0.0 <= tasks.score(item, f"#### {payload}", partial_credit=True) <= 1.0  # scorer may accept it)
        assert not marker.exists(), (verifier, payload)


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_user_data_never_runs(verifier: str, box: sandbox.Sandbox, tmp_path: Path) -> None:
    """A user row whose answer, solution and metadata are code is refused by config validation; nothing runs."""
    tmp_path.chmod(0o777)
    marker = tmp_path / "marker"
    rows = []
    for payload in _payloads(marker):
        meta = {"problem": payload, "question": payload, "expression": payload, "numbers": [1, 2], "target": 3}
        rows.append({"prompt": f"{payload}\n", "answer": payload, "metadata": meta})
    for row in rows:
        data = tmp_path / "rows.jsonl"
        data.write_text(json.dumps(row) + "\n")
        with contextlib.suppress(ValueError):  # refused, the usual outcome; accepted is fine too if nothing ran
            tasks.load_user_data(data, verifier=verifier)
        assert not marker.exists(), (verifier, row)


def test_the_reported_holes_are_closed(box: sandbox.Sandbox, tmp_path: Path) -> None:
    """The reproductions: bitwise_arithmetic's problem text, puzzle24's answer and model output, the power tower."""
    tmp_path.chmod(0o777)
    marker = tmp_path / "marker"
    code = f"__import__('os').system('touch {marker}')"
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "p\n", "answer": "0", "metadata": {"problem": code}}) + "\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:1"):
        tasks.load_user_data(data, verifier="bitwise_arithmetic")
    data.write_text(json.dumps({"prompt": "p\n", "answer": code}) + "\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:1"):
        tasks.load_user_data(data, verifier="puzzle24")
    assert tasks.score(_item("puzzle24", "24"), f"#### {code}") == 0.0
    assert not marker.exists()
    data.write_text(json.dumps({"prompt": "p\n", "answer": "0", "metadata": {"problem": "(2**2**34)&0"}}) + "\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rows.jsonl:1: verifier 'bitwise_arithmetic' failed .*timed out"):
        tasks.load_user_data(data, verifier="bitwise_arithmetic")
    assert time.monotonic() - start < box.timeout_s + 60  # the time limit, plus a fresh worker's start


def test_a_hanging_scorer_scores_zero_is_counted_and_the_next_request_works(box: sandbox.Sandbox) -> None:
    tasks.take_scorer_failures()
    hang = _item("bitwise_arithmetic", "0", problem="(2**2**34)&0")
    assert tasks.score(hang, "#### 0") == 0.0
    assert tasks.take_scorer_failures() == 1
    ok = _item("bitwise_arithmetic", "7", problem="(3 | 4)")
    assert tasks.score(ok, "#### 7") == 1.0  # a fresh worker
    assert tasks.take_scorer_failures() == 0


def test_sandbox_is_locked_down(box: sandbox.Sandbox) -> None:
    tasks.score(_item("bitwise_arithmetic", "7", problem="(3 | 4)"), "#### 7")
    assert box.level == sandbox.FULL_LEVEL  # Linux on x86_64 or aarch64: the filter, namespaces and keyring hold


def test_sandbox_scores_match_reasoning_gym_on_its_own_items(box: sandbox.Sandbox) -> None:
    import reasoning_gym

    for name in ("bitwise_arithmetic", "simple_equations", "complex_arithmetic", "gcd", "word_sorting"):
        for entry in reasoning_gym.create_dataset(name, seed=3, size=3):
            item = tasks.TaskItem(
                task="user",
                prompt="q\n",
                solution="",
                answer=entry["answer"],
                verifier=name,
                metadata={**entry["metadata"], "question": entry["question"]},
            )
            assert tasks.score(item, f"#### {entry['answer']}") == 1.0, (name, entry["answer"])
            assert tasks._verifier_score(name, "nonsense", item) == get_score_answer_fn(name)("nonsense", entry)


# ---------------------------------------------------------------------------------------- native grammars


@pytest.mark.parametrize("name", ["countdown", "chain_sum", "basic_arithmetic", "gsm_symbolic"])
def test_native_scores_match_reasoning_gym(name: str) -> None:
    """The grammar-scored verifiers give reasoning-gym's raw score on right, wrong, padded and malformed answers."""
    fn = get_score_answer_fn(name)
    for item in tasks.make_task(name, seed=11).take(8):
        entry = {"question": item.metadata["question"], "answer": item.answer, "metadata": item.metadata}
        for answer in (item.answer, item.answer + "1", "1" + item.answer, "", None, "((", "x+1", "3/0", " 7 "):
            assert tasks._verifier_score(name, answer, item) == pytest.approx(fn(answer, entry)), (name, answer)


def test_puzzle24_native_matches_reasoning_gym_on_exact_answers() -> None:
    fn = get_score_answer_fn("puzzle24")
    item = _item("puzzle24", "24")
    for answer in ("(1+2+3)*4", "4*6+1-1", "24", "2*3*4*1*1", "11+13", "(9-3)*4", "(8/2)*(3+3)", None, "((", "6*4"):
        assert tasks._verifier_score("puzzle24", answer, item) == fn(answer, {}), answer


def test_numeric_verifier_matches_reasoning_gym() -> None:
    from reasoning_gym.utils import compute_decimal_reward

    item = _item("numeric", "1,000")
    for answer in ("1000", "+01,000.00", "1000.5", "21000", "abc", "", None, "1e3", "NaN", "Infinity"):
        expected = compute_decimal_reward(answer, oracle_answer="1000", strip_commas=True)
        assert tasks._verifier_score("numeric", answer, item) == expected, answer


@pytest.mark.parametrize(
    ("text", "value"),
    [("1+2*3", 7), ("(1+2)*3", 9), ("-(4-6)/4", Fraction(1, 2)), ("+-+3", -3), (" 12 / 4 ", 3), ("7", 7)],
)
def test_arith_evaluates_its_grammar(text: str, value: Fraction) -> None:
    assert arith.evaluate(text) == value


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("2**2**34", r"unexpected '\*'"),
        ("(2**2**34)&0", "not in the grammar"),
        ("__import__('os')", "not in the grammar"),
        ("9" * 40, "longer than 18 digits"),
        ("1+" * 150 + "1", "longer than 200"),
        ("(" * 40 + "1" + ")" * 40, "deeper than 32"),
        ("-" * 60 + "1", "deeper than 32"),
        ("1/0", "division by zero"),
        ("(1+2", "unbalanced|ends early"),
        ("1 2", "unexpected '2'"),
        ("", "empty"),
    ],
)
def test_arith_refuses_what_is_outside_its_grammar_or_bounds(text: str, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(arith.ExpressionError, match=match):
        arith.evaluate(text)
    assert time.monotonic() - start < 0.1
