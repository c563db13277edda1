"""The ``turn:`` block of a listening node and the ``expects:`` of an agent's tool.

Both say what answer the caller is about to give: free speech, yes or no, or a value of known
shape (digits, a ZIP code, a date), which ends the turn as soon as it is whole
(``ivr.call.answer_shapes``). The ``turn:`` block also sets the pauses that end a turn.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from ivr.callio.turn_policy import Expect
from ivr.flows.spec import Spec


class ShapeSpec(Spec):
    """What answer the caller gives: its kind and, for digits, how many."""

    expect: Expect = Field(
        default="any",
        description="any: free speech; yes_no: a yes/no question; digits: a number read out "
        "(an account number: its length in digits, or unknown); zip: a US ZIP code (5 or 9 "
        "digits); date: a calendar date with its year, or a day like 'tomorrow'. A whole "
        "answer of known shape ends at the shortest pause, a part of one waits the longest.",
    )
    digits: int | None = Field(
        default=None,
        ge=1,
        le=32,
        description="expect: digits only: how many digits the answer has (with max_digits: "
        "the fewest). Unset: the node's digits.num_digits, else a number of unknown length.",
    )
    max_digits: int | None = Field(
        default=None, ge=1, le=32, description="expect: digits only: the most digits it has."
    )

    @model_validator(mode="after")
    def _digits_with_digits(self) -> Self:
        _check_digits(self.expect, self.digits, self.max_digits)
        return self


class TurnSpec(ShapeSpec):
    """When a spoken answer is over: the pause that ends it, by what the node waits for.

    A pause ends the turn after ``min_silence_ms`` when the answer is clearly complete, after
    ``max_silence_ms`` when it is clearly not ("my number is", "and", digits still missing),
    ``number_silence_ms`` after a number that may be whole or go on, and in between by how
    sure the end-of-turn model is. Unset values come from ``expect``.
    """

    min_silence_ms: int | None = Field(
        default=None, ge=100, le=3000, description="Pause that ends a clearly complete answer."
    )
    max_silence_ms: int | None = Field(
        default=None, ge=200, le=5000, description="Pause that ends a clearly unfinished one."
    )
    fallback_silence_ms: int | None = Field(
        default=None,
        ge=100,
        le=5000,
        description="Pause that ends the turn when nothing tells whether it is complete (no "
        "transcript yet, end-of-turn model unavailable); default: between the two.",
    )
    number_silence_ms: int | None = Field(
        default=None,
        ge=100,
        le=3000,
        description="Pause that ends a number that may be whole or go on (its length "
        "unknown): default 700, never past max_silence_ms.",
    )

    @model_validator(mode="after")
    def _in_order(self) -> Self:
        low, high = self.min_silence_ms, self.max_silence_ms
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_silence_ms ({low}) is above max_silence_ms ({high})")
        fallback = self.fallback_silence_ms
        if fallback is not None and (
            (low is not None and fallback < low) or (high is not None and fallback > high)
        ):
            raise ValueError(
                f"fallback_silence_ms ({fallback}) must lie between min_silence_ms and "
                "max_silence_ms"
            )
        return self


class ExpectedArgument(Spec):
    """A tool argument the agent asks the caller for: how the answer looks, and the words
    that name it in the agent's question."""

    expect: Expect | None = Field(
        default=None,
        description="As in a turn block; unset: from the argument's JSON schema (a pattern "
        "like ^\\d{8}$, format: date, an integer's minimum and maximum).",
    )
    digits: int | None = Field(default=None, ge=1, le=32)
    max_digits: int | None = Field(default=None, ge=1, le=32)
    asked_as: list[str] = Field(
        default_factory=list,
        description="Words in the agent's question that ask for this argument (besides its "
        "name with spaces for underscores, e.g. 'account number', and its schema title).",
    )

    @model_validator(mode="after")
    def _shape_given_whole(self) -> Self:
        _check_digits(self.expect, self.digits, self.max_digits)
        return self


def _check_digits(expect: Expect | None, digits: int | None, max_digits: int | None) -> None:
    for name, value in (("digits", digits), ("max_digits", max_digits)):
        if value is not None and expect != "digits":
            raise ValueError(f"{name}: {value} only applies with 'expect: digits'")
    if digits is not None and max_digits is not None and max_digits < digits:
        raise ValueError(f"max_digits ({max_digits}) is below digits ({digits})")
