"""Whole calls with a streaming STT, beyond the happy path of ``test_stream_stt_call.py``:
Deepgram Flux's turn events, OpenAI Realtime's failures, the failover to the batch STT, the
speculation restarted on final words that land in the caller's pause, and a ``Finalize`` that
Deepgram leaves unanswered. The real gateway, the simulated Twilio caller, and the local
servers speaking each provider's wire protocol; failures injected at their sockets. Plus the
per-utterance mode a streaming provider gives what is not a call (``StreamedBatchStt``)."""

from __future__ import annotations

import re
import time
import wave
from pathlib import Path
from typing import Any

import pytest
from conftest import provider_settings
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
from streaming_fixtures import silence, tone
from structlog.testing import capture_logs
from structlog.typing import EventDict, WrappedLogger

from ivr.audio.codec import ulaw_to_pcm16
from ivr.audio.wav import wav_to_pcm16
from ivr.errors import ProviderError
from ivr.stt.build import build_stt
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import WsFault

pytestmark = pytest.mark.slow


def hint_counts(metrics: str, provider: str) -> dict[str, float]:
    """``ivr_stt_turn_hints_total`` for ``provider``, summed over verdicts, by kind."""
    out: dict[str, float] = {}
    pattern = r'ivr_stt_turn_hints_total\{kind="(\w+)",provider="%s",verdict="\w+"\} ([\d.]+)'
    for kind, value in re.findall(pattern % provider, metrics):
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


# -- 1. Deepgram Flux ----------------------------------------------------------------------

FLUX_LINE = "Well, what are your opening hours?"
FLUX_SAID = "well what are your opening hours"


async def test_a_flux_call_is_heard_answered_and_its_turn_events_counted(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer
) -> None:
    # espeak pauses after "Well,": Flux's eager end there (0.1 s in), resumed when the caller
    # goes on; a second eager end at the real end, then EndOfTurn. The gateway's endpoint
    # waits 0.7 s: the pause after "Well," is no end of the turn for it either.
    dg.script = SttScript([FLUX_SAID], final_delay=0.15, end_silence=0.4)
    dg.eager_silence = 0.1
    fake_openai.chat = [ChatScript(text=REPLY)]
    flux = {
        **deepgram(dg, flux=True), "deepgram_eager_eot_threshold": 0.5, "endpoint_silence_ms": 700,
    }  # fmt: skip
    async with gateway(fake_openai, **flux) as server:
        before = hint_counts(await metrics_text(server), "deepgram_flux")
        report = await dial(server, [FLUX_LINE])
        after = hint_counts(await metrics_text(server), "deepgram_flux")
    assert not report.errors and not report.violations, report.format_transcript()
    assert user_said(fake_openai) == [FLUX_SAID]
    assert answered(report) < 1.5, "Flux's EndOfTurn, not the gateway's 0.7 s, ended the turn"
    link = dg.connections[0]
    assert len(dg.connections) == 1 and link.path == "/v2/listen"
    assert link.query["eager_eot_threshold"] == "0.5" and link.query["encoding"] == "mulaw"
    counted = {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in after}
    assert counted == {
        "speech_started": 1, "eager_end_of_turn": 2, "turn_resumed": 1, "end_of_turn": 1,
    }, counted  # fmt: skip


# -- 2. OpenAI Realtime's failures in a call: tests/test_stream_stt_call.py, next to
# Deepgram's (the same faults, parametrised by provider) ------------------------------------


# -- 3. failover to the batch STT inside a call --------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [WsFault(refuse=401), WsFault(after=2, then="close", code=1008, reason="DATA-0000")],
    ids=["handshake-401", "close-1008-mid-utterance"],
)
async def test_a_refusing_streaming_stt_fails_over_to_the_batch_stt_and_the_call_goes_on(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer, fault: WsFault
) -> None:
    dg.script = script()
    dg.faults = [fault] * 3
    fake_openai.transcripts.append(SAID)
    fallback = {"stt_fallback_base_url": fake_openai.base_url, "stt_fallback_api_key": "sk-test"}
    with capture_logs() as logs:
        report = await call(fake_openai, {**deepgram(dg), **fallback})
    assert not report.errors, report.format_transcript()
    assert any(e["event"] == "provider.fallback" for e in logs) or fault.refuse
    assert user_said(fake_openai) == [SAID]
    asked = fake_openai.requests_for("chat")[0].time
    uploads = fake_openai.requests_for("transcriptions")
    assert len(uploads) == 1, "the turn's audio, uploaded once (none at the call's end)"
    assert uploads[0].time < asked
    assert answered(report) < HEARD_WITHIN


