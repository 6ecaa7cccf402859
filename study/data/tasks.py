"""Verifiable tasks for the RL study: reasoning-gym generators and verifiers behind one small interface.

A task item is a prompt, a reference solution (the cold-start SFT target), the reference answer and reasoning-gym's
metadata. The format is compact and has no chat template, so a tiny model trained from scratch can learn it:

    prompt:   "sum 4-1-7\\n"
    solution: "4-1=3\\n3-7=-4\\n#### -4"

The solution works the problem one operation per line and ends with the answer after the delimiter `####`
(GSM8K's). `extract_answer` takes the text after the last `####` up to the end of that line; `score` scores it as
reasoning-gym's verifier for the task does. Nothing a response or a user's row says ever runs: the generated tasks,
`exact`, `numeric` and `puzzle24` are scored here on grammars of this module's own (study.data.arith for expressions,
no `eval`, no sympy), and every other reasoning-gym verifier runs in study.data.sandbox: each text in a fresh
locked-down child process with a time limit, so nothing one text does reaches another's score; a verifier that times
out, fails or replies malformed scores 0 and is counted (`take_scorer_failures`).
A response cut at the length limit is scored as it stands: cut before the delimiter it has no answer, cut inside the
answer it has a wrong one.

Rewards are binary by default: 1.0 when the verifier gives full credit, else 0.0 (`partial_credit=True` passes the
verifier's raw score through). reasoning-gym's partial credits are format shaping (countdown pays 0.01 for no answer
and 0.05 for a wrong expression) or substring matches ("1214" earns 0.75 against "214"), neither of which the paper's
verifier rewards have.

Tasks and knobs (each range knob takes an int or a (min, max) pair):

- `chain_sum`: `terms` operands joined by + and -, each of `digits` digits. The worked solution has terms-1 lines,
  so `terms` is the generation-length knob.
- `basic_arithmetic`: `terms` operands of up to `digits` digits (negatives and parentheses allowed) with the
  `operators` (a subset of "+-*/"; "/" is floor division, as reasoning-gym evaluates it). One line per operation.
- `countdown`: reach a target with all `terms` source numbers of `digits` digits and the `operators`; the solution
  evaluates a reference expression line by line and answers with the expression.
- `gsm_symbolic`: GSM8K-style word problems; the solution is reasoning-gym's worked answer. reasoning-gym has one
  difficulty, so the knob is `steps`: the number of worked lines before the answer (items are drawn until one fits).

Held-out evaluation sets (`eval_set`) have fixed seeds: `in_dist` draws from the default knobs (the analogue of the
paper's AIME'24), `hard` from longer problems (the analogue of LiveCodeBench). Training streams (`make_task`) never
yield a prompt of either set of the same task. Score them with `pass_at_1` (mean pass@1 over k samples per problem).

User data (`load_user_data`): a JSONL or parquet file of (prompt, answer[, solution][, metadata]) rows scored by a
named verifier: `exact`, `numeric`, or any reasoning-gym task's own scorer.
"""

from __future__ import annotations

import ast
import hashlib
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any, Literal

import reasoning_gym
from reasoning_gym.factory import DATASETS as RG_DATASETS

from runfiles.bounded import BoundError, load_json, read_bytes
from study.data import arith, sandbox

ANSWER_DELIMITER = "####"
"""The answer follows the last occurrence of this marker in a response, up to the end of its line."""

TASKS: tuple[str, ...] = ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic")
"""Generated task names, in a fixed order."""

EVAL_SPLITS: tuple[str, ...] = ("in_dist", "hard")
"""Held-out validation splits: in-distribution (default knobs) and harder/longer. Every choice of a study's design
(cold-start band, temperatures, clip ranges, probes, tuning) reads these."""

TEST_POOL = 512
"""Problems in each task's in-distribution test pool (`held_out_test_set`): disjoint from every validation set, and
from the training streams and cold starts of runs that hold it out (`make_task(held_out_test=True)`)."""
TEST_SEED = 2000
"""Seed offset of the test pools (validation sets use 1000 + ...)."""
TEST_METRIC = "test_in_dist"
"""The metrics.parquet column of the test split's mean pass@1 (validation: `eval_in_dist`, `eval_hard`)."""

USER_VERIFIERS: tuple[str, ...] = ("exact", "numeric")
"""Verifiers for user data besides reasoning-gym's task scorers."""

OPERATORS = "+-*/"
_MAX_DRAWS = 1000
_GSM_SUFFIX = " Give the result as your final answer. Do not include units."

