"""What a turn's provider traffic costs the gateway's CPU, per adapter, against the arrival load's
providers (``bench/arrivals.py``: LLM 40 tokens at 700 tok/s, TTS 4x real time in 40 ms chunks
of 24 kHz PCM; their own process on another CPU).

Each row is CPU-ms of this process (pinned to ``--cpu``, on uvloop as ``ivr serve`` runs) per
unit, with ``--concurrency`` units at once as a loaded gateway has them:

* ``tts``: one reply's speech (its two sentences, ~11 s), read as fast as it comes;
* ``tts paced``: the same read as the gateway reads it (``ivr.call.speech``: once 0.4 s of
  audio is in hand, next when the listener would be down to 0.4 s, 0.1 to 1 s later);
* ``tts every 100 ms``: as the gateway read it before stop 37 (every 100 ms past 0.4 s);
* ``llm``: one 40-token streamed reply; ``stt``: one 3 s utterance.

``--sdk`` adds the same requests through the openai SDK over its default httpx2 transport, with
typed stream chunks: how the adapters talked before (the difference was the capacity ceiling).

``--count-reads`` adds, per unit, how often aiohttp's response protocol was handed bytes and how
often it ran its parser on nothing: aiohttp 3.14's ``StreamReader._read_nowait_chunk`` calls
``protocol.resume_reading()`` for every buffered HTTP chunk it hands out, paused or not, and
that runs ``data_received(b"")`` (the figures for an upstream report; stop 47).

    .venv/bin/python bench/provider_cost.py
    .venv/bin/python bench/provider_cost.py --sdk --concurrency 20
    .venv/bin/python bench/provider_cost.py --count-reads
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import uvloop
from aiohttp.client_proto import ResponseHandler
from arrivals import REPLY, ProviderProfile, providers
from gateway_harness import API_KEY

from ivr.call.speech import (
    TTS_FILL_FROM_S,
    TTS_LOW_WATER_S,
    TTS_READ_EVERY_S,
    TTS_READ_MAX_WAIT_S,
)
from ivr.llm.base import ChatMessage
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.tts.openai_http import OpenAIHttpTts

SENTENCES = [s if s.endswith(".") else s + "." for s in REPLY.split(". ")]
PACE_AHEAD_S, PACE_EVERY_S, PACE_MAX_S = TTS_LOW_WATER_S, TTS_READ_EVERY_S, TTS_READ_MAX_WAIT_S
SPEECH_RATE = 24_000


async def tts_reply(tts: OpenAIHttpTts, paced: bool, fixed: bool = False) -> None:
    for sentence in SENTENCES:
        first: float | None = None
        audio_s = 0.0
        async for pcm in tts.synthesize(sentence):
            now = time.monotonic()
            first = now if first is None else first
            audio_s += len(pcm) / 2 / SPEECH_RATE
            ahead = audio_s - (now - first)
            if paced and ahead > PACE_AHEAD_S:
                spare = ahead - PACE_AHEAD_S
                wait = PACE_EVERY_S if fixed else min(PACE_MAX_S, max(PACE_EVERY_S, spare))
                await asyncio.sleep(wait)
            elif paced and not fixed and ahead >= TTS_FILL_FROM_S:
                await asyncio.sleep(ahead / 2)  # filling: ivr.call.speech._paced


async def llm_reply(llm: OpenAICompatLlm) -> None:
    async for _ in llm.stream_chat([ChatMessage(role="user", content="When are you open?")]):
        pass


async def sdk_tts(client: openai.AsyncOpenAI) -> None:
    for sentence in SENTENCES:
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=sentence, response_format="pcm"
        ) as response:
            async for _ in response.iter_bytes():
                pass


async def sdk_llm(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "When are you open?"}], stream=True
    )
    async for _ in stream:
        pass


class ReadCounter:
    """Counts what aiohttp's client protocol is handed: bytes off the socket, or nothing (a
    resumed parser with no new data). Wraps the third-party method for this process only."""

    def __init__(self) -> None:
        self.with_bytes = 0
        self.empty = 0
        original = ResponseHandler.data_received

        def counted(protocol: ResponseHandler, data: bytes) -> None:
            if data:
                self.with_bytes += 1
            else:
                self.empty += 1
            original(protocol, data)

        ResponseHandler.data_received = counted  # type: ignore[method-assign,assignment]

    def take(self) -> tuple[int, int]:
        taken = self.with_bytes, self.empty
        self.with_bytes = self.empty = 0
        return taken


async def cost(unit: Callable[[], Awaitable[None]], rounds: int, concurrency: int) -> float:
    """CPU-ms of this process per ``unit``, ``concurrency`` of them at a time."""
    await unit()  # connections up, imports done
    started = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(unit() for _ in range(concurrency)))
    return 1000 * (time.process_time() - started) / (rounds * concurrency)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, providers(ProviderProfile(), "1", Path(tmp)) as prov:
        os.sched_setaffinity(0, {args.cpu})
        tts = OpenAIHttpTts(base_url=prov.url, api_key=API_KEY)
        llm = OpenAICompatLlm(base_url=prov.url, api_key=API_KEY, model="gemma-4-31b")
        stt = OpenAIHttpStt(base_url=prov.url, api_key=API_KEY)
        utterance = bytes(2 * 16000 * 3)
        rows: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("tts (a reply, as fast as it comes)", lambda: tts_reply(tts, paced=False)),
            ("tts paced (a reply, as the gateway reads it)", lambda: tts_reply(tts, paced=True)),
            ("tts every 100 ms (before stop 37)", lambda: tts_reply(tts, paced=True, fixed=True)),
            ("llm (a 40-token reply)", lambda: llm_reply(llm)),
            ("stt (a 3 s utterance)", lambda: stt.transcribe(utterance)),
        ]
        sdk = openai.AsyncOpenAI(base_url=prov.url, api_key=API_KEY, max_retries=0)
        if args.sdk:
            rows += [
                ("sdk over httpx2: tts", lambda: sdk_tts(sdk)),
                ("sdk over httpx2: llm (typed chunks)", lambda: sdk_llm(sdk)),
            ]
        counter = ReadCounter() if args.count_reads else None
        units = args.rounds * args.concurrency + 1  # cost() runs one unit first
        print(f"CPU-ms per unit, {args.concurrency} at once, {args.rounds} rounds, uvloop")
        if counter is not None:
            print(f"  {'':<46} {'CPU-ms':>7} {'reads':>7} {'empty':>7}  (aiohttp, per unit)")
        try:
            for name, unit in rows:
                ms = await cost(unit, args.rounds, args.concurrency)
                if counter is None:
                    print(f"  {name:<46} {ms:7.1f}")
                    continue
                reads, empty = counter.take()
                print(f"  {name:<46} {ms:7.1f} {reads / units:7.1f} {empty / units:7.1f}")
        finally:
            for closing in (tts.aclose(), llm.aclose(), stt.aclose(), sdk.close()):
                await closing


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu", type=int, default=0, help="this process's CPU")
    parser.add_argument("--sdk", action="store_true", help="add the openai SDK over httpx2")
    parser.add_argument(
        "--count-reads", action="store_true", help="count aiohttp's reads, empty ones apart"
    )
    sys.exit(uvloop.run(main(parser.parse_args())))
