"""Personal data out of logs and out of what people are shown: phone and card numbers masked.

A mask keeps the separators and the last digits, so support can still match a call with what a
customer reads out: ``+14155550123 -> +*********23``, ``4242 4242 4242 4242 ->
**** **** **** 4242`` (the last 4 for card-length numbers, 2 otherwise).

A number to mask is a run of 7 or more digits, alone or in groups joined by single spaces or
dashes, with an optional leading ``+`` and ``(area code)`` (``mask_speech`` also masks 7 or more
digit words in a row: "four two four two ..."). Shorter runs (a menu key, a 5-digit account, an
amount, a time) stay.
Luhn is not checked: every run that long is masked anyway, and a card number the caller or the
recogniser got one digit wrong fails Luhn yet still is 15 of the card's 16 digits. Digits inside
a word are not a number (call SIDs and hex digests such as ``CA3f1234567...``); neither are ISO
dates, decimals, times or digit groups with commas (``2024-06-01``, ``1250.00``, ``10:30``,
``1,250``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from structlog.typing import EventDict, WrappedLogger

MIN_DIGITS = 7
"""The shortest digit run masked in free text: a local phone number."""
CARD_DIGITS = 13
"""From this length a number may be a card: its last 4 digits stay, as on a receipt."""
MASK = "*"

_NUMBER = re.compile(
    r"(?<![\w\-])(?<!\d[.,:])"  # not the tail of a word, an id, a decimal or a time
    r"\+?(?=(?:[ ()\-]{0,3}\d){7})"  # cheap filter: 7 digits ahead, or no need to look closer
    r"(?>\(?\d+(?:(?:\) ?|[ \-]\(?)\d+)*)"  # atomic: never backtrack into a shorter run
    r"(?!\w|[.,:]\d)"  # nor the head of one
)
_DIGIT_WORD = r"(?:zero|oh|one|two|three|four|five|six|seven|eight|nine)"
_SPOKEN = re.compile(rf"\b{_DIGIT_WORD}(?:[ ,\-]+{_DIGIT_WORD}\b){{6,}}", re.IGNORECASE)
_ONE_DIGIT_WORD = re.compile(_DIGIT_WORD, re.IGNORECASE)
_ISO_DATE = re.compile(r"\d{4}-\d\d-\d\d")
_DIGIT = re.compile(r"\d")

NOT_PERSONAL = frozenset(
    {"call_sid", "stream_sid", "account_sid", "version", "flow_version", "file_version"}
)
"""Log keys whose values are Twilio ids or digests, never numbers of people (and on nearly every
line: skipping them halves the filter's cost)."""


def kept_digits(count: int) -> int:
    """How many trailing digits a mask keeps: none of a PIN, 4 of a card, else 2."""
    if count <= 4:
        return 0
    return 4 if count >= CARD_DIGITS else 2


def mask_number(text: str, keep: int | None = None) -> str:
    """Every digit but the last ``keep`` (default: ``kept_digits``) replaced; the rest stays."""
    count = sum(ch.isdigit() for ch in text)
    hide = count - (kept_digits(count) if keep is None else keep)
    out = []
    for ch in text:
        if hide > 0 and ch.isdigit():
            out.append(MASK)
            hide -= 1
        else:
            out.append(ch)
    return "".join(out)


def _mask_run(match: re.Match[str]) -> str:
    text = match.group()
    if sum(ch.isdigit() for ch in text) < MIN_DIGITS or _ISO_DATE.fullmatch(text):
        return text
    return mask_number(text)


def _mask_spoken(match: re.Match[str]) -> str:
    words = list(_ONE_DIGIT_WORD.finditer(match.group()))
    hide = len(words) - kept_digits(len(words))
    text = match.group()
    for word in reversed(words[:hide]):  # from the end: earlier offsets stay valid
        text = text[: word.start()] + MASK + text[word.end() :]
    return text


def mask_text(text: str) -> str:
    """``text`` with every phone- or card-like run of digits masked (the same object if none).
    The log filter's masker: spoken digit words reach logs only as transcripts, under
    ``pii_*`` keys, which are redacted whole."""
    if len(text) < MIN_DIGITS or _DIGIT.search(text) is None:
        return text
    masked = _NUMBER.sub(_mask_run, text)
    return text if masked == text else masked


def mask_speech(text: str) -> str:
    """``mask_text``, and runs of 7 or more digit words ("four two four two ...") masked too:
    for what callers said and the bot answered (call records, admin views)."""
    masked = mask_text(text)
    # Seven digit words and six separators take 29 characters or more, and a separator.
    if len(masked) >= 29 and (" " in masked or "-" in masked or "," in masked):
        masked = _SPOKEN.sub(_mask_spoken, masked)
    return masked


def mask_deep(value: Any, mask: Callable[[str], str] = mask_text) -> Any:
    """``value`` with ``mask`` applied to every string in it, through dicts, lists and tuples.
    Dict keys are kept: they are names, not data."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {key: mask_deep(item, mask) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [mask_deep(item, mask) for item in value]
    return value


def redact(value: Any) -> Any:
    """A ``pii_*`` log value: a phone number masked, any other text reduced to its length."""
    if value is None or value == "":
        return value
    if isinstance(value, str):
        match = _NUMBER.fullmatch(value)
        if match is not None and sum(ch.isdigit() for ch in value) >= MIN_DIGITS:
            return mask_number(value)
        return f"[{len(value)} chars]"
    return "[redacted]"


class PiiFilter:
    """structlog processor: ``pii_*`` values redacted and phone or card numbers masked in every
    other string of the event (the message too, nested values included). It runs on every log
    line, so strings too short to hold a number and non-strings are passed over at once."""

    __slots__ = ()

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        for key, value in event.items():
            if key.startswith("pii_"):
                event[key] = redact(value)
            elif type(value) is str:
                if len(value) >= MIN_DIGITS and key not in NOT_PERSONAL:
                    event[key] = mask_text(value)
            elif isinstance(value, dict | list | tuple):
                event[key] = mask_deep(value)
        return event
