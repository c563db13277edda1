"""A call's streaming STT surviving its provider, against real local servers: a Deepgram
socket that drops mid-utterance is reconnected and the unsettled audio replayed (the words
come, in the call's clock); a Deepgram that refuses the key fails over to the batch
OpenAI-compatible STT, which transcribes the utterance at finalize(): the utterance alone,
not a sound the gateway ruled out before it, nor what came after the finalize."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from streaming_fixtures import collect, push_real_time, silence, tone

from ivr.audio.wav import wav_to_pcm16
from ivr.errors import ProviderError
from ivr.providers.resilience import RetryPolicy
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import FinalWords
from ivr.stt.deepgram import DeepgramStt
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.stt.resilient_stream import (
    REPLAY_SECONDS,
    BatchSttStream,
    ResilientStreamingStt,
    ResilientSttSession,
)
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.testing.openai_wire import Fault
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import WsFault

KEY = "k"
POLICY = RetryPolicy(budget=1.5, min_attempt=0.5)


@pytest.fixture
async def deepgram() -> AsyncIterator[FakeDeepgramServer]:
    async with FakeDeepgramServer(api_key=KEY) as srv:
        yield srv  # type: ignore[misc]


def primary(server: FakeDeepgramServer, key: str = KEY) -> DeepgramStt:
    return DeepgramStt(api_key=key, base_url=server.url, finalize_timeout=0.5)


async def test_drop_mid_utterance_reconnects_and_replays(deepgram: FakeDeepgramServer) -> None:
    deepgram.script = SttScript(["lost words", "my chain is broken"], final_delay=0.1)
    # The first socket drops after its first interim words: "lost words" is what that
    # connection heard; the new one hears the replayed utterance again.
    deepgram.faults = [WsFault(after=3, then="drop")]
    stt = ResilientStreamingStt([primary(deepgram)], POLICY)
    session = await stt.open(PHONE_AUDIO)
    await push_real_time(session, silence(0.5), speed=10)
    feeding = asyncio.create_task(push_real_time(session, tone(1.2) + silence(0.3), speed=2))
    events = []
    async for event in session:
        events.append(event)
        if isinstance(event, FinalWords) and event.text:
            break
    await feeding
    await session.aclose()
    assert session.reconnects == 1 and len(deepgram.connections) == 2
    final = next(e for e in events if isinstance(e, FinalWords) and e.text)
    assert final.text == "my chain is broken"
    # In the call's clock: the speech started 0.5 s in, whatever the new socket's clock says.
    assert final.words[0].start == pytest.approx(0.5, abs=0.05)
    assert final.audio_end == pytest.approx(1.7, abs=0.05)
    replayed = b"".join(m for m in deepgram.connections[1].received if isinstance(m, bytes))
    assert len(replayed) >= 1.2 * 8000 * 0.5  # the unsettled audio went to the new socket


@contextlib.asynccontextmanager
async def failed_over(
    deepgram: FakeDeepgramServer, *transcripts: str
) -> AsyncIterator[tuple[FakeOpenAIServer, ResilientSttSession]]:
    """A session whose Deepgram refuses the key: it serves the call with the batch
    OpenAI-compatible STT (a local server answering ``transcripts`` in turn)."""
    async with FakeOpenAIServer(api_key=KEY) as openai:
        openai.transcripts.extend(transcripts)
        batch = BatchSttStream(OpenAIHttpStt(base_url=openai.base_url, api_key=KEY, timeout=2.0))
        stt = ResilientStreamingStt([primary(deepgram, key="revoked"), batch], POLICY)
        session = await stt.open(PHONE_AUDIO)
        assert session.provider == "openai_stt"
        try:
            yield openai, session
        finally:
            await session.aclose()
            await stt.aclose()


def uploaded_seconds(openai: FakeOpenAIServer) -> list[float]:
    """The length of each audio file the batch STT received."""
    out = []
    for request in openai.requests_for("transcriptions"):
        wav = wav_to_pcm16(request.files["file"])
        out.append(round(len(wav.pcm16) / 2 / wav.sample_rate, 2))
    return out


async def test_refused_key_fails_over_to_batch_stt(deepgram: FakeDeepgramServer) -> None:
    async with failed_over(deepgram, "I want a new wheel") as (openai, session):
        await push_real_time(session, tone(1.0) + silence(0.1), speed=10)
        session.finalize()
        events = await collect(session)
    assert events[-1].text == "I want a new wheel" and events[-1].flushed  # type: ignore[union-attr]
    assert len(openai.requests_for("transcriptions")) == 1


async def test_the_batch_fallback_uploads_the_utterance_not_the_sound_ruled_out_before_it(
    deepgram: FakeDeepgramServer,
) -> None:
    """A cough (no turn) and the silence after it are forgotten; the utterance and its
    trailing silence are uploaded. Before, every sound since the last turn went up with it
    (on a speakerphone: the bot's own echo, transcribed as the caller's words)."""
    async with failed_over(deepgram, "I want a new wheel") as (openai, session):
        await push_real_time(session, tone(0.4) + silence(1.0), speed=20)
        session.forget_through(1.4)  # the gateway: that sound was no turn
        await push_real_time(session, tone(1.0, hz=500) + silence(0.3), speed=20)
        session.forget_through(1.2)  # the utterance's audio starts here (pre-roll): no-op
        session.finalize()
        events = await collect(session)
    assert events[-1].text == "I want a new wheel" and events[-1].audio_end == pytest.approx(2.7)
    assert uploaded_seconds(openai) == [pytest.approx(1.3, abs=0.03)]


async def test_each_batch_finalize_uploads_only_the_audio_pushed_before_it(
    deepgram: FakeDeepgramServer,
) -> None:
    """Two turns in quick succession: the second utterance arrives while the first is still
    being transcribed, and goes up on its own at the second finalize (before, the first
    upload swallowed both and the second turn got nothing)."""
    async with failed_over(deepgram, "first words", "second words") as (openai, session):
        openai.faults["transcriptions"] = Fault(delay=0.3, times=1)
        session.push(tone(1.0))
        session.finalize()
        session.push(tone(0.6, hz=500))
        session.finalize()
        finals = []
        async for event in session:
            if isinstance(event, FinalWords) and event.flushed:
                finals.append(event)
            if len(finals) == 2:
                break
    assert [(f.text, f.audio_end) for f in finals] == [
        ("first words", pytest.approx(1.0)), ("second words", pytest.approx(1.6))
    ]  # fmt: skip
    assert uploaded_seconds(openai) == [pytest.approx(1.0, abs=0.02), pytest.approx(0.6, abs=0.02)]


async def test_the_batch_fallback_keeps_at_most_the_replay_window(
    deepgram: FakeDeepgramServer,
) -> None:
    """A caller who never ends a turn: what a finalize would upload stays bounded."""
    async with failed_over(deepgram, "the end of it") as (openai, session):
        for _ in range(int(REPLAY_SECONDS) + 10):
            session.push(tone(1.0))
        session.finalize()
        events = await collect(session)
    assert events[-1].audio_end == pytest.approx(REPLAY_SECONDS + 10)
    assert uploaded_seconds(openai) == [pytest.approx(REPLAY_SECONDS, abs=0.02)]


async def test_no_provider_left_ends_with_the_error(deepgram: FakeDeepgramServer) -> None:
    deepgram.faults = [WsFault(after=0, then="close", code=1008, reason="DATA-0000")]
    stt = ResilientStreamingStt([primary(deepgram)], POLICY)
    session = await stt.open(PHONE_AUDIO)
    session.push(tone(0.2))
    with pytest.raises(ProviderError, match="1008"):
        await collect(session)
    await session.aclose()
