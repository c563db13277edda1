"""Matching caller answers and evaluating conditions: plain comparisons, never ``eval``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ivr.flows.spec import Condition
from ivr.flows.template import lookup

_WORD = re.compile(r"[a-z0-9']+")
_DIGIT_WORDS = {
    "zero": "0", "oh": "0", "one": "1", "two": "2", "to": "2", "too": "2", "three": "3",
    "four": "4", "for": "4", "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9",
    "star": "*", "pound": "#", "hash": "#",
}  # fmt: skip
_KEY_LEADS = ("press", "option", "number", "key")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def phrase_in(text_words: list[str], phrase: str) -> bool:
    """True if the phrase's words appear, in order and adjacent, in the answer."""
    want = words(phrase)
    n = len(want)
    return n > 0 and any(text_words[i : i + n] == want for i in range(len(text_words) - n + 1))


def any_phrase(text: str, phrases: Iterable[str]) -> bool:
    text_words = words(text)
    return any(phrase_in(text_words, p) for p in phrases)


def spoken_key(text: str) -> str | None:
    """The key a caller *said* ("one", "press 2", "option three"), if the answer is just that."""
    ws = [w for w in words(text) if w not in _KEY_LEADS]
    if len(ws) != 1:
        return None
    word = ws[0]
    if word in _DIGIT_WORDS:
        return _DIGIT_WORDS[word]
    return word if len(word) == 1 and word.isdigit() else None


def spoken_digits(text: str) -> str:
    """Digits in an answer like "one two 3 4" -> "1234" (for DTMF-style answers by voice)."""
    out = []
    for word in words(text):
        if word.isdigit():
            out.append(word)
        elif (
            word in _DIGIT_WORDS
            and _DIGIT_WORDS[word].isdigit()
            and word not in ("to", "too", "for")
        ):
            out.append(_DIGIT_WORDS[word])
    return "".join(out)


def holds(cond: Condition, variables: Mapping[str, Any]) -> bool:
    value = lookup(variables, cond.var)
    op = cond.operator
    if op == "exists":
        return (value is not None and value != "") == cond.exists
    if op == "equals":
        return _same(value, cond.equals)
    if op == "not_equals":
        return not _same(value, cond.not_equals)
    if op == "in":
        return any(_same(value, item) for item in cond.in_ or [])
    if op == "contains":
        return value is not None and str(cond.contains).lower() in str(value).lower()
    if op == "matches":
        return value is not None and re.fullmatch(str(cond.matches), str(value)) is not None
    return _compare(op, value, getattr(cond, op))


def all_hold(conds: Iterable[Condition], variables: Mapping[str, Any]) -> bool:
    return all(holds(c, variables) for c in conds)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return na == nb
    if a is None or b is None:
        return False
    return str(a).strip().lower() == str(b).strip().lower()


def _compare(op: str, value: Any, limit: float | None) -> bool:
    number = _number(value)
    if number is None or limit is None:
        return False
    return {
        "gt": number > limit,
        "ge": number >= limit,
        "lt": number < limit,
        "le": number <= limit,
    }[op]
