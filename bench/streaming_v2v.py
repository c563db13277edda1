"""Voice-to-voice latency at one call, streaming STT and TTS against batch (issue 24).

A real gateway in this process (uvicorn, real sockets) answers the simulated Twilio caller
(``ivr call``'s, espeak speech in real time, Twilio's playout); the LLM is the local
OpenAI-compatible server (first token ``--llm``). The STT is either that server's batch
``/v1/audio/transcriptions`` answering ``--batch-delay`` after the upload, or a local server
speaking Deepgram's (or OpenAI Realtime's) protocol: interim words as spoken, final words
``final_delay`` after the end of speech. The TTS is either that server's batch
``/v1/audio/speech`` (first byte ``--tts-delay`` after the request, then 24 kHz PCM at 4x real
time in 40 ms chunks) or a local server speaking Cartesia's or ElevenLabs' WebSocket protocol
(first audio ``--tts-delay`` after the reply's first text, then 8 kHz mu-law at 4x real time in
40 ms chunks). The endpoint is ``--endpoint-ms`` of silence. Voice-to-voice is what the caller
measures: the end of their speech to the first bot audio played at them.

First every ``--stts`` x ``--tts`` pair (and batch STT) at the issue's timings (final words
``--final`` after the end of speech), then the final-words sweep (``--finals``) for the first
of ``--stts`` with each TTS. The issue's target, p50 <= 450 ms, is for streaming STT *and*
streaming TTS.

    .venv/bin/python bench/streaming_v2v.py [--calls 5] [--tts batch,cartesia,elevenlabs]
    .venv/bin/python bench/streaming_v2v.py --stts deepgram --tts cartesia --finals ''
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import provider_settings
from gateway_support import dial
from streaming_fixtures import VOICE_SERVERS
from test_stream_tts_calls import PROMPT_VOICE

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import FakeOpenAIServer, echo_script
from ivr.testing.openai_wire import Fault
from ivr.testing.stt_script import SttScript
from ivr.testing.tts_script import TtsScript
from ivr.testing.ws_server import FakeWsServer
from ivr.tts.openai_http import OpenAIHttpTts

SAID = "what are your opening hours"
LINE = "What are your opening hours?"
KEY = "sk-bench"
CHUNK_S, SPEED = 0.04, 4.0
"""Both kinds of voice: 40 ms chunks at 4x real time after the first."""


async def one_setup(
    args: argparse.Namespace, stt: str, final_delay: float, tts: str
) -> list[float]:
    """Voice-to-voice (s) of ``args.calls`` calls, one at a time."""
    fake = FakeOpenAIServer(api_key=KEY)
    fake.transcribe = lambda wav, form: SAID
    fake.chat = lambda request: replace(echo_script(request), first_token_delay=args.llm)
    fake.faults = {
        "transcriptions": Fault(delay=final_delay),
        "speech": Fault(delay=args.tts_delay),  # the batch voice's first byte
    }
    fake.speech_chunk_bytes = round(24_000 * 2 * CHUNK_S)
    fake.speech_chunk_delay = CHUNK_S / SPEED
    words: FakeDeepgramServer | FakeOpenAIRealtimeServer | None = None
    overrides: dict[str, Any] = {
        "endpoint_silence_ms": args.endpoint_ms, "speculate_after_ms": args.speculate_after_ms,
    }  # fmt: skip
    if stt == "openai-realtime":
        words = FakeOpenAIRealtimeServer(api_key=KEY)
        overrides |= {"stt_provider": stt, "stt_api_key": KEY, "stt_realtime_url": "-"}
    elif stt != "batch":
        words = FakeDeepgramServer(api_key=KEY)
        overrides |= {"stt_provider": stt, "deepgram_api_key": KEY, "deepgram_url": "-"}
    with fake:
        if words is not None:
            await asyncio.to_thread(words.start)
            words.script = SttScript([SAID] * args.calls, final_delay=final_delay)
            key = "stt_realtime_url" if stt == "openai-realtime" else "deepgram_url"
            overrides[key] = words.url
        try:
            async with gateway(args, fake, stt, tts, overrides) as server:
                return await _calls(server, args.calls)
        finally:
            if words is not None:
                await asyncio.to_thread(words.stop)


async def _calls(server: RunningServer, calls: int) -> list[float]:
    out: list[float] = []
    for _ in range(calls):
        report = await dial(server, [LINE])
        latency = report.turns[-1].latency_s
        if latency is not None and report.turns[-1].caller_text is not None:
            out.append(latency)
    return out


@contextlib.asynccontextmanager
async def gateway(
    args: argparse.Namespace,
    fake: FakeOpenAIServer,
    stt: str,
    tts: str,
    overrides: dict[str, Any],
) -> AsyncIterator[RunningServer]:
    """The gateway with the batch voice, or with a streaming voice built from its settings
    (``IVR_TTS_PROVIDER=cartesia|elevenlabs``) against that provider's local server."""
    base = fake.base_url
    async with contextlib.AsyncExitStack() as stack:
        voice: FakeWsServer | None = None
        if tts != "batch":
            voice = await stack.enter_async_context(VOICE_SERVERS[tts](api_key=KEY))
            voice.script = PROMPT_VOICE  # type: ignore[attr-defined]  # the startup prompts
            overrides = overrides | {
                "tts_provider": tts, f"{tts}_api_key": KEY, f"{tts}_voice": "bench",
                f"{tts}_url": voice.url,
            }  # fmt: skip
        built = build_gateway(
            provider_settings(**overrides),
            stt=OpenAIHttpStt(base_url=base, api_key=KEY) if stt == "batch" else None,
            tts=OpenAIHttpTts(base_url=base, api_key=KEY) if voice is None else None,
            llm=OpenAICompatLlm(base_url=base, api_key=KEY, model="bench"),
        )
        server = await stack.enter_async_context(running_server(built))
        if voice is not None:
            first = args.tts_delay
            script = TtsScript(first_audio=first, speed=SPEED, chunk_seconds=CHUNK_S)
            voice.script = script  # type: ignore[attr-defined]
        yield server


