"""How the speech path reads a streaming TTS answer (``ivr.call.speech._paced``): at once while
the caller is short of audio, then in gulps spaced by what they have in hand, never so late
that they run dry. Real HTTP: the fake OpenAI server streams 40 ms pieces every 10 ms (4x
real time, the capacity issue's TTS) to the real adapter, whose audio a real player queues."""

from __future__ import annotations

import asyncio
import math

from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import StreamResampler
from ivr.call.player import AudioPlayer
from ivr.call.speech import TTS_LOW_WATER_S, _paced
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.openai_http import OpenAIHttpTts

KEY = "sk-test"
SENTENCE = "On Saturdays we open at ten and close at four, and on Sundays we are closed."
"""~5 s of the fake's speech (65 ms a character)."""


async def _nowhere(*_: object) -> None:
    return None


async def read_paced(srv: FakeOpenAIServer) -> tuple[int, float, float]:
    """Reads the answer took, the least audio the caller had in hand at a read once they had
    had ``TTS_LOW_WATER_S``, and the seconds of audio."""
    tts = OpenAIHttpTts(base_url=srv.base_url, api_key=KEY)
    player = AudioPlayer(_nowhere, _nowhere, _nowhere, lead_seconds=0.6, refill_seconds=0.4)
    sender = asyncio.create_task(player.run_sender())
    segment = player.open_segment(SENTENCE)
    resampler = StreamResampler(tts.sample_rate, 8000)
    reads, lowest, filled = 0, math.inf, False
    try:
        async for pcm in _paced(tts.synthesize(SENTENCE), player):
            reads += 1
            ahead = player.ahead()
            filled = filled or ahead > TTS_LOW_WATER_S
            if filled:
                lowest = min(lowest, ahead)
            await player.write(segment, pcm16_to_ulaw(resampler.push(pcm)))
        await player.write(segment, pcm16_to_ulaw(resampler.flush()))
        player.close_segment(segment)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        await tts.aclose()
    return reads, lowest, segment.duration


async def test_a_fast_tts_is_read_in_few_gulps_and_the_caller_never_runs_dry() -> None:
    with FakeOpenAIServer(api_key=KEY) as srv:
        srv.speech_chunk_bytes = 1920  # 40 ms of 24 kHz PCM16
        srv.speech_chunk_delay = 0.01  # every 10 ms: 4x real time
        reads, lowest, seconds = await read_paced(srv)
    assert 4.0 < seconds < 6.5
    # 125 pieces: ~12 reads, one by one as they come, until 0.4 s is in hand, then a gulp each
    # time the caller would be down to it: 19 in all here. Every 100 ms took 27.
    assert reads <= 22, reads
    assert lowest > 0.2, f"the caller was down to {lowest:.2f} s of audio at a read"
