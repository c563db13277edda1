"""A streaming voice in real calls (issue 24): the gateway in this process, the simulated Twilio
caller on a real WebSocket, STT and the LLM on the OpenAI-compatible fake, the voice either
Cartesia's local stand-in (8 kHz mu-law, first audio 120 ms, 4x real time) or the batch
OpenAI-compatible TTS (24 kHz PCM16 at 4x real time, resampled and encoded by the gateway).

(a) CPU per call-minute: this process's event-loop thread (the gateway and the simulated
    caller; the fake providers run on threads of their own), over calls that hear a long
    reply whole. The caller's share is the same for both voices; the difference is the
    gateway's TTS path.
(b) After a barge-in at each of ``--barge-at`` seconds into the reply, the words the history
    kept against the words whose audio the caller played before the ``clear`` (the fake
    voice's word times), with Cartesia and ElevenLabs.

    .venv/bin/python bench/streaming_voice.py [--calls 3] [--barge-at 0.5,0.8,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import provider_settings
from gateway_support import dial
from test_stream_tts_calls import (
    LONG_REPLY,
    assistant_lines,
    gateway,
    words_heard,
)

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.elevenlabs_server import FakeElevenLabsServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.openai_wire import Fault
from ivr.tts.openai_http import OpenAIHttpTts

KEY = "voice-key"


@contextlib.asynccontextmanager
async def batch_gateway(fake: FakeOpenAIServer) -> AsyncIterator[RunningServer]:
    """The OpenAI-compatible voice at 24 kHz: first byte 120 ms after the request, as
    Cartesia's stand-in's first audio, then 4x real time (100 ms chunks every 25 ms)."""
    fake.faults["speech"] = Fault(delay=0.12)
    fake.speech_chunk_delay = 0.025
    base = fake.base_url
    built = build_gateway(
        provider_settings(stt_provider="openai", tts_provider="openai", heard_within_ms=1500),
        stt=OpenAIHttpStt(base_url=base, api_key="sk-test"),
        tts=OpenAIHttpTts(base_url=base, api_key="sk-test", sample_rate=24000),
        llm=OpenAICompatLlm(base_url=base, api_key="sk-test", model="m", first_token_timeout=3),
    )
    async with running_server(built) as running:
        yield running


async def cpu_per_minute(voice: str, calls: int) -> tuple[float, float]:
    """(CPU-s per call-minute, seconds of bot audio per call) over ``calls`` calls."""
    with FakeOpenAIServer(api_key="sk-test") as fake:
        cpu = minutes = audio = 0.0
        async with contextlib.AsyncExitStack() as stack:
            if voice == "openai-24k":
                server = await stack.enter_async_context(batch_gateway(fake))
            else:
                tts = await stack.enter_async_context(FakeCartesiaServer(api_key=KEY))
                server = await stack.enter_async_context(gateway(fake, tts))  # type: ignore[arg-type]
            for _ in range(calls):
                fake.transcripts.extend(["opening hours"])
                fake.chat = [ChatScript(text=LONG_REPLY * 2)]
                started = time.thread_time()
                report = await dial(server, ["When are you open?", {"silence": 12.0}])
                cpu += time.thread_time() - started
                minutes += report.duration_s / 60
                audio += report.bot_audio_s
    return cpu / minutes, audio / calls


async def barge_in_words(voice: str, at: float) -> tuple[int, int, float]:
    """(words kept, words played, seconds of the reply played) for one barge-in."""
    with FakeOpenAIServer(api_key="sk-test") as fake:
        kind = FakeCartesiaServer if voice == "cartesia" else FakeElevenLabsServer
        async with kind(api_key=KEY) as tts, gateway(fake, tts) as server:  # type: ignore[arg-type]
            fake.transcripts.extend(["opening hours", "thanks"])
            fake.chat = [ChatScript(text=LONG_REPLY), ChatScript(text="You're welcome.")]
            script = [
                "When are you open?",
                {"barge_in": {"say": "Thanks, bye.", "after": at}},
                {"silence": 1.5},
                {"hangup": None},
            ]
            report = await dial(server, script)
        cut = next(t for t in report.turns if t.interrupted)
        kept = assistant_lines(fake)[-1].split()
        return len(kept), len(words_heard(LONG_REPLY, cut.bot_audio_seconds)), cut.bot_audio_seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--barge-at", default="0.5,0.8,1.1,1.4,1.7,2.0,2.5,3.0,3.5")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print("(a) event-loop CPU per call-minute, a long reply heard whole")
    for voice in ("openai-24k", "cartesia"):
        cpu, audio = await cpu_per_minute(voice, args.calls)
        print(f"  {voice:11} {cpu:.3f} CPU-s per call-minute  ({audio:.1f} s of bot audio a call)")
    print("(b) after a barge-in: words kept in the history vs words played")
    worst = 0
    for voice in ("cartesia", "elevenlabs"):
        for at in [float(x) for x in args.barge_at.split(",")]:
            kept, played, seconds = await barge_in_words(voice, at)
            worst = max(worst, abs(kept - played))
            print(f"  {voice:10} barge-in at {at:.1f} s: {seconds:5.2f} s played, "
                  f"{played:2d} words played, {kept:2d} kept")  # fmt: skip
    print(f"  largest difference: {worst} word(s)")


if __name__ == "__main__":
    asyncio.run(main())