def p50_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:5.0f}" if values else "  n/a"


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stts", default=",".join(STREAMING_STT),
                        help=f"streaming STTs, of {','.join(STREAMING_STT)}")  # fmt: skip
    parser.add_argument("--tts", default=",".join(TTS_KINDS), help=f"of {','.join(TTS_KINDS)}")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--final", type=float, default=0.15, help="final words, s (the issue's)")
    parser.add_argument("--finals", default="0.05,0.3", help="the sweep's other delays, s")
    parser.add_argument("--batch-delay", type=float, default=0.15, help="batch STT answer, s")
    parser.add_argument("--llm", type=float, default=0.12, help="LLM first token, s")
    parser.add_argument("--tts-delay", type=float, default=0.12, help="TTS first audio, s")
    parser.add_argument("--endpoint-ms", type=int, default=300)
    parser.add_argument("--speculate-after-ms", type=int, default=60)
    args = parser.parse_args(argv)
    stts, ttss = _names(args.stts, STREAMING_STT), _names(args.tts, TTS_KINDS)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(
        f"one call at a time, {args.calls} calls a row; endpoint {args.endpoint_ms} ms, LLM first "
        f"token {args.llm * 1000:.0f} ms, TTS first audio {args.tts_delay * 1000:.0f} ms then "
        f"{SPEED:g}x real time, speculation after {args.speculate_after_ms} ms"
    )
    print(
        f"{'stt':<16} {'tts':<11} {'final words':>11}  {'v2v p50 ms':>10}  {'min':>5}  {'max':>5}"
    )
    rows = [(stt, tts, args.final) for tts in ttss for stt in stts]
    rows += [("batch", tts, args.batch_delay) for tts in ttss]
    sweep = [float(d) for d in args.finals.split(",") if d]
    rows += [(stts[0], tts, d) for tts in ttss for d in sweep if stts]
    for stt, tts, delay in rows:
        values = await one_setup(args, stt, delay, tts)
        low = f"{min(values) * 1000:5.0f}" if values else "  n/a"
        high = f"{max(values) * 1000:5.0f}" if values else "  n/a"
        print(
            f"{stt:<16} {tts:<11} {delay * 1000:>8.0f} ms  {p50_ms(values):>10}  {low}  {high}",
            flush=True,
        )


STREAMING_STT = ("deepgram", "deepgram-flux", "openai-realtime")
TTS_KINDS = ("batch", "cartesia", "elevenlabs")


def _names(spec: str, known: tuple[str, ...]) -> list[str]:
    names = [n for n in spec.split(",") if n]
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


if __name__ == "__main__":
    asyncio.run(main())
