"""HTTP and WebSocket routes. Thin: each hands off to the module that owns the work."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

import structlog
from fastapi import APIRouter, FastAPI, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ivr import phrases
from ivr.call.stream import handle_stream
from ivr.console import console_router
from ivr.control.connect import CallParams
from ivr.control.endings import (
    CallAlreadyEnded,
    expect_stream,
    record_overflow,
    settle,
    when_twilio_ended,
)
from ivr.control.status_callbacks import status_callbacks_router
from ivr.control.tokens import valid_call_sid
from ivr.control.warm_routes import warm_transfer_router
from ivr.control.webhook_auth import signed_form
from ivr.gateway import Gateway
from ivr.obs import metrics
from ivr.outbound.routes import outbound_router
from ivr.state.admin import admin_router
from ivr.state.base import CallExists, CallRecord, StoreError, StoreUnavailable
from ivr.state.outcomes import Outcome
from ivr.telephony import twilio
from ivr.telephony.dialing import is_dialable

log = structlog.get_logger("ivr.app")

MAX_STREAMS = 4  # the first stream plus three resumes (planned moves do not count)
XML = "application/xml"


def create_app(gateway: Gateway, *, manage_lifecycle: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await gateway.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await gateway.aclose()

    # No /docs, /redoc or /openapi.json: the routes are Twilio's and the operators', and a
    # public schema only maps the attack surface.
    app = FastAPI(title="ivr", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.include_router(_twilio_routes(gateway))
    settings = gateway.settings
    app.include_router(
        admin_router(gateway.store, settings.admin_token or None, settings.admin_pii_token or None)
    )
    app.include_router(
        console_router(
            gateway.store,
            settings.admin_token or None,
            settings.admin_pii_token or None,
            recordings=gateway.services.recordings,
        )
    )
    app.include_router(outbound_router(gateway))
    services = gateway.services
    app.include_router(warm_transfer_router(services.auth, services.warm))
    app.include_router(status_callbacks_router(services.store, services.auth))
    app.include_router(_ops_routes(gateway))
    return app


def _twilio_routes(gateway: Gateway) -> APIRouter:
    """What Twilio calls: the voice webhook, the <Connect action> and the media stream."""
    router = APIRouter()

    @router.post("/twilio/voice")
    async def voice(request: Request) -> Response:
        form = await _signed_form(request, gateway)
        if form is None:
            metrics.WEBHOOKS.labels("forbidden").inc()
            return Response("invalid signature", status_code=403)
        if not gateway.admission.takes_new_call():
            # Full, or the loop cannot keep time: a call here would stutter. The balancer
            # sends the next one elsewhere once /readyz says so.
            log.warning("webhook.overflow", **gateway.admission.status().as_dict())
            metrics.WEBHOOKS.labels("overflow").inc()
            await _overflowed(gateway, form)
            return _twiml(gateway.admission.overflow_twiml())
        return await _new_call(gateway, form)

    @router.post("/twilio/after-stream")
    async def after_stream(request: Request) -> Response:
        form = await _signed_form(request, gateway)
        if form is None:
            return Response("invalid signature", status_code=403)
        call_sid = form.get("CallSid", "")
        try:
            streams = _int(request.query_params.get("streams", "")) + 1
            return await _after_stream(gateway, call_sid, form.get("CallStatus", ""), streams)
        except StoreUnavailable as exc:
            # Redis is unreachable and another instance carried the call: answer from what
            # Twilio sent and the action URL carries.
            log.warning("call.after_stream_without_record", call_sid=call_sid, error=str(exc))
            return await _after_stream_without_record(gateway, form, request.query_params)
        except StoreError as exc:
            # Without the record we cannot resume or transfer; say so rather than fail with 500.
            log.error("call.after_stream_failed", call_sid=call_sid, error=str(exc))
            return _twiml(twilio.reject_twiml(phrases.TECHNICAL_PROBLEM))

    @router.websocket("/twilio/stream/{token}")
    async def stream(ws: WebSocket, token: str) -> None:
        await handle_stream(ws, token, gateway.services)

    return router


def _ops_routes(gateway: Gateway) -> APIRouter:
    """Liveness, readiness and metrics for the orchestrator and Prometheus."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz(verbose: bool = False) -> dict[str, object]:
        # Alive: the process answers. No host name or pid: this answer is public.
        if not verbose:
            return {"status": "ok"}
        return {"status": "ok", **gateway.admission.status().as_dict()}

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        # Whether THIS instance takes calls (not draining, not full, loop keeping time).
        # Redis is reported, not required: without it calls go on from memory.
        status = gateway.admission.status()
        return JSONResponse(status.as_dict(), status_code=200 if status.ready else 503)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return router


async def _new_call(gateway: Gateway, form: dict[str, str]) -> Response:
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
        await gateway.flows.pin(record)
    except LookupError as exc:
        log.error("webhook.no_flow", error=str(exc), pii_to=record.to_number)
        metrics.WEBHOOKS.labels("no_flow").inc()
        return _twiml(twilio.reject_twiml(phrases.NOT_IN_SERVICE))
    try:
        await gateway.store.create(record)
    except CallExists:
        # Twilio retries a webhook that timed out, before any stream. Once the call has had
        # one, a "retry" is a replayed request: a fresh token would let it take the call over.
        existing = await gateway.store.get(call_sid)
        if existing is not None and (existing.stream_count > 0 or existing.is_ended):
            log.warning("webhook.replay_refused", streams=existing.stream_count)
            metrics.WEBHOOKS.labels("replay").inc()
            return Response("this call already has a stream", status_code=409)
        log.info("webhook.repeat", call_sid=call_sid)  # Twilio retried: same call, new token
        await _restart_wait(gateway, call_sid)
    metrics.WEBHOOKS.labels("accepted").inc()
    gateway.admission.reserve(call_sid)  # counts against IVR_MAX_CALLS until its stream is here
    return await _stream_twiml(gateway, CallParams.of(record))


