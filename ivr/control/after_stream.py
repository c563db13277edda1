"""What happens to a call after one of its streams ends.

Twilio asks (the ``<Connect action>`` request) and the answer comes from the call's record:
``<Dial>`` for a transfer, ``<Hangup/>`` when the flow or the caller ended it, or a new stream
when the stream dropped without a decision to end (any instance may carry it). Resuming stops
after ``MAX_STREAMS``: a stream that dies at once, a flow that crashes, must not loop forever.
With Redis unreachable an instance may hold no record of the call: the action URL's query and
Twilio's form say enough to resume it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import structlog

from ivr import phrases
from ivr.control.connect import CallParams, StreamConnector
from ivr.control.endings import CallAlreadyEnded, expect_stream, settle, when_twilio_ended
from ivr.control.tokens import valid_call_sid
from ivr.state.base import CallStore, StoreError, StoreUnavailable
from ivr.state.outcomes import Outcome
from ivr.telephony import twilio
from ivr.telephony.dialing import is_dialable

log = structlog.get_logger("ivr.app")  # the logger these lines have always come from

MAX_STREAMS = 4
"""The first stream plus three resumes (planned moves do not count)."""


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
