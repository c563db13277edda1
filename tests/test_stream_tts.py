"""Cartesia and ElevenLabs streaming TTS against local servers speaking their protocols: one
reply fed in pieces, mu-law at 8 kHz out with word times in its audio, first audio within
the limit, cancel on barge-in; every failure a ProviderError of the right kind."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from streaming_fixtures import VOICE_SERVERS

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout
from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.elevenlabs_server import FakeElevenLabsServer
from ivr.testing.tts_script import TtsScript
from ivr.testing.ws_server import WsFault
from ivr.tts.cartesia import CartesiaTts
from ivr.tts.elevenlabs import ElevenLabsTts

KEY = "tts-key"
Kind = ProviderErrorKind
Server = FakeCartesiaServer | FakeElevenLabsServer


@pytest.fixture(params=["cartesia", "elevenlabs"])
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    async with VOICE_SERVERS[request.param](api_key=KEY) as srv:
        yield srv  # type: ignore[misc]


def tts(server: Server, key: str = KEY, **limits: Any) -> CartesiaTts | ElevenLabsTts:
    limits = {"first_audio_timeout": 0.6, "stall_timeout": 0.4} | limits
    if isinstance(server, FakeCartesiaServer):
        return CartesiaTts(api_key=key, voice="voice-1", base_url=server.url, **limits)
    return ElevenLabsTts(api_key=key, voice="voice-1", base_url=server.url, **limits)


async def test_reply_in_pieces_mulaw_with_word_times(server: Server) -> None:
    server.script = TtsScript(first_audio=0.12, speed=4)
    client = tts(server)
    session = await client.open()
    started = time.monotonic()
    for piece in ["Your bike ", "is rea", "dy. ", "Come by ", "at five."]:
        session.push_text(piece)
    session.end_input()
    audio, words, first = b"", [], None
    async for part in session:
        if part.audio and first is None:
            first = time.monotonic() - started
        audio += part.audio
        words += part.words
    await session.aclose()
    await client.aclose()
    assert first is not None and 0.1 <= first < 0.4
    assert [w.text for w in words] == ["Your", "bike", "is", "ready.", "Come", "by", "at", "five."]
    assert words[0].start == 0.0 and all(a.end <= b.start for a, b in itertools.pairwise(words))
    assert words[-1].end <= len(audio) / 8000 + 0.01  # times in the audio as yielded
    assert audio.count(b"\xff") > 0 and len(audio) == pytest.approx(words[-1].end * 8000, rel=0.1)


async def test_cancel_stops_the_reply(server: Server) -> None:
    server.script = TtsScript(first_audio=0.05, speed=1)
    client = tts(server)
    session = await client.open()
    session.push_text("A long reply that the caller will interrupt after the first words. ")
    got = 0
    async for part in session:
        got += len(part.audio)
        if got:
            session.cancel()
    await session.aclose()
    await client.aclose()
    assert 0 < got < 8000  # stopped at once, not the whole reply
    for _ in range(100):  # the server sees it a moment later, on its own thread
        told = server.cancelled if isinstance(server, FakeCartesiaServer) else server.last().closed
        if told:
            break
        await asyncio.sleep(0.01)
    # Cartesia gets its cancel; stream-input has none: its socket is closed.
    assert told


async def test_bad_key(server: Server) -> None:
    client = tts(server, key="wrong")
    with pytest.raises(ProviderError) as caught:
        session = await client.open()
        session.push_text("Hello. ")
        session.end_input()
        [part async for part in session]
    assert caught.value.kind is Kind.STATUS and not caught.value.retryable
    if isinstance(server, FakeCartesiaServer):
        assert isinstance(caught.value, ProviderStatusError) and caught.value.status == 401
    else:
        assert "1008" in str(caught.value) or "Invalid API key" in str(caught.value)
    await client.aclose()


@pytest.mark.parametrize(
    ("fault", "kind", "retryable"),
    [
        (WsFault(after=0, then="stall"), Kind.TIMEOUT, True),
        (WsFault(after=3, then="stall"), Kind.TIMEOUT, True),
        (WsFault(after=2, then="drop"), Kind.RESET, True),
        (WsFault(after=2, then="close", code=1011, reason="overloaded"), None, True),
        (WsFault(after=2, then="garbage"), Kind.PAYLOAD, False),
        (WsFault(refuse=503), Kind.STATUS, True),
    ],
    ids=["no-first-audio", "stall", "drop", "close-1011", "garbage", "handshake-503"],
)
async def test_failures(server: Server, fault: WsFault, kind: Kind | None, retryable: bool) -> None:
    server.script = TtsScript(first_audio=0.05, speed=4)
    server.faults = [fault]
    client = tts(server)
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        session = await client.open()
        session.push_text("Several words to say here, enough for a few chunks of audio. ")
        session.end_input()
        [part async for part in session]
    elapsed = time.monotonic() - started
    await client.aclose()
    if kind is None:  # a close frame: the shared Cartesia socket fails its contexts too
        kind = Kind.STATUS
    assert caught.value.kind is kind and caught.value.retryable is retryable
    if kind is Kind.TIMEOUT:
        assert isinstance(caught.value, ProviderTimeout) and elapsed < 1.5


async def test_cartesia_replies_share_one_warm_socket() -> None:
    async with FakeCartesiaServer(api_key=KEY) as server:
        server.script = TtsScript(first_audio=0.02, speed=0)
        client = tts(server)
        await client.warm()
        for _ in range(3):
            session = await client.open()
            session.push_text("Hi. ")
            session.end_input()
            assert [p async for p in session]
            await session.aclose()
        await client.aclose()
        assert len(server.connections) == 1
        contexts = {m["context_id"] for m in server.last().json_received()}
        assert len(contexts) == 3  # one context per reply


async def test_failover_before_first_audio_replays_the_text() -> None:
    from ivr.providers.resilience import RetryPolicy
    from ivr.tts.resilient_stream import ResilientStreamingTts

    async with (
        FakeCartesiaServer(api_key=KEY) as cartesia,
        FakeElevenLabsServer(api_key=KEY) as eleven,
    ):
        cartesia.faults = [WsFault(after=0, then="stall")]  # no first audio
        eleven.script = TtsScript(first_audio=0.05, speed=0)
        primary = tts(cartesia, first_audio_timeout=0.5)
        fallback = tts(eleven)
        resilient = ResilientStreamingTts(
            [primary, fallback], RetryPolicy(budget=1.5, min_attempt=0.4)
        )
        session = await resilient.open()
        session.push_text("Your bike ")
        session.push_text("is ready. ")
        session.end_input()
        started = time.monotonic()
        words = [w.text for part in [p async for p in session] for w in part.words]
        elapsed = time.monotonic() - started
        await session.aclose()
        await resilient.aclose()
    assert words == ["Your", "bike", "is", "ready."] and session.provider == "elevenlabs"
    assert elapsed < 1.5  # within the stage budget


async def test_a_cartesia_socket_gone_silent_is_replaced_for_the_next_reply() -> None:
    """The shared socket stalls mid-reply: that reply fails, the next one opens a new socket
    (reusing the silent one would stall every later reply of every call)."""
    async with FakeCartesiaServer(api_key=KEY) as server:
        server.script = TtsScript(first_audio=0.02, speed=4)
        server.faults = [WsFault(after=2, then="stall")]
        client = tts(server)
        session = await client.open()
        session.push_text("Several words to say here, enough for a few chunks of audio. ")
        session.end_input()
        with pytest.raises(ProviderTimeout):
            [part async for part in session]
        await session.aclose()
        session = await client.open()
        session.push_text("Hi there. ")
        session.end_input()
        assert b"".join([p.audio async for p in session])
        await session.aclose()
        await client.aclose()
        assert len(server.connections) == 2
