"""HTTP and WebSocket routes. Thin: each hands off to the module that owns the work."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request, Response, WebSocket
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ivr.call.stream import handle_stream
from ivr.gateway import Gateway
from ivr.obs import metrics
from ivr.state.admin import admin_router
from ivr.state.base import CallExists, CallRecord, CallStatus, StoreError
from ivr.telephony import twilio

log = structlog.get_logger("ivr.app")

STREAM_TOKEN_TTL = 300.0
NOT_IN_SERVICE = "Sorry, this number is not in service."
TECHNICAL_PROBLEM = "Sorry, we are having technical problems. Please call back later."
MAX_STREAMS = 4  # the first stream plus three resumes
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

    app = FastAPI(title="ivr", lifespan=lifespan)
    app.state.gateway = gateway

    @app.post("/twilio/voice")
    async def voice(request: Request) -> Response:
        form = await _signed_form(request, gateway)
        if form is None:
            metrics.WEBHOOKS.labels("forbidden").inc()
            return Response("invalid signature", status_code=403)
        call_sid = form.get("CallSid", "")
        if not call_sid:
            metrics.WEBHOOKS.labels("bad_request").inc()
            return Response("CallSid missing", status_code=400)
        record = CallRecord(
            call_sid=call_sid,
            account_sid=form.get("AccountSid", ""),
            from_number=form.get("From", ""),
            to_number=form.get("To", ""),
        )
        if gateway.pin_flow is not None:
            try:
                await gateway.pin_flow(record)
            except LookupError as exc:
                log.error("webhook.no_flow", error=str(exc), pii_to=record.to_number)
                metrics.WEBHOOKS.labels("no_flow").inc()
                return Response(twilio.reject_twiml(NOT_IN_SERVICE), media_type=XML)
        try:
            await gateway.store.create(record)
        except CallExists:
            log.info("webhook.repeat", call_sid=call_sid)  # Twilio retried: same call, new token
        metrics.WEBHOOKS.labels("accepted").inc()
        return await _stream_twiml(gateway, record)

    @app.post("/twilio/after-stream")
    async def after_stream(request: Request) -> Response:
        form = await _signed_form(request, gateway)
        if form is None:
            return Response("invalid signature", status_code=403)
        call_sid = form.get("CallSid", "")
        try:
            return await _after_stream(gateway, call_sid, form.get("CallStatus", ""))
        except StoreError as exc:
            # Without the record we cannot resume or transfer; say so rather than fail with 500.
            log.error("call.after_stream_failed", call_sid=call_sid, error=str(exc))
            return Response(twilio.reject_twiml(TECHNICAL_PROBLEM), media_type=XML)

    @app.websocket("/twilio/stream/{token}")
    async def stream(ws: WebSocket, token: str) -> None:
        await handle_stream(ws, token, gateway)

    app.include_router(admin_router(gateway.store, gateway.settings.admin_token or None))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "instance": gateway.instance_id}

    @app.get("/readyz")
    async def readyz() -> Response:
        ok = await gateway.store.ping()
        return Response("ready" if ok else "store unavailable", status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _after_stream(gateway: Gateway, call_sid: str, call_status: str) -> Response:
    """Twilio asks what to do now that the stream is over: <Dial>, <Hangup/> or a new stream."""
    record = await gateway.store.get(call_sid) if call_sid else None
    if record is None:
        return Response(twilio.hangup_twiml(), media_type=XML)
    if call_status == "completed":  # the caller is gone: a missed `stop` must not leave it live
        if not record.is_ended:
            await gateway.store.end(call_sid, CallStatus.ENDED)
        return Response(twilio.hangup_twiml(), media_type=XML)
    if record.end_action == "transfer" and record.transfer_to:
        if not twilio.E164.fullmatch(record.transfer_to):  # never dial what a flow did not validate
            log.error(
                "call.transfer_invalid_number", call_sid=call_sid, pii_number=record.transfer_to
            )
            await gateway.store.end(call_sid, CallStatus.ENDED)
            return Response(twilio.reject_twiml(TECHNICAL_PROBLEM), media_type=XML)
        log.info("call.transfer", call_sid=call_sid, pii_number=record.transfer_to)
        await gateway.store.end(call_sid, CallStatus.ENDED)
        return Response(twilio.dial_twiml(record.transfer_to), media_type=XML)
    if record.end_action == "hangup" or record.is_ended:
        return Response(twilio.hangup_twiml(), media_type=XML)
    if record.stream_count >= MAX_STREAMS:
        # Resuming keeps failing (a stream that dies at once, a flow that crashes): stop the
        # loop with an apology instead of reconnecting the caller forever.
        log.error("call.resume_limit", call_sid=call_sid, streams=record.stream_count)
        await gateway.store.end(call_sid, CallStatus.ENDED)
        return Response(twilio.reject_twiml(TECHNICAL_PROBLEM), media_type=XML)
    # The stream dropped without a decision to end: resume on a new stream (any instance).
    log.info("call.resume_requested", call_sid=call_sid, node=record.node)
    return await _stream_twiml(gateway, record)


async def _signed_form(request: Request, gateway: Gateway) -> dict[str, str] | None:
    form = {k: str(v) for k, v in (await request.form()).items()}
    if gateway.signatures is None:
        return form if gateway.accepts_unsigned else None
    signature = request.headers.get("x-twilio-signature", "")
    if gateway.signatures.check_webhook(request.url.path, request.url.query, form, signature):
        return form
    log.warning(
        "webhook.bad_signature",
        url=gateway.signatures.webhook_url(request.url.path, request.url.query),
        hint="IVR_PUBLIC_URL must be exactly the URL configured at Twilio",
    )
    return None


async def _stream_twiml(gateway: Gateway, record: CallRecord) -> Response:
    token = secrets.token_urlsafe(24)
    await gateway.store.put_stream_token(record.call_sid, token, STREAM_TOKEN_TTL)
    settings = gateway.settings
    xml = twilio.connect_stream_twiml(
        stream_url=f"{settings.public_ws_base}/twilio/stream/{token}",
        action_url=f"{settings.public_url}/twilio/after-stream",
        parameters={
            "CallSid": record.call_sid,
            "From": record.from_number,
            "To": record.to_number,
        },
    )
    return Response(xml, media_type=XML)
