"""Whole calls with a streaming STT (issue 24): the simulated Twilio caller (real HTTP and
WebSocket) speaks to the real gateway, which opens one session per call on a local server
speaking Deepgram's or OpenAI Realtime's protocol; the LLM and the TTS are the local
OpenAI-compatible server. Failures are injected at the STT server's socket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from gateway_support import dial
from stream_calls import (
    HEARD_WITHIN,
    REPLY,
    SAID,
    answered,
    call,
    deepgram,
    gateway,
    metrics_text,
    realtime,
    script,
    user_said,
)
from structlog.testing import capture_logs

from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import FakeWsServer, WsFault

pytestmark = pytest.mark.slow


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

# Where the fault hits: Deepgram after SpeechStarted and one interim (the caller speaking);
# OpenAI Realtime after session.created, session.updated and speech_started, where
# speech_stopped would go (the caller has just stopped).
DG, RT = "deepgram", "openai-realtime"


def fault_call(dg: FakeDeepgramServer, rt: FakeOpenAIRealtimeServer, kind: str) -> Any:
    """The server the call's STT uses, and the settings that point the gateway at it."""
    return (dg, deepgram(dg)) if kind == DG else (rt, realtime(rt))


@pytest.mark.parametrize(
    ("kind", "fault"),
    [
        (DG, WsFault(after=2, then="error", code=1011, reason="INTERNAL")),
        (DG, WsFault(after=2, then="close", code=1011, reason="NET-0000")),
        (DG, WsFault(after=2, then="drop")),
        (RT, WsFault(after=3, then="error", reason="server_error")),
        (RT, WsFault(after=3, then="close", code=1011, reason="internal")),
        (RT, WsFault(after=3, then="drop")),
    ],
    ids=["dg-error-message", "dg-close-1011", "dg-drop", "rt-error-event", "rt-close-1011",
         "rt-drop"],
)  # fmt: skip
async def test_a_socket_that_breaks_mid_utterance_reconnects_and_keeps_the_words(
    fake_openai: FakeOpenAIServer,
    dg: FakeDeepgramServer,
    rt: FakeOpenAIRealtimeServer,
    kind: str,
    fault: WsFault,
) -> None:
    server, settings = fault_call(dg, rt, kind)
    server.script = script(copies=2)
    server.faults = [fault]
    with capture_logs() as logs:
        report = await call(fake_openai, settings)
    assert not report.errors, report.format_transcript()
    assert len(server.connections) == 2, "one reconnection within the call"
    assert any(e["event"] == "provider.reconnect" for e in logs)
    assert user_said(fake_openai) == [SAID], "the replayed utterance keeps the words"
    assert answered(report) < HEARD_WITHIN


@pytest.mark.parametrize(
    ("kind", "fault"),
    [
        (DG, WsFault(after=2, then="stall")),
        (DG, WsFault(after=2, then="close", code=1008, reason="DATA-0000")),
        (RT, WsFault(after=3, then="stall")),
        (RT, WsFault(after=3, then="close", code=1008, reason="policy")),
    ],
    ids=["dg-stall", "dg-close-1008", "rt-stall", "rt-close-1008"],
)
async def test_an_stt_that_stalls_or_refuses_gets_the_re_ask_within_the_turn_deadline(
    fake_openai: FakeOpenAIServer,
    dg: FakeDeepgramServer,
    rt: FakeOpenAIRealtimeServer,
    kind: str,
    fault: WsFault,
) -> None:
    # A stall: no final words; a 1008 close: not retryable, and no fallback configured.
    server, settings = fault_call(dg, rt, kind)
    server.script = script(copies=3)
    server.faults = [fault] * 5
    with capture_logs() as logs:
        report = await call(fake_openai, {**settings, "stt_timeout": 3.0})
    assert not report.errors, report.format_transcript()
    assert not fake_openai.requests_for("chat"), "no words: the LLM is not asked"
    # A stall fails the turn's final words; a refusal as the caller stops (Realtime) fails
    # the session first (reopened for the turns after, the turn's words lost with it).
    failed = {"stt.failed"} if kind == DG else {"stt.failed", "stt.stream_failed"}
    assert any(e["event"] in failed for e in logs)
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
        metrics = await metrics_text(server)
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
