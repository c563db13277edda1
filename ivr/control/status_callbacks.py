"""Twilio's own word on a call: the call-status callback and the media stream's status callback.

``POST /twilio/status`` is the URL an operator sets on the number ("Call status changes"; the
gateway sets it on the calls it places too). Of Twilio's statuses only the final ones matter:
``completed``, ``busy``, ``no-answer``, ``failed``, ``canceled``. The first to arrive is kept in
the record with ``CallDuration`` (the seconds Twilio billed); if nothing here has ended the call
yet, it ends now, with the outcome the record implies (``ivr.control.endings.when_twilio_ended``).

``POST /twilio/stream-status`` is the ``<Stream statusCallback>`` every stream's TwiML asks for:
``stream-started``, ``stream-stopped`` and ``stream-error`` with Twilio's ``StreamError`` (the
only place it says why a stream failed: a refused handshake, TLS). Each is kept on the call's
timeline and counted (``ivr_twilio_stream_events_total``); none ends a call: Twilio goes on to
the ``<Connect action>`` request, which resumes or ends it.

Both are signed like every webhook (403 otherwise) and answered by any instance. A callback
repeated or arriving late changes nothing twice: what is kept is kept once, and an ending
already settled stays as it was. A call the store does not know (expired, or refused before it
had a record) gets 204 as well: there is nothing to correct, and Twilio must not retry. So does
one that arrives while Redis is away: it is logged (``twilio_status.not_stored``), not kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Final, get_args

import structlog
from fastapi import APIRouter, Request, Response

from ivr.control.connect import STREAM_STATUS_PATH
from ivr.control.endings import settle, when_twilio_ended
from ivr.control.tokens import valid_call_sid
from ivr.control.webhook_auth import StreamAuth, signed_form
from ivr.obs import metrics
from ivr.state.base import CallNotFound, CallRecord, CallStore, StoreError, TwilioStatus

log = structlog.get_logger("ivr.twilio_status")

CALL_STATUS_PATH: Final = "/twilio/status"
OUTBOUND_STATUS_PATH: Final = "/twilio/outbound-status"
"""Where the previous version told Twilio to report the calls it placed: still answered."""
FINAL_STATUSES: Final[dict[str, TwilioStatus]] = {s: s for s in get_args(TwilioStatus) if s}
STREAM_EVENTS: Final = frozenset(metrics.TWILIO_STREAM_EVENT_NAMES)
MAX_ERROR_CHARS = 300
Handler = Callable[[CallStore, Mapping[str, str]], Awaitable[None]]


class BadCallback(ValueError):
    """A callback that cannot be Twilio's; the message names the field and the value."""


async def on_call_status(store: CallStore, form: Mapping[str, str]) -> None:
    """Keep Twilio's final status and billed duration once; end the call if nothing has."""
    call_sid = _call_sid(form)
    status = FINAL_STATUSES.get(form.get("CallStatus", ""))
    if status is None:
        return  # ringing, in-progress, ...: the call's own path says more than these
    seconds = _seconds(form.get("CallDuration", ""))
    known = await store.get(call_sid)
    if known is None:
        log.info("twilio_status.unknown_call", call_sid=call_sid, status=status)
        return
    if known.twilio_status and known.is_ended:
        return  # a repeat: kept and settled the first time

    def keep(record: CallRecord) -> None:
        if record.twilio_status:
            return
        record.twilio_status, record.billed_seconds = status, seconds
        record.add_events([_event("twilio_status", status=status, seconds=seconds)])

    try:
        settled = await settle(store, call_sid, when_twilio_ended, by="twilio", also=keep)
    except CallNotFound:
        return  # expired in between
    log.info(
        "twilio_status.final",
        call_sid=call_sid,
        status=status,
        billed_seconds=seconds,
        outcome=settled.record.outcome,
        ended_here=settled.ours,
    )


async def on_stream_status(store: CallStore, form: Mapping[str, str]) -> None:
    """Keep a stream event on the call's timeline, once; a stream error is logged too."""
    call_sid, event = _call_sid(form), form.get("StreamEvent", "")
    if event not in STREAM_EVENTS:
        names = ", ".join(sorted(STREAM_EVENTS))
        raise BadCallback(f"StreamEvent={event[:40]!r}: expected one of {names}")
    stream_sid = form.get("StreamSid", "")[:64]
    error = form.get("StreamError", "")[:MAX_ERROR_CHARS]
    if event == "stream-error":
        log.warning("twilio_status.stream_error", call_sid=call_sid, error=error)
    known = await store.get(call_sid)
    if known is None or _has(known, event, stream_sid):
        return  # not ours to keep, or a repeat
    metrics.TWILIO_STREAM_EVENTS.labels(event).inc()
    fields = {"event": event, "stream_sid": stream_sid} | ({"error": error} if error else {})

    def keep(record: CallRecord) -> None:
        if not _has(record, event, stream_sid):
            record.add_events([_event("twilio_stream", **fields)])

    try:
        await store.update(call_sid, keep)
    except CallNotFound:
        return


def status_callbacks_router(store: CallStore, auth: StreamAuth) -> APIRouter:
    router = APIRouter()

    async def call_status(request: Request) -> Response:
        return await _answer(request, store, auth, on_call_status)

    router.add_api_route(CALL_STATUS_PATH, call_status, methods=["POST"])
    router.add_api_route(OUTBOUND_STATUS_PATH, call_status, methods=["POST"])

    @router.post(STREAM_STATUS_PATH)
    async def stream_status(request: Request) -> Response:
        return await _answer(request, store, auth, on_stream_status)

    return router


async def _answer(
    request: Request, store: CallStore, auth: StreamAuth, handle: Handler
) -> Response:
    form = await signed_form(request, auth)
    if form is None:
        return Response("invalid signature", status_code=403)
    try:
        await handle(store, form)
    except BadCallback as exc:
        return Response(str(exc), status_code=400)
    except StoreError as exc:
        # Redis away: what Twilio said stays in this log line, and the sweep ends the call as
        # without it. A 5xx would only add a 15003 warning to the caller's call in Twilio's
        # debugger (Twilio does not retry a status callback).
        fields = {k: form.get(k, "") for k in _KEPT_IN_LOG}
        log.error("twilio_status.not_stored", error=str(exc), path=request.url.path, **fields)
    return Response(status_code=204)


_KEPT_IN_LOG = ("CallSid", "CallStatus", "CallDuration", "StreamSid", "StreamEvent", "StreamError")


def _call_sid(form: Mapping[str, str]) -> str:
    call_sid = form.get("CallSid", "")
    if not valid_call_sid(call_sid):
        raise BadCallback(f"CallSid={call_sid[:80]!r}: missing or malformed")
    return call_sid


def _seconds(text: str) -> int | None:
    if not text:
        return None  # busy, no-answer, ...: no duration
    if not text.isdigit():
        raise BadCallback(f"CallDuration={text[:40]!r}: expected whole seconds")
    return int(text)


def _has(record: CallRecord, event: str, stream_sid: str) -> bool:
    return any(
        e.get("kind") == "twilio_stream"
        and e.get("event") == event
        and e.get("stream_sid") == stream_sid
        for e in record.timeline
    )


def _event(kind: str, **fields: object) -> dict[str, object]:
    return {"at": datetime.now(UTC).isoformat(), "kind": kind, **fields}
