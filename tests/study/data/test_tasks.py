"""Tasks and rewards: reasoning-gym items in the compact format, its real verifiers, held-out sets, user data."""

from __future__ import annotations

import hashlib
import json
import statistics
from functools import cache
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from study.data import tasks
from study.data.tasks import (
    EVAL_SPLITS,
    TASKS,
    TaskItem,
    eval_set,
    extract_answer,
    load_user_data,
    make_task,
    pass_at_1,
    score,
)


def _with_answer(item: TaskItem, answer: str) -> str:
    """The reference solution with its final answer replaced."""
    head, _ = item.solution.rsplit("####", 1)
    return f"{head}#### {answer}"


def _wrong_answer(item: TaskItem) -> str:
    if item.task == "countdown":  # a different source number: the verifier checks the numbers used
        expr = item.answer
        i = max(i for i, c in enumerate(expr) if c.isdigit())
        return expr[:i] + str((int(expr[i]) + 1) % 10) + expr[i + 1 :]
    return str(int(float(item.answer)) + 1)


@pytest.mark.parametrize("name", TASKS)
def test_reference_solutions_score_one(name: str) -> None:
    items = make_task(name, seed=3).take(40) + eval_set(name, "in_dist", size=20) + eval_set(name, "hard", size=20)
    for item in items:
        assert item.prompt.endswith("\n") and not item.solution[0].isspace()
        assert item.solution.endswith(f"#### {item.answer}")
        assert extract_answer(item.solution) == item.answer
        assert score(item, item.solution) == 1.0
        assert score(item, item.solution, partial_credit=True) == 1.0


@pytest.mark.parametrize("name", TASKS)
def test_corrupted_answers_score_zero(name: str) -> None:
    for item in make_task(name, seed=4).take(30):
        assert score(item, _with_answer(item, _wrong_answer(item))) == 0.0
        assert score(item, item.solution.replace("####", "##")) == 0.0  # no delimiter: no answer
        assert score(item, "") == 0.0
        assert score(item, "#### ") == 0.0


def test_partial_credit_passes_reasoning_gyms_raw_score() -> None:
    item = make_task("chain_sum").take(1)[0]
    padded = f"#### 1{item.answer}"  # substring credit in reasoning-gym, a wrong answer here
    assert score(item, padded) == 0.0
    assert score(item, padded, partial_credit=True) == pytest.approx(len(item.answer) / len(item.answer + "1"))
    countdown = make_task("countdown").take(1)[0]
    assert score(countdown, "no answer", partial_credit=True) == 0.01  # reasoning-gym's format shaping
    assert score(countdown, "no answer") == 0.0


def test_countdown_answers_outside_its_grammar_are_not_evaluated() -> None:
    item = make_task("countdown").take(1)[0]
    for bad in ("__import__('os').getcwd()", "9**9**9**9", "1e5", "x+1"):
        assert score(item, f"#### {bad}") == 0.0
        assert score(item, f"#### {bad}", partial_credit=True) == 0.01  # reasoning-gym's unparseable score


@pytest.mark.parametrize("name", TASKS)
def test_truncated_response_scores_as_it_stands(name: str) -> None:
    for item in make_task(name, seed=5).take(10):
        sol = item.solution
        start = max(0, sol.rindex("####") - 20)  # cuts through the last worked lines, the delimiter and the answer
        for cut in range(start, len(sol) + 1):
            expected = 1.0 if cut == len(sol) else 0.0
            assert score(item, sol[:cut]) == expected, (sol, cut)
        # generation that ran past the answer without an end-of-sequence marker: the answer line is what counts
        assert score(item, sol + "\n12+") == 1.0
        assert score(item, sol + "7") == 0.0


def test_extract_answer_takes_the_last_delimited_line() -> None:
    assert extract_answer("1+1=2\n#### 2") == "2"
    assert extract_answer("#### 1\n#### 2\nmore text") == "2"
    assert extract_answer("####-3  ") == "-3"
    assert extract_answer("no delimiter") is None
    assert extract_answer("cut #### ") == ""


@pytest.mark.parametrize("terms", [2, 5, 9, 14])
def test_chain_sum_solution_grows_with_terms(terms: int) -> None:
    for item in make_task("chain_sum", terms=terms, digits=2).take(20):
        lines = item.solution.split("\n")
        assert len(lines) == terms  # terms-1 worked lines, then the answer
        assert item.metadata["num_terms"] == terms


