"""How the speech path reads a streaming TTS answer (``ivr.call.speech._paced``): at once while
the caller has almost nothing, then in gulps spaced by what they have in hand, never so late
that they run dry. Real HTTP: the fake OpenAI server streams 40 ms pieces every 10 ms (4x
real time, the capacity issue's TTS) to the real adapter, whose audio a real player queues."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import StreamResampler
from ivr.call.player import AudioPlayer
from ivr.call.speech import TTS_FILL_FROM_S, TTS_LOW_WATER_S, _paced
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.openai_http import OpenAIHttpTts

KEY = "sk-test"
SENTENCE = "On Saturdays we open at ten and close at four, and on Sundays we are closed."
"""~5 s of the fake's speech (65 ms a character)."""


async def _nowhere(*_: object) -> None:
    return None


@dataclass
class Reading:
    reads: int = 0
    lowest: float = math.inf
    """The least audio the caller had in hand at a read once they had had ``TTS_LOW_WATER_S``."""
    seconds: float = 0.0
    filling_reads: int = 0
    """Reads before the caller first had ``TTS_LOW_WATER_S``."""
    filling_lowest: float = math.inf
    """The least in hand at a read meanwhile, once they had had ``TTS_FILL_FROM_S``."""


async def read_paced(srv: FakeOpenAIServer, text: str = SENTENCE) -> Reading:
    """How the answer was read: reads, and what the caller had in hand at each."""
    tts = OpenAIHttpTts(base_url=srv.base_url, api_key=KEY)
    player = AudioPlayer(_nowhere, _nowhere, _nowhere, lead_seconds=0.6, refill_seconds=0.4)
    sender = asyncio.create_task(player.run_sender())
    segment = player.open_segment(text)
    resampler = StreamResampler(tts.sample_rate, 8000)
    seen = Reading()
    filled = started = False
    try:
        async for pcm in _paced(tts.synthesize(text), player):
            seen.reads += 1
            ahead = player.ahead()
            filled = filled or ahead > TTS_LOW_WATER_S
            started = started or ahead >= TTS_FILL_FROM_S
            if filled:
                seen.lowest = min(seen.lowest, ahead)
            else:
                seen.filling_reads += 1
                if started:
                    seen.filling_lowest = min(seen.filling_lowest, ahead)
            await player.write(segment, pcm16_to_ulaw(resampler.push(pcm)))
        await player.write(segment, pcm16_to_ulaw(resampler.flush()))
        player.close_segment(segment)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        await tts.aclose()
    seen.seconds = segment.duration
    return seen


async def test_a_fast_tts_is_read_in_few_gulps_and_the_caller_never_runs_dry() -> None:
    with FakeOpenAIServer(api_key=KEY) as srv:
        srv.speech_chunk_bytes = 1920  # 40 ms of 24 kHz PCM16
        srv.speech_chunk_delay = 0.01  # every 10 ms: 4x real time
        seen = await read_paced(srv)
    assert 4.0 < seen.seconds < 6.5
    # 125 pieces: a few reads until 0.4 s is in hand, then a gulp each time the caller would
    # be down to it: 9 in all here. Every 100 ms took 27; one by one until 0.4 s, 19.
    assert seen.reads <= 12, seen.reads
    assert seen.lowest > 0.2, f"the caller was down to {seen.lowest:.2f} s of audio at a read"


async def test_the_start_of_a_reply_fills_in_few_reads_and_the_caller_never_runs_dry() -> None:
    with FakeOpenAIServer(api_key=KEY) as srv:
        srv.speech_chunk_bytes = 1920
        srv.speech_chunk_delay = 0.01
        seen = await read_paced(srv, "Sure, we can do that.")  # ~1.3 s: all of it filling
    # Read at once while the caller has under 80 ms, then when half of it has played: ~6
    # reads to 0.4 s. One 40 ms piece a read until 0.4 s took 16.
    assert seen.filling_reads <= 9, seen.filling_reads
    assert seen.filling_lowest > 0.03, f"down to {seen.filling_lowest:.3f} s while filling"
