"""What the whole-call tests with a streaming STT share (``tests/test_stream_stt_call*.py``):
the real gateway on a free port with the local OpenAI-compatible server as LLM and TTS, the
settings that point its STT at a local Deepgram or OpenAI Realtime server, one simulated
Twilio call, and what the caller heard of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from conftest import STT_KEY, provider_settings
from gateway_support import dial

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.report import CallReport
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.stt_script import SttScript
from ivr.tts.openai_http import OpenAIHttpTts

KEY = STT_KEY
SAID = "what are your opening hours"
REPLY = "We are open nine to five."
HEARD_WITHIN = 2.0


def script(copies: int = 1) -> SttScript:
    """The caller's one line; a reconnection hears the replayed utterance again, as a new
    stretch of speech, so a fault test scripts it once per connection that may hear it. A
    stretch ends at 0.4 s of silence: espeak's pauses between words are not its end."""
    return SttScript([SAID] * copies, final_delay=0.15, end_silence=0.4)


@asynccontextmanager
async def gateway(fake: FakeOpenAIServer, **overrides: Any) -> AsyncIterator[RunningServer]:
    settings = provider_settings(heard_within_ms=int(HEARD_WITHIN * 1000), **overrides)
    base = fake.base_url
    built = build_gateway(
        settings,
        tts=OpenAIHttpTts(base_url=base, api_key="sk-test"),
        llm=OpenAICompatLlm(base_url=base, api_key="sk-test", model="gemma-test"),
    )
    async with running_server(built) as server:
        yield server


def deepgram(server: FakeDeepgramServer, *, flux: bool = False) -> dict[str, Any]:
    provider = "deepgram-flux" if flux else "deepgram"
    return {"stt_provider": provider, "deepgram_api_key": KEY, "deepgram_url": server.url}


def realtime(server: FakeOpenAIRealtimeServer) -> dict[str, Any]:
    return {"stt_provider": "openai-realtime", "stt_api_key": KEY, "stt_realtime_url": server.url}


def user_said(fake: FakeOpenAIServer) -> list[str]:
    """The last user message of every chat request the gateway made."""
    out = []
    for request in fake.requests_for("chat"):
        assert request.json is not None
        out.append(request.json["messages"][-1]["content"])
    return out


async def call(
    fake: FakeOpenAIServer, settings: dict[str, Any], lines: list[Any] | None = None
) -> CallReport:
    fake.chat = [ChatScript(text=REPLY)]
    async with gateway(fake, **settings) as server:
        report = await dial(server, lines or ["What are your opening hours?"])
        await asyncio.sleep(0.3)  # the stream's teardown: the session's end
    return report


async def metrics_text(server: RunningServer) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{server.base_url}/metrics")).text


def answered(report: CallReport) -> float:
    """Seconds from the caller's end of speech to the bot's answer, as the caller heard it."""
    reply = report.turns[-1]
    assert reply.caller_text is not None and reply.bot_audio_seconds > 0, report.format_transcript()
    assert reply.latency_s is not None
    return reply.latency_s