@given(
    name=st.sampled_from(["chain_sum", "basic_arithmetic"]),
    terms=st.integers(2, 8),
    digits=st.integers(1, 3),
    seed=st.integers(0, 2**20),
)
def test_arithmetic_worked_solutions_are_exact(name: str, terms: int, digits: int, seed: int) -> None:
    ops = {"operators": "+-*/"} if name == "basic_arithmetic" else {}
    item = make_task(name, terms=terms, digits=digits, seed=seed, **ops)[0]
    assert score(item, item.solution) == 1.0
    for line in item.solution.split("\n")[:-1]:  # each worked line is a true equation (floor division)
        lhs, rhs = line.rsplit("=", 1)
        assert eval(lhs.replace("/", "//")) == int(rhs)


def test_training_stream_is_deterministic_and_seeded() -> None:
    a = make_task("basic_arithmetic", seed=7).take(50)
    assert a == make_task("basic_arithmetic", seed=7).take(50)
    assert make_task("basic_arithmetic", seed=7).take(10, start=40) == a[40:]
    b = make_task("basic_arithmetic", seed=8).take(50)
    assert sum(x.prompt == y.prompt for x, y in zip(a, b, strict=True)) < 10


def test_eval_sets_are_fixed() -> None:
    first = {(t, s): eval_set(t, s) for t in TASKS for s in EVAL_SPLITS}
    tasks._eval_items.cache_clear()
    tasks._held_out_prompts.cache_clear()
    for (t, s), items in first.items():
        again = eval_set(t, s)
        assert again == items
        assert len(items) == tasks.EVAL_SPECS[(t, s)].size == 128
        assert len({i.prompt for i in items}) == len(items)  # distinct problems
        assert eval_set(t, s, size=16) == items[:16]
    # pinned: a change of reasoning-gym's generators or of the format shows up here
    assert first[("chain_sum", "in_dist")][0].prompt == "sum 61+73\n"
    assert first[("chain_sum", "in_dist")][0].solution == "61+73=134\n#### 134"
    digest = hashlib.sha256()
    for items in first.values():
        for item in items:
            digest.update((item.prompt + item.solution).encode())
    assert digest.hexdigest()[:16] == "51d5c3a251ddb01d"


@pytest.mark.parametrize("name", TASKS)
def test_eval_sets_are_disjoint_from_training(name: str) -> None:
    held = {i.prompt for s in EVAL_SPLITS for i in eval_set(name, s)}
    in_dist = {i.prompt for i in eval_set(name, "in_dist")}
    assert not in_dist & {i.prompt for i in eval_set(name, "hard")}
    for knobs in (tasks.DEFAULT_KNOBS[name], tasks.HARD_KNOBS[name]):
        train = {i.prompt for i in make_task(name, **knobs).take(300)}
        assert not train & held


def test_held_out_problems_are_skipped_even_in_a_small_problem_space() -> None:
    # 2 one-digit terms: 200 problems, some of which are in the default in_dist set; the in_dist set of these knobs
    # (the run's held-out set when it trains on them) is held out of their stream too
    small = {i.prompt for i in eval_set("chain_sum", "in_dist") if i.metadata["num_terms"] == 2}
    small = {p for p in small if all(len(n) == 1 for n in p[4:-1].replace("-", "+").split("+"))}
    assert small, "the in_dist set should hold some 2-term one-digit problems"
    own = {i.prompt for i in eval_set("chain_sum", "in_dist", knobs={"terms": 2, "digits": 1})}  # these knobs' set
    train = {i.prompt for i in make_task("chain_sum", terms=2, digits=1).take(400)}
    # 200 problems: 128 in the knobs' own in_dist set, a few in the default sets; the stream yields the rest
    assert len(own) == 128 and not own & small
    assert len(train) > 40 and not train & small and not train & own


