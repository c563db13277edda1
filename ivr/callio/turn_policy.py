"""How a listening node's turns end: what answer it waits for, and the silences that end it.

Flows declare a ``TurnPolicy`` per node (``ivr.flows.waits``); the call's endpointing obeys it
(``ivr.call.turn_end`` combines it with the words so far and the audio turn model).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final, Literal

Expect = Literal["any", "digits", "yes_no", "zip", "date"]
"""What a listening node waits for: free speech, a number read out digit by digit (of a known
length or not), yes or no, a US ZIP code (5 or 9 digits), a calendar date."""
EXPECT_KINDS: Final[tuple[Expect, ...]] = ("any", "digits", "yes_no", "zip", "date")


@dataclass(frozen=True, slots=True)
class TurnPolicy:
    """How long a node lets the caller pause before their turn counts as over (milliseconds
    of silence after the last speech)."""

    min_silence_ms: int = 250
    """The turn is clearly complete (the model is sure, or "yes" to a yes/no question)."""
    max_silence_ms: int = 1500
    """The turn is clearly unfinished ("my number is", "and", digits still missing)."""
    expect: Expect = "any"
    digits: int | None = None
    """With ``expect="digits"``: how many digits the answer has (with ``max_digits``: at
    least). None and no ``max_digits``: a number of unknown length."""
    max_digits: int | None = None
    """With ``expect="digits"``: the answer has ``digits`` to this many digits."""
    number_silence_ms: int = 700
    """A number that may be whole or go on (its length unknown, or within its range): the
    pause that ends it, between ``min_silence_ms`` and ``max_silence_ms``. Callers pause
    between the groups of a number for less than this; longer, they are mostly done."""
    answers: tuple[str, ...] = field(default=(), compare=False)
    """Phrases that are whole answers here (a menu's spoken options, an ask node's intent
    examples): an answer that ends with one is complete. Not part of the timing, so not of
    equality either (a node with the default timing keeps the gateway's endpoint)."""
    fallback_silence_ms: int = 300
    """Nothing to go on (no transcript yet, no model answer): plain silence endpointing."""
    complete_above: float | None = None
    """A model probability at or above this ends the turn after ``min_silence_ms``. None: the
    model never shortens the wait, it only lengthens it (bench/turn_model.py: on phone audio
    it calls 40-50 % of mid-sentence pauses complete, often with p > 0.9)."""
    incomplete_below: float = 0.5
    """A model probability below this waits ``max_silence_ms``; otherwise the fallback."""

    @property
    def unsure_silence_ms(self) -> int:
        """Words that may end the answer or go on ("yes, that is", "and I have"): halfway
        between the fallback and the longest pause. Long enough for a caller who stops to
        think mid-clause (a 700 ms pause with the defaults), short enough that an elliptical
        answer ("Yes, it is.") is not held the full ``max_silence_ms``."""
        return (self.fallback_silence_ms + self.max_silence_ms) // 2

    def __post_init__(self) -> None:
        if not 0 < self.min_silence_ms <= self.fallback_silence_ms <= self.max_silence_ms:
            raise ValueError(
                "need 0 < min_silence_ms <= fallback_silence_ms <= max_silence_ms, got "
                f"{self.min_silence_ms}, {self.fallback_silence_ms}, {self.max_silence_ms}"
            )
        above = 1.0 if self.complete_above is None else self.complete_above
        if not 0.0 <= self.incomplete_below <= above <= 1.0:
            raise ValueError(
                "need 0 <= incomplete_below <= complete_above <= 1, got "
                f"{self.incomplete_below}, {self.complete_above}"
            )
        for name in ("digits", "max_digits"):
            count = getattr(self, name)
            if count is not None and (self.expect != "digits" or count < 1):
                raise ValueError(f"{name}: a positive count, only with expect='digits'")
        if self.max_digits is not None and self.max_digits < (self.digits or 1):
            raise ValueError(f"max_digits ({self.max_digits}) is below digits ({self.digits})")


# What each kind of answer gets when the flow sets no numbers: digits are read out in groups
# with pauses between them, so a part of one waits long; a whole one ends at the normal
# endpoint. A yes/no answer is over as soon as it is said.
_SHAPED: Final = TurnPolicy(min_silence_ms=300, max_silence_ms=2500, fallback_silence_ms=1500)
DEFAULT_POLICIES: Final[dict[Expect, TurnPolicy]] = {
    "any": TurnPolicy(),
    "digits": replace(_SHAPED, expect="digits"),
    "zip": replace(_SHAPED, expect="zip"),
    "date": replace(_SHAPED, expect="date"),
    "yes_no": TurnPolicy(
        min_silence_ms=200, max_silence_ms=1000, fallback_silence_ms=500, expect="yes_no"
    ),
}


def policy_for(
    expect: Expect = "any",
    *,
    digits: int | None = None,
    max_digits: int | None = None,
    min_silence_ms: int | None = None,
    max_silence_ms: int | None = None,
    fallback_silence_ms: int | None = None,
    number_silence_ms: int | None = None,
    answers: tuple[str, ...] = (),
) -> TurnPolicy:
    """The default policy for ``expect`` with the given values replacing its defaults.

    A value that is given pulls the defaults with it where they would no longer be in order
    (e.g. ``max_silence_ms=700`` also lowers the fallback to 700). Raises ``ValueError`` when
    the given values themselves are out of order."""
    base = DEFAULT_POLICIES[expect]
    given = [v for v in (min_silence_ms, fallback_silence_ms, max_silence_ms) if v is not None]
    high = max_silence_ms if max_silence_ms is not None else max([base.max_silence_ms, *given])
    low = min_silence_ms if min_silence_ms is not None else min([base.min_silence_ms, *given])
    middle = fallback_silence_ms
    if middle is None:
        middle = min(max(base.fallback_silence_ms, low), high)
    return TurnPolicy(
        min_silence_ms=low,
        max_silence_ms=high,
        expect=expect,
        digits=digits,
        max_digits=max_digits,
        fallback_silence_ms=middle,
        number_silence_ms=number_silence_ms or base.number_silence_ms,
        complete_above=base.complete_above,
        incomplete_below=base.incomplete_below,
        answers=answers,
    )
