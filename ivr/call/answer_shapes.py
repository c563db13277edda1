"""Whether the words so far are a whole answer of a known shape: digits, a ZIP code, a date.

A listening turn that expects a value of known shape ends as soon as the value is complete and
waits while it is not. Callers read numbers in groups with pauses between them ("four five six
seven ... eight nine zero one"), so "four digits of eight" must wait, and "eight of eight" need
not. A number whose length nobody declared may be whole or may go on: ``"number"``, a short
wait (``TurnPolicy.number_silence_ms``), not the longest pause.

Pure functions over lowercase words (``[a-z0-9']+``, as ``ivr.call.turn_end`` splits them): an
STT writes a number as numerals ("4567", "45 67", "4, 5, 6, 7") or as words ("four five six
seven", "forty five sixty seven", "double five"); both count.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final, Literal


def _set(words: str) -> frozenset[str]:
    return frozenset(words.split())


ShapeVerdict = Literal["complete", "incomplete", "number"]
"""complete: the value is whole; incomplete: part of it is missing; number: whole, or goes on."""

UNITS: Final = _set("zero oh one two three four five six seven eight nine")
TEENS: Final = _set(
    "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
)
TENS: Final = _set("twenty thirty forty fifty sixty seventy eighty ninety")
_REPEATS: Final = {"double": 1, "triple": 2}  # "double five": the five counts twice
_IN_A_NUMBER: Final = _set("uh um er erm ah hmm dash hyphen and then")
"""Words a caller says between the groups of one number; they do not end it."""
PHONE_DIGITS: Final = 10
"""A number the caller names ("my number is ...") with fewer digits than this may go on."""
ZIP_DIGITS: Final = (5, 9)
"""A US ZIP code, or ZIP+4."""


def is_digit_word(word: str) -> bool:
    return word.isdigit() or word in UNITS or word in TEENS or word in TENS or word in _REPEATS


def digits_in(words: Sequence[str]) -> int:
    """Digits the words say: a numeral each of its digits, "four" one, "forty" or "fifteen"
    two, "forty five" two, "double five" two."""
    count = 0
    for i, word in enumerate(words):
        if word.isdigit():
            count += len(word)
        elif word in UNITS:
            count += 0 if i and words[i - 1] in TENS else 1  # "forty five": 45
        elif word in TEENS or word in TENS:
            count += 2
        elif word in _REPEATS and i + 1 < len(words) and words[i + 1] in UNITS:
            count += _REPEATS[word]
    return count


def last_number(words: Sequence[str]) -> tuple[int, bool]:
    """The digits of the last number in the words, and whether the words end with it. A number
    runs over the fillers callers put between its groups ("4567, uh, 8901": eight digits)."""
    end = len(words)
    while end and words[end - 1] in _IN_A_NUMBER:
        end -= 1
    trailing = end > 0 and is_digit_word(words[end - 1])
    if not trailing:
        while end and not is_digit_word(words[end - 1]):
            end -= 1
    start = end
    while start and (is_digit_word(words[start - 1]) or words[start - 1] in _IN_A_NUMBER):
        start -= 1
    return digits_in(words[start:end]), trailing


def digits_verdict(words: Sequence[str], low: int | None, high: int | None) -> ShapeVerdict | None:
    """A number of ``low`` to ``high`` digits (both None: length unknown). None: no digits yet."""
    said, trailing = last_number(words)
    if said == 0:
        return None
    if low is None and high is None:
        return "number" if trailing else None
    low = low if low is not None else 1
    high = high if high is not None else low
    if said < low:
        return "incomplete"
    return "complete" if said >= high else "number"


def zip_verdict(words: Sequence[str]) -> ShapeVerdict | None:
    """Five digits, or nine (ZIP+4): anything in between is a ZIP+4 being read."""
    said, _ = last_number(words)
    if said == 0:
        return None
    return "complete" if said in ZIP_DIGITS or said > ZIP_DIGITS[1] else "incomplete"


def reading_a_number(words: Sequence[str]) -> bool:
    """With no shape declared, the words end in a number being read out: digits said one by
    one ("four five six", "4 5 6"), or digits after the caller named a number ("my account
    number is 456": an STT writes "four five six" as "456"), fewer than a phone number has."""
    run = 0
    for word in reversed(words):
        if not (word in UNITS or (word.isdigit() and len(word) == 1)):
            break
        run += 1
    if run >= 2:
        return True
    start = len(words)
    while start and (words[start - 1].isdigit() or words[start - 1] in UNITS):
        start -= 1
    if start == len(words) or "number" not in words[:start]:
        return False
    return digits_in(words[start:]) < PHONE_DIGITS


# ---------------------------------------------------------------- dates

_MONTHS: Final = _set(
    "january february march april may june july august september october november "
    "december jan feb mar apr jun jul aug sep sept oct nov dec"
)
_RELATIVE: Final = _set(
    "today tomorrow yesterday tonight monday tuesday wednesday thursday friday "
    "saturday sunday weekend"
)
_ORDINALS: Final = _set(
    "first second third fourth fifth sixth seventh eighth ninth tenth eleventh "
    "twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth "
    "nineteenth twentieth thirtieth"
)
_DAY_NUMERAL: Final = re.compile(r"(?:[1-9]|[12][0-9]|3[01])(?:st|nd|rd|th)?")
_NUMERIC_DATE: Final = re.compile(r"\b\d{1,4}[/.\-]\d{1,2}[/.\-]\d{2,4}\b")
_CENTURIES: Final = frozenset({"nineteen", "twenty", "eighteen"})
YearState = Literal["complete", "partial", "begun"]


def year_state(words: Sequence[str]) -> YearState | None:
    """How far the words end in saying a year: "1985", "nineteen eighty five", "two thousand
    three" are complete; "nineteen eighty", "two thousand" may be whole or go on (partial);
    "nineteen" has begun one. None: they do not end in a year."""
    if not words:
        return None
    last = words[-1]
    if last.isdigit() and len(last) == 4 and 1000 <= int(last) <= 2999:
        return "complete"
    tail = list(words[-4:])
    if "thousand" in tail:  # "two thousand", "two thousand and three", "two thousand twelve"
        after = tail[tail.index("thousand") + 1 :]
        after = [w for w in after if w != "and"]
        if not after:
            return "partial"
        return "partial" if after[-1] in TENS else "complete"
    if len(tail) >= 2 and tail[-2] in _CENTURIES and (last in TEENS or last in TENS):
        return "partial" if last in TENS else "complete"  # "nineteen eighty" (five?)
    if len(tail) >= 3 and tail[-3] in _CENTURIES and tail[-2] in TENS | {"oh"} and last in UNITS:
        return "complete"  # "nineteen eighty five", "nineteen oh five"
    if last in _CENTURIES and len(words) >= 2:
        return "begun"
    return None


def _has_day(words: Sequence[str]) -> bool:
    return any(w in _ORDINALS or _DAY_NUMERAL.fullmatch(w) for w in words)


def date_verdict(words: Sequence[str], text: str) -> ShapeVerdict | None:
    """A calendar date with its year ("March 14th, 1985", "03/14/1985", "the fourteenth of
    March nineteen eighty five"), or a day named relative to today ("tomorrow", "Tuesday").
    A month and day without a year may be whole or go on; a month alone, or a year begun
    ("nineteen"), is incomplete. None: nothing date-like said yet."""
    if _NUMERIC_DATE.search(text):
        return "complete"
    year = year_state(words)
    month = any(w in _MONTHS for w in words)
    if year == "complete":
        return "complete" if month or _has_day(words[:-1]) else "number"
    if year == "partial":
        return "number"
    if year == "begun":
        return "incomplete"
    if any(w in _RELATIVE for w in words) and not month:
        return "complete"
    if month and words[-1] in _MONTHS:
        return "number" if _has_day(words) else "incomplete"  # "the 14th of March" (1985?)
    if month or _has_day(words):
        return "number"
    return None
