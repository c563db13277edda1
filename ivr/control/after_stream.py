"""What happens to a call after one of its streams ends.

The stream handler (``ivr.call.stream``) says how the call left it (``StreamEnd``): that is
stored in the call's record and, when the call ended with the stream, its ending is settled
(``ivr.control.endings``). Then Twilio asks (the ``<Connect action>`` request) and the answer
comes from the record: ``<Dial>`` for a transfer, ``<Hangup/>`` when the flow or the caller
ended it, or a new stream when the stream dropped without a decision to end (any instance may
carry it). Resuming stops after ``MAX_STREAMS``: a stream that dies at once, a flow that
crashes, must not loop forever. With Redis unreachable an instance may hold no record of the
call: the action URL's query and Twilio's form say enough to resume it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Literal

import structlog

from ivr import phrases
from ivr.control.connect import CallParams, StreamConnector
from ivr.control.endings import (
    CallAlreadyEnded,
    announce,
    expect_stream,
    settle,
    when_twilio_ended,
)
from ivr.control.summary import StreamStats
from ivr.control.tokens import valid_call_sid
from ivr.state.base import (
    CallRecord,
    CallStatus,
    CallStore,
    StoreError,
    StoreUnavailable,
    StreamSuperseded,
    fenced,
)
from ivr.state.outcomes import Outcome
from ivr.telephony import twilio
from ivr.telephony.dialing import is_dialable

log = structlog.get_logger("ivr.call")

MAX_STREAMS = 4
"""The first stream plus three resumes (planned moves do not count)."""


class StreamOutcome(StrEnum):
    """Why a call left this stream (the ``reason`` label of ``ivr_streams_total``); how the
    call itself ended is its ``Outcome`` (``_ending_of``)."""

    STOP = "stop"
    """Twilio sent ``stop``: the caller hung up (or a redirect completed)."""
    DISCONNECT = "disconnect"
    """The socket dropped without ``stop``: the call may resume on a new stream."""
    HANGUP = "hangup"
    TRANSFER = "transfer"
    ERROR = "error"
    """The flow failed: the call ends, it is never resumed into the same failure."""
    SUPERSEDED = "superseded"
    """A newer stream carries the call: this one must leave the record alone."""
    MOVED = "moved"
    """A draining instance redirected the call to a new stream (a planned move)."""


_CALL_OVER: dict[StreamOutcome, tuple[Outcome, CallStatus]] = {
    StreamOutcome.STOP: (Outcome.CALLER_HUNG_UP, CallStatus.ENDED),
    StreamOutcome.HANGUP: (Outcome.FLOW_HUNG_UP, CallStatus.ENDED),
    StreamOutcome.ERROR: (Outcome.FAILED, CallStatus.ENDED),
    # The <Connect action> request answers <Dial> from the record (ended or not).
    StreamOutcome.TRANSFER: (Outcome.TRANSFERRED_COLD, CallStatus.ENDED),
}
"""Stream ends after which no stream of this call follows (no resume): how the call ended."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a call left one of its streams, as its stream handler saw it."""

    reason: StreamOutcome
    action: Literal["hangup", "transfer"] | None = None
    """What the flow decided (None: nothing)."""
    number: str = ""
    """The number to dial, for a transfer."""
    held: bool = False
    """A warm transfer put the caller on hold: the call may come back, so the record stays
    open (the transfer's callbacks end it) and its transfer fields are the transfer's."""
    redirected: bool = False
    """Twilio took the call over through a REST update (transfer): our part of it is over."""
    turns: Sequence[dict[str, Any]] = ()
    """The stream's turns not yet stored."""
    events: Sequence[dict[str, Any]] = ()
    """The stream's timeline events not yet stored."""
    stats: StreamStats | None = None
    started: float | None = None
    """Monotonic time the stream started."""

    def ending(self) -> tuple[Outcome, CallStatus] | None:
        """How the call ended, when it ended with this stream; None: it goes on (a resume, a
        planned move, a warm transfer's hold) or a newer stream carries it."""
        if self.held:
            return None  # the transfer's callbacks end it, or the caller comes back
        if self.redirected:
            return Outcome.TRANSFERRED_COLD, CallStatus.TRANSFERRING  # Twilio has the call
        if self.reason == StreamOutcome.TRANSFER and not is_dialable(self.number):
            return Outcome.FAILED, CallStatus.ENDED  # the <Connect action> will not dial it
        return _CALL_OVER.get(self.reason)

    def mark(self, record: CallRecord) -> None:
        """Write this end into ``record``: the stream's turns and events, and what the
        ``<Connect action>`` will find (the flow's decision, or a stream to resume)."""
        for turn in self.turns:
            record.add_turn(turn)
        record.add_events(list(self.events))
        if record.is_ended:
            return  # ended elsewhere first (Twilio's status callback): keep how
        if self.action is not None and not self.held:  # held: the transfer owns these fields
            record.end_action = self.action
            record.transfer_to = self.number
            transfer = self.action == "transfer"
            record.status = CallStatus.TRANSFERRING if transfer else CallStatus.ENDED
        elif self.reason in (StreamOutcome.DISCONNECT, StreamOutcome.MOVED):
            # No `stop`: the socket dropped. Twilio will fetch the <Connect action> URL and
            # any instance can resume the call from the store. Moved: a new stream takes it.
            record.status = CallStatus.RECONNECTING