# Valid range of every range knob, per task; the knobs a task takes are exactly the keys listed here (plus
# `operators` where _TAKES_OPERATORS says so).
_RANGES: dict[str, dict[str, tuple[int, int]]] = {
    "chain_sum": {"terms": (2, 16), "digits": (1, 6)},
    "basic_arithmetic": {"terms": (2, 10), "digits": (1, 4)},
    "countdown": {"terms": (2, 6), "digits": (1, 3)},
    "gsm_symbolic": {"steps": (1, 30)},
}
_TAKES_OPERATORS = {"basic_arithmetic", "countdown"}

DEFAULT_KNOBS: dict[str, dict[str, Any]] = {
    "chain_sum": {"terms": (2, 5), "digits": (1, 2)},
    "basic_arithmetic": {"terms": (2, 4), "digits": (1, 1), "operators": "+-*"},
    "countdown": {"terms": (3, 4), "digits": (1, 1), "operators": "+-*"},
    "gsm_symbolic": {"steps": (1, 30)},
}
"""Training distribution of each task when no knob is given; also the knobs of its `in_dist` evaluation set."""

HARD_KNOBS: dict[str, dict[str, Any]] = {
    "chain_sum": {"terms": (8, 12), "digits": (1, 2)},
    "basic_arithmetic": {"terms": (6, 8), "digits": (1, 1), "operators": "+-*"},
    "countdown": {"terms": (5, 6), "digits": (1, 1), "operators": "+-*"},
    "gsm_symbolic": {"steps": (4, 30)},
}
"""Knobs of each task's `hard` evaluation set: more operands / more worked steps, so longer answers."""


@dataclass(frozen=True)
class EvalSpec:
    """A held-out evaluation set: fixed task, knobs, seed and size."""

    task: str
    split: str
    knobs: Mapping[str, Any]
    seed: int
    size: int


EVAL_SPECS: dict[tuple[str, str], EvalSpec] = {
    (task, split): EvalSpec(
        task=task,
        split=split,
        knobs=(DEFAULT_KNOBS if split == "in_dist" else HARD_KNOBS)[task],
        seed=1000 + 10 * i + j,
        size=128,
    )
    for i, task in enumerate(TASKS)
    for j, split in enumerate(EVAL_SPLITS)
}
"""Every held-out set, by (task, split)."""


@dataclass(frozen=True)
class TaskItem:
    """One problem: what the policy sees, what cold start imitates, and what the verifier needs."""

    task: str
    """Task name (`user` for user data)."""
    prompt: str
    """Model input, ending with a newline; no chat template."""
    solution: str
    """Reference response: worked lines, then `#### <answer>` (no end-of-sequence marker)."""
    answer: str
    """Reference answer, as reasoning-gym states it."""
    verifier: str
    """Name of the scorer: a reasoning-gym task name, `exact` or `numeric`."""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    """reasoning-gym's metadata (countdown's verifier reads `numbers` and `target`) plus `question` and `rg_seed`."""


# --------------------------------------------------------------------------------------------------------- knobs


def _range_knob(task: str, name: str, value: Any) -> tuple[int, int]:
    lo_ok, hi_ok = _RANGES[task][name]
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    valid = f"an int or a (min, max) pair with {lo_ok} <= min <= max <= {hi_ok}"
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        or not lo_ok <= pair[0] <= pair[1] <= hi_ok
    ):
        raise ValueError(f"task {task}: {name} = {value!r}; valid: {valid}")
    return int(pair[0]), int(pair[1])


