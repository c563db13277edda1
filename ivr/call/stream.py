"""One Media Streams WebSocket, from handshake to teardown.

The handshake is refused (close 1008, which Twilio sees as a 403) unless the signature over the
``wss://`` URL is valid and the per-call token in the path was minted by a webhook for the same
CallSid that ``start`` names. Then four tasks share the call, all owned here: the receive loop,
the paced sender, the STT worker and the conversation (flow runner). Whichever ends the call
first (``stop``, a dropped socket, the flow hanging up) cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ivr.audio.endpointer import EndpointConfig, Endpointer
from ivr.audio.gated_vad import GatedSileroVad, shared_pool
from ivr.audio.vad import WebRtcVad
from ivr.call.player import AudioPlayer
from ivr.call.session import CallEnd, CallSession
from ivr.errors import ProtocolError
from ivr.gateway import Gateway
from ivr.obs import metrics
from ivr.state.base import CallRecord, CallStatus, StreamSuperseded, fenced
from ivr.telephony import twilio
from ivr.telephony.twilio import Dtmf, Mark, Media, Start, Stop, Unknown

log = structlog.get_logger("ivr.stream")

START_TIMEOUT = 10.0
# After a REST redirect Twilio sends `stop` within moments; past this we close the WS ourselves.
REDIRECT_STOP_TIMEOUT = 5.0
POLICY_VIOLATION = 1008


@dataclass(slots=True)
class _Outcome:
    reason: str = "disconnect"  # "stop" | "disconnect" | "hangup" | "transfer" | "error"
    end: CallEnd | None = None
    session: CallSession | None = None
    redirected: bool = False
    """Twilio took the call over through a REST update (transfer): our part of it is over."""


async def handle_stream(ws: WebSocket, token: str, gateway: Gateway) -> None:
    call_sid = await _authorise(ws, token, gateway)
    if call_sid is None:
        return
    await ws.accept()
    try:
        start = await asyncio.wait_for(_wait_for_start(ws), START_TIMEOUT)
    except (TimeoutError, WebSocketDisconnect, ProtocolError) as exc:
        log.warning("stream.no_start", error=repr(exc))
        await _close(ws, POLICY_VIOLATION)
        return
    if start.call_sid != call_sid:
        log.warning(
            "stream.callsid_mismatch", token_call_sid=call_sid, start_call_sid=start.call_sid
        )
        metrics.PROTOCOL_ERRORS.labels("callsid_mismatch").inc()
        await _close(ws, POLICY_VIOLATION)
        return
    with structlog.contextvars.bound_contextvars(
        call_sid=start.call_sid, stream_sid=start.stream_sid
    ):
        metrics.ACTIVE_CALLS.inc()
        outcome = _Outcome()
        try:
            await _run_call(ws, start, gateway, outcome)
        finally:
            metrics.ACTIVE_CALLS.dec()
            metrics.CALLS.labels(outcome.reason).inc()
            await _finish(gateway, start, outcome)
            await _close(ws, 1000)
            log.info("call.stream_ended", outcome=outcome.reason)


async def _authorise(ws: WebSocket, token: str, gateway: Gateway) -> str | None:
    if gateway.signatures is not None:
        signature = ws.headers.get("x-twilio-signature", "")
        if not gateway.signatures.check_stream(ws.url.path, signature):
            log.warning("stream.bad_signature", url=gateway.signatures.stream_url(ws.url.path))
            metrics.PROTOCOL_ERRORS.labels("bad_signature").inc()
            await ws.close(POLICY_VIOLATION)
            return None
    elif not gateway.accepts_unsigned:
        await ws.close(POLICY_VIOLATION)
        return None
    call_sid = await gateway.store.redeem_stream_token(token)
    if call_sid is None:
        log.warning("stream.unknown_token")
        metrics.PROTOCOL_ERRORS.labels("bad_token").inc()
        await ws.close(POLICY_VIOLATION)
    return call_sid


async def _wait_for_start(ws: WebSocket) -> Start:
    while True:
        raw = await ws.receive()
        if raw["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(raw.get("code", 1000))
        message = twilio.parse_message(raw.get("text") or raw.get("bytes") or b"")
        if isinstance(message, Start):
            return message
        if isinstance(message, Stop):
            raise ProtocolError("stop_before_start")


async def _run_call(ws: WebSocket, start: Start, gateway: Gateway, outcome: _Outcome) -> None:
    started = time.monotonic()
    record = await _attach(gateway, start)

    def first_media(sent_at: float) -> None:
        metrics.FIRST_AUDIO.observe(sent_at - started)
        log.info("call.first_audio", seconds=round(sent_at - started, 4))

    send = ws.send_text  # only the player sends, under its own lock
    player = AudioPlayer(
        send_media=lambda ulaw: send(twilio.media_message(start.stream_sid, ulaw)),
        send_mark=lambda name: send(twilio.mark_message(start.stream_sid, name)),
        send_clear=lambda: send(twilio.clear_message(start.stream_sid)),
        lead_seconds=gateway.settings.playout_lead_ms / 1000,
        on_first_media=first_media,
    )
    settings = gateway.settings
    vad = (
        GatedSileroVad(shared_pool(settings.silero_threshold))
        if settings.vad == "silero"
        else WebRtcVad(settings.vad_mode)
    )
    endpointer = Endpointer(
        vad,
        EndpointConfig(
            silence_ms=settings.endpoint_silence_ms, min_speech_ms=settings.min_speech_ms
        ),
    )

    def on_end(end: CallEnd) -> None:
        outcome.end = end

    session = CallSession(
        player=player,
        endpointer=endpointer,
        stt=gateway.stt,
        tts=gateway.tts,
        prompts=gateway.prompts,
        on_end=on_end,
        llm_name=gateway.llm.name,
    )
    log.info("call.stream_started", resumed=record.stream_count > 1)
    receive = asyncio.create_task(_receive(ws, session), name="receive")
    tasks = {
        receive,
        asyncio.create_task(player.run_sender(), name="sender"),
        asyncio.create_task(session.run_stt(), name="stt"),
    }
    conversation = (
        asyncio.create_task(gateway.conversation(session, record), name="conversation")
        if gateway.conversation is not None
        else None
    )
    if conversation is not None:
        tasks.add(conversation)
    outcome.session = session
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        # The caller hanging up outranks whatever else finished in the same wake-up.
        finished = receive if receive in done else done.pop()
        _record_outcome(outcome, finished, conversation)
        if finished is conversation and outcome.end and outcome.end.action == "transfer":
            outcome.redirected = await _transfer_by_rest(
                gateway, start.call_sid, outcome.end, receive
            )
            if not outcome.redirected and _ended_by_stop(receive):
                outcome.reason = "stop"  # the caller hung up during the handoff
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(vad, GatedSileroVad):
            vad.close()
    if outcome.reason in ("stop", "disconnect"):
        session.on_hangup()


def _ended_by_stop(receive: asyncio.Task[str]) -> bool:
    if not receive.done() or receive.cancelled() or receive.exception() is not None:
        return False
    return receive.result() == "stop"


def _record_outcome(
    outcome: _Outcome, finished: asyncio.Task[Any], conversation: asyncio.Task[None] | None
) -> None:
    """Why the call left this stream, from the task that ended first."""
    error = None if finished.cancelled() else finished.exception()
    if isinstance(error, StreamSuperseded):
        outcome.reason = "superseded"
        log.warning("call.stream_superseded", detail=str(error))
    elif finished is conversation:
        if error is not None:
            log.error("call.flow_failed", exc_info=error)
        # The flow ended (hung up, transferred, failed or simply ran out): never resume it, or
        # Twilio's <Connect action> request would start it again and again.
        outcome.end = outcome.end or CallEnd("hangup")
        outcome.reason = "error" if error is not None else outcome.end.action
    elif error is not None:
        # The socket broke under the receive loop or the sender: like a drop, resumable.
        log.warning("call.stream_failed", task=finished.get_name(), error=repr(error))
        outcome.reason = "disconnect"
    else:
        outcome.reason = finished.result() or "disconnect"


async def _transfer_by_rest(
    gateway: Gateway, call_sid: str, end: CallEnd, receive: asyncio.Task[str]
) -> bool:
    """Redirect the call to ``<Dial>`` over REST; on failure the WS is closed as before.

    The decision is stored first, so a ``<Connect action>`` request (REST failed, or raced it)
    answers ``<Dial>`` too. After a redirect Twilio ends the stream with ``stop``: that is the
    transfer completing, not the caller hanging up, so wait for it (bounded) without acting on it.
    """
    rest = gateway.rest  # one client per gateway: transfers reuse its connection
    if rest is None:
        return False

    def decide(record: CallRecord) -> None:
        record.end_action, record.transfer_to = end.action, end.number
        record.status = CallStatus.TRANSFERRING

    try:
        await gateway.store.update(call_sid, decide)
    except Exception as exc:  # without the stored decision the action path can't Dial either
        log.error("call.transfer_store_failed", error=repr(exc))
    redirected = await rest.redirect(call_sid, twilio.dial_twiml(end.number))
    if redirected:
        log.info("call.transfer_redirected", pii_number=end.number)
        await asyncio.wait({receive}, timeout=REDIRECT_STOP_TIMEOUT)
    else:
        log.warning("call.transfer_rest_failed", fallback="connect_action")
    return redirected


async def _receive(ws: WebSocket, session: CallSession) -> str:
    """Dispatch Twilio's messages until ``stop`` or the socket closes; never raise on bad input."""
    last_sequence = 0
    reported: set[str] = set()
    while True:
        raw = await ws.receive()
        if raw["type"] == "websocket.disconnect":
            return "disconnect"
        text = raw.get("text")
        try:
            message = twilio.parse_message(text if text is not None else raw.get("bytes") or b"")
        except ProtocolError as exc:
            metrics.PROTOCOL_ERRORS.labels(exc.reason).inc()
            if exc.reason not in reported:  # one log line per kind per call, not 50 a second
                reported.add(exc.reason)
                log.warning("stream.bad_message", reason=exc.reason, detail=str(exc)[:200])
            continue
        sequence = getattr(message, "sequence", 0)
        if sequence and last_sequence and sequence > last_sequence + 1:
            metrics.PROTOCOL_ERRORS.labels("sequence_gap").inc()
        last_sequence = max(last_sequence, sequence)
        if isinstance(message, Media):
            await session.on_media(message.payload, message.timestamp_ms / 1000)
        elif isinstance(message, Dtmf):
            await session.on_dtmf(message.digit)
        elif isinstance(message, Mark):
            session.on_mark(message.name)
        elif isinstance(message, Stop):
            return "stop"
        elif isinstance(message, Unknown):
            metrics.UNKNOWN_EVENTS.inc()