async def test_the_batch_fallback_uploads_the_turn_not_the_sounds_before_it(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer, tmp_path: Path
) -> None:
    """Failed over to the batch STT, a turn's upload is its utterance (pre-roll, speech, the
    endpoint's silence), not the greeting's silence nor a sound the caller made before."""
    dg.faults = [WsFault(refuse=401)] * 3
    fake_openai.transcripts.append(SAID)
    knock = tmp_path / "knock.wav"
    with wave.open(str(knock), "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(8000)
        out.writeframes(ulaw_to_pcm16(tone(0.5, hz=700)))
    fallback = {"stt_fallback_base_url": fake_openai.base_url, "stt_fallback_api_key": "sk-test"}
    lines = [{"wav": str(knock), "wait": False}, {"silence": 2.0}, "What are your opening hours?"]
    report = await call(fake_openai, {**deepgram(dg), **fallback}, lines)
    assert not report.errors, report.format_transcript()
    assert user_said(fake_openai) == [SAID]
    (upload,) = fake_openai.requests_for("transcriptions")
    wav = wav_to_pcm16(upload.files["file"])
    seconds = len(wav.pcm16) / 2 / wav.sample_rate
    print(f"\nthe turn's upload: {seconds:.2f} s")
    assert 1.2 < seconds < 2.6, "the utterance alone: no knock, no 2 s of silence before it"


# -- 4. the per-utterance mode (not a call) --------------------------------------------------


@pytest.mark.parametrize("provider", ["deepgram", "deepgram-flux", "openai-realtime"])
async def test_a_streaming_provider_transcribes_one_utterance_for_what_is_not_a_call(
    dg: FakeDeepgramServer, rt: FakeOpenAIRealtimeServer, provider: str
) -> None:
    server = rt if provider == "openai-realtime" else dg
    server.script = SttScript(["I need a repair"], final_delay=0.1)
    settings: dict[str, Any] = (
        realtime(rt) if server is rt else deepgram(dg, flux=provider == "deepgram-flux")
    )
    stt = build_stt(provider_settings(**settings))
    pcm = ulaw_to_pcm16(silence(0.2) + tone(0.8) + silence(0.2))
    started = time.monotonic()
    transcript = await stt.transcribe(pcm)
    elapsed = time.monotonic() - started
    assert transcript.text.lower().rstrip(".") == "i need a repair"
    assert elapsed < 1.0, f"{elapsed:.2f} s: the answer, not a limit"
    assert len(server.connections) == 1
    link = await server.connections[0].finished()
    assert link.received, "the audio went to the provider"
    await stt.aclose()


async def test_the_per_utterance_mode_raises_when_the_provider_refuses(
    dg: FakeDeepgramServer,
) -> None:
    dg.faults = [WsFault(refuse=401)]
    stt = build_stt(provider_settings(**deepgram(dg)))
    with pytest.raises(ProviderError):
        await stt.transcribe(ulaw_to_pcm16(tone(0.5)))


# -- 5. final words in the caller's pause restart the speculation ---------------------------


def monotonic(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    event["t"] = time.monotonic()  # the fake server's clock for its requests
    return event


async def test_final_words_in_the_pause_restart_the_reply_before_the_endpoint(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer
) -> None:
    # The pause is heard 60 ms after the caller stops; the final words come 150 ms after it
    # (the interim ones lack the last word), while the endpoint's silence still runs.
    dg.script = SttScript([SAID], final_delay=0.15)
    fake_openai.chat = lambda request: ChatScript(text=REPLY)
    async with gateway(fake_openai, speculate_after_ms=60, **deepgram(dg)) as server:
        with capture_logs(processors=[monotonic]) as logs:
            report = await dial(server, ["What are your opening hours?"])
    assert not report.errors, report.format_transcript()
    assert user_said(fake_openai) == ["what are your opening", SAID]
    said = next(e for e in logs if e["event"] == "caller.said")
    endpoint = said["t"] - said["stt_s"]  # the turn's STT starts at the endpoint
    request = fake_openai.requests_for("chat")[-1]
    assert request.time < endpoint, "the reply on the full words started in the pause"
    latency = next(e for e in logs if e["event"] == "turn.latency")
    assert latency["llm_ttft"] < 0.05, "and it is the one used: its first token was in"


# -- 6. a Finalize that Deepgram leaves unanswered -------------------------------------------


async def test_an_unanswered_finalize_after_the_last_final_costs_no_wait(
    fake_openai: FakeOpenAIServer, dg: FakeDeepgramServer
) -> None:
    # Deepgram's last final (speech_final) is in before the gateway's endpoint, but its last
    # word ends 0.3 s before the sound the gateway heard: the turn asks for a Finalize, which
    # Deepgram, holding no speech, leaves unanswered (its docs: an answer "typically" comes
    # when a noticeable amount of audio is buffered).
    dg.script = SttScript([SAID], final_delay=0.05, word_tail=0.3)
    dg.finalize_silent = True
    with capture_logs() as logs:
        report = await call(fake_openai, {**deepgram(dg), "stt_timeout": 3.0})
    assert not report.errors, report.format_transcript()
    link = await dg.connections[0].finished()
    assert {"type": "Finalize"} in link.json_received(), "the case under test: a Finalize"
    assert user_said(fake_openai) == [SAID]
    said = next(e for e in logs if e["event"] == "caller.said")
    assert said["stt_s"] < 0.5, "the words were in: no wait for an answer that never comes"
    assert answered(report) < 1.2
