"""The simulated caller: Twilio's voice webhook plus its Media Streams server, driven by a script.

``place_call`` does what Twilio does for one inbound call: signed voice webhook, ``<Connect>
<Stream>`` over WebSocket (signed handshake, ``connected``/``start``/real-time ``media``/``dtmf``/
``mark`` echoes/``stop``), then the signed ``<Connect action>`` request when the gateway closes
the stream, following a new ``<Connect><Stream>`` if that is what comes back. The Twilio side is
written from the protocol reference, not from the gateway's parser, so each checks the other.

All times in the report are seconds since the call was placed. The report types live in
``ivr.sim.report``, the HTTP side in ``ivr.sim.webhook``, the command line in ``ivr.sim.cli``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np
import soxr
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ivr.sim.callbacks import TwilioCallbacks
from ivr.sim.echo import LineEcho, LineFrame, LineRecord
from ivr.sim.playout import (
    FRAME_BYTES,
    SAMPLE_RATE,
    ULAW_SILENCE,
    LinkDelay,
    Segment,
    TwilioPlayout,
    Violation,
    render_track,
    ulaw_decode,
    ulaw_encode,
    write_wav,
)
from ivr.sim.report import CallReport, StreamReport, TurnReport
from ivr.sim.rest_api import CallUpdate, ConferenceHost, FakeTwilioRestApi
from ivr.sim.script import (
    BargeIn,
    Hangup,
    Press,
    Rendered,
    Say,
    Script,
    Silence,
    Synthesize,
    Wav,
    render_script,
    script_from_data,
)
from ivr.sim.webhook import (
    CallFailed,
    CallIds,
    StreamTwiml,
    TwilioSide,
    parse_stream,
    rebase,
)

Transcriber = Callable[[bytes], Awaitable[str]]
"""PCM16 mono 16 kHz -> text; used only to print what the bot said."""

_FRAME_S = FRAME_BYTES / SAMPLE_RATE
_POLL_S = 0.02


# -- the caller's microphone ----------------------------------------------------------------------


class _Mic:
    """Caller audio waiting to go out, 20 ms per frame; silence (or faint noise) otherwise."""

    def __init__(self, comfort_noise: bool) -> None:
        self._buf = bytearray()
        self._queued = 0
        self._taken = 0
        self._waiters: list[tuple[int, asyncio.Future[float]]] = []
        self._noise = _noise_frames() if comfort_noise else []
        self._noise_i = 0

    def queue(self, audio: bytes) -> asyncio.Future[float]:
        """Queue whole frames; the future gets the send time of the last one."""
        self._buf += audio
        self._queued += len(audio)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters.append((self._queued, fut))
        return fut

    def take(self) -> tuple[bytes, bool]:
        if self._buf:
            frame = bytes(self._buf[:FRAME_BYTES])
            del self._buf[:FRAME_BYTES]
            self._taken += len(frame)
            return frame, True
        if self._noise:
            self._noise_i = (self._noise_i + 1) % len(self._noise)
            return self._noise[self._noise_i], False
        return bytes([ULAW_SILENCE]) * FRAME_BYTES, False

    def sent(self, t: float) -> None:
        while self._waiters and self._waiters[0][0] <= self._taken:
            _, fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(t)


def _noise_frames() -> list[bytes]:
    # About -66 dBFS: present on the line like a real handset, far below any VAD threshold.
    rng = np.random.default_rng(7)
    pcm = (rng.normal(0, 16, 50 * FRAME_BYTES)).astype("<i2").tobytes()
    ulaw = ulaw_encode(pcm)
    return [ulaw[i : i + FRAME_BYTES] for i in range(0, len(ulaw), FRAME_BYTES)]


# -- one call, across streams ---------------------------------------------------------------------


@dataclass(slots=True)
class _CallerTurn:
    text: str | None
    start_t: float
    end_t: float


class _Line:
    """State shared by the script runner and whichever stream is connected."""

    def __init__(
        self,
        t0: float,
        comfort_noise: bool,
        echo: LineEcho | None = None,
        streaming: asyncio.Event | None = None,
        *,
        frame_clock: bool = False,
        record: LineRecord | None = None,
        link: LinkDelay | None = None,
    ) -> None:
        self.t0 = t0
        self.streaming = streaming or asyncio.Event()
        """Set once the first stream starts: the caller's audio is on its way."""
        self.echo = echo
        self.frame_clock = frame_clock
        """Twilio plays the bot on its 20 ms frame clock (see ``TwilioPlayout``)."""
        self.record = record
        """When set, every frame the line sends is kept here, with its parts."""
        self.link = link
        """When set, the gateway's messages reach the playout this much later."""
        self.mic = _Mic(comfort_noise)
        self.playouts: list[TwilioPlayout] = []
        self.caller_track: list[Segment] = []
        self.caller_turns: list[_CallerTurn] = []
        self.session: _Session | None = None
        self.session_changed = asyncio.Event()
        self.hangup = asyncio.Event()
        self.first_stream_t: float | None = None
        self.rest_updates: list[CallUpdate] = []
        self.redirected = asyncio.Event()
        self.conference: ConferenceHost | None = None
        """Twilio's conference rooms, when the REST stand-in has them (a warm transfer)."""
        self.callbacks: TwilioCallbacks | None = None

    def on_rest_update(self, update: CallUpdate) -> None:
        self.rest_updates.append(update)
        self.redirected.set()

    def rel(self, t: float) -> float:
        return t - self.t0

    def last_bot_audio(self, now: float) -> float | None:
        ends = [e for p in self.playouts if (e := p.last_played_t(now)) is not None]
        return max(ends, default=None)

    def first_bot_audio_after(self, since: float, now: float) -> float | None:
        starts = [
            p.t0 + s.start / SAMPLE_RATE
            for p in self.playouts
            for s in p.segments
            if s.arrived_t >= since
        ]
        first = min(starts, default=None)
        return first if first is not None and first <= now else None

    async def wait_bot_turn(self, since: float, turn_gap: float, max_wait: float) -> None:
        """Until the bot spoke after ``since`` and then went quiet for ``turn_gap`` (or timeout)."""
        deadline = time.monotonic() + max_wait
        while (now := time.monotonic()) < deadline:
            last = self.last_bot_audio(now)
            if (
                self.first_bot_audio_after(since, now) is not None
                and last is not None
                and now - last >= turn_gap
            ):
                return
            await asyncio.sleep(_POLL_S)

    async def wait_bot_start(self, since: float, max_wait: float) -> float | None:
        deadline = time.monotonic() + max_wait
        while (now := time.monotonic()) < deadline:
            first = self.first_bot_audio_after(since, now)
            if first is not None:
                return first
            await asyncio.sleep(_POLL_S)
        return None

    async def current_session(self) -> _Session:
        while self.session is None:
            self.session_changed.clear()
            await self.session_changed.wait()
        return self.session


