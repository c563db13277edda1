"""Voice-to-voice latency at one call, streaming STT against batch STT (issue 24).

A real gateway in this process (uvicorn, real sockets) answers the simulated Twilio caller
(``ivr call``'s, espeak speech in real time, Twilio's playout); the LLM and the TTS are the
local OpenAI-compatible server with fixed delays (LLM first token ``--llm``, TTS first audio
``--tts-delay``), the STT is either that server's batch ``/v1/audio/transcriptions`` answering
``--batch-delay`` after the upload, or a local server speaking Deepgram's (or OpenAI
Realtime's) protocol: interim words as spoken, final words ``final_delay`` after the end of
speech. The endpoint is ``--endpoint-ms`` of silence. Voice-to-voice is what the caller
measures: the end of their speech to the first bot audio played at them.

``--tts`` is the TTS kind (only ``batch``, the OpenAI-compatible ``/v1/audio/speech``, until
streaming TTS lands on its own branch); the issue's target, p50 <= 450 ms, is for streaming STT
*and* streaming TTS.

    .venv/bin/python bench/streaming_v2v.py [--stt deepgram] [--calls 5] [--finals 0.05,0.15,0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import provider_settings
from gateway_support import dial

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import running_server
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import FakeOpenAIServer, echo_script
from ivr.testing.openai_wire import Fault
from ivr.testing.stt_script import SttScript
from ivr.tts.openai_http import OpenAIHttpTts

SAID = "what are your opening hours"
LINE = "What are your opening hours?"
KEY = "sk-bench"


async def one_setup(args: argparse.Namespace, stt: str, final_delay: float) -> list[float]:
    """Voice-to-voice (s) of ``args.calls`` calls, one at a time."""
    fake = FakeOpenAIServer(api_key=KEY)
    fake.transcribe = lambda wav, form: SAID
    fake.chat = lambda request: replace(echo_script(request), first_token_delay=args.llm)
    fake.faults = {
        "transcriptions": Fault(delay=final_delay),
        "speech": Fault(delay=args.tts_delay),
    }
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
            return await _calls(args, fake, stt, overrides)
        finally:
            if words is not None:
                await asyncio.to_thread(words.stop)


async def _calls(
    args: argparse.Namespace, fake: FakeOpenAIServer, stt: str, overrides: dict[str, Any]
) -> list[float]:
    base = fake.base_url
    gateway = build_gateway(
        provider_settings(**overrides),
        stt=OpenAIHttpStt(base_url=base, api_key=KEY) if stt == "batch" else None,
        tts=OpenAIHttpTts(base_url=base, api_key=KEY),
        llm=OpenAICompatLlm(base_url=base, api_key=KEY, model="bench"),
    )
    out: list[float] = []
    async with running_server(gateway) as server:
        for _ in range(args.calls):
            report = await dial(server, [LINE])
            latency = report.turns[-1].latency_s
            if latency is not None and report.turns[-1].caller_text is not None:
                out.append(latency)
    return out


def p50_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:5.0f}" if values else "  n/a"


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stt", default="deepgram",
                        choices=["deepgram", "deepgram-flux", "openai-realtime"])  # fmt: skip
    parser.add_argument("--tts", default="batch", choices=["batch"])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--finals", default="0.05,0.15,0.3", help="final-words delays, s")
    parser.add_argument("--batch-delay", type=float, default=0.15, help="batch STT answer, s")
    parser.add_argument("--llm", type=float, default=0.12, help="LLM first token, s")
    parser.add_argument("--tts-delay", type=float, default=0.12, help="TTS first audio, s")
    parser.add_argument("--endpoint-ms", type=int, default=300)
    parser.add_argument("--speculate-after-ms", type=int, default=60)
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(
        f"one call at a time, {args.calls} calls a row; endpoint {args.endpoint_ms} ms, LLM first "
        f"token {args.llm * 1000:.0f} ms, TTS ({args.tts}) first audio "
        f"{args.tts_delay * 1000:.0f} ms, speculation after {args.speculate_after_ms} ms"
    )
    print(f"{'stt':<18} {'final words':>11}  {'v2v p50 ms':>10}  {'min':>5}  {'max':>5}")
    rows = [(args.stt, float(d)) for d in args.finals.split(",")]
    rows.append(("batch", args.batch_delay))
    for stt, delay in rows:
        values = await one_setup(args, stt, delay)
        low = f"{min(values) * 1000:5.0f}" if values else "  n/a"
        high = f"{max(values) * 1000:5.0f}" if values else "  n/a"
        print(f"{stt:<18} {delay * 1000:>8.0f} ms  {p50_ms(values):>10}  {low}  {high}")


if __name__ == "__main__":
    asyncio.run(main())
