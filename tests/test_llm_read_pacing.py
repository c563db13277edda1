"""How a reply's text is read off the LLM once the voice has something to say: in gulps, not a
trip through every layer per token. Real HTTP: the fake OpenAI server streams the capacity
issue's reply (40 tokens at 700 a second) to the real adapter (``OpenAICompatLlm``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from ivr.call.reply_text import LLM_READ_EVERY_S, ReplyText
from ivr.call.reply_timing import ReplyTiming
from ivr.call.turns import CallStats
from ivr.flows.speculation import PrefetchingModel, join_text
from ivr.llm.base import ChatMessage, LlmEvent, TextDelta, ToolCall
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.testing.openai_wire import ChatScript

KEY = "sk-test"
USER = [ChatMessage(role="user", content="When are you open?")]
REPLY = (
    "We open at nine in the morning on weekdays. On Saturdays we open at ten and close at "
    "four in the afternoon, and on Sundays we stay closed all day long for the staff."
)
TOKENS = [w if i == 0 else " " + w for i, w in enumerate(REPLY.split(" "))]


@pytest.fixture
def srv(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.chat = ChatScript(text=REPLY, tokens=TOKENS, token_delay=1 / 700)
    return fake_openai


def llm(srv: FakeOpenAIServer) -> OpenAICompatLlm:
    return OpenAICompatLlm(base_url=srv.base_url, api_key=KEY, model="gemma-4-31b")


async def texts(events: AsyncIterator[LlmEvent], asked: list[float]) -> AsyncIterator[str]:
    """The flow runner's view of the stream (its text), noting when each delta was handed on."""
    async for event in events:
        if isinstance(event, TextDelta):
            asked.append(time.monotonic())
            yield event.text


def reply_text() -> ReplyText:
    timing = ReplyTiming(None, on_turn=None, clock=time.monotonic, llm_name="l", tts_name="t")
    return ReplyText(timing, CallStats(), time.monotonic)


async def speak(chunks: AsyncIterator[str]) -> tuple[list[str], float]:
    """The pieces, and when the first one came."""
    pieces: list[str] = []
    first = 0.0
    async for piece in reply_text().pieces(chunks, None):
        first = first or time.monotonic()
        pieces.append(piece)
    return pieces, first


async def test_after_the_first_piece_the_text_is_read_in_gulps_not_token_by_token(srv) -> None:
    model = llm(srv)
    handed: list[float] = []
    try:
        pieces, first = await speak(texts(model.stream_chat(USER), handed))
    finally:
        await model.aclose()
    assert " ".join(pieces) == REPLY
    after = [t for t in handed if t > first]
    # 37 tokens arrive over ~50 ms after the first piece: read as they come, ~30 deltas (what
    # this test saw before the pacing); asked at most every LLM_READ_EVERY_S, a few.
    assert len(after) <= 4, len(after)
    gaps = [b - a for a, b in itertools.pairwise(after)]
    assert all(gap > LLM_READ_EVERY_S * 0.8 for gap in gaps), gaps


async def test_a_prefetched_reply_drained_before_adoption_is_handed_on_as_one_delta(srv) -> None:
    model = PrefetchingModel(llm(srv))
    try:
        prefetch = model.prefetch(USER)
        while not prefetch.done:  # the whole reply arrives while the caller's turn ends
            await prefetch.wait_changed()
        assert len(prefetch.items_so_far()) > 10  # read token by token as it came
        handed: list[float] = []
        pieces, _ = await speak(texts(model.stream_chat(USER), handed))
    finally:
        await model.aclose()
        await model.inner.aclose()
    assert " ".join(pieces) == REPLY
    assert len(handed) == 1
    assert len(srv.requests_for("chat")) == 1  # adopted, not asked again


def test_text_deltas_join_around_tool_calls_which_keep_their_place() -> None:
    call = ToolCall(id="c1", name="hours", arguments="{}")
    events: list[LlmEvent] = [TextDelta("One"), TextDelta(" moment."), call, TextDelta("Done")]
    assert join_text(events) == [TextDelta("One moment."), call, TextDelta("Done")]
    assert join_text([]) == []


async def test_an_interrupted_reply_stops_reading_while_it_waits_to_read(srv) -> None:
    srv.chat = ChatScript(text=REPLY, tokens=TOKENS, token_delay=0.02)
    model = llm(srv)
    handed: list[float] = []
    pieces = reply_text().pieces(texts(model.stream_chat(USER), handed), None)
    try:
        first = await anext(pieces)
        reader = asyncio.ensure_future(anext(pieces))
        await asyncio.sleep(LLM_READ_EVERY_S / 2)  # inside the wait before the next read
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await pieces.aclose()
    finally:
        await model.aclose()
    assert REPLY.startswith(first)
    assert len(handed) < len(TOKENS)
