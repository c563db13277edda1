"""Twilio's two questions about a call, answered: the voice webhook (a new call: pin its flow,
create its record and connect it to a stream, or refuse it) and the ``<Connect action>`` request
after a stream (``ivr.control.after_stream``). Both are signed (403 otherwise)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog
from fastapi import APIRouter, Request, Response

from ivr import phrases
from ivr.control.after_stream import answer_after_stream
from ivr.control.connect import CallParams, StreamConnector
from ivr.control.endings import expect_stream, record_overflow
from ivr.control.tokens import valid_call_sid
from ivr.control.webhook_auth import StreamAuth, signed_form
from ivr.obs import metrics
from ivr.state.base import CallExists, CallRecord, CallStore, StoreError
from ivr.telephony import twilio

log = structlog.get_logger("ivr.webhook")

XML = "application/xml"


class AdmissionStatus(Protocol):
    def as_dict(self) -> dict[str, object]: ...


class Admission(Protocol):
    """Whether this instance takes another call (``ivr.admission.Admission``)."""

    def takes_new_call(self) -> bool: ...
    def status(self) -> AdmissionStatus: ...
    def overflow_twiml(self) -> str: ...
    def reserve(self, call_sid: str) -> None:
        """Count ``call_sid`` against the limit until its stream is here."""
        ...


class FlowPins(Protocol):
    async def pin(self, record: CallRecord) -> None:
        """Set the flow (and version) that answers ``record``; LookupError: none does."""
        ...


@dataclass(frozen=True, slots=True)
class CallWebhooks:
    """The parts the answers need, one set per gateway."""

    store: CallStore
    auth: StreamAuth
    connector: StreamConnector
    admission: Admission
    flows: FlowPins


def call_webhooks_router(hooks: CallWebhooks) -> APIRouter:
    """``POST /twilio/voice`` and ``POST /twilio/after-stream``."""
    router = APIRouter()

    @router.post("/twilio/voice")
    async def voice(request: Request) -> Response:
        form = await signed_form(request, hooks.auth)
        if form is None:
            metrics.WEBHOOKS.labels("forbidden").inc()
            return Response("invalid signature", status_code=403)
        return await answer_call(hooks, form)

    @router.post("/twilio/after-stream")
    async def after(request: Request) -> Response:
        form = await signed_form(request, hooks.auth)
        if form is None:
            return Response("invalid signature", status_code=403)
        query = request.query_params
        return _twiml(await answer_after_stream(hooks.store, hooks.connector, form, query))

    return router


async def answer_call(hooks: CallWebhooks, form: Mapping[str, str]) -> Response:
    """A call arrives: take it, or (full, or the loop cannot keep time) refuse it."""
    if hooks.admission.takes_new_call():
        return await _new_call(hooks, form)
    # A call here would stutter. The balancer sends the next one elsewhere once /readyz says so.
    log.warning("webhook.overflow", **hooks.admission.status().as_dict())
    metrics.WEBHOOKS.labels("overflow").inc()
    await _overflowed(hooks.store, form)
    return _twiml(hooks.admission.overflow_twiml())


async def _new_call(hooks: CallWebhooks, form: Mapping[str, str]) -> Response:
    """A new call: pin its flow, create its record, answer with a stream to connect."""
    call_sid = form.get("CallSid", "")
    if not valid_call_sid(call_sid):
        metrics.WEBHOOKS.labels("bad_request").inc()
        return Response("CallSid missing or malformed", status_code=400)
    record = CallRecord(
        call_sid=call_sid,
        account_sid=form.get("AccountSid", ""),
        from_number=form.get("From", ""),
        to_number=form.get("To", ""),
    )
    try:
        await hooks.flows.pin(record)
    except LookupError as exc:
        log.error("webhook.no_flow", error=str(exc), pii_to=record.to_number)
        metrics.WEBHOOKS.labels("no_flow").inc()
        return _twiml(twilio.reject_twiml(phrases.NOT_IN_SERVICE))
    try:
        await hooks.store.create(record)
    except CallExists:
        # Twilio retries a webhook that timed out, before any stream. Once the call has had
        # one, a "retry" is a replayed request: a fresh token would let it take the call over.
        existing = await hooks.store.get(call_sid)
        if existing is not None and (existing.stream_count > 0 or existing.is_ended):
            log.warning("webhook.replay_refused", streams=existing.stream_count)
            metrics.WEBHOOKS.labels("replay").inc()
            return Response("this call already has a stream", status_code=409)
        log.info("webhook.repeat", call_sid=call_sid)  # Twilio retried: same call, new token
        await _restart_wait(hooks.store, call_sid)
    metrics.WEBHOOKS.labels("accepted").inc()
    hooks.admission.reserve(call_sid)  # counts against IVR_MAX_CALLS until its stream is here
    return _twiml(await hooks.connector.twiml(CallParams.of(record)))


async def _overflowed(store: CallStore, form: Mapping[str, str]) -> None:
    """Keep the refused call as ended (``overflow``), so it is listed and counted."""
    call_sid = form.get("CallSid", "")
    if not valid_call_sid(call_sid):
        return
    await record_overflow(
        store,
        call_sid,
        account_sid=form.get("AccountSid", ""),
        from_number=form.get("From", ""),
        to_number=form.get("To", ""),
    )


async def _restart_wait(store: CallStore, call_sid: str) -> None:
    """A new token for a call still waiting for its first stream: its wait restarts now."""
    try:
        await expect_stream(store, call_sid)
    except StoreError as exc:  # the call is answered either way; the sweep may end it early
        log.warning("webhook.wait_not_restarted", call_sid=call_sid, error=str(exc))


def _twiml(xml: str) -> Response:
    return Response(xml, media_type=XML)
