"""How a call ended, in the words an operator reads: one name everywhere (the call record, the
console, ``ivr calls``, the ``call.ended`` log line and ``ivr_calls_total{outcome}``).

A record written by the previous version has no ``outcome``: ``outcome_of`` reads it from what
that version kept (the flow's own outcome, the end action, whether a stream ever connected),
and ``parse_outcome`` takes the previous version's names too (``hangup``, ``transfer``, ``stop``,
``error``, ``dropped``), so old searches and habits keep working.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol


class Outcome(enum.StrEnum):
    """How a call ended. The value is the word shown and the metric label."""

    CALLER_HUNG_UP = "caller_hung_up"
    FLOW_HUNG_UP = "flow_hung_up"
    TRANSFERRED_COLD = "transferred_cold"
    TRANSFERRED_WARM = "transferred_warm"
    DROPPED = "dropped"
    FAILED = "failed"
    NEVER_CONNECTED = "never_connected"
    OVERFLOW = "overflow"


MEANING: dict[Outcome, str] = {
    Outcome.CALLER_HUNG_UP: "the caller hung up",
    Outcome.FLOW_HUNG_UP: "the flow said goodbye and hung up",
    Outcome.TRANSFERRED_COLD: "transferred to a number (cold)",
    Outcome.TRANSFERRED_WARM: "transferred to an agent who was briefed and joined (warm)",
    Outcome.DROPPED: "the media stream was lost and the call was not resumed",
    Outcome.FAILED: "the flow failed (an error); the caller heard an apology",
    Outcome.NEVER_CONNECTED: "answered, but no media stream ever connected",
    Outcome.OVERFLOW: "refused at the webhook: every instance was full or overloaded",
}
"""One line per outcome, for the console's tooltips and the docs."""

LEGACY: dict[str, Outcome] = {
    "hangup": Outcome.FLOW_HUNG_UP,
    "caller_hangup": Outcome.CALLER_HUNG_UP,
    "stop": Outcome.CALLER_HUNG_UP,
    "transfer": Outcome.TRANSFERRED_COLD,
    "error": Outcome.FAILED,
}
"""Names the previous version used for outcomes (console, metric labels, flow outcomes)."""


class _Leg(Protocol):
    @property
    def status(self) -> str: ...


class EndedCall(Protocol):
    """What ``outcome_of`` reads of a call record (``ivr.state.base.CallRecord``)."""

    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def is_ended(self) -> bool: ...
    @property
    def flow_state(self) -> dict[str, Any]: ...
    @property
    def end_action(self) -> str | None: ...
    @property
    def warm_transfer(self) -> _Leg | None: ...
    @property
    def stream_count(self) -> int: ...


class UnknownOutcome(ValueError):
    """Not an outcome name; the message lists the names there are."""


def parse_outcome(text: str) -> Outcome:
    """An outcome by its name, or by the name the previous version gave it."""
    name = text.strip().lower().replace(" ", "_").replace("-", "_")
    if name in _NAMES:
        return Outcome(name)
    if name in LEGACY:
        return LEGACY[name]
    names = ", ".join(o.value for o in Outcome)
    raise UnknownOutcome(f"outcome={text!r}: not an outcome; one of {names}")


_NAMES = frozenset(o.value for o in Outcome)


def outcome_of(record: EndedCall) -> Outcome | None:
    """How ``record``'s call ended; None while it has not. Records written by the previous
    version (no ``outcome``) are read from what that version stored."""
    if record.outcome is not None:
        return record.outcome
    if not record.is_ended:
        return None
    flow_outcome = record.flow_state.get("outcome")
    if isinstance(flow_outcome, str) and flow_outcome in LEGACY:
        return _transferred(record) if flow_outcome == "transfer" else LEGACY[flow_outcome]
    if record.end_action == "transfer":
        return _transferred(record)
    if record.end_action == "hangup":
        return Outcome.FLOW_HUNG_UP
    # The previous version ended a call without a decision when Twilio sent `stop` (its
    # "dropped"), or when an outbound call was never answered.
    return Outcome.CALLER_HUNG_UP if record.stream_count > 0 else Outcome.NEVER_CONNECTED


def _transferred(record: EndedCall) -> Outcome:
    leg = record.warm_transfer
    warm = leg is not None and leg.status == "connected"
    return Outcome.TRANSFERRED_WARM if warm else Outcome.TRANSFERRED_COLD
