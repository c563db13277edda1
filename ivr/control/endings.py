"""Every call ends once, in its record.

``settle`` is the one way a call's outcome is decided: a compare-and-set update of the record
that sets ``outcome`` (with ``ended_at`` and the final status) only when nobody has yet, so the
ending is logged (``call.ended``) and counted (``ivr_calls_total{outcome}``) exactly once across
instances, by whichever ends it first: its stream's teardown, the ``<Connect action>`` request,
Twilio's call-status callback, a warm transfer's callbacks, the webhook's overflow answer, or
the sweep of calls that never connected or were dropped and not resumed (``ivr.control.sweeper``).
The update may run more than once (a lost version race re-runs it on the newer record), so what
it decides depends only on the record it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from ivr.control.summary import StreamStats, log_summary
from ivr.obs import metrics
from ivr.state.base import (
    CallExists,
    CallRecord,
    CallStatus,
    CallStore,
    Mutator,
    StoreError,
)
from ivr.state.outcomes import Outcome

log = structlog.get_logger("ivr.call")


@dataclass(frozen=True, slots=True)
class Settled:
    record: CallRecord
    """The record as stored."""
    ours: bool
    """This update settled the outcome (and logged and counted it); False: it was settled."""


async def settle(
    store: CallStore,
    call_sid: str,
    outcome: Outcome | Callable[[CallRecord], Outcome],
    *,
    by: str,
    status: CallStatus = CallStatus.ENDED,
    also: Mutator | None = None,
    when: Callable[[CallRecord], bool] | None = None,
    stats: StreamStats | None = None,
    started: float | None = None,
) -> Settled:
    """End ``call_sid`` with ``outcome`` (or what it says for the record as stored) unless its
    ending is settled already, or ``when``, asked of the record as stored, says no. ``also`` is
    applied in the same write either way (a stream's last turns). ``by`` names who ended it in
    the log line. ``CallNotFound`` if the store has no such call."""
    ours: Outcome | None = None

    def decide(record: CallRecord) -> None:
        nonlocal ours
        ours = None  # re-run on a newer record after a lost race: decide again
        if also is not None:
            also(record)
        if record.outcome is not None or record.is_ended:
            return  # settled; a record of the previous version may be ended without outcome
        if when is not None and not when(record):
            return
        ours = outcome(record) if callable(outcome) else outcome
        record.outcome, record.status = ours, status
        record.ended_at = datetime.now(UTC)

    record = await store.update(call_sid, decide)
    if ours is not None:
        announce(record, ours, by=by, stats=stats, started=started)
    return Settled(record, ours is not None)


def announce(
    record: CallRecord | None,
    outcome: Outcome,
    *,
    by: str,
    stats: StreamStats | None = None,
    started: float | None = None,
) -> None:
    """The ``call.ended`` line and ``ivr_calls_total{outcome}``: once per call."""
    metrics.CALLS.labels(outcome.value).inc()
    log_summary(record, stats, outcome=outcome.value, final=True, started=started, ended_by=by)


def when_twilio_ended(record: CallRecord) -> Outcome:
    """The outcome of a call Twilio says is over (``completed``, ``busy``, ...) that nobody
    here has ended: from what the record says it was doing."""
    leg = record.warm_transfer
    if leg is not None and leg.status == "connected":
        return Outcome.TRANSFERRED_WARM
    if leg is not None and leg.status in ("holding", "dialling"):
        return Outcome.CALLER_HUNG_UP  # left the hold before the agent joined
    if record.end_action == "transfer":
        return Outcome.TRANSFERRED_COLD
    if record.end_action == "hangup":
        return Outcome.FLOW_HUNG_UP
    if record.status == CallStatus.RINGING and record.stream_count == 0:
        return Outcome.NEVER_CONNECTED
    if record.status in (CallStatus.RECONNECTING, CallStatus.RINGING):
        return Outcome.DROPPED  # its stream was lost and no new one came before the end
    return Outcome.CALLER_HUNG_UP


class CallAlreadyEnded(StoreError):
    def __init__(self, call_sid: str) -> None:
        super().__init__(f"call {call_sid!r} has ended: no new stream for it")
        self.call_sid = call_sid


async def expect_stream(store: CallStore, call_sid: str) -> CallRecord:
    """Before a new stream token for a call goes out (a resume, a retried webhook, an outbound
    call answered): the call waits for a stream from now, so the sweep gives the token its whole
    life. ``CallAlreadyEnded`` if its ending is settled (no stream may revive it)."""

    def waiting(record: CallRecord) -> None:
        if record.outcome is not None or record.is_ended:
            raise CallAlreadyEnded(record.call_sid)
        if record.stream_count > 0:
            record.status = CallStatus.RECONNECTING

    return await store.update(call_sid, waiting)


async def record_overflow(
    store: CallStore, call_sid: str, *, account_sid: str, from_number: str, to_number: str
) -> None:
    """A call refused at the webhook (every instance full or overloaded): an ended record, so
    it is listed and counted like any other ending. Never fails the overflow answer."""
    now = datetime.now(UTC)
    record = CallRecord(
        call_sid=call_sid,
        account_sid=account_sid,
        from_number=from_number,
        to_number=to_number,
        status=CallStatus.ENDED,
        ended_at=now,
        outcome=Outcome.OVERFLOW,
    )
    try:
        stored: CallRecord | None = await store.create(record)
    except CallExists:
        return  # Twilio retried a webhook it had an answer for: counted the first time
    except StoreError as exc:
        log.warning("call.overflow_not_stored", call_sid=call_sid, error=str(exc))
        stored = None
    announce(stored or record, Outcome.OVERFLOW, by="webhook")