async def record_stream_end(
    store: CallStore, call_sid: str, stream_sid: str, end: StreamEnd
) -> tuple[CallRecord | None, bool]:
    """Store how the call left stream ``stream_sid`` and, when the call ended with it, settle
    how: the record as stored (None if not), and whether this stream settled the call's ending
    (logged ``call.ended`` and counted it). Never raises: the call is over either way."""
    ending = end.ending()
    try:
        if ending is None:
            return await store.update(call_sid, fenced(stream_sid, end.mark)), False
        settled = await settle(
            store,
            call_sid,
            ending[0],
            by="stream",
            status=ending[1],
            also=fenced(stream_sid, end.mark),
            stats=end.stats,
            started=end.started,
        )
    except StreamSuperseded:
        log.info("call.finish_skipped", reason="a newer stream carries the call")
        return None, False
    except Exception as exc:  # never fail teardown
        log.error("call.finish_failed", error=repr(exc))
        if ending is None:
            return None, False
        # Nothing else knows how it ended: say it here (Twilio's callback may say it again).
        announce(None, ending[0], by="stream", stats=end.stats, started=end.started)
        return None, True
    return settled.record, settled.ours


async def answer_after_stream(
    store: CallStore, connector: StreamConnector, form: Mapping[str, str], query: Mapping[str, str]
) -> str:
    """The TwiML for Twilio's ``<Connect action>`` request (``form``, the action URL's
    ``query``): what the call does now that its stream is over."""
    call_sid = form.get("CallSid", "")
    try:
        streams = _int(query.get("streams", "")) + 1
        return await _after_stream(store, connector, call_sid, form.get("CallStatus", ""), streams)
    except StoreUnavailable as exc:
        # Redis is unreachable and another instance carried the call: answer from what
        # Twilio sent and the action URL carries.
        log.warning("call.after_stream_without_record", call_sid=call_sid, error=str(exc))
        return await _without_record(connector, form, query)
    except StoreError as exc:
        # Without the record we cannot resume or transfer; say so rather than fail with 500.
        log.error("call.after_stream_failed", call_sid=call_sid, error=str(exc))
        return twilio.reject_twiml(phrases.TECHNICAL_PROBLEM)


async def _after_stream(
    store: CallStore,
    connector: StreamConnector,
    call_sid: str,
    call_status: str,
    streams_in_url: int,
) -> str:
    """Twilio asks what to do now that the stream is over: <Dial>, <Hangup/> or a new stream.

    ``streams_in_url`` is the stream count the action URL carries (plus the one that just
    ended): with Redis away this instance may hold only the webhook's copy of the record,
    which never counted a stream, and the resume limit must hold all the same.
    """
    record = await store.get(call_sid) if call_sid else None
    if record is None:
        return twilio.hangup_twiml()
    if call_status == "completed":  # the caller is gone: a missed `stop` must not leave it live
        await settle(store, call_sid, when_twilio_ended(record), by="twilio")
        return twilio.hangup_twiml()
    if record.end_action == "transfer" and record.transfer_to:
        if not is_dialable(record.transfer_to):  # never dial what a flow did not validate
            log.error(
                "call.transfer_invalid_number", call_sid=call_sid, pii_number=record.transfer_to
            )
            await settle(store, call_sid, Outcome.FAILED, by="connect_action")
            return twilio.reject_twiml(phrases.TECHNICAL_PROBLEM)
        log.info("call.transfer", call_sid=call_sid, pii_number=record.transfer_to)
        await settle(store, call_sid, Outcome.TRANSFERRED_COLD, by="connect_action")
        return twilio.dial_twiml(record.transfer_to)
    if record.end_action == "hangup" or record.is_ended:
        return twilio.hangup_twiml()
    if max(record.stream_count, streams_in_url) >= MAX_STREAMS:
        # Resuming keeps failing (a stream that dies at once, a flow that crashes): stop the
        # loop with an apology instead of reconnecting the caller forever.
        log.error("call.resume_limit", call_sid=call_sid, streams=record.stream_count)
        await settle(store, call_sid, Outcome.DROPPED, by="connect_action")
        return twilio.reject_twiml(phrases.TECHNICAL_PROBLEM)
    # The stream dropped without a decision to end: resume on a new stream (any instance).
    try:
        record = await expect_stream(store, call_sid)
    except CallAlreadyEnded:  # ended meanwhile (Twilio's status callback, the sweep)
        return twilio.hangup_twiml()
    log.info("call.resume_requested", call_sid=call_sid, node=record.node)
    # The count the action URL carries may be ahead of a stale copy of the record (Redis
    # away, another instance carried the streams): keep it, or the resume limit never trips.
    call = replace(CallParams.of(record), streams=max(record.stream_count, streams_in_url))
    return await connector.twiml(call)


async def _without_record(
    connector: StreamConnector, form: Mapping[str, str], query: Mapping[str, str]
) -> str:
    """The ``<Connect action>`` on an instance with no record of the call, Redis unreachable.

    The caller hung up: hang up. Otherwise resume on a new stream; the instance that takes it
    resumes the call where it was if it holds the record, else starts the call's pinned flow
    again from its greeting (nothing of its progress is readable here). The stream count rides
    in the action URL, so the resume limit holds without the record too.
    """
    call_sid = form.get("CallSid", "")
    if form.get("CallStatus") == "completed" or not valid_call_sid(call_sid):
        return twilio.hangup_twiml()
    streams = _int(query.get("streams", "")) + 1  # the stream that just ended
    if streams >= MAX_STREAMS:
        log.error("call.resume_limit", call_sid=call_sid, streams=streams)
        return twilio.reject_twiml(phrases.TECHNICAL_PROBLEM)
    params = CallParams(
        call_sid=call_sid,
        from_number=form.get("From", ""),
        to_number=form.get("To", ""),
        flow_name=query.get("flow", ""),
        flow_version=query.get("version", ""),
        streams=streams,
    )
    return await connector.twiml(params)


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0