async def _attach(gateway: Gateway, start: Start) -> CallRecord:
    """Mark the call as carried by this instance on this stream (a resume bumps stream_count)."""

    def attach(record: CallRecord) -> None:
        record.stream_sid = start.stream_sid
        record.account_sid = start.account_sid or record.account_sid
        record.status = CallStatus.ACTIVE
        record.instance_id = gateway.instance_id
        record.stream_count += 1

    return await gateway.store.update(start.call_sid, attach)


async def _finish(gateway: Gateway, start: Start, outcome: _Outcome) -> None:
    if outcome.reason == "superseded":
        return  # a newer stream owns the record now
    call_sid = start.call_sid
    end = outcome.end
    turns = outcome.session.unsaved_turns() if outcome.session is not None else []

    def mark(record: CallRecord) -> None:
        for turn in turns:
            record.add_turn(turn)
        if end is not None:
            record.end_action = end.action
            record.transfer_to = end.number
            record.status = (
                CallStatus.TRANSFERRING if end.action == "transfer" else CallStatus.ENDED
            )
        elif outcome.reason == "disconnect":
            # No `stop`: the socket dropped. Twilio will fetch the <Connect action> URL and
            # any instance can resume the call from the store.
            record.status = CallStatus.RECONNECTING

    try:
        await gateway.store.update(call_sid, fenced(start.stream_sid, mark))
        if outcome.redirected:  # no action request follows a REST redirect: end the record here
            await gateway.store.end(call_sid, CallStatus.TRANSFERRING)
        elif outcome.reason == "stop" or (end is not None and end.action == "hangup"):
            await gateway.store.end(call_sid, CallStatus.ENDED)
    except StreamSuperseded:
        log.info("call.finish_skipped", reason="a newer stream carries the call")
    except Exception as exc:  # the call is over either way; never fail teardown
        log.error("call.finish_failed", error=repr(exc))


async def _close(ws: WebSocket, code: int) -> None:
    if ws.application_state == WebSocketState.CONNECTED:
        with contextlib.suppress(Exception):
            await ws.close(code)
