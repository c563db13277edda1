"""Provider connections stay open between requests: a new one costs the caller a TCP and a TLS
handshake (two round trips to the provider) on the turn's wait. Counted at a real HTTP server
(``FakeOpenAIServer.connections_accepted``), never timed."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import numpy as np
import pytest

from ivr.errors import ProviderError, ProviderTimeout
from ivr.providers.openai_http import preconnect_idle
from ivr.stt.openai_http import MAX_ABANDONED, OpenAIHttpStt
from ivr.testing.openai_server import FakeOpenAIServer, Fault
from ivr.tts.openai_http import OpenAIHttpTts

KEY = "sk-test"  # conftest's fake_openai: a fresh server for each test


def speech(seconds: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 220 * t)).astype("<i2").tobytes()


async def until(condition: Callable[[], object], within: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_a_transcription_nobody_waits_for_finishes_and_its_connection_serves_the_next(
    fake_openai: FakeOpenAIServer,
) -> None:
    # The speculative transcript of a caller who went on talking: its asker is cancelled while
    # the provider works. The next transcription must not open a second connection.
    fake_openai.faults["transcriptions"] = Fault(delay=0.3, times=1)
    fake_openai.transcripts_per_utterance = False  # one transcript per request, as scripted
    fake_openai.transcripts.extend(["my account number", "my account number is four two"])
    stt = OpenAIHttpStt(base_url=fake_openai.base_url, api_key=KEY)
    try:
        speculative = asyncio.create_task(stt.transcribe(speech(0.4)))
        await until(lambda: fake_openai.requests_for("transcriptions"))
        speculative.cancel()
        with pytest.raises(asyncio.CancelledError):
            await speculative
        first = fake_openai.requests_for("transcriptions")[0]
        await until(lambda: first.outcome != "pending")
        assert first.outcome == "completed"  # answered, not abandoned mid-way
        await asyncio.sleep(0.05)  # the connection goes back to the pool
        final = await stt.transcribe(speech(1.2))
        assert final.text == "my account number is four two"
        assert fake_openai.connections_accepted == 1
    finally:
        await stt.aclose()


async def test_an_answer_that_times_out_closes_its_connection(
    fake_openai: FakeOpenAIServer,
) -> None:
    # A stalled provider's connection is suspect: the next request opens a new one.
    fake_openai.faults["transcriptions"] = Fault(hang=True, times=1)
    stt = OpenAIHttpStt(base_url=fake_openai.base_url, api_key=KEY, timeout=0.3)
    try:
        with pytest.raises(ProviderTimeout):
            await stt.transcribe(speech(0.4))
        await stt.transcribe(speech(0.4))
        assert fake_openai.connections_accepted == 2
    finally:
        await stt.aclose()


async def test_past_the_bound_an_abandoned_request_is_aborted_and_close_ends_the_rest(
    fake_openai: FakeOpenAIServer,
) -> None:
    fake_openai.faults["transcriptions"] = Fault(hang=True)
    stt = OpenAIHttpStt(base_url=fake_openai.base_url, api_key=KEY, timeout=30.0)
    asks = [asyncio.create_task(stt.transcribe(speech(0.2))) for _ in range(MAX_ABANDONED + 2)]
    await until(lambda: len(fake_openai.requests_for("transcriptions")) == len(asks), within=10.0)
    for ask in asks:
        ask.cancel()
    await asyncio.gather(*asks, return_exceptions=True)
    # A hung answer never ends by itself: the two past the bound were aborted, closing their
    # connections; the others stay open until the client closes.
    await until(lambda: fake_openai.open_connections == MAX_ABANDONED)
    await stt.aclose()
    await until(lambda: fake_openai.open_connections == 0)


async def test_an_idle_provider_is_preconnected_and_its_next_request_uses_that_connection(
    fake_openai: FakeOpenAIServer,
) -> None:
    fake_openai.transcripts.append("hello")
    stt = OpenAIHttpStt(base_url=fake_openai.base_url, api_key=KEY)
    try:
        preconnect_idle(4.0)  # never used: no connection can be open
        await until(
            lambda: fake_openai.requests_for("models") and fake_openai.open_connections == 1
        )
        await asyncio.sleep(0.05)  # the HEAD's answer releases the connection to the pool
        assert (await stt.transcribe(speech(0.4))).text == "hello"
        [warm] = fake_openai.requests_for("models")
        [used] = fake_openai.requests_for("transcriptions")
        assert warm.method == "HEAD" and warm.peer == used.peer
        assert fake_openai.connections_accepted == 1
        preconnect_idle(4.0)  # just used: nothing to do
        await asyncio.sleep(0.1)
        assert len(fake_openai.requests_for("models")) == 1
    finally:
        await stt.aclose()


async def test_a_provider_whose_answer_is_still_being_read_is_preconnected_once_quiet_since_sent(
    fake_openai: FakeOpenAIServer,
) -> None:
    # A reply's TTS answer is read at the caller's pace, seconds after the server sent it all:
    # the server's idle clock runs from its last byte. Counting from the answer's release
    # (or skipping an endpoint with an answer still open) let the server close the pooled
    # connection first, and the next reply's TTS paid the handshakes on the caller's wait.
    tts = OpenAIHttpTts(base_url=fake_openai.base_url, api_key=KEY)
    stream = tts.synthesize("A sentence long enough to be read over several seconds.")
    try:
        assert await anext(stream)  # sent, and its first audio read; the rest waits
        await asyncio.sleep(0.3)
        preconnect_idle(0.2)  # quiet 0.3 s since the request was sent
        await until(lambda: fake_openai.requests_for("models"))
        [warm] = fake_openai.requests_for("models")
        [speech_request] = fake_openai.requests_for("speech")
        assert warm.method == "HEAD" and warm.peer != speech_request.peer
    finally:
        await stream.aclose()
        await tts.aclose()


async def test_a_preconnect_to_a_server_that_is_down_stays_quiet_and_the_request_says_why():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stt = OpenAIHttpStt(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY)
    try:
        preconnect_idle(4.0)
        await asyncio.sleep(0.1)  # it failed, and logged at debug only
        with pytest.raises(ProviderError, match="connect"):
            await stt.transcribe(speech(0.2))
    finally:
        await stt.aclose()


async def test_a_preconnect_the_server_never_answers_does_not_hold_up_the_turn(
    fake_openai: FakeOpenAIServer,
) -> None:
    # A server that accepts the HEAD and stalls: the turn's request goes on a connection of its
    # own and is answered as usual; no second preconnect piles up behind the stalled one.
    fake_openai.faults["models"] = Fault(hang=True)
    fake_openai.transcripts.append("hello")
    stt = OpenAIHttpStt(base_url=fake_openai.base_url, api_key=KEY, timeout=2.0)
    try:
        preconnect_idle(4.0)
        await until(lambda: fake_openai.requests_for("models"))
        assert (await stt.transcribe(speech(0.4))).text == "hello"
        preconnect_idle(0.0)
        await asyncio.sleep(0.1)
        assert len(fake_openai.requests_for("models")) == 1
        assert fake_openai.connections_accepted == 2
    finally:
        await stt.aclose()  # ends the stalled HEAD too
    await until(lambda: fake_openai.open_connections == 0)
