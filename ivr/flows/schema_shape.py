"""The shape of a value a JSON schema declares, as a turn can listen for it.

An agent's tool says what its arguments look like: ``{type: string, pattern: "^\\d{8}$"}`` is
an eight-digit number, ``^\\d{5}(-\\d{4})?$`` a ZIP code, ``format: date`` a calendar date,
``{type: integer, minimum: 1000, maximum: 9999}`` four digits. When the agent asks the caller
for that argument, the caller's answer ends as soon as it has that shape
(``ivr.call.answer_shapes``). Patterns are read only as far as digits, separators and
optional groups go; anything else (letters, alternations) declares no shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ivr.callio.turn_policy import Expect


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """What a value looks like when the caller says it (``TurnPolicy``'s fields)."""

    expect: Expect
    digits: int | None = None
    max_digits: int | None = None


_DIGIT = r"(?:\\d|\[0-9\])"
_SEPARATOR = r"(?:\\?-|\\s|\\\.|/| |\[(?:\\?[- ./]|\\s)+\])"
_QUANTIFIER = r"(?:\{(\d+)(?:(,)(\d*))?\}|([+*?]))?"
_ATOM = re.compile(rf"(?:({_DIGIT})|{_SEPARATOR}){_QUANTIFIER}")
Span = tuple[int, int | None]
"""Fewest and most digits (None: no limit)."""


def pattern_digits(pattern: str) -> Span | None:
    """How many digits a string matching ``pattern`` has, if the pattern is digits, separators
    and optional groups only (``^\\d{3}-?\\d{4}$``: 7); None for any other pattern."""
    body = pattern.removeprefix("^").removesuffix("$")
    span, rest = _sequence(body)
    if rest or span is None or span == (0, 0):
        return None
    return span


def _sequence(text: str) -> tuple[Span | None, str]:
    """The digits of the items at the start of ``text`` up to a ``)`` (or its end)."""
    low, high = 0, 0
    high_open = False
    while text and not text.startswith(")"):
        if text.startswith("("):
            inner, rest = _sequence(text[3:] if text.startswith("(?:") else text[1:])
            if inner is None or not rest.startswith(")"):
                return None, text
            rest = rest[1:]
            optional = rest.startswith("?")
            rest = rest.removeprefix("?")
            low += 0 if optional else inner[0]
            high_open = high_open or inner[1] is None
            high += inner[1] or 0
            text = rest
            continue
        atom = _ATOM.match(text)
        if atom is None or not atom.group(0):
            return None, text
        text = text[atom.end() :]
        if atom.group(1) is None:
            continue  # a separator: no digits
        n, comma, m, symbol = atom.group(2, 3, 4, 5)
        if n is not None:
            low += int(n)
            high_open = high_open or (comma is not None and not m)
            high += int(m) if m else int(n)
        else:
            low += 0 if symbol in ("*", "?") else 1
            high_open = high_open or symbol in ("+", "*")
            high += 1
    return (low, None if high_open else high), text


def schema_shape(schema: Mapping[str, Any]) -> AnswerShape | None:
    """The shape ``schema`` declares for one value, or None when it declares none."""
    if schema.get("format") == "date":
        return AnswerShape("date")
    span: Span | None = None
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        span = pattern_digits(pattern)
        if span is not None and span[0] <= 1 and span[1] is None:
            span = _length_span(schema) or span  # "^\\d+$" with minLength/maxLength
    elif schema.get("type") == "integer":
        span = _integer_span(schema)
    if span is None:
        return None
    low, high = span
    if (low, high) == (5, 9):
        return AnswerShape("zip")
    if high is None:
        return AnswerShape("digits")  # a number of unknown length
    return AnswerShape("digits", low, high if high != low else None)


def _length_span(schema: Mapping[str, Any]) -> Span | None:
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) and isinstance(high, int) and 0 < low <= high:
        return low, high
    return None


def _integer_span(schema: Mapping[str, Any]) -> Span | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, int) and isinstance(high, int) and 0 <= low <= high:
        return len(str(low)), len(str(high))
    return None