def resolve_knobs(task: str, **knobs: Any) -> dict[str, Any]:
    """Validate `knobs` for `task` and fill in its defaults; errors name the task, the knob and the valid values."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    valid_names = [*_RANGES[task], *(["operators"] if task in _TAKES_OPERATORS else [])]
    resolved = dict(DEFAULT_KNOBS[task])
    for name, value in knobs.items():
        if value is None:
            continue
        if name not in valid_names:
            raise ValueError(f"task {task}: unknown knob {name!r}; valid: {', '.join(valid_names)}")
        resolved[name] = value
    for name in _RANGES[task]:
        resolved[name] = _range_knob(task, name, resolved[name])
    if "operators" in resolved:
        ops = resolved["operators"]
        if not isinstance(ops, str) or not ops or any(op not in OPERATORS for op in ops) or len(set(ops)) != len(ops):
            raise ValueError(
                f"task {task}: operators = {ops!r}; valid: a non-empty string of distinct characters from {OPERATORS!r}"
            )
        if task == "basic_arithmetic" and ops == "/":  # reasoning-gym needs a non-division operator between terms
            raise ValueError(f"task {task}: operators = {ops!r}; valid: must include one of '+-*' besides '/'")
        resolved["operators"] = "".join(op for op in OPERATORS if op in ops)  # canonical order
    return resolved


def _rg_config(task: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """reasoning-gym config fields for the resolved knobs."""
    if task == "chain_sum":
        (t0, t1), (d0, d1) = knobs["terms"], knobs["digits"]
        return dict(min_terms=t0, max_terms=t1, min_digits=d0, max_digits=d1, allow_negation=False)
    if task == "basic_arithmetic":
        (t0, t1), (d0, d1) = knobs["terms"], knobs["digits"]
        return dict(
            min_terms=t0,
            max_terms=t1,
            min_digits=d0,
            max_digits=d1,
            operators=tuple(knobs["operators"]),
            allow_parentheses=True,
            allow_negation=True,
            whitespace="single",
            format_style="simple",
        )
    if task == "countdown":
        (t0, t1), (d0, d1) = knobs["terms"], knobs["digits"]
        return dict(
            min_numbers=t0,
            max_numbers=t1,
            min_value=1 if d0 == 1 else 10 ** (d0 - 1),
            max_value=10**d1 - 1,
            min_target=1,
            max_target=10 ** (d1 + 2) - 1,
            operators=tuple(knobs["operators"]),
            shuffle=True,
        )
    return {"difficulty": 1.0}  # gsm_symbolic: reasoning-gym supports only 1.0


# ------------------------------------------------------------------------------------------ worked solutions


def _fmt(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _worked_steps(expression: str, *, floor_div: bool) -> tuple[list[str], Fraction]:
    """One line per operation of `expression` (post-order, Python precedence): `a<op>b=c`; and the value.

    `floor_div` evaluates "/" as floor division (basic_arithmetic's semantics), else exactly (countdown's sympy).
    Negative literals are operands, not steps; negating a parenthesised group is a step `-(v)=-v`.
    """
    steps: list[str] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            if isinstance(node.operand, ast.Constant):
                return -ev(node.operand)
            value = ev(node.operand)
            steps.append(f"-({_fmt(value)})={_fmt(-value)}")
            return -value
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                op, r = "+", a + b
            elif isinstance(node.op, ast.Sub):
                op, r = "-", a - b
            elif isinstance(node.op, ast.Mult):
                op, r = "*", a * b
            elif isinstance(node.op, ast.Div):
                op, r = "/", (Fraction(math.floor(a / b)) if floor_div else a / b)
            else:
                raise ValueError(f"unsupported operator in {expression!r}")
            steps.append(f"{_fmt(a)}{op}{_fmt(b)}={_fmt(r)}")
            return r
        raise ValueError(f"unsupported syntax in {expression!r}")

    value = ev(ast.parse(expression, mode="eval").body)
    return steps, value


def _solution(steps: Sequence[str], answer: str) -> str:
    return "".join(f"{s}\n" for s in steps) + f"{ANSWER_DELIMITER} {answer}"


# ------------------------------------------------------------------------------------------------- generation


def _key(*parts: Any) -> int:
    """A 56-bit reasoning-gym seed derived from `parts`: streams with different parts do not share items."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "big")


def _generate(task: str, knobs: Mapping[str, Any], rg_seed: int) -> TaskItem | None:
    """The item reasoning-gym makes from `rg_seed`, in the compact format; None if the knobs reject it."""
    try:
        entry = reasoning_gym.create_dataset(task, seed=rg_seed, size=1, **_rg_config(task, knobs))[0]
    except (ValueError, ZeroDivisionError):  # countdown: no target in range after 100 tries; rare degenerate draws
        return None
    meta = dict(entry["metadata"], question=entry["question"], rg_seed=rg_seed)
    answer = entry["answer"]
    if task in ("chain_sum", "basic_arithmetic"):
        expression = entry["metadata"]["expression"].replace(" ", "")
        steps, value = _worked_steps(expression, floor_div=True)
        if _fmt(value) != answer:
            raise AssertionError(f"{task}: worked solution of {expression!r} gives {_fmt(value)}, answer {answer}")
        prompt = f"{'sum' if task == 'chain_sum' else 'calc'} {expression}\n"
    elif task == "countdown":
        answer = entry["answer"].replace(" ", "")
        steps, value = _worked_steps(answer, floor_div=False)
        if value != meta["target"]:
            raise AssertionError(f"countdown: {answer!r} gives {_fmt(value)}, target {meta['target']}")
        prompt = f"countdown {meta['target']} from {','.join(map(str, meta['numbers']))}\n"
    else:  # gsm_symbolic
        lines = meta["answer_cot"].strip().splitlines()
        if not lines or not lines[-1].startswith(ANSWER_DELIMITER):
            raise AssertionError(f"gsm_symbolic: worked answer does not end with {ANSWER_DELIMITER}: {lines[-1:]}")
        steps = [line.rstrip() for line in lines[:-1]]
        lo, hi = knobs["steps"]
        if not lo <= sum(1 for s in steps if s.strip()) <= hi:
            return None
        question = entry["question"].removesuffix(_GSM_SUFFIX)
        prompt = f"{question}\n"
    return TaskItem(
        task=task, prompt=prompt, solution=_solution(steps, answer), answer=answer, verifier=task, metadata=meta
    )


