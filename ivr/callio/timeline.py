"""What happens on a call besides its words, kept for the call record: key presses, barge-ins,
the caller's backchannels over the bot, and node changes.

The call's ``CallTimeline`` collects events where they already pass (the flow runner: its
``CallerPressed`` digits, the node each step lands on, a prompt the caller interrupted) and
hands them out once (``drain``) to the store write that follows anyway: the flow's per-step save
(``ivr.conversation``) and the end of the stream (``ivr.call.stream``). No event costs a store
round trip of its own. Bounded: past ``limit`` unsaved events the oldest are dropped (counted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from ivr.state.base import DEFAULT_TIMELINE_LIMIT

Kind = Literal["dtmf", "barge_in", "backchannel", "node"]
TimelineEvent = dict[str, Any]


def _now() -> datetime:
    return datetime.now(UTC)


class CallTimeline:
    def __init__(
        self, limit: int = DEFAULT_TIMELINE_LIMIT, clock: Callable[[], datetime] = _now
    ) -> None:
        self._unsaved: deque[TimelineEvent] = deque(maxlen=limit)
        self._clock = clock
        self.dropped = 0

    def add(self, kind: Kind, **fields: Any) -> None:
        if len(self._unsaved) == self._unsaved.maxlen:
            self.dropped += 1
        self._unsaved.append({"at": self._clock().isoformat(), "kind": kind, **fields})

    def drain(self) -> list[TimelineEvent]:
        """The events not yet handed out (each is handed out once), oldest first."""
        events = list(self._unsaved)
        self._unsaved.clear()
        return events


def backchannel_spans(events: Iterable[TimelineEvent]) -> list[int]:
    """The speech spans (ms) of the caller's backchannels recorded in ``events``, oldest first.
    The record is JSON any version may have written: an event without a whole positive
    ``span_ms`` is skipped."""
    spans = []
    for event in events:
        span = event.get("span_ms") if event.get("kind") == "backchannel" else None
        if isinstance(span, int) and not isinstance(span, bool) and span > 0:
            spans.append(span)
    return spans