def _twiml(xml: str) -> Response:
    return Response(xml, media_type=XML)


async def _overflowed(gateway: Gateway, form: dict[str, str]) -> None:
    """Keep the refused call as ended (``overflow``), so it is listed and counted."""
    call_sid = form.get("CallSid", "")
    if not valid_call_sid(call_sid):
        return
    await record_overflow(
        gateway.store,
        call_sid,
        account_sid=form.get("AccountSid", ""),
        from_number=form.get("From", ""),
        to_number=form.get("To", ""),
    )


async def _restart_wait(gateway: Gateway, call_sid: str) -> None:
    """A new token for a call still waiting for its first stream: its wait restarts now."""
    try:
        await expect_stream(gateway.store, call_sid)
    except StoreError as exc:  # the call is answered either way; the sweep may end it early
        log.warning("webhook.wait_not_restarted", call_sid=call_sid, error=str(exc))


async def _after_stream(
    gateway: Gateway, call_sid: str, call_status: str, streams_in_url: int
) -> Response:
    """Twilio asks what to do now that the stream is over: <Dial>, <Hangup/> or a new stream.

    ``streams_in_url`` is the stream count the action URL carries (plus the one that just
    ended): with Redis away this instance may hold only the webhook's copy of the record,
    which never counted a stream, and the resume limit must hold all the same.
    """
    store = gateway.store
    record = await store.get(call_sid) if call_sid else None
    if record is None:
        return Response(twilio.hangup_twiml(), media_type=XML)
    if call_status == "completed":  # the caller is gone: a missed `stop` must not leave it live
        await settle(store, call_sid, when_twilio_ended(record), by="twilio")
        return Response(twilio.hangup_twiml(), media_type=XML)
    if record.end_action == "transfer" and record.transfer_to:
        if not is_dialable(record.transfer_to):  # never dial what a flow did not validate
            log.error(
                "call.transfer_invalid_number", call_sid=call_sid, pii_number=record.transfer_to
            )
            await settle(store, call_sid, Outcome.FAILED, by="connect_action")
            return Response(twilio.reject_twiml(phrases.TECHNICAL_PROBLEM), media_type=XML)
        log.info("call.transfer", call_sid=call_sid, pii_number=record.transfer_to)
        await settle(store, call_sid, Outcome.TRANSFERRED_COLD, by="connect_action")
        return Response(twilio.dial_twiml(record.transfer_to), media_type=XML)
    if record.end_action == "hangup" or record.is_ended:
        return Response(twilio.hangup_twiml(), media_type=XML)
    if max(record.stream_count, streams_in_url) >= MAX_STREAMS:
        # Resuming keeps failing (a stream that dies at once, a flow that crashes): stop the
        # loop with an apology instead of reconnecting the caller forever.
        log.error("call.resume_limit", call_sid=call_sid, streams=record.stream_count)
        await settle(store, call_sid, Outcome.DROPPED, by="connect_action")
        return Response(twilio.reject_twiml(phrases.TECHNICAL_PROBLEM), media_type=XML)
    # The stream dropped without a decision to end: resume on a new stream (any instance).
    try:
        record = await expect_stream(store, call_sid)
    except CallAlreadyEnded:  # ended meanwhile (Twilio's status callback, the sweep)
        return Response(twilio.hangup_twiml(), media_type=XML)
    log.info("call.resume_requested", call_sid=call_sid, node=record.node)
    # The count the action URL carries may be ahead of a stale copy of the record (Redis
    # away, another instance carried the streams): keep it, or the resume limit never trips.
    call = replace(CallParams.of(record), streams=max(record.stream_count, streams_in_url))
    return await _stream_twiml(gateway, call)


async def _signed_form(request: Request, gateway: Gateway) -> dict[str, str] | None:
    return await signed_form(request, gateway.services.auth)


async def _stream_twiml(gateway: Gateway, call: CallParams) -> Response:
    xml = await gateway.services.connector.twiml(call)
    return Response(xml, media_type=XML)


async def _after_stream_without_record(
    gateway: Gateway, form: dict[str, str], query: Mapping[str, str]
) -> Response:
    """The ``<Connect action>`` on an instance with no record of the call, Redis unreachable.

    The caller hung up: hang up. Otherwise resume on a new stream; the instance that takes it
    resumes the call where it was if it holds the record, else starts the call's pinned flow
    again from its greeting (nothing of its progress is readable here). The stream count rides
    in the action URL, so the resume limit holds without the record too.
    """
    call_sid = form.get("CallSid", "")
    if form.get("CallStatus") == "completed" or not valid_call_sid(call_sid):
        return _twiml(twilio.hangup_twiml())
    streams = _int(query.get("streams", "")) + 1  # the stream that just ended
    if streams >= MAX_STREAMS:
        log.error("call.resume_limit", call_sid=call_sid, streams=streams)
        return _twiml(twilio.reject_twiml(phrases.TECHNICAL_PROBLEM))
    params = CallParams(
        call_sid=call_sid,
        from_number=form.get("From", ""),
        to_number=form.get("To", ""),
        flow_name=query.get("flow", ""),
        flow_version=query.get("version", ""),
        streams=streams,
    )
    return await _stream_twiml(gateway, params)


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0