def _draw(task: str, knobs: Mapping[str, Any], parts: tuple[Any, ...], exclude: frozenset[str]) -> TaskItem:
    for attempt in range(_MAX_DRAWS):
        item = _generate(task, knobs, _key(*parts, attempt))
        if item is not None and item.prompt not in exclude:
            return item
    raise ValueError(
        f"task {task}: no item with knobs {dict(knobs)} in {_MAX_DRAWS} draws (the knob range is too narrow, "
        "or its few problems are all held out for evaluation)"
    )


def _knob_key(knobs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(knobs.items()))


def _knobs_key(task: str, knobs: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """The resolved `knobs` as a cache key; () when they are the task's defaults (or none are given)."""
    if not knobs:
        return ()
    resolved = resolve_knobs(task, **knobs)
    return () if resolved == resolve_knobs(task) else _knob_key(resolved)


@dataclass(frozen=True)
class Task:
    """An endless, deterministic training stream of one task: `task[i]` is the same item for the same seed and
    knobs, on any machine. Prompts of the task's held-out evaluation sets are never yielded; with `held_out_test`,
    nor those of the test pool of its knobs."""

    name: str
    knobs: Mapping[str, Any]
    seed: int
    held_out_test: bool = False

    def __getitem__(self, index: int) -> TaskItem:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"task index must be a non-negative int, got {index!r}")
        return _draw(
            self.name,
            self.knobs,
            ("train", self.name, _knob_key(self.knobs), self.seed, index),
            _held_out_prompts(self.name, _knobs_key(self.name, self.knobs), test=self.held_out_test),
        )

    def take(self, n: int, start: int = 0) -> list[TaskItem]:
        """Items start .. start+n-1."""
        return [self[i] for i in range(start, start + n)]

    def __iter__(self) -> Iterator[TaskItem]:
        i = 0
        while True:
            yield self[i]
            i += 1


def make_task(
    name: str,
    *,
    terms: int | tuple[int, int] | None = None,
    digits: int | tuple[int, int] | None = None,
    operators: str | None = None,
    steps: int | tuple[int, int] | None = None,
    seed: int = 0,
    held_out_test: bool = False,
) -> Task:
    """The training stream of task `name`. Knobs left at None take DEFAULT_KNOBS[name]; a knob the task does not
    take, an unknown task or a value out of range raises ValueError naming it and the valid values.

    terms: operands (chain_sum, basic_arithmetic) or source numbers (countdown); the length knob.
    digits: digits per operand / source number.
    operators: subset of "+-*/" (basic_arithmetic, countdown).
    steps: worked lines before the answer (gsm_symbolic).
    held_out_test: the stream also never yields a prompt of the test pool of its knobs (`held_out_test_set`); False
    keeps the stream of a run without a test split item for item.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"task {name}: seed = {seed!r}; valid: a non-negative int")
    if not isinstance(held_out_test, bool):
        raise ValueError(f"task {name}: held_out_test = {held_out_test!r}; valid: true, false")
    knobs = resolve_knobs(name, terms=terms, digits=digits, operators=operators, steps=steps)
    return Task(name=name, knobs=knobs, seed=seed, held_out_test=held_out_test)


# ------------------------------------------------------------------------------------------------- evaluation


@cache
def _eval_items(task: str, split: str, knobs_key: tuple[tuple[str, Any], ...] = ()) -> tuple[TaskItem, ...]:
    """The held-out set (task, split); `knobs_key` (in_dist only): the training knobs it follows, () = the defaults.
    A set of other knobs is drawn from its own seed and excludes the default sets' prompts."""
    spec = EVAL_SPECS[(task, split)]
    knobs = resolve_knobs(task, **(dict(knobs_key) or spec.knobs))
    default = knobs == resolve_knobs(task, **spec.knobs)
    seen: set[str] = set() if default else set(_held_out_prompts(task))
    parts = ("eval", task, split, spec.seed) if default else ("eval", task, split, spec.seed, _knob_key(knobs))
    items: list[TaskItem] = []
    index = 0
    while len(items) < spec.size:  # distinct problems: each counts once in pass@1
        item = _draw(task, knobs, (*parts, index), frozenset(seen))
        seen.add(item.prompt)
        items.append(item)
        index += 1
    return tuple(items)


