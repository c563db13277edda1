"""Outbound calls over HTTP: ``POST /calls`` (operators, admin token) and what Twilio asks of a
call we placed: the answer webhook (``/twilio/outbound``, then the same Media Streams path as an
inbound call) and the async AMD result (``/twilio/amd``). Twilio's requests must be signed. Its
call-status callback is every call's (``ivr.control.status_callbacks``): one nobody answered ends
there, as never connected."""

from __future__ import annotations

import asyncio
import json
from typing import Final

import structlog
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ivr import phrases
from ivr.console.auth import ConsoleAuth
from ivr.control.connect import CallParams
from ivr.control.endings import CallAlreadyEnded, expect_stream
from ivr.control.tokens import valid_call_sid
from ivr.control.webhook_auth import signed_form
from ivr.gateway import Gateway
from ivr.outbound.dialer import (
    AMD_PATH,
    ANSWER_PATH,
    Dialer,
    DialRefused,
    DialRequest,
)
from ivr.state.base import CallRecord, StoreError, mask
from ivr.telephony import twilio

log = structlog.get_logger("ivr.outbound")

XML: Final = "application/xml"
RECORD_WAIT_S: Final = 2.0
"""How long the answer webhook waits for the dial's record. The record is written the moment
Twilio returns the CallSid, seconds before a callee can pick up; this covers only a store
write that is slower than a ring."""
ANSWERED_BY: Final = frozenset(
    {
        "human",
        "machine_start",
        "machine_end_beep",
        "machine_end_silence",
        "machine_end_other",
        "fax",
        "unknown",
    }
)


def outbound_router(gateway: Gateway) -> APIRouter:
    router = APIRouter()
    settings = gateway.settings
    auth = ConsoleAuth(settings.admin_token or None, settings.admin_pii_token or None)
    dialer = Dialer(
        gateway.services.rest,
        gateway.store,
        gateway.flows.registry,
        public_url=settings.public_url,
        from_number=settings.outbound_from,
        machine_detection=settings.twilio_amd,
    )

    @router.post("/calls")
    async def create_call(request: Request) -> JSONResponse:
        if not auth.enabled:
            return _error(404, "outbound calls over HTTP are off: IVR_ADMIN_TOKEN is not set")
        if auth.bearer(request.headers.get("authorization", "")) is None:
            return _error(401, "missing or wrong admin token (Authorization: Bearer ...)")
        try:
            dial = DialRequest.model_validate(json.loads(await request.body() or b"null"))
        except ValueError as exc:  # JSONDecodeError and ValidationError are ValueErrors
            return _error(400, _bad_body(exc))
        try:
            placed = await dialer.dial(dial)
        except DialRefused as exc:
            return _error(exc.status, str(exc))
        body = {
            "call_sid": placed.call_sid,
            "status": "queued",
            "to": mask(dial.to),
            "flow": placed.flow,
            "flow_version": placed.flow_version,
        }
        return JSONResponse(body, status_code=201)

    @router.post(ANSWER_PATH)
    async def answered(request: Request) -> Response:
        form = await signed_form(request, gateway.services.auth)
        if form is None:
            return Response("invalid signature", status_code=403)
        return await _answer(gateway, form.get("CallSid", ""))

    @router.post(AMD_PATH)
    async def amd_result(request: Request) -> Response:
        form = await signed_form(request, gateway.services.auth)
        if form is None:
            return Response("invalid signature", status_code=403)
        call_sid, answered_by = form.get("CallSid", ""), form.get("AnsweredBy", "")
        if not valid_call_sid(call_sid) or answered_by not in ANSWERED_BY:
            return Response("CallSid or AnsweredBy missing or malformed", status_code=400)
        here = gateway.flows.answers.report(call_sid, answered_by)
        log.info("amd.twilio_result", call_sid=call_sid, answered_by=answered_by, here=here)
        await _store_twilio_result(gateway, call_sid, answered_by)
        return Response(status_code=200)

    return router


async def _answer(gateway: Gateway, call_sid: str) -> Response:
    """The callee picked up: connect the call's stream (its flow was pinned at dial time)."""
    if not valid_call_sid(call_sid):
        return Response("CallSid missing or malformed", status_code=400)
    record = await _dialled_record(gateway, call_sid)
    if record is None or record.direction != "outbound":
        log.error("outbound.unknown_call", call_sid=call_sid, found=record is not None)
        return Response(twilio.reject_twiml(phrases.TECHNICAL_PROBLEM), media_type=XML)
    if record.stream_count > 0 or record.is_ended:
        log.warning("webhook.replay_refused", call_sid=call_sid, streams=record.stream_count)
        return Response("this call already has a stream", status_code=409)
    if not gateway.admission.takes_new_call():
        log.warning("outbound.overflow", call_sid=call_sid)
        return Response(gateway.admission.overflow_twiml(), media_type=XML)
    try:  # it may have rung for a while: its wait for a stream starts now
        record = await expect_stream(gateway.store, call_sid)
    except CallAlreadyEnded:
        return Response(twilio.hangup_twiml(), media_type=XML)
    except StoreError as exc:
        log.warning("outbound.wait_not_restarted", call_sid=call_sid, error=str(exc))
    gateway.admission.reserve(call_sid)
    xml = await gateway.services.connector.twiml(CallParams.of(record))
    return Response(xml, media_type=XML)


async def _dialled_record(gateway: Gateway, call_sid: str) -> CallRecord | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECORD_WAIT_S
    while True:
        try:
            record = await gateway.store.get(call_sid)
        except StoreError as exc:
            log.error("outbound.record_unreadable", call_sid=call_sid, error=str(exc))
            return None
        if record is not None or loop.time() >= deadline:
            return record
        await asyncio.sleep(0.05)


async def _store_twilio_result(gateway: Gateway, call_sid: str, answered_by: str) -> None:
    """Keep Twilio's verdict in the record: the instance carrying the call reads it if the
    callback came before the stream, and the console shows it."""

    def save(record: CallRecord) -> None:
        record.twilio_answered_by = answered_by

    try:
        await gateway.store.update(call_sid, save)
    except StoreError as exc:  # not ours, expired, or the store is away: the call goes on
        log.warning("amd.twilio_result_not_stored", call_sid=call_sid, error=str(exc))


def _error(status: int, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _bad_body(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        ]
        return "invalid request body: " + "; ".join(problems)
    return f"request body is not JSON: {exc}"
