"""The simulated phone line: the caller's microphone, what one call shares across its streams,
and one Media Stream WebSocket as Twilio runs it (``connected``/``start``/real-time ``media``/
``dtmf``/``mark`` echoes/``stop``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ivr.sim.callbacks import TwilioCallbacks
from ivr.sim.echo import LineEcho, LineFrame, LineRecord
from ivr.sim.playout import (
    FRAME_BYTES,
    SAMPLE_RATE,
    ULAW_SILENCE,
    LinkDelay,
    Segment,
    TwilioPlayout,
    ulaw_encode,
)
from ivr.sim.rest_api import CallUpdate, ConferenceHost
from ivr.sim.webhook import CallIds, StreamTwiml

FRAME_S = FRAME_BYTES / SAMPLE_RATE
_POLL_S = 0.02


# -- the caller's microphone ----------------------------------------------------------------------


class Mic:
    """Caller audio waiting to go out, 20 ms per frame; silence (or faint noise) otherwise."""

    def __init__(self, comfort_noise: bool) -> None:
        self._buf = bytearray()
        self._queued = 0
        self._taken = 0
        self._waiters: list[tuple[int, asyncio.Future[float]]] = []
        self._noise = _noise_frames() if comfort_noise else []
        self._noise_i = 0

    def queue(self, audio: bytes) -> asyncio.Future[float]:
        """Queue whole frames; the future gets when the last one ends on the frame clock."""
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
class CallerTurn:
    text: str | None
    start_t: float
    end_t: float


class Line:
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
        self.mic = Mic(comfort_noise)
        self.playouts: list[TwilioPlayout] = []
        self.caller_track: list[Segment] = []
        self.caller_turns: list[CallerTurn] = []
        self.session: MediaSession | None = None
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

    async def current_session(self) -> MediaSession:
        while self.session is None:
            self.session_changed.clear()
            await self.session_changed.wait()
        return self.session


class MediaSession:
    """One Media Stream WebSocket, from ``connected`` to ``stop`` or the gateway's close."""

    def __init__(self, line: Line, ws: ClientConnection, ids: CallIds, stream: StreamTwiml) -> None:
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
                due = origin + chunk * FRAME_S  # when this frame's 20 ms are over
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                frame, speech = self.line.mic.take()
                # By the frame clock, not the send time: an echo has no gaps.
                end = round((due - self.line.t0) * SAMPLE_RATE)
                parts = None
                if self.line.echo is not None:
                    parts = self.line.echo.mix_frame(frame, self.playout, end)
                    frame = parts.ulaw
                if self.line.record is not None:
                    self.line.record.add(end - len(frame), parts or LineFrame.plain(frame), speech)
                media = {
                    "track": "inbound",
                    "chunk": str(chunk),
                    "timestamp": str(round((offset + (chunk - 1) * FRAME_S) * 1000)),
                    "payload": base64.b64encode(frame).decode(),
                }
                t = await self._send({"event": "media", "media": media})
                # The caller's words end, and their track is placed, on the frame clock, as the
                # timestamps the gateway counts its silence by: a send this task makes late
                # (a busy test process) is not the caller speaking later. By the send time, a
                # reply's latency read short by that lag.
                if speech:
                    self.line.caller_track.append(Segment(t, max(0, end - FRAME_BYTES), frame))
                self.line.mic.sent(due)

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