def test_hard_sets_have_longer_solutions() -> None:
    ratios = {}
    for name in TASKS:
        mean = {s: statistics.mean(len(i.solution) for i in eval_set(name, s)) for s in EVAL_SPLITS}
        ratios[name] = mean["hard"] / mean["in_dist"]
    # measured: chain_sum 87.8/29.6 chars, basic_arithmetic 66.8/26.3, countdown 50.3/29.3, gsm_symbolic 344/257
    assert ratios["chain_sum"] > 2.5
    assert ratios["basic_arithmetic"] > 2.0
    assert ratios["countdown"] > 1.5
    assert ratios["gsm_symbolic"] > 1.2
    lines = {s: statistics.mean(i.solution.count("\n") for i in eval_set("chain_sum", s)) for s in EVAL_SPLITS}
    assert lines["in_dist"] < 3.0 < 7.0 < lines["hard"]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: make_task("sudoku"), r"unknown task 'sudoku'; valid: chain_sum, basic_arithmetic, countdown"),
        (lambda: make_task("chain_sum", steps=3), r"chain_sum: unknown knob 'steps'; valid: terms, digits"),
        (lambda: make_task("gsm_symbolic", terms=3), r"gsm_symbolic: unknown knob 'terms'; valid: steps"),
        (lambda: make_task("chain_sum", terms=(5, 2)), r"chain_sum: terms = \(5, 2\); valid: .*2 <= min <= max <= 16"),
        (lambda: make_task("chain_sum", terms=1), r"terms = 1; valid"),
        (lambda: make_task("chain_sum", terms=17), r"terms = 17; valid"),
        (lambda: make_task("chain_sum", digits="2"), r"digits = '2'; valid: an int or a \(min, max\) pair"),
        (lambda: make_task("chain_sum", digits=True), r"digits = True; valid"),
        (lambda: make_task("countdown", terms=(2, 3, 4)), r"countdown: terms = \(2, 3, 4\); valid"),
        (lambda: make_task("countdown", operators="x"), r"operators = 'x'; valid: .*'\+-\*/'"),
        (lambda: make_task("countdown", operators=""), r"operators = ''; valid"),
        (lambda: make_task("countdown", operators="++"), r"operators = '\+\+'; valid"),
        (lambda: make_task("basic_arithmetic", operators="/"), r"operators = '/'; valid: must include one of"),
        (lambda: make_task("chain_sum", seed=-1), r"seed = -1; valid: a non-negative int"),
        (lambda: eval_set("chain_sum", "test"), r"eval split = 'test'; valid: in_dist, hard"),
        (lambda: eval_set("chess"), r"unknown task 'chess'"),
        (lambda: eval_set("chain_sum", size=0), r"eval size = 0; valid: an int in \[1, 128\]"),
        (lambda: make_task("gsm_symbolic", steps=(25, 30))[0], r"gsm_symbolic: no item with knobs .* in 1000 draws"),
    ],
)
def test_bad_knobs_raise_naming_the_field_and_valid_values(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_task_index_must_be_non_negative() -> None:
    with pytest.raises(IndexError, match="non-negative int"):
        make_task("chain_sum")[-1]


def test_pass_at_1() -> None:
    # problem 1: 3 of 4 samples pass; problem 2: none; a partial score is not a pass
    assert pass_at_1([[1, 0, 1, 1], [0, 0, 0, 0]]) == pytest.approx(0.375)
    assert pass_at_1([[1.0], [0.5, 1.0]]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="scores is empty"):
        pass_at_1([])
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        pass_at_1([[1.0], []])
    with pytest.raises(ValueError, match=r"problem 0 has score 1.5 outside \[0, 1\]"):
        pass_at_1([[1.5]])


def test_pass_at_1_of_reference_and_wrong_responses() -> None:
    items = eval_set("chain_sum", "hard", size=10)
    scores = [[score(i, i.solution), score(i, _with_answer(i, _wrong_answer(i)))] for i in items]
    assert pass_at_1(scores) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------- user data

ROWS = [
    {"prompt": "2+2=\n", "answer": "4"},
    {"prompt": "ten minus three\n", "answer": 7, "solution": "10-3=7"},
    {"prompt": "half of 9\n", "answer": "4.5", "solution": "9/2=4.5\n#### 4.5"},
]


def _jsonl(path: Path, rows: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("\n".join([*(json.dumps(r) for r in rows), *extra_lines]) + "\n")
    return path


def test_user_data_jsonl_and_parquet(tmp_path: Path) -> None:
    from_jsonl = load_user_data(_jsonl(tmp_path / "d.jsonl", ROWS), verifier="numeric")
    df = pd.DataFrame([{**r, "answer": str(r["answer"]), "solution": r.get("solution")} for r in ROWS])
    df.to_parquet(tmp_path / "d.parquet")
    from_parquet = load_user_data(tmp_path / "d.parquet", verifier="numeric")
    assert from_jsonl == from_parquet
    assert [i.answer for i in from_jsonl] == ["4", "7", "4.5"]
    assert [i.solution for i in from_jsonl] == ["#### 4", "10-3=7\n#### 7", "9/2=4.5\n#### 4.5"]
    item = from_jsonl[2]
    assert score(item, "#### 4.50") == 1.0  # numeric
    assert score(item, "#### 4.4") == 0.0
    exact = load_user_data(tmp_path / "d.jsonl", verifier="exact")[2]
    assert score(exact, "#### 4.5") == 1.0 and score(exact, "#### 4.50") == 0.0


def test_user_data_with_a_reasoning_gym_verifier(tmp_path: Path) -> None:
    meta = {"numbers": [3, 4, 5], "target": 27}
    rows = [{"prompt": "countdown 27 from 3,4,5\n", "answer": "3+4*5+4-4", "metadata": meta}]
    with pytest.raises(ValueError, match=r"d.jsonl:1: verifier 'countdown' does not accept the row's own 'answer'"):
        load_user_data(_jsonl(tmp_path / "d.jsonl", rows), verifier="countdown")
    rows[0]["answer"] = "3+4+5"  # the right numbers, the wrong value
    with pytest.raises(ValueError, match=r"d.jsonl:1: verifier 'countdown' does not accept"):
        load_user_data(_jsonl(tmp_path / "d.jsonl", rows), verifier="countdown")
    rows[0]["answer"] = "(4+5)*3"
    (item,) = load_user_data(_jsonl(tmp_path / "d.jsonl", rows), verifier="countdown")
    assert score(item, "#### 3*(5+4)") == 1.0 and score(item, "#### 3*5+4") == 0.0
    del rows[0]["metadata"]  # countdown's scorer reads metadata.numbers: the error points at the field
    with pytest.raises(ValueError, match=r"d.jsonl:1: verifier 'countdown' failed .*metadata.numbers.*'metadata'"):
        load_user_data(_jsonl(tmp_path / "d.jsonl", rows), verifier="countdown")
    (chain,) = load_user_data(
        _jsonl(tmp_path / "c.jsonl", [{"prompt": "sum 1+2\n", "answer": "3"}]), verifier="chain_sum"
    )
    assert score(chain, "#### 3") == 1.0


@pytest.mark.parametrize(
    ("rows", "extra", "match"),
    [
        ([{"answer": "1"}], (), r"d.jsonl:1: field 'prompt' must be a non-empty string, got None"),
        ([ROWS[0], {"prompt": "x", "answer": None}], (), r"d.jsonl:2: field 'answer' must be a non-empty one-line"),
        ([ROWS[0], {"prompt": "x", "answer": "1\n2"}], (), r"d.jsonl:2: field 'answer'"),
        ([ROWS[0], {"prompt": "x", "answer": "1", "solution": 5}], (), r"d.jsonl:2: field 'solution' must be a str"),
        ([ROWS[0], {"prompt": "x", "answer": "1", "solution": "#### 2"}], (), r"d.jsonl:2: .*own 'solution'"),
        ([ROWS[0], {"prompt": "x", "answer": "1", "metadata": "{bad"}], (), r"d.jsonl:2: field 'metadata' is not"),
        ([ROWS[0], {"prompt": "x", "answer": "1", "metadata": [1]}], (), r"d.jsonl:2: field 'metadata' must be"),
        ([ROWS[0]], ("{not json",), r"d.jsonl:2: not valid JSON"),
        ([ROWS[0]], ("[1, 2]",), r"d.jsonl:2: a row must be a JSON object, got list"),
        ([], (), r"d.jsonl: no rows"),
    ],
)
def test_bad_user_jsonl_names_the_row_and_field(tmp_path: Path, rows: list[dict], extra: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_user_data(_jsonl(tmp_path / "d.jsonl", rows, extra), verifier="numeric")


def test_bad_user_parquet_and_files(tmp_path: Path) -> None:
    pd.DataFrame({"prompt": ["a\n", "b\n"], "answer": ["1", ""]}).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet row 1: field 'answer' must be a non-empty one-line string"):
        load_user_data(tmp_path / "d.parquet", verifier="exact")
    pd.DataFrame({"question": ["a\n"], "answer": ["1"]}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"q.parquet row 0: field 'prompt'"):
        load_user_data(tmp_path / "q.parquet", verifier="exact")
    assert load_user_data(tmp_path / "q.parquet", verifier="exact", prompt_field="question")[0].prompt == "a\n"
    with pytest.raises(ValueError, match=r"verifier = 'fuzzy'; valid: exact, numeric, or a reasoning-gym task: .*"):
        load_user_data(tmp_path / "q.parquet", verifier="fuzzy")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'; valid: .jsonl, .parquet"):
        load_user_data(tmp_path / "d.csv", verifier="exact")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_user_data(tmp_path / "missing.jsonl", verifier="exact")


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"metadata": {"numbers": [3, 4, 5], "target": float("inf")}}, r"metadata.target = inf; valid: finite"),
        ({"metadata": '{"numbers": [3, 4, 5], "target": -Infinity}'}, r"metadata.target = -inf; valid: finite"),
        ({"metadata": {"numbers": [3, float("nan"), 5], "target": 27}}, r"metadata.numbers\[1\] = nan; valid"),
    ],
)
def test_user_data_numbers_must_be_finite(tmp_path: Path, row: dict, match: str) -> None:
    # before: "target": Infinity passed, and every expression of the numbers scored 1.0 (|v - inf| <= inf)
    base = {"prompt": "countdown 27 from 3,4,5\n", "answer": "(4+5)*3"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({**base, **row}) + "\n")  # json writes inf and nan as Infinity and NaN
    with pytest.raises(ValueError, match=rf"d.jsonl:1: {match}"):
        load_user_data(path, verifier="countdown")


