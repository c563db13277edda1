"""One Media Streams WebSocket, from handshake to teardown.

Call control admits the stream (``ivr.control.handshake``: signature, token) and, at the end,
takes how the call left it (``ivr.control.after_stream``) and any transfer or hang-up over REST
(``ivr.control.redirects``, ``ivr.control.warm``). In between four tasks share the call, all
owned here: the receive loop, the paced sender, the STT worker and the conversation (flow
runner). Whichever ends the call first (``stop``, a dropped socket, the flow hanging up) cancels
the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import structlog

from ivr.audio.endpointer import Endpointer
from ivr.call.live import LiveCall
from ivr.call.moves import MovedCallSession
from ivr.call.player import AudioPlayer
from ivr.call.services import CallServices
from ivr.call.session import CallEnd, CallSession, EndAction
from ivr.call.turns import CallStats
from ivr.callio.timeline import backchannel_spans
from ivr.control.after_stream import StreamEnd, StreamOutcome, record_stream_end
from ivr.control.connect import CallParams, record_from_start
from ivr.control.handshake import POLICY_VIOLATION, authorise_stream
from ivr.control.redirects import hang_up_without_store, store_degraded, transfer_by_rest
from ivr.control.summary import log_summary
from ivr.control.tokens import StreamClaims
from ivr.errors import ProtocolError
from ivr.obs import metrics
from ivr.recording.recorder import CallRecorder
from ivr.state.base import (
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    StoreUnavailable,
    StreamSuperseded,
)
from ivr.telephony import twilio
from ivr.telephony.media_socket import MediaSocket
from ivr.telephony.twilio import Dtmf, Mark, Media, Start, Stop, Unknown

log = structlog.get_logger("ivr.stream")

START_TIMEOUT = 10.0


@dataclass(slots=True)
class _Outcome:
    started: float
    """Monotonic time the stream started."""
    reason: StreamOutcome = StreamOutcome.DISCONNECT
    end: CallEnd | None = None
    session: CallSession | None = None
    redirected: bool = False
    """Twilio took the call over through a REST update (transfer): our part of it is over."""
    held: bool = False
    """The redirect put the caller on a warm transfer's hold: the call may come back, so the
    record stays open (the transfer's callbacks end it)."""
    live: LiveCall | None = None
    rebuilt: bool = False
    """The record was rebuilt from ``start``: no other instance can read how the call ends."""
    recorder: CallRecorder | None = None
    """Records this stream (the call's record asks for it and a sink is configured)."""

    @property
    def stats(self) -> CallStats | None:
        return self.session.stats if self.session is not None else None

    def stream_end(self) -> StreamEnd:
        """How the call left this stream, for the record (the stream's unsaved turns and
        timeline events are handed over: each once)."""
        session, end = self.session, self.end
        return StreamEnd(
            reason=self.reason,
            action=end.action.value if end is not None else None,
            number=end.number if end is not None else "",
            held=self.held,
            redirected=self.redirected,
            turns=session.unsaved_turns() if session is not None else [],
            events=session.timeline.drain() if session is not None else [],
            stats=self.stats,
            started=self.started,
        )


@dataclass(slots=True)
class _CallTasks:
    receive: asyncio.Task[StreamOutcome]
    conversation: asyncio.Task[None]
    workers: tuple[asyncio.Task[None], ...]

    @property
    def all(self) -> set[asyncio.Task[Any]]:
        return {self.receive, self.conversation, *self.workers}


async def handle_stream(ws: MediaSocket, token: str, services: CallServices) -> None:
    claims = await authorise_stream(
        ws,
        token,
        auth=services.auth,
        tokens=services.tokens,
        store=services.store,
        draining=services.live.draining,
    )
    if claims is not None:
        await serve_stream(ws, claims, services)


async def serve_stream(ws: MediaSocket, claims: StreamClaims, services: CallServices) -> None:
    """Accept an authorised stream and carry its call until the socket or the call ends."""
    with services.live.socket_open():  # a drain waits for the close, not just the session
        await ws.accept()
        await _serve_accepted(ws, claims.call_sid, claims.planned, services)


async def _serve_accepted(
    ws: MediaSocket, call_sid: str, planned: bool, services: CallServices
) -> None:
    try:
        start = await asyncio.wait_for(_wait_for_start(ws), START_TIMEOUT)
    except (TimeoutError, ProtocolError) as exc:
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
        outcome = _Outcome(started=time.monotonic())
        try:
            await _run_call(ws, start, services, outcome, planned)
        finally:
            _save_recording(services, outcome)
            metrics.ACTIVE_CALLS.dec()
            metrics.STREAMS.labels(outcome.reason.value).inc()
            record, settled = await _finish(services, start, outcome)
            await _close(ws, 1000)
            if not settled:  # the call goes on (resumes), or was ended elsewhere first
                log_summary(
                    record,
                    outcome.stats,
                    outcome=outcome.reason.value,
                    final=False,
                    started=outcome.started,
                )


async def _wait_for_start(ws: MediaSocket) -> Start:
    while True:
        raw = await ws.receive()
        if raw is None:
            raise ProtocolError("closed_before_start")
        message = twilio.parse_message(raw)
        if isinstance(message, Start):
            return message
        if isinstance(message, Stop):
            raise ProtocolError("stop_before_start")


def _new_player(
    ws: MediaSocket, start: Start, services: CallServices, outcome: _Outcome
) -> AudioPlayer:
    started = time.monotonic()

    def first_media(sent_at: float) -> None:
        metrics.FIRST_AUDIO.observe(sent_at - started)
        log.info("call.first_audio", seconds=round(sent_at - started, 4))

    send = ws.send_text  # only the player sends, under its own lock
    sid = start.stream_sid

    async def send_media(ulaw: bytes) -> None:
        await send(twilio.media_message(sid, ulaw))
        if outcome.recorder is not None:  # heard from now, or after what Twilio has queued
            outcome.recorder.bot_audio(ulaw)

    async def send_clear() -> None:
        if outcome.recorder is not None:  # what Twilio has not played yet is never heard
            outcome.recorder.bot_cleared()
        await send(twilio.clear_message(sid))

    return AudioPlayer(
        send_media=send_media,
        send_mark=lambda name: send(twilio.mark_message(sid, name)),
        send_clear=send_clear,
        lead_seconds=services.playout_lead,
        refill_seconds=services.playout_refill,
        on_first_media=first_media,
    )


async def _run_call(
    ws: MediaSocket, start: Start, services: CallServices, outcome: _Outcome, planned: bool
) -> None:
    player = _new_player(ws, start, services, outcome)
    record, rebuilt = await _attach(services, start, planned)
    outcome.rebuilt = rebuilt
    outcome.recorder = _recorder_for(services, record, start)
    endpointer = services.new_endpointer()
    # A planned move skips what the flow says before it listens again; not on a rebuilt
    # record, whose flow starts from its greeting.
    moved = planned and not rebuilt and bool(record.flow_state)
    session = _new_session(services, player, endpointer, outcome, moved=moved)
    session.recall_backchannels(backchannel_spans(record.timeline))
    outcome.session = session
    live = LiveCall(CallParams.of(record), start.stream_sid, session, lambda: _close(ws, 1000))
    outcome.live = live
    log.info(
        "call.stream_started", resumed=record.stream_count > 1, planned=planned, rebuilt=rebuilt
    )
    tasks = _CallTasks(
        receive=asyncio.create_task(_receive(ws, session, outcome.recorder), name="receive"),
        conversation=asyncio.create_task(
            services.conversation.run(session, record), name="conversation"
        ),
        workers=(
            asyncio.create_task(player.run_sender(), name="sender"),
            asyncio.create_task(session.run_stt(), name="stt"),
        ),
    )
    services.live.add(live)
    try:
        await _until_first_ends(tasks, services, start, outcome)
    finally:
        for task in tasks.all:
            task.cancel()
        await asyncio.gather(*tasks.all, return_exceptions=True)
        await session.aclose()
        endpointer.close()
        services.live.remove(live)
    if outcome.reason in (StreamOutcome.STOP, StreamOutcome.DISCONNECT):
        session.on_hangup()


def _new_session(
    services: CallServices,
    player: AudioPlayer,
    endpointer: Endpointer,
    outcome: _Outcome,
    *,
    moved: bool,
) -> CallSession:
    def on_end(end: CallEnd) -> None:
        outcome.end = end

    kind = MovedCallSession if moved else CallSession
    return kind(
        player=player,
        endpointer=endpointer,
        stt=services.stt,
        tts=services.tts,
        prompts=services.prompts,
        on_end=on_end,
        llm_name=services.llm_name,
        heard_within=services.heard_within,
        turn_model=services.turn_model,
        streaming_stt=services.streaming_stt,
        backlog=services.live.backlog,
        on_speech_start=services.preconnect,
    )


async def _until_first_ends(
    tasks: _CallTasks, services: CallServices, start: Start, outcome: _Outcome
) -> None:
    done, _ = await asyncio.wait(tasks.all, return_when=asyncio.FIRST_COMPLETED)
    # The caller hanging up outranks whatever else finished in the same wake-up.
    finished = tasks.receive if tasks.receive in done else done.pop()
    _record_outcome(outcome, finished, tasks.conversation)
    moving = outcome.live is not None and outcome.live.moving
    if moving and outcome.reason in (StreamOutcome.STOP, StreamOutcome.DISCONNECT):
        outcome.reason = StreamOutcome.MOVED  # the drain redirected the call to a new stream
        return
    end = outcome.end
    if finished is tasks.conversation and end is not None and end.action == EndAction.TRANSFER:
        if end.warm is not None and services.warm is not None:
            outcome.held = await services.warm.hold(
                start.call_sid, end.number, end.warm, tasks.receive
            )
            outcome.redirected = outcome.held
        else:
            if end.warm is not None:
                log.warning("call.warm_transfer_made_cold", reason="no Twilio REST credentials")
            # One REST client per gateway: transfers reuse its connection.
            outcome.redirected = await transfer_by_rest(
                services.rest, services.store, start.call_sid, end.number, tasks.receive
            )
        if not outcome.redirected and _ended_by_stop(tasks.receive):
            outcome.reason = StreamOutcome.STOP  # the caller hung up during the handoff
    elif (
        finished is tasks.conversation
        and outcome.reason == StreamOutcome.HANGUP
        and (outcome.rebuilt or store_degraded(services.store))
    ):
        await hang_up_without_store(services.rest, start.call_sid, tasks.receive)


def _ended_by_stop(receive: asyncio.Task[StreamOutcome]) -> bool:
    if not receive.done() or receive.cancelled() or receive.exception() is not None:
        return False
    return receive.result() == StreamOutcome.STOP


def _record_outcome(
    outcome: _Outcome, finished: asyncio.Task[Any], conversation: asyncio.Task[None]
) -> None:
    """Why the call left this stream, from the task that ended first."""
    error = None if finished.cancelled() else finished.exception()
    if isinstance(error, StreamSuperseded):
        outcome.reason = StreamOutcome.SUPERSEDED
        log.warning("call.stream_superseded", detail=str(error))
    elif finished is conversation:
        if error is not None:
            log.error("call.flow_failed", exc_info=error)
        # The flow ended (hung up, transferred, failed or simply ran out): never resume it, or
        # Twilio's <Connect action> request would start it again and again.
        outcome.end = outcome.end or CallEnd(EndAction.HANGUP)
        outcome.reason = StreamOutcome.ERROR if error is not None else _ended_by(outcome.end)
    elif error is not None:
        # The socket broke under the receive loop or the sender: like a drop, resumable.
        log.warning("call.stream_failed", task=finished.get_name(), error=repr(error))
        outcome.reason = StreamOutcome.DISCONNECT
    else:
        outcome.reason = finished.result() or StreamOutcome.DISCONNECT


def _ended_by(end: CallEnd) -> StreamOutcome:
    return StreamOutcome.TRANSFER if end.action == EndAction.TRANSFER else StreamOutcome.HANGUP


async def _receive(
    ws: MediaSocket, session: CallSession, recorder: CallRecorder | None
) -> StreamOutcome:
    """Dispatch Twilio's messages until ``stop`` or the socket closes; never raise on bad input."""
    last_sequence = 0
    reported: set[str] = set()
    while True:
        raw = await ws.receive()
        if raw is None:
            return StreamOutcome.DISCONNECT
        try:
            message = twilio.parse_message(raw)
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
            if recorder is not None:
                recorder.caller_audio(message.payload, message.timestamp_ms / 1000)
            await session.on_media(message.payload, message.timestamp_ms / 1000)
        elif isinstance(message, Dtmf):
            await session.on_dtmf(message.digit)
        elif isinstance(message, Mark):
            session.on_mark(message.name)
        elif isinstance(message, Stop):
            return StreamOutcome.STOP
        elif isinstance(message, Unknown):
            metrics.UNKNOWN_EVENTS.inc()


def _recorder_for(services: CallServices, record: CallRecord, start: Start) -> CallRecorder | None:
    """A recorder when the call's record asks for one (its flow decided at webhook time)."""
    if not record.record_call:
        return None
    if services.recordings is None:
        log.warning("recording.no_sink", detail="the flow records calls but neither "
                    "IVR_RECORDING_DIR nor IVR_RECORDING_S3_BUCKET is set")  # fmt: skip
        return None
    return services.recordings.begin(start.call_sid, start.stream_sid)


def _save_recording(services: CallServices, outcome: _Outcome) -> None:
    """Hand the stream's recording over to be saved in the background; never fails the call."""
    if outcome.recorder is None or services.recordings is None:
        return
    try:
        services.recordings.finish(outcome.recorder)
    except Exception as exc:  # a bug in the recorder must not skip the call's teardown
        log.error("recording.finish_failed", error=repr(exc))


async def _attach(services: CallServices, start: Start, planned: bool) -> tuple[CallRecord, bool]:
    """Mark the call as carried by this instance on this stream (a resume bumps stream_count,
    a planned move does not). Returns the record and whether it had to be rebuilt from
    ``start`` because the store has none this instance can read (Redis unreachable)."""

    def attach(record: CallRecord) -> None:
        record.stream_sid = start.stream_sid
        record.account_sid = start.account_sid or record.account_sid
        record.status = CallStatus.ACTIVE
        record.instance_id = services.instance_id
        if not planned:
            record.stream_count += 1

    store = services.store
    try:
        return await store.update(start.call_sid, attach), False
    except (StoreUnavailable, CallNotFound) as exc:
        # The token was signed for this CallSid by one of us: the call is real, carry it.
        log.warning("call.record_rebuilt", reason=str(exc))
    with contextlib.suppress(CallExists):  # created meanwhile (a racing write-back): use it
        await store.create(record_from_start(start, services.instance_id))
    return await store.update(start.call_sid, attach), True


async def _close(ws: MediaSocket, code: int) -> None:
    if ws.connected:
        with contextlib.suppress(Exception):
            await ws.close(code)


async def _finish(
    services: CallServices, start: Start, outcome: _Outcome
) -> tuple[CallRecord | None, bool]:
    """Hand how the call left this stream to call control (``ivr.control.after_stream``): the
    record as stored (None if not), and whether this stream settled the call's ending."""
    if outcome.reason == StreamOutcome.SUPERSEDED:
        return None, False  # a newer stream owns the record now
    end = outcome.stream_end()
    return await record_stream_end(services.store, start.call_sid, start.stream_sid, end)