@cache
def _held_out_prompts(task: str, knobs_key: tuple[tuple[str, Any], ...] = (), *, test: bool = False) -> frozenset[str]:
    """Every prompt of the task's default held-out sets, and of the in_dist set of `knobs_key` when given; with
    `test`, of the test pool of `knobs_key` too."""
    prompts = {item.prompt for split in EVAL_SPLITS for item in _eval_items(task, split)}
    if knobs_key:
        prompts |= {item.prompt for item in _eval_items(task, "in_dist", knobs_key)}
    if test:
        prompts |= {item.prompt for item in _test_items(task, knobs_key)}
    return frozenset(prompts)


@cache
def _test_items(task: str, knobs_key: tuple[tuple[str, Any], ...] = ()) -> tuple[TaskItem, ...]:
    """The test pool of (task, knobs): TEST_POOL distinct prompts of the in-distribution knobs `knobs_key` (() = the
    defaults), drawn from its own seed, none of them in a validation set."""
    knobs = resolve_knobs(task, **dict(knobs_key))
    seen = set(_held_out_prompts(task, knobs_key))
    seed = TEST_SEED + TASKS.index(task)
    items: list[TaskItem] = []
    index = 0
    while len(items) < TEST_POOL:
        item = _draw(task, knobs, ("test", task, seed, _knob_key(knobs), index), frozenset(seen))
        seen.add(item.prompt)
        items.append(item)
        index += 1
    return tuple(items)


def held_out_test_set(task: str, *, size: int, knobs: Mapping[str, Any] | None = None) -> list[TaskItem]:
    """The test split of (task, knobs): the first `size` problems of its fixed test pool (so smaller splits nest in
    larger ones), in-distribution (the training knobs; the task's defaults when None or empty), disjoint from every
    validation set (`eval_set`) and from the streams that hold it out. Only verdicts and the headline read it; every
    design choice reads the validation sets."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= TEST_POOL:
        raise ValueError(f"test split size = {size!r}; valid: an int in [1, {TEST_POOL}]")
    return list(_test_items(task, _knobs_key(task, knobs))[:size])


@dataclass(frozen=True)
class EvalPass:
    """One held-out set scored at an evaluation: the metric it is logged as, its problems and samples per problem."""

    metric: str
    items: Sequence[TaskItem]
    samples: int


def evaluation_plan(
    validation: Mapping[str, Sequence[TaskItem]],
    *,
    samples: int,
    step: int,
    last_step: int,
    test: Sequence[TaskItem] = (),
    test_samples: int = 0,
) -> list[EvalPass]:
    """What an evaluation at `step` scores: every validation set (`eval_<split>`, `samples` each), and the test split
    (TEST_METRIC, `test_samples` each) only at the run's first (step 0) and last (`last_step`) evaluations, so the
    verdicts read it at the start and the end and nothing in between can be chosen on it."""
    plan = [EvalPass(f"eval_{split}", items, samples) for split, items in validation.items()]
    if test and test_samples > 0 and step in (0, last_step):
        plan.append(EvalPass(TEST_METRIC, test, test_samples))
    return plan


def eval_set(
    task: str,
    split: Literal["in_dist", "hard"] = "in_dist",
    *,
    size: int | None = None,
    knobs: Mapping[str, Any] | None = None,
) -> list[TaskItem]:
    """The held-out set (task, split): fixed seed, distinct prompts, disjoint from every training stream of the
    task. `knobs` (in_dist only): the training knobs the set follows (the task's defaults when None or empty: the
    in-distribution set is the training distribution's). `size` takes a prefix (so smaller sets nest in larger
    ones); at most EVAL_SPECS[...].size."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    if split not in EVAL_SPLITS:
        raise ValueError(f"eval split = {split!r}; valid: {', '.join(EVAL_SPLITS)}")
    if knobs and split != "in_dist":
        raise ValueError(
            f"eval split = {split!r} has fixed knobs (HARD_KNOBS); only in_dist follows the training knobs"
        )
    items = _eval_items(task, split, _knobs_key(task, knobs))
    if size is None:
        return list(items)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= len(items):
        raise ValueError(f"eval size = {size!r}; valid: an int in [1, {len(items)}]")
    return list(items[:size])


def pass_at_1(scores: Sequence[Sequence[float]]) -> float:
    """Mean pass@1 over problems: scores[p][j] is the score of sample j of problem p; a sample passes when its
    score is 1.0. Each problem's pass rate over its k samples is the unbiased pass@1 estimate; this is their mean."""
    rows = [list(row) for row in scores]
    if not rows:
        raise ValueError("pass_at_1: scores is empty; need one row of k >= 1 sample scores per problem")
    rates = []
    for p, row in enumerate(rows):
        if not row:
            raise ValueError(f"pass_at_1: problem {p} has no samples")
        for s in row:
            if not 0.0 <= float(s) <= 1.0:
                raise ValueError(f"pass_at_1: problem {p} has score {s!r} outside [0, 1]")
        rates.append(sum(float(s) >= 1.0 for s in row) / len(row))
    return sum(rates) / len(rates)