def test_a_fifo_as_user_data_is_refused_not_waited_on(tmp_path: Path) -> None:
    """The data file and the run id's hash of it are read with the bounded reader: a FIFO is named, never opened
    for a read that waits for a writer (before: the run id's hash hung for ever)."""
    import os
    import threading

    from study.run.config import load_config

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    rescue = threading.Timer(20, lambda: open(fifo, "w").close())  # frees a reader that waits, so a failure ends
    rescue.start()
    try:
        with pytest.raises(ValueError, match=r"user data .*rows.jsonl: not a regular file \(a FIFO\); valid: a .jsonl"):
            load_user_data(fifo, verifier="exact")
        sets = ["task=user", f"data={fifo}", "verifier=exact", "coldstart=scratch"]
        with pytest.raises(ValueError, match=r"^data = .*rows.jsonl': user data .*: not a regular file \(a FIFO\)"):
            load_config(preset="tiny", sets=sets)
    finally:
        rescue.cancel()


@cache
def _first_item(name: str) -> TaskItem:
    return make_task(name, seed=9)[0]


@given(name=st.sampled_from(TASKS), text=st.text(alphabet=st.sampled_from("0123456789+-*/() .e#x\n_'"), max_size=60))
def test_verifiers_never_raise_on_arbitrary_responses(name: str, text: str) -> None:
    # an RL run scores whatever the policy writes; reasoning-gym's verifier must give a number in [0, 1]
    for response in (text, f"#### {text}"):
        assert score(_first_item(name), response) in (0.0, 1.0)
        assert 0.0 <= score(_first_item(name), response, partial_credit=True) <= 1.0


def test_in_dist_follows_the_training_knobs() -> None:
    """A run training on other knobs is evaluated in distribution: its in_dist set has those knobs (and the task's
    defaults give the default set exactly); `hard` keeps HARD_KNOBS and refuses knobs."""
    easy = {"terms": (2, 3), "digits": 1}
    items = eval_set("chain_sum", "in_dist", knobs=easy)
    assert len(items) == 128 and all(2 <= i.metadata["num_terms"] <= 3 for i in items)
    assert eval_set("chain_sum", "in_dist", knobs=tasks.DEFAULT_KNOBS["chain_sum"]) == eval_set("chain_sum", "in_dist")
    assert eval_set("chain_sum", "in_dist", size=8, knobs=easy) == items[:8]
    train = {i.prompt for i in make_task("chain_sum", **easy).take(300)}
    assert not train & {i.prompt for i in items}
    with pytest.raises(ValueError, match="only in_dist follows the training knobs"):
        eval_set("chain_sum", "hard", knobs=easy)
