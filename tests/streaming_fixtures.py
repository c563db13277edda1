"""Audio and drivers for the streaming provider tests: a caller's "speech" (a tone the fake
STT servers hear as voiced) and silence, in 20 ms mu-law frames, pushed in real time."""

from __future__ import annotations

import asyncio

import numpy as np

from ivr.audio.codec import pcm16_to_ulaw
from ivr.stt.base import FinalWords, SpeechToTextSession, SttStreamEvent
from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.elevenlabs_server import FakeElevenLabsServer
from ivr.testing.ws_server import FakeWsServer

VOICE_SERVERS: dict[str, type[FakeWsServer]] = {
    "cartesia": FakeCartesiaServer,
    "elevenlabs": FakeElevenLabsServer,
}
"""The streaming TTS stand-ins, by ``IVR_TTS_PROVIDER`` name."""

FRAME = 160
SILENCE = b"\xff" * FRAME


def tone(seconds: float, hz: float = 300.0) -> bytes:
    t = np.arange(int(seconds * 8000)) / 8000
    return pcm16_to_ulaw((np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes())


def silence(seconds: float) -> bytes:
    return SILENCE * int(seconds * 50)


async def push_real_time(session: SpeechToTextSession, audio: bytes, *, speed: float = 1.0) -> None:
    """``audio`` into ``session`` in 20 ms frames at ``speed`` x real time."""
    for offset in range(0, len(audio), FRAME):
        session.push(audio[offset : offset + FRAME])
        await asyncio.sleep(0.02 / speed)


async def collect(
    session: SpeechToTextSession, *, until_flushed: bool = True
) -> list[SttStreamEvent]:
    """Events until a flushed final (or the end of the iteration)."""
    events: list[SttStreamEvent] = []
    async for event in session:
        events.append(event)
        if until_flushed and isinstance(event, FinalWords) and event.flushed:
            break
    return events


def final_texts(events: list[SttStreamEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, FinalWords) and e.text]