# ----------------------------------------------------------------------------------------------------- scoring


def extract_answer(response: str) -> str | None:
    """The text after the last `####` up to the end of its line, stripped; None if there is no delimiter."""
    at = response.rfind(ANSWER_DELIMITER)
    if at < 0:
        return None
    return response[at + len(ANSWER_DELIMITER) :].split("\n", 1)[0].strip()


def _decimal_reward(answer: str | None, oracle: str) -> float:
    """reasoning-gym's `compute_decimal_reward`: 1.0 when the numbers are equal as decimals (sign, leading zeros,
    trailing decimals and commas tolerated), else len(oracle) / len(answer) when the oracle is a substring."""
    if not answer:
        return 0.0
    answer, oracle = answer.replace(",", ""), oracle.replace(",", "")
    try:
        if Decimal(answer) == Decimal(oracle):
            return 1.0
    except (InvalidOperation, ValueError):
        pass
    return len(oracle) / len(answer) if oracle in answer else 0.0


def _substring_reward(answer: str | None, oracle: str) -> float:
    """reasoning-gym's default scorer: 1.0 for the oracle, len(oracle) / len(answer) when it is a substring."""
    if not answer:
        return 0.0
    return 1.0 if answer == oracle else (len(oracle) / len(answer) if oracle in answer else 0.0)


def _gsm_reward(answer: str | None, oracle: str) -> float:
    """reasoning-gym's gsm_symbolic scorer: the first number of the answer against the oracle, 0.01 when unequal."""
    match = re.search(r"\b-?\d+(?:\.\d+)?\b", answer) if answer is not None else None
    if match is None:
        return 0.0
    try:
        return 1.0 if float(match.group(0)) == float(oracle) else 0.01
    except ValueError:
        return 0.0


def _expression_reward(answer: str | None, numbers: Sequence[int], target: float, *, no_answer: float) -> float:
    """countdown's scorer on study.data.arith's grammar: 1.0 when the expression uses exactly `numbers` and reaches
    `target` (np.isclose's tolerance, as reasoning-gym's), 0.05 for a wrong one, 0.01 when it does not parse."""
    if answer is None or not answer.strip():
        return no_answer
    try:
        value = float(arith.evaluate(answer))
    except (arith.ExpressionError, OverflowError):
        return 0.01
    if sorted(arith.integers(answer)) != sorted(int(n) for n in numbers):
        return 0.05
    return 1.0 if abs(value - float(target)) <= 1e-6 + 1e-5 * abs(float(target)) else 0.05


def _puzzle24_reward(answer: str | None) -> float:
    """puzzle24's scorer on study.data.arith's grammar: 1.0 when four numbers in reasoning-gym's default range
    [1, 10] make exactly 24, else 0.01."""
    if answer is None:
        return 0.01
    try:
        value = arith.evaluate(answer.strip())
    except arith.ExpressionError:
        return 0.01
    used = arith.integers(answer)
    return 1.0 if value == 24 and len(used) == 4 and all(1 <= n <= 10 for n in used) else 0.01


def _native(verifier: str, answer: str | None, item: TaskItem) -> float | None:
    """The score of the verifiers this module scores itself, on grammars of its own (no third-party parser, nothing
    in `answer` runs); None for every other verifier."""
    oracle = item.answer.strip() if verifier in ("exact", "numeric") else item.answer
    if verifier == "exact":
        return float(answer is not None and answer == oracle)
    if verifier in ("numeric", "chain_sum"):
        return _decimal_reward(answer, oracle)
    if verifier == "basic_arithmetic":
        return _substring_reward(answer, oracle)
    if verifier == "gsm_symbolic":
        return _gsm_reward(answer, oracle)
    if verifier == "countdown":
        meta = item.metadata
        if not isinstance(meta.get("numbers"), list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in meta["numbers"]
        ):
            raise ValueError("countdown needs metadata.numbers, a list of integers")
        if not isinstance(meta.get("target"), int | float) or isinstance(meta.get("target"), bool):
            raise ValueError("countdown needs metadata.target, a number")
        return _expression_reward(answer, meta["numbers"], meta["target"], no_answer=0.01)
    if verifier == "puzzle24":
        return _puzzle24_reward(answer)
    return None


NATIVE_VERIFIERS: tuple[str, ...] = (*USER_VERIFIERS, *TASKS, "puzzle24")
"""Verifiers scored in process on this module's own grammars; every other one runs in study.data.sandbox."""