class _Session:
    """One Media Stream WebSocket, from ``connected`` to ``stop`` or the gateway's close."""

    def __init__(
        self, line: _Line, ws: ClientConnection, ids: CallIds, stream: StreamTwiml
    ) -> None:
        self.line = line
        self.ws = ws
        self.ids = ids
        self.stream = stream
        self.sid = "MZ" + secrets.token_hex(16)
        self.playout = TwilioPlayout(self.sid, t0=line.t0, frame_clock=line.frame_clock)
        self._seq = 0
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.started_t = 0.0

    async def _send(self, msg: dict[str, Any], numbered: bool = True) -> float:
        # The lock keeps sequence numbers in wire order across the three sending tasks.
        async with self._lock:
            if numbered:
                self._seq += 1
                msg = {"event": msg["event"], "sequenceNumber": str(self._seq), **msg}
                msg["streamSid"] = self.sid
            await self.ws.send(json.dumps(msg))
            return time.monotonic()

    async def send_dtmf(self, digit: str) -> float:
        body = {"track": "inbound_track", "digit": digit}
        return await self._send({"event": "dtmf", "dtmf": body})

    async def run(self) -> str:
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"}, False)
        self.started_t = await self._send({"event": "start", "start": self._start_body()})
        if self.line.callbacks is not None:
            self.line.callbacks.stream_event(self.stream, self.sid, "stream-started")
        self.line.playouts.append(self.playout)
        if self.line.first_stream_t is None:
            self.line.first_stream_t = self.started_t
            self.line.streaming.set()
        self.line.session = self
        self.line.session_changed.set()
        pump = asyncio.create_task(self._pump())
        marker = asyncio.create_task(self._echo_marks())
        recv = asyncio.create_task(self._receive())
        hang = asyncio.create_task(self.line.hangup.wait())
        rest = asyncio.create_task(self.line.redirected.wait())
        try:
            await asyncio.wait({recv, hang, rest}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done():
                return "gateway"
            pump.cancel()  # no media after stop
            await asyncio.gather(pump, return_exceptions=True)
            with contextlib.suppress(ConnectionClosed):
                stop = {"accountSid": self.ids.account_sid, "callSid": self.ids.call_sid}
                await self._send({"event": "stop", "stop": stop})
                await self.ws.close()
            return "rest" if rest.done() else "caller"
        finally:
            self.line.session = None
            self.playout.close()
            for task in (pump, marker, recv, hang, rest):
                task.cancel()
            await asyncio.gather(pump, marker, recv, hang, rest, return_exceptions=True)

    def _start_body(self) -> dict[str, Any]:
        return {
            "accountSid": self.ids.account_sid,
            "streamSid": self.sid,
            "callSid": self.ids.call_sid,
            "tracks": ["inbound"],
            "customParameters": dict(self.stream.parameters),
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": SAMPLE_RATE, "channels": 1},
        }

    async def _pump(self) -> None:
        """Caller audio at real time, 20 ms a frame, for as long as the stream lives."""
        origin = time.monotonic()
        offset = origin - self.started_t  # timestamps count from the start of the stream
        chunk = 0
        with contextlib.suppress(ConnectionClosed):
            while True:
                chunk += 1
                delay = origin + chunk * _FRAME_S - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                frame, speech = self.line.mic.take()
                # By the frame clock, not the send time: an echo has no gaps.
                end = round((origin + chunk * _FRAME_S - self.line.t0) * SAMPLE_RATE)
                parts = None
                if self.line.echo is not None:
                    parts = self.line.echo.mix_frame(frame, self.playout, end)
                    frame = parts.ulaw
                if self.line.record is not None:
                    self.line.record.add(end - len(frame), parts or LineFrame.plain(frame), speech)
                media = {
                    "track": "inbound",
                    "chunk": str(chunk),
                    "timestamp": str(round((offset + (chunk - 1) * _FRAME_S) * 1000)),
                    "payload": base64.b64encode(frame).decode(),
                }
                t = await self._send({"event": "media", "media": media})
                if speech:
                    start = round((t - self.line.t0) * SAMPLE_RATE) - FRAME_BYTES
                    self.line.caller_track.append(Segment(t, max(0, start), frame))
                self.line.mic.sent(t)

    async def _receive(self) -> None:
        link = self.line.link.arrivals() if self.line.link is not None else None
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                self.playout.receive(raw, None if link is None else link(time.monotonic()))
                self._wake.set()

    async def _echo_marks(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                self._wake.clear()
                for echo in self.playout.due_marks():
                    await self._send({"event": "mark", "mark": {"name": echo.name}})
                nxt = self.playout.next_mark_time()
                timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)


# -- script runner --------------------------------------------------------------------------------


async def _run_script(line: _Line, steps: list[Rendered], script: Script) -> None:
    since = time.monotonic()
    if script.wait_for_greeting:
        await line.wait_bot_turn(since, script.turn_gap, script.max_wait)
    for r in steps:
        step = r.step
        if isinstance(step, Hangup):
            break
        if isinstance(step, Silence):
            await asyncio.sleep(step.silence)
            continue
        if isinstance(step, Say | Wav | Press) and step.wait and line.caller_turns:
            await line.wait_bot_turn(line.caller_turns[-1].end_t, script.turn_gap, script.max_wait)
        if isinstance(step, BargeIn):
            await _barge_in_delay(line, step, script)
        start = time.monotonic()
        end = await _press(line, step) if isinstance(step, Press) else await line.mic.queue(r.audio)
        line.caller_turns.append(_CallerTurn(r.text, start, end))
    else:
        if line.caller_turns:
            await line.wait_bot_turn(line.caller_turns[-1].end_t, script.turn_gap, script.max_wait)
    line.hangup.set()


async def _barge_in_delay(line: _Line, step: BargeIn, script: Script) -> None:
    since = line.caller_turns[-1].end_t if line.caller_turns else line.t0
    first = await line.wait_bot_start(since, script.max_wait)
    if first is not None:
        await asyncio.sleep(max(0.0, first + step.barge_in.after - time.monotonic()))


async def _press(line: _Line, step: Press) -> float:
    t = time.monotonic()
    for i, digit in enumerate(step.press):
        if i:
            await asyncio.sleep(step.gap)
        t = await (await line.current_session()).send_dtmf(digit)
    return t


# -- the call -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboundAnswer:
    """A call the gateway placed through the REST API, answered: what Twilio then requests."""

    call_sid: str
    url: str
    """The call's ``Url``: the TwiML for the answered call."""
    method: str = "POST"
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the callee's audio starts reaching the gateway (its first stream starts): the
    moment the simulated callee starts talking, so what hears it (Twilio's AMD) starts then."""


@dataclass(frozen=True, slots=True)
class _FirstRequest:
    url: str
    status: str
    method: str = "POST"


async def place_call(
    http_base: str,
    *,
    script: Script | Sequence[str],
    auth_token: str,
    public_base_url: str | None = None,
    ws_base: str | None = None,
    from_: str = "+15550001111",
    to: str = "+15550002222",
    record_path: str | Path | None = None,
    transcriber: Transcriber | None = None,
    synthesize: Synthesize | None = None,
    comfort_noise: bool = False,
    open_timeout: float = 10.0,
    rest_api: FakeTwilioRestApi | None = None,
    echo: LineEcho | None = None,
    outbound: OutboundAnswer | None = None,
    call_status_url: str | None = None,
    frame_clock: bool = False,
    line_record: LineRecord | None = None,
    link: LinkDelay | None = None,
) -> CallReport:
    """Place one inbound call at the gateway and run ``script`` on it, in real time.

    With ``rest_api`` the call belongs to its account and can be updated through it (a REST
    redirect ends the stream with ``stop`` and its TwiML takes over, as on Twilio). With
    ``echo`` the line feeds the bot's own audio back (``ivr.sim.echo``). ``frame_clock``: the
    bot's audio plays on Twilio's 20 ms tick. ``line_record`` keeps what the line sent.
    ``link``: the gateway's messages reach Twilio's playout that much later. With
    ``outbound`` this is the callee of a call the gateway placed: Twilio asks the call's
    ``Url`` (not the voice webhook) once the callee has picked up, and ``script`` is the callee.
    With ``call_status_url`` (the number's status callback, a public URL) Twilio reports the
    call ``completed`` with its duration when it is over; streams whose TwiML asks for status
    callbacks get them either way (``ivr.sim.callbacks``).
    """
    if not isinstance(script, Script):
        script = script_from_data(list(script), source="<script>")
    steps = await render_script(script, synthesize)
    account_sid = rest_api.account_sid if rest_api else "AC" + secrets.token_hex(16)
    if outbound is None:
        ids = CallIds("CA" + secrets.token_hex(16), account_sid, from_, to)
        first = _FirstRequest("/twilio/voice", "ringing")
    else:
        ids = CallIds(outbound.call_sid, account_sid, from_, to, "outbound-api")
        first = _FirstRequest(outbound.url, "in-progress", outbound.method)
    ws_base = ws_base or http_base.replace("https://", "wss://").replace("http://", "ws://")
    report = CallReport(ids.call_sid, ids.account_sid)
    line = _Line(
        time.monotonic(),
        comfort_noise,
        echo,
        outbound.streaming if outbound else None,
        frame_clock=frame_clock,
        record=line_record,
        link=link,
    )
    if rest_api is not None:
        rest_api.add_call(ids.call_sid, from_=from_, to=to, control=line.on_rest_update)
        line.conference = rest_api.conference_host
    async with httpx.AsyncClient(timeout=10.0) as http:
        tw = TwilioSide(http, http_base, public_base_url or http_base, auth_token, ids)
        line.callbacks = TwilioCallbacks(tw, report, line.t0, call_status_url)
        runner = asyncio.create_task(_run_script(line, steps, script))
        try:
            await _drive(line, tw, ws_base, report, open_timeout, first)
        except CallFailed as e:
            report.errors.append(str(e))
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            if rest_api is not None:
                rest_api.end_call(ids.call_sid)
            line.callbacks.call_over("completed", round(line.rel(time.monotonic())))
            await line.callbacks.aclose()
    report.rest_update_t = [line.rel(u.t) for u in line.rest_updates]
    await _finish(line, report, record_path, transcriber)
    return report


async def _drive(
    line: _Line,
    tw: TwilioSide,
    ws_base: str,
    report: CallReport,
    open_timeout: float,
    first: _FirstRequest,
) -> None:
    twiml = await tw.request(first.url, tw.params(first.status), first.method)
    closed_at: float | None = None
    while True:
        report.twiml.append(twiml)
        stream = parse_stream(twiml)
        if stream is None:
            back = await _hold_in_conference(line, tw, twiml)
            if back is not None:  # taken off a conference's hold by a REST redirect
                twiml = back
                continue
            report.closing_twiml = twiml
            return
        if line.hangup.is_set():
            return
        s = await _connect_stream(line, tw, stream, ws_base, report, open_timeout)
        if closed_at is not None and s.started_t:
            report.resume_gaps_s.append(s.started_t - closed_at)
        if s.ended_by == "caller":
            return
        if s.ended_by == "rest":
            next_twiml = await _after_rest_update(line, tw)
            if next_twiml is None:
                return
            twiml = next_twiml
            continue
        closed_at = s.ended_t  # both relative to the call start
        if stream.action is None:
            return  # no action: the call goes on to the next verb, of which there is none
        twiml = await tw.request(stream.action, tw.params("in-progress"), stream.method)


async def _hold_in_conference(line: _Line, tw: TwilioSide, twiml: str) -> str | None:
    """Wait in the ``<Dial><Conference>`` of ``twiml`` (if the stand-in hosts rooms) until a
    REST redirect takes the call elsewhere: its TwiML. None: the call ended there."""
    if line.conference is None or "<Conference" not in twiml:
        return None
    how = await line.conference.hold(tw.ids.call_sid, twiml, line.redirected, line.hangup)
    return await _after_rest_update(line, tw) if how == "rest" else None


async def _after_rest_update(line: _Line, tw: TwilioSide) -> str | None:
    """The TwiML a REST update put in charge (None: the update ended the call)."""
    update = line.rest_updates[-1]
    line.redirected.clear()
    if update.status == "completed":
        return None
    if update.twiml is not None:
        return update.twiml
    assert update.url is not None  # the fake REST API only accepts Twiml, Url or Status
    return await tw.request(update.url, tw.params("in-progress"), update.method)


async def _connect_stream(
    line: _Line,
    tw: TwilioSide,
    stream: StreamTwiml,
    ws_base: str,
    report: CallReport,
    open_s: float,
) -> StreamReport:
    url = _check_stream_url(stream.url, line, report)
    info = StreamReport(stream.url, "", 0.0, custom_parameters=dict(stream.parameters))
    report.streams.append(info)
    # Twilio signs the wss:// URL it connects to, with no parameters.
    headers = {"X-Twilio-Signature": tw.validator.compute_signature(url, {})}
    outcome = "handshake-failed"
    try:
        async with connect(
            # Twilio does not negotiate permessage-deflate; neither does its stand-in.
            rebase(url, ws_base),
            additional_headers=headers,
            open_timeout=open_s,
            compression=None,
        ) as ws:
            session = _Session(line, ws, tw.ids, stream)
            info.stream_sid = session.sid
            try:
                outcome = await session.run()
            finally:
                info.started_t = line.rel(session.started_t) if session.started_t else 0.0
                if session.started_t and line.callbacks is not None:
                    line.callbacks.stream_event(stream, session.sid, "stream-stopped")
    except InvalidStatus as e:
        report.errors.append(f"31920 stream handshake to {url}: HTTP {e.response.status_code}")
        _stream_error(line, stream, f"31920 handshake: HTTP {e.response.status_code}")
    except (InvalidHandshake, OSError, TimeoutError) as e:
        report.errors.append(f"31920 stream handshake to {url} failed: {e!r}")
        _stream_error(line, stream, f"31920 handshake failed: {type(e).__name__}")
    info.ended_by = outcome
    info.ended_t = line.rel(time.monotonic())
    return info


def _stream_error(line: _Line, stream: StreamTwiml, error: str) -> None:
    if line.callbacks is not None:  # a stream that never started has a sid all the same
        line.callbacks.stream_event(stream, "MZ" + secrets.token_hex(16), "stream-error", error)


def _check_stream_url(url: str, line: _Line, report: CallReport) -> str:
    """Twilio only dials wss:// and drops query strings; flag both, connect like Twilio would."""
    parts = urlsplit(url)
    now = time.monotonic()
    if parts.scheme != "wss":
        reason = f"<Stream url> must be wss://, got {parts.scheme}://"
        report.violations.append(Violation(line.rel(now), "31922", reason, url))
    if parts.query:
        reason = "<Stream url> has a query string; Twilio does not deliver it"
        report.violations.append(Violation(line.rel(now), "stream-url-query", reason, url))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


# -- after the call -------------------------------------------------------------------------------


async def _finish(
    line: _Line, report: CallReport, record_path: str | Path | None, transcriber: Transcriber | None
) -> None:
    end = time.monotonic()
    report.duration_s = line.rel(end)
    for p in line.playouts:
        report.marks_echoed += len(p.echoes)
        report.marks_cleared += sum(e.cleared for e in p.echoes)
        report.clears += [line.rel(t) for t in p.clears]
        report.violations += [
            Violation(line.rel(v.t), v.code, v.reason, v.excerpt) for v in p.violations
        ]
    report.violations.sort(key=lambda v: v.t)
    n = round(report.duration_s * SAMPLE_RATE)
    bot = [s for p in line.playouts for s in p.segments]
    report.bot_audio_s = sum(len(s.audio) for s in bot) / SAMPLE_RATE
    report.turns = _turns(line, bot, end)
    if record_path is not None:
        caller = ulaw_decode(render_track(line.caller_track, n))
        await asyncio.to_thread(write_wav, record_path, [caller, ulaw_decode(render_track(bot, n))])
    if transcriber is not None:
        await _transcribe(report.turns, bot, n, transcriber)


def _turns(line: _Line, bot: list[Segment], end: float) -> list[TurnReport]:
    """Bot audio belongs to the turn during which it *arrived* (after that caller turn ended)."""
    turns = line.caller_turns
    out: list[TurnReport] = []
    if line.first_stream_t is not None:
        until = turns[0].end_t if turns else end
        greet = _turn(line, _CallerTurn(None, line.first_stream_t, line.first_stream_t), bot, until)
        if greet.bot_first_audio_t is not None:
            out.append(greet)
    for i, t in enumerate(turns):
        out.append(_turn(line, t, bot, turns[i + 1].end_t if i + 1 < len(turns) else end))
    return out


def _turn(line: _Line, t: _CallerTurn, bot: list[Segment], until: float) -> TurnReport:
    mine = [s for s in bot if t.end_t <= s.arrived_t < until and s.audio]
    rep = TurnReport(t.text, line.rel(t.start_t), line.rel(t.end_t))
    if mine:
        first = min(s.start for s in mine) / SAMPLE_RATE
        rep.bot_first_audio_t = first
        rep.latency_s = first - rep.caller_end_t
        rep.bot_audio_seconds = sum(len(s.audio) for s in mine) / SAMPLE_RATE
        rep.bot_audio_end_t = max(s.end for s in mine) / SAMPLE_RATE
    clears = [c for p in line.playouts for c in p.clears]
    rep.interrupted = any(t.end_t <= c < until for c in clears)
    return rep


async def _transcribe(
    turns: list[TurnReport], bot: list[Segment], n: int, transcriber: Transcriber
) -> None:
    track = render_track(bot, n)
    bounds = [t.bot_first_audio_t for t in turns]
    for i, t in enumerate(turns):
        if t.bot_first_audio_t is None:
            continue
        start = round(t.bot_first_audio_t * SAMPLE_RATE)
        later = [b for b in bounds[i + 1 :] if b is not None]
        stop = round(later[0] * SAMPLE_RATE) if later else n
        pcm = np.frombuffer(ulaw_decode(track[start:stop]), dtype="<i2")
        pcm16k = await asyncio.to_thread(soxr.resample, pcm, SAMPLE_RATE, 16000)
        t.bot_text = (await transcriber(pcm16k.astype("<i2").tobytes())).strip()


# -- command line ---------------------------------------------------------------------------------


__all__ = ["CallReport", "LineEcho", "StreamReport", "Transcriber", "TurnReport", "place_call"]
