"""Deepgram live STT (Nova and Flux) against a local server speaking Deepgram's protocol:
words as spoken, finals after the end of speech, the turn hints, KeepAlive while quiet,
Finalize and CloseStream; and every failure as a ProviderError of the right kind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from streaming_fixtures import collect, final_texts, push_real_time, silence, tone

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import FinalWords, InterimWords, TurnHint, TurnHintKind
from ivr.stt.deepgram import DeepgramStt
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import WsFault

KEY = "dg-test"
Kind = ProviderErrorKind


@pytest.fixture
async def server() -> AsyncIterator[FakeDeepgramServer]:
    async with FakeDeepgramServer(api_key=KEY) as srv:
        yield srv  # type: ignore[misc]


def stt(server: FakeDeepgramServer, *, flux: bool = False, key: str = KEY) -> DeepgramStt:
    return DeepgramStt(
        api_key=key, base_url=server.url, flux=flux, finalize_timeout=0.5, eager_eot_threshold=0.5
    )


@pytest.mark.parametrize("flux", [False, True], ids=["nova", "flux"])
async def test_words_as_spoken_final_after_speech(server: FakeDeepgramServer, flux: bool) -> None:
    server.script = SttScript(["I need a new chain", "yes"], final_delay=0.15)
    session = await stt(server, flux=flux).open(PHONE_AUDIO)
    feeding = asyncio.create_task(
        push_real_time(session, tone(1.5) + silence(0.5) + tone(0.3) + silence(0.4), speed=2)
    )
    events = []
    async for event in session:
        events.append(event)
        if final_texts(events) == ["I need a new chain", "yes"]:
            break
    await feeding
    await session.aclose()
    interims = [e.text for e in events if isinstance(e, InterimWords)]
    assert interims[0] == "I" and "I need a new" in interims  # grows as it is spoken
    first = next(e for e in events if isinstance(e, FinalWords) and e.text)
    assert [w.text for w in first.words] == ["I", "need", "a", "new", "chain"]
    assert first.words[0].start == 0.0 and first.audio_end == pytest.approx(1.5, abs=0.03)
    hints = [e.kind for e in events if isinstance(e, TurnHint)]
    assert hints[0] is TurnHintKind.SPEECH_STARTED and TurnHintKind.END_OF_TURN in hints
    if flux:
        assert TurnHintKind.EAGER_END_OF_TURN in hints
    request = server.connections[0]
    assert request.query["encoding"] == "mulaw" and request.query["sample_rate"] == "8000"
    assert request.path == ("/v2/listen" if flux else "/v1/listen")
    assert request.headers["authorization"] == f"Token {KEY}"
    assert isinstance(request.received[0], bytes)  # mu-law as it is, binary frames


async def test_finalize_and_close_stream(server: FakeDeepgramServer) -> None:
    server.script = SttScript(["one two three"], final_delay=5.0)  # only Finalize ends it
    session = await stt(server).open(PHONE_AUDIO)
    await push_real_time(session, tone(0.9) + silence(0.04), speed=4)
    asked = time.monotonic()
    session.finalize()
    events = await collect(session)
    assert time.monotonic() - asked < 0.3
    assert events[-1] == FinalWords(
        "one two three", events[-1].words, 0.98, audio_end=events[-1].audio_end, flushed=True
    )
    session.end_input()
    rest = [e async for e in session if isinstance(e, FinalWords)]
    assert [(e.text, e.flushed) for e in rest] == [("", True)]
    sent = (await server.last().finished()).json_received()
    assert [m["type"] for m in sent] == ["Finalize", "Finalize", "CloseStream"]


async def test_keepalive_while_quiet(server: FakeDeepgramServer) -> None:
    server.idle_close = 0.6
    client = stt(server)
    client.limits = type(client.limits)(finalize=0.5, keepalive=0.2)
    session = await client.open(PHONE_AUDIO)
    await asyncio.sleep(1.0)  # no audio: KeepAlive keeps the socket open past idle_close
    assert server.last().closed is None
    assert [m["type"] for m in server.last().json_received()].count("KeepAlive") >= 3
    await session.aclose()


async def test_quiet_socket_without_keepalive_is_closed_1011(server: FakeDeepgramServer) -> None:
    server.idle_close = 0.2
    client = stt(server, flux=True)  # Flux sends no KeepAlive: the gateway's audio keeps it
    session = await client.open(PHONE_AUDIO)
    with pytest.raises(ProviderError) as caught:
        await collect(session)
    assert caught.value.kind is Kind.STATUS and caught.value.retryable
    assert "1011" in str(caught.value) and "NET-0001" in str(caught.value)


async def test_bad_key_refused_at_handshake(server: FakeDeepgramServer) -> None:
    with pytest.raises(ProviderStatusError) as caught:
        await stt(server, key="wrong").open(PHONE_AUDIO)
    assert caught.value.status == 401 and not caught.value.retryable
    assert "Invalid credentials" in str(caught.value)


@pytest.mark.parametrize(
    ("fault", "kind", "retryable", "says"),
    [
        (WsFault(after=2, then="close", code=1011, reason="NET-0000"), Kind.STATUS, True, "1011"),
        (WsFault(after=2, then="close", code=1008, reason="DATA-0000"), Kind.STATUS, False, "1008"),
        (WsFault(after=2, then="error", code=1011, reason="INTERNAL"), Kind.STATUS, True, "error"),
        (WsFault(after=2, then="drop"), Kind.RESET, True, "connection broke"),
        (WsFault(after=2, then="garbage"), Kind.PAYLOAD, False, "not JSON"),
        (WsFault(after=3, then="stall"), Kind.TIMEOUT, True, "final words"),
    ],
    ids=["close-1011", "close-1008", "error-message", "drop", "garbage", "stall"],
)
async def test_failure_mid_utterance(
    server: FakeDeepgramServer, fault: WsFault, kind: Kind, retryable: bool, says: str
) -> None:
    server.script = SttScript(["a long sentence that is cut"], final_delay=0.1)
    server.faults = [fault]
    session = await stt(server).open(PHONE_AUDIO)

    async def speak_then_stop() -> None:
        await push_real_time(session, tone(1.5), speed=3)
        session.finalize()  # the gateway's endpointer: the caller stopped

    feeding = asyncio.create_task(speak_then_stop())
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        await collect(session)
    feeding.cancel()
    await session.aclose()
    assert caught.value.kind is kind and caught.value.retryable is retryable
    assert says in str(caught.value)
    assert time.monotonic() - started < 2.0  # the stall: within the finalize limit
    if kind is Kind.TIMEOUT:
        assert isinstance(caught.value, ProviderTimeout)


async def test_handshake_that_never_answers_times_out(server: FakeDeepgramServer) -> None:
    server.faults = [WsFault(hang_handshake=True)]
    started = time.monotonic()
    with pytest.raises(ProviderTimeout, match="connection"):
        await stt(server).open(PHONE_AUDIO, first_output_limit=0.3)
    assert time.monotonic() - started < 0.8


async def test_nothing_listening_is_a_connect_error() -> None:
    client = DeepgramStt(api_key=KEY, base_url="ws://127.0.0.1:9")
    with pytest.raises(ProviderError) as caught:
        await client.open(PHONE_AUDIO)
    assert caught.value.kind is Kind.CONNECT and caught.value.retryable