def _verifier_score(verifier: str, answer: str | None, item: TaskItem) -> float:
    """The verifier's raw score of `answer` for `item`; sandbox.ScorerFailure when a sandboxed scorer times out,
    fails or its worker dies, ValueError when a native verifier lacks the metadata it reads."""
    native = _native(verifier, answer, item)
    if native is not None:
        return native
    entry = {"question": item.metadata.get("question", item.prompt), "answer": item.answer, "metadata": item.metadata}
    return sandbox.sandbox_for(verifier).score(verifier, answer, entry)


_failures = 0
_failures_lock = threading.Lock()


def take_scorer_failures() -> int:
    """Responses `score` gave 0 because their verifier timed out or failed since the last call (the step metric
    `scorer_failures`), and reset the count."""
    global _failures
    with _failures_lock:
        n, _failures = _failures, 0
    return n


def score(item: TaskItem, response: str, *, partial_credit: bool = False) -> float:
    """Reward in [0, 1] of `response` (the generated text, as it stands, truncated or not) for `item`: the item's
    verifier applied to `extract_answer(response)`; 1.0 or 0.0 unless `partial_credit`. A verifier that times out or
    fails scores 0 and is counted (`take_scorer_failures`); it never raises."""
    global _failures
    try:
        raw = _verifier_score(item.verifier, extract_answer(response), item)
    except Exception:
        with _failures_lock:
            _failures += 1
        return 0.0
    if partial_credit:
        return min(max(raw, 0.0), 1.0)
    return 1.0 if raw >= 1.0 else 0.0


# --------------------------------------------------------------------------------------------------- user data


def _check_verifier(verifier: str) -> None:
    if verifier not in USER_VERIFIERS and verifier not in RG_DATASETS:
        raise ValueError(
            f"verifier = {verifier!r}; valid: {', '.join(USER_VERIFIERS)}, or a reasoning-gym task: "
            + ", ".join(sorted(RG_DATASETS))
        )


MAX_DATA_BYTES = 1 << 30
"""Largest user data file read (bytes)."""


def read_data_file(path: str | Path) -> bytes:
    """The bytes of the user data file `path`, read with runfiles.bounded's reader (no FIFO, device or directory,
    at most MAX_DATA_BYTES): what the rows are parsed from and what a run id hashes. FileNotFoundError for none;
    ValueError naming the file, what it is and the fix otherwise."""
    try:
        return read_bytes(path, max_bytes=MAX_DATA_BYTES)
    except BoundError as err:
        raise ValueError(f"user data {path}: {err}; valid: a .jsonl or .parquet file") from None


