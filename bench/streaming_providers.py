"""Each streaming provider adapter against its local stand-in at the issue's timings (final
words 150 ms after the end of speech, TTS first audio 120 ms): time to final words / first
audio as the adapter sees it, and the adapter's CPU (this thread's) per call-minute of TTS
output as 8 kHz mu-law against 24 kHz PCM16 through the resampler and the mu-law encoder
(what the gateway does with a 24 kHz voice). Latencies are wall time on a shared machine.

    .venv/bin/python bench/streaming_providers.py [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from streaming_fixtures import push_real_time, silence, tone

from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.resample import StreamResampler, resample
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import FinalWords
from ivr.stt.deepgram import DeepgramStt
from ivr.stt.openai_realtime import OpenAIRealtimeStt
from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.elevenlabs_server import FakeElevenLabsServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.stt_script import SttScript
from ivr.testing.tts_script import TtsScript
from ivr.tts.cartesia import CartesiaTts
from ivr.tts.elevenlabs import ElevenLabsTts

REPLY = "Your bike is ready. We close at six today, so come by whenever suits you. "


async def stt_turns(kind: str, turns: int) -> list[float]:
    server = FakeOpenAIRealtimeServer() if kind == "openai-realtime" else FakeDeepgramServer()
    server.script = SttScript(["I need a new chain please"] * turns, final_delay=0.15)
    async with server:
        if kind == "openai-realtime":
            stt = OpenAIRealtimeStt(api_key="k", base_url=server.url + "/v1/realtime")
        else:
            stt = DeepgramStt(api_key="k", base_url=server.url, flux=kind == "deepgram-flux")
        session = await stt.open(PHONE_AUDIO)
        waits: list[float] = []
        for _ in range(turns):
            await push_real_time(session, tone(1.2))
            ended = time.monotonic()
            feeding = asyncio.create_task(push_real_time(session, silence(0.8)))
            async for event in session:
                if isinstance(event, FinalWords) and event.text:
                    waits.append(time.monotonic() - ended)
                    break
            await feeding
        await session.aclose()
    return waits


async def tts_replies(kind: str, replies: int) -> tuple[list[float], float]:
    server = FakeCartesiaServer() if kind == "cartesia" else FakeElevenLabsServer()
    server.script = TtsScript(first_audio=0.12, speed=0)
    async with server:
        cls = CartesiaTts if kind == "cartesia" else ElevenLabsTts
        tts = cls(api_key="k", voice="v", base_url=server.url)
        await tts.warm()
        firsts, cpu, seconds = [], 0.0, 0.0
        for _ in range(replies):
            cpu0 = time.thread_time()
            session = await tts.open()
            started = time.monotonic()
            session.push_text(REPLY)
            session.end_input()
            first = None
            async for part in session:
                if part.audio and first is None:
                    first = time.monotonic() - started
                seconds += len(part.audio) / 8000
            await session.aclose()
            cpu += time.thread_time() - cpu0
            firsts.append(first or 0.0)
        await tts.aclose()
    return firsts, cpu / seconds * 60


def resample_cost(seconds: float = 60.0) -> tuple[float, float]:
    """CPU per call-minute of turning TTS output into the phone's mu-law: (mu-law as it
    comes: nothing; 24 kHz PCM16: stream resampler + encoder), in 100 ms chunks."""
    pcm24 = resample(ulaw_to_pcm16(tone(seconds)), 8000, 24000)
    started = time.thread_time()
    resampler = StreamResampler(24000, 8000)
    for i in range(0, len(pcm24), 4800):
        pcm16_to_ulaw(resampler.push(pcm24[i : i + 4800]))
    return 0.0, (time.thread_time() - started) / seconds * 60


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    print("STT: time from the end of speech to the final words (scripted 150 ms)")
    for kind in ("deepgram", "deepgram-flux", "openai-realtime"):
        waits = await stt_turns(kind, args.turns)
        p50, worst = statistics.median(waits) * 1000, max(waits) * 1000
        print(f"  {kind:16} p50 {p50:5.0f} ms  max {worst:5.0f} ms")
    print("TTS: time from the text to the first audio (scripted 120 ms); adapter CPU")
    for kind in ("cartesia", "elevenlabs"):
        firsts, cpu = await tts_replies(kind, args.turns)
        print(
            f"  {kind:16} p50 {statistics.median(firsts) * 1000:5.0f} ms  "
            f"adapter {cpu:.3f} CPU-s per call-minute of speech"
        )
    _, pcm = resample_cost()
    print(f"Output conversion per call-minute: mu-law 0.000 CPU-s; 24 kHz PCM16 {pcm:.3f} CPU-s")


if __name__ == "__main__":
    asyncio.run(main())
