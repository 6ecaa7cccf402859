"""A bounded arithmetic grammar for scoring answers: integers, + - * /, unary signs and parentheses, evaluated exactly.

The verifiers in study.data.tasks parse answers with this grammar instead of handing text to `eval` or sympy's
parser: nothing in an answer can run, and every answer is evaluated in time linear in its length (no powers, a bound
on length, nesting and literal size), so a hostile answer is a parse error, never code and never a hang.

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/") unary)*
    unary  := ("+" | "-") unary | atom
    atom   := INT | "(" expr ")"
    INT    := [0-9]+

Digits are ASCII only and blanks are space, tab and form feed, as reasoning-gym's parsers read them: a full-width
or Arabic-Indic digit, a no-break or ideographic space is outside the grammar.

"/" is exact division (a Fraction), as sympy evaluates it; division by zero is a parse error.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_LENGTH = 200
"""Longest expression accepted, in characters (a countdown answer of 6 numbers is about 25)."""

MAX_DEPTH = 32
"""Deepest nesting of unary signs and parentheses accepted."""

MAX_DIGITS = 18
"""Most digits of one integer literal."""

_TOKEN = re.compile(r"[ \t\f]*(?:([0-9]+)|([^ \t\f]))")


class ExpressionError(ValueError):
    """An expression outside the grammar or its bounds (the message says which)."""


def _tokens(text: str) -> list[str]:
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    out: list[str] = []
    for m in _TOKEN.finditer(text):
        number, other = m.groups()
        if number is not None:
            if len(number) > MAX_DIGITS:
                raise ExpressionError(f"integer literal longer than {MAX_DIGITS} digits")
            out.append(number)
        elif other is not None:
            if other not in "+-*/()":
                raise ExpressionError(f"character {other!r} is not in the grammar (integers, + - * /, parentheses)")
            out.append(other)
    return out


def evaluate(text: str) -> Fraction:
    """The exact value of `text`; ExpressionError (a ValueError) when it is outside the grammar or its bounds."""
    toks = _tokens(text)
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(toks):
            raise ExpressionError("expression ends early")
        pos += 1
        return toks[pos - 1]

    def expr(depth: int) -> Fraction:
        value = term(depth)
        while peek() in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth: int) -> Fraction:
        value = unary(depth)
        while peek() in ("*", "/"):
            op = take()
            rhs = unary(depth)
            if op == "*":
                value *= rhs
            elif rhs == 0:
                raise ExpressionError("division by zero")
            else:
                value /= rhs
        return value

    def unary(depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExpressionError(f"nested deeper than {MAX_DEPTH}")
        tok = peek()
        if tok in ("+", "-"):
            take()
            value = unary(depth + 1)
            return -value if tok == "-" else value
        return atom(depth)

    def atom(depth: int) -> Fraction:
        tok = take()
        if tok == "(":
            value = expr(depth + 1)
            if take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if tok.isascii() and tok.isdigit():
            return Fraction(int(tok))
        raise ExpressionError(f"unexpected {tok!r}")

    if not toks:
        raise ExpressionError("empty expression")
    value = expr(0)
    if pos != len(toks):
        raise ExpressionError(f"unexpected {toks[pos]!r}")
    return value


_INT = re.compile(r"\b[0-9]+\b", re.ASCII)


def integers(text: str) -> list[int]:
    """The integer literals of `text`, in order (reasoning-gym's countdown and puzzle24 count the numbers used so)."""
    return [int(m) for m in _INT.findall(text[:MAX_LENGTH])]
