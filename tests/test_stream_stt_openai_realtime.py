"""OpenAI Realtime transcription against a local server speaking its events: the session
configured for mu-law, the server VAD's events as turn hints, deltas then the completed words,
finalize() as a commit; its error events and socket failures as ProviderErrors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from streaming_fixtures import collect, final_texts, push_real_time, silence, tone

from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import FinalWords, InterimWords, TurnHint, TurnHintKind
from ivr.stt.openai_realtime import OpenAIRealtimeStt
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.stt_script import SttScript
from ivr.testing.ws_server import WsFault

KEY = "sk-rt"
Kind = ProviderErrorKind


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAIRealtimeServer]:
    async with FakeOpenAIRealtimeServer(api_key=KEY) as srv:
        yield srv  # type: ignore[misc]


def stt(server: FakeOpenAIRealtimeServer, key: str = KEY) -> OpenAIRealtimeStt:
    return OpenAIRealtimeStt(
        api_key=key, base_url=server.url + "/v1/realtime", finalize_timeout=0.5
    )


async def test_server_vad_turns_and_words(server: FakeOpenAIRealtimeServer) -> None:
    server.script = SttScript(["where is the shop"], final_delay=0.1)
    session = await stt(server).open(PHONE_AUDIO)
    feeding = asyncio.create_task(push_real_time(session, tone(1.0) + silence(0.6), speed=2))
    events = []
    async for event in session:
        events.append(event)
        if final_texts(events):
            break
    await feeding
    await session.aclose()
    hints = [(e.kind, e.at) for e in events if isinstance(e, TurnHint)]
    assert hints[0] == (TurnHintKind.SPEECH_STARTED, 0.0)
    assert hints[1][0] is TurnHintKind.END_OF_TURN and hints[1][1] == pytest.approx(1.0, abs=0.03)
    assert [e.text for e in events if isinstance(e, InterimWords)][-1] == "where is the shop"
    final = next(e for e in events if isinstance(e, FinalWords))
    assert final.text == "where is the shop" and final.audio_end == pytest.approx(1.0, abs=0.03)
    assert final.last_word_probability == pytest.approx(0.951, abs=0.01)
    sent = server.last().json_received()
    update = sent[0]
    assert update["type"] == "session.update" and update["session"]["type"] == "transcription"
    assert update["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert sent[1]["type"] == "input_audio_buffer.append"
    assert server.last().query == {"intent": "transcription"}


async def test_finalize_commits_before_the_server_vad(server: FakeOpenAIRealtimeServer) -> None:
    server.script = SttScript(["yes please"], final_delay=0.05)
    session = await stt(server).open(PHONE_AUDIO)
    await push_real_time(session, tone(0.6) + silence(0.06), speed=2)  # VAD wants 300 ms
    session.finalize()
    events = await collect(session)
    assert events[-1].flushed and events[-1].text == "yes please"  # type: ignore[union-attr]
    session.finalize()  # nothing pending now: answered at once, nothing sent
    assert (await collect(session))[-1] == FinalWords("", flushed=True)
    commits = [m for m in server.last().json_received() if m["type"].endswith("commit")]
    assert len(commits) == 1
    await session.aclose()


async def test_bad_key_refused(server: FakeOpenAIRealtimeServer) -> None:
    with pytest.raises(ProviderStatusError) as caught:
        await stt(server, key="sk-wrong").open(PHONE_AUDIO)
    assert caught.value.status == 401 and "Incorrect API key" in str(caught.value)


@pytest.mark.parametrize(
    ("fault", "kind", "retryable"),
    [
        (WsFault(after=2, then="error", code=1011), Kind.STATUS, True),
        (WsFault(after=2, then="drop"), Kind.RESET, True),
        (WsFault(after=2, then="garbage"), Kind.PAYLOAD, False),
    ],
    ids=["error-event", "drop", "garbage"],
)
async def test_failures(
    server: FakeOpenAIRealtimeServer, fault: WsFault, kind: Kind, retryable: bool
) -> None:
    server.script = SttScript(["cut short"])
    server.faults = [fault]
    session = await stt(server).open(PHONE_AUDIO)
    feeding = asyncio.create_task(push_real_time(session, tone(1.0), speed=4))
    with pytest.raises(ProviderError) as caught:
        await collect(session)
    feeding.cancel()
    await session.aclose()
    assert caught.value.kind is kind and caught.value.retryable is retryable


async def test_refused_session_format_is_an_error(server: FakeOpenAIRealtimeServer) -> None:
    client = stt(server)
    client.session_config["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": 24000}
    session = await client.open(PHONE_AUDIO)
    with pytest.raises(ProviderError, match="invalid_value") as caught:
        await collect(session)
    assert caught.value.kind is Kind.STATUS and not caught.value.retryable
    assert json.loads(json.dumps(server.last().json_received()[0]))["type"] == "session.update"
