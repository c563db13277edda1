"""Whole calls with a streaming STT (issue 24): the simulated Twilio caller (real HTTP and
WebSocket) speaks to the real gateway, which opens one session per call on a local server
speaking Deepgram's or OpenAI Realtime's protocol; the LLM and the TTS are the local
OpenAI-compatible server. Failures are injected at the STT server's socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from conftest import provider_settings
from gateway_support import dial
from structlog.testing import capture_logs

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.report import CallReport
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import FakeWsServer, WsFault
from ivr.tts.openai_http import OpenAIHttpTts

pytestmark = pytest.mark.slow

KEY = "stt-key"
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


def deepgram(server: FakeDeepgramServer, **extra: Any) -> dict[str, Any]:
    return {"stt_provider": "deepgram", "deepgram_api_key": KEY, "deepgram_url": server.url}


def realtime(server: FakeOpenAIRealtimeServer) -> dict[str, Any]:
    return {"stt_provider": "openai-realtime", "stt_api_key": KEY, "stt_realtime_url": server.url}


@pytest.fixture
async def dg() -> AsyncIterator[FakeDeepgramServer]:
    async with FakeDeepgramServer(api_key=KEY) as server:
        yield server  # type: ignore[misc]


@pytest.fixture
async def rt() -> AsyncIterator[FakeOpenAIRealtimeServer]:
    async with FakeOpenAIRealtimeServer(api_key=KEY) as server:
        yield server  # type: ignore[misc]


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


def answered(report: CallReport) -> float:
    """Seconds from the caller's end of speech to the bot's answer, as the caller heard it."""
    reply = report.turns[-1]
    assert reply.caller_text is not None and reply.bot_audio_seconds > 0, report.format_transcript()
    assert reply.latency_s is not None
    return reply.latency_s


# -- the words reach the LLM, the reply is heard ----------------------------------------------


Provider = Callable[[Any], dict[str, Any]]


@pytest.mark.parametrize("kind", ["deepgram", "openai-realtime"])
async def test_a_call_is_heard_by_a_streaming_stt_and_answered(
    fake_openai: FakeOpenAIServer,
    dg: FakeDeepgramServer,
    rt: FakeOpenAIRealtimeServer,
    kind: str,
) -> None:
    server: FakeWsServer = dg if kind == "deepgram" else rt
    server.script = script()  # type: ignore[attr-defined]
    settings = deepgram(dg) if kind == "deepgram" else realtime(rt)
    report = await call(fake_openai, settings)
    assert not report.errors and not report.violations, report.format_transcript()
    assert user_said(fake_openai) == [SAID]
    assert answered(report) < 1.5
    # One session for the call, the phone's mu-law sent as it arrived (no batch upload).
    assert len(server.connections) == 1
    assert not fake_openai.requests_for("transcriptions")
    link = await server.connections[0].finished()
    audio = [m for m in link.received if isinstance(m, bytes)] if kind == "deepgram" else [
        m for m in link.json_received() if m.get("type") == "input_audio_buffer.append"
    ]  # fmt: skip
    assert len(audio) > 50, "audio goes out as it arrives, not once per utterance"
    if kind == "deepgram":
        assert link.query["encoding"] == "mulaw" and link.query["sample_rate"] == "8000"
        # The call's end ends the input: the provider is told, then the socket closes.
        assert {"type": "CloseStream"} in link.json_received()


# -- failures at the STT's socket --------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        WsFault(after=2, then="error", code=1011, reason="INTERNAL"),
        WsFault(after=2, then="close", code=1011, reason="NET-0000"),
        WsFault(after=2, then="drop"),
    ],
    ids=["error-message", "close-1011", "drop"],
)
async def test_a_socket_that_breaks_mid_utterance_reconnects_and_keeps_the_words(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer, fault: WsFault
) -> None:
    dg.script = script(copies=2)
    dg.faults = [fault]
    with capture_logs() as logs:
        report = await call(fake_openai, deepgram(dg))
    assert not report.errors, report.format_transcript()
    # The fault hit while the caller spoke (2 messages: SpeechStarted, one interim).
    assert len(dg.connections) == 2, "one reconnection within the call"
    assert any(e["event"] == "provider.reconnect" for e in logs)
    assert user_said(fake_openai) == [SAID], "the replayed utterance keeps the words"
    assert answered(report) < HEARD_WITHIN


@pytest.mark.parametrize(
    "fault",
    [
        WsFault(after=2, then="stall"),
        WsFault(after=2, then="close", code=1008, reason="DATA-0000"),
    ],
    ids=["stall", "close-1008"],
)
async def test_an_stt_that_stalls_or_refuses_gets_the_re_ask_within_the_turn_deadline(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer, fault: WsFault
) -> None:
    # A stall: no final words; a 1008 close: not retryable, and no fallback configured.
    dg.script = script(copies=3)
    dg.faults = [fault, fault, fault, fault, fault]
    with capture_logs() as logs:
        report = await call(fake_openai, {**deepgram(dg), "stt_timeout": 3.0})
    assert not report.errors, report.format_transcript()
    assert not fake_openai.requests_for("chat"), "no words: the LLM is not asked"
    assert any(e["event"] == "stt.failed" for e in logs)
    # The caller hears the re-ask ("Sorry, I didn't catch that") within the turn deadline.
    assert answered(report) < HEARD_WITHIN + 0.2


# -- the words feed the speculation; the provider's end of turn is weighed --------------------


async def test_final_words_in_the_pause_start_the_reply_and_an_agreeing_end_shortens_it(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer
) -> None:
    dg.script = SttScript([SAID], final_delay=0.15)  # final words in the 300 ms endpoint
    fake_openai.chat = lambda request: ChatScript(text=REPLY)
    async with gateway(fake_openai, speculate_after_ms=60, **deepgram(dg)) as server:
        with capture_logs() as logs:
            report = await dial(server, ["What are your opening hours?"])
        metrics = (await httpx.AsyncClient().get(f"{server.base_url}/metrics")).text
    # At the pause the interim words lack the word still spoken: that speculation is dropped
    # when the final words come (still in the pause), and the one on them is adopted.
    assert user_said(fake_openai) == ["what are your opening", SAID]
    assert not any(e["event"] == "flow.llm_failed" for e in logs)
    assert not fake_openai.requests_for("transcriptions"), "words so far: no request"
    latency = next(e for e in logs if e["event"] == "turn.latency")
    assert latency["llm_ttft"] < 0.05, "the speculative reply's first token was in already"
    assert latency["endpoint_silence"] < 0.29, "the agreeing end of turn ended the pause sooner"
    used = 'ivr_stt_turn_hints_total{kind="end_of_turn",provider="deepgram",verdict="used"}'
    assert used in metrics
    assert answered(report) < 0.5
