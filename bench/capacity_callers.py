"""Callers that talk, for the capacity benches: each says its lines, waits for the bot's reply to
play out, and measures voice-to-voice (its end of speech -> the reply's first audio *played* on
Twilio's playout clock)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway_harness import GatewayProcess, ListenLoad, Stream
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ivr.sim.script import default_synthesize, to_line_audio

TURN_GAP_S = 0.7
"""The bot's turn is over after this much silence at the caller (as ``place_call`` waits)."""
REPLY_WAIT_S = 10.0


@dataclass(slots=True, eq=False)
class TalkingStream(Stream):
    """A caller that speaks: its microphone queue, and when bot audio starts playing."""

    mic: list[str] = field(default_factory=list)
    spoke_until: asyncio.Future[float] | None = None
    """Resolved with the send time of the last speech frame."""
    reply: asyncio.Future[float] | None = None
    """Resolved with when the first bot audio after ``spoke_until`` starts playing."""
    last_media: float = 0.0
    turns: list[tuple[float, float]] = field(default_factory=list)
    """(end of the caller's speech, when the reply started playing) per turn."""

    def next_payload(self, line_noise: str, now: float) -> str:
        if not self.mic:
            return line_noise
        payload = self.mic.pop()
        if not self.mic and self.spoke_until is not None and not self.spoke_until.done():
            self.spoke_until.set_result(now)
        return payload

    def on_message(self, raw: str | bytes, now: float) -> None:
        plays_at = max(now, self.play_end)  # Twilio plays audio once what is queued has played
        media_before = self.media_in
        Stream.on_message(self, raw, now)
        if self.media_in > media_before:
            if self.reply is not None and not self.reply.done():
                self.reply.set_result(plays_at)
            self.last_media = now

    def bot_silent_for(self, now: float) -> float:
        return now - max(self.play_end, self.last_media)


class TalkLoad(ListenLoad):
    """N callers making calls of ``lines`` back to back; voice-to-voice per turn. With
    ``greeting`` the caller first lets the bot's greeting play out."""

    greeting = True

    def __init__(
        self,
        gw: GatewayProcess,
        calls: int,
        payloads: list[str],
        lines: list[list[str]],
        ramp: float,
    ) -> None:
        super().__init__(gw, calls, payloads)
        self.lines = lines
        self.ramp = ramp
        self.turns: list[tuple[float, float]] = []
        """(caller's end of speech, voice-to-voice seconds)."""
        self.missed = 0
        """Caller lines that got no reply within REPLY_WAIT_S."""

    def start_delay(self, index: int) -> float:
        return index * self.ramp / self.calls

    def new_stream(self, ws: ClientConnection, sid: str, t0: float) -> Stream:
        return TalkingStream(ws, sid, t0, time.monotonic())

    async def converse(self, stream: Stream) -> bool:
        assert isinstance(stream, TalkingStream)
        receiver = asyncio.create_task(self._receive(stream))
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await self._talk(stream, receiver)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return True  # the caller hangs up (the bench sends `stop`)

    async def _talk(self, stream: TalkingStream, receiver: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        if self.greeting:
            await self._bot_turn_over(stream, receiver)
        for line in self.lines:
            if time.monotonic() > self.stop_at - 2 or receiver.done():
                return
            stream.spoke_until = loop.create_future()
            stream.mic = list(reversed(line))
            end = await stream.spoke_until
            stream.reply = loop.create_future()
            await asyncio.wait({stream.reply, receiver}, timeout=REPLY_WAIT_S)
            if not stream.reply.done():
                # Cut by the end of the run is not a miss; a gateway that hung up or went
                # quiet on a caller's line is.
                if not (receiver.done() and time.monotonic() >= self.stop_at):
                    self.missed += 1
                return
            plays_at = stream.reply.result()
            self.turns.append((end, plays_at - end))
            stream.turns.append((end, plays_at))
            await self._bot_turn_over(stream, receiver)

    async def _bot_turn_over(self, stream: TalkingStream, receiver: asyncio.Task[None]) -> None:
        """Until bot audio has played and none followed for TURN_GAP_S."""
        deadline = time.monotonic() + 3 * REPLY_WAIT_S
        while not receiver.done() and time.monotonic() < deadline:
            now = time.monotonic()
            if stream.last_media and stream.bot_silent_for(now) >= TURN_GAP_S:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError


def render_lines(lines: Sequence[str]) -> list[list[str]]:
    """Each caller line as base64 mu-law 20 ms payloads (espeak, once per run)."""
    out = []
    for text in lines:
        ulaw = to_line_audio(*default_synthesize(text))
        out.append([base64.b64encode(ulaw[i : i + 160]).decode() for i in range(0, len(ulaw), 160)])
    return out