def _read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(row label for errors, row) pairs of a .jsonl or .parquet file."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"user data {path}: unsupported file type {path.suffix!r}; valid: .jsonl, .parquet")
    data = read_data_file(path)
    if suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = load_json(line)
            except ValueError as e:  # json.JSONDecodeError, or a bound of runfiles.bounded
                raise ValueError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            rows.append((where, row))
        return rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(data))
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _non_finite(value: Any, where: str) -> str | None:
    """The dotted place of the first number in `value` that is not finite (inf, -inf, NaN), None when all are."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} = {value}"
    if isinstance(value, dict):
        items: Iterator[tuple[str, Any]] = ((f"{where}.{k}", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for place, v in items if (found := _non_finite(v, place)) is not None), None)


def load_user_data(
    path: str | Path,
    *,
    verifier: str,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str = "solution",
    metadata_field: str = "metadata",
) -> list[TaskItem]:
    """Items from a JSONL or parquet file of rows {prompt, answer[, solution][, metadata]} scored by `verifier`
    (`exact`, `numeric`, or a reasoning-gym task name, whose scorer may read `metadata`, e.g. countdown's numbers
    and target). Prompts are used verbatim. A solution without `####` gets `\\n#### <answer>` appended; a missing
    one becomes `#### <answer>`. Every row's own solution must score 1.0, so a row the verifier cannot accept is
    caught here, and every number of a row's answer and metadata must be finite. The file is read with the bounded
    reader (`read_data_file`). Errors name the file, the row and the field; a sandboxed verifier that this machine
    cannot lock down is refused before any row (study.data.sandbox.SandboxRefused)."""
    _check_verifier(verifier)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"user data: no such file {path}")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"user data {path}: no rows")
    if verifier not in NATIVE_VERIFIERS:
        sandbox.level(verifier)  # SandboxRefused, one line naming why and how to allow it, before any row
    items = []
    for where, row in rows:
        prompt = row.get(prompt_field)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field {prompt_field!r} must be a non-empty string, got {prompt!r}")
        answer = row.get(answer_field)
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip() or "\n" in answer.strip():
            raise ValueError(f"{where}: field {answer_field!r} must be a non-empty one-line string, got {answer!r}")
        answer = answer.strip()
        solution = row.get(solution_field)
        if solution is None:
            solution = f"{ANSWER_DELIMITER} {answer}"
        elif not isinstance(solution, str):
            raise ValueError(f"{where}: field {solution_field!r} must be a string, got {type(solution).__name__}")
        elif ANSWER_DELIMITER not in solution:
            solution = f"{solution.rstrip()}\n{ANSWER_DELIMITER} {answer}"
        metadata = row.get(metadata_field) or {}
        if isinstance(metadata, str):
            try:
                metadata = load_json(metadata)
            except ValueError as e:  # json.JSONDecodeError, or a bound of runfiles.bounded
                why = getattr(e, "msg", e)
                raise ValueError(f"{where}: field {metadata_field!r} is not valid JSON ({why})") from None
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: field {metadata_field!r} must be an object, got {type(metadata).__name__}")
        for name, value in ((answer_field, row.get(answer_field)), (metadata_field, metadata)):
            found = _non_finite(value, name)
            if found is not None:  # countdown's target = inf would accept every expression
                raise ValueError(f"{where}: {found}; valid: finite numbers (no inf, -inf or NaN)")
        item = TaskItem(
            task="user", prompt=prompt, solution=solution, answer=answer, verifier=verifier, metadata=dict(metadata)
        )
        try:
            ok = _verifier_score(verifier, extract_answer(solution), item)
        except Exception as e:  # a scorer missing the metadata it reads, timing out on the row, ...
            raise ValueError(
                f"{where}: verifier {verifier!r} failed on this row ({type(e).__name__}: {str(e)[:300]}); "
                f"check fields {answer_field!r} and {metadata_field!r}"
            ) from None
        if ok < 1.0:
            raise ValueError(
                f"{where}: verifier {verifier!r} does not accept the row's own "
                f"{solution_field if row.get(solution_field) is not None else answer_field!r} "
                f"(answer {extract_answer(solution)!r} scores 0); check fields {answer_field!r}, {solution_field!r} "
                f"and {metadata_field!r}"
            )
        items.append(item)
    return items


def check_verifier(verifier: str) -> None:
    """Raise ValueError naming `verifier` and the valid choices unless it is a user-data verifier."""
    _check_verifier(verifier)


USER_HELDOUT_SEED = 0
"""Seed of the held-out split of a user data file: fixed (not the run's seed), so every run of a sweep over the same
file evaluates on the same items and trains on the rest."""


def split_user_data(
    items: Sequence[TaskItem], *, eval_size: int, eval_items: Sequence[TaskItem] | None = None
) -> tuple[list[TaskItem], list[TaskItem]]:
    """(training items, held-out items) of a user data file. Without `eval_items`, `eval_size` items drawn with
    USER_HELDOUT_SEED are held out; with them, they are the held-out set (its first `eval_size`). Training items whose
    prompt is in the held-out set are dropped either way, so no evaluated prompt is trained on."""
    import random

    if eval_items is None:
        if len(items) <= eval_size:
            raise ValueError(
                f"user data has {len(items)} rows; the held-out split takes eval_size = {eval_size}, leaving none to "
                "train on; valid: more rows, a smaller eval_size, or eval_data"
            )
        order = list(range(len(items)))
        random.Random(USER_HELDOUT_SEED).shuffle(order)
        held = [items[i] for i in sorted(order[:eval_size])]
    else:
        held = list(eval_items[:eval_size])
    held_prompts = {item.prompt for item in held}
    train = [item for item in items if item.prompt not in held_prompts]
    if not train:
        raise ValueError("user data: every training prompt is also in the held-out set; nothing left to train on")
    return train, held


@dataclass(frozen=True)
class UserTask:
    """A deterministic, endless training stream over a user's items: epoch e is a permutation of the items drawn from
    (seed, e), so the stream cycles through every item once per epoch in a seed-dependent order. `take` and indexing
    match Task's, so the RL loop's data position resumes it exactly."""

    items: tuple[TaskItem, ...]
    seed: int

    def __getitem__(self, index: int) -> TaskItem:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"task index must be a non-negative int, got {index!r}")
        epoch, i = divmod(index, len(self.items))
        return self.items[_epoch_order(self.seed, epoch, len(self.items))[i]]

    def take(self, n: int, start: int = 0) -> list[TaskItem]:
        """Items start .. start+n-1."""
        return [self[i] for i in range(start, start + n)]


@cache
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    import random

    order = list(range(n))
    random.Random(_key("user", seed, epoch)).shuffle(order)
    return tuple(order)
