"""Issue 21: turns that end together reach the providers together.

Twenty calls speak at once through the real gateway (signed webhooks, real media streams);
the fake provider server holds each transcription and each chat request until twenty wait at
once (``ivr.testing.hold``). A gateway that serialises its provider requests anywhere (a
connection pool, a lock, one worker) never fills the hold: the count at the server says so,
with no clock in the assertion.
"""

from __future__ import annotations

import asyncio

import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory

from ivr.sim.caller import place_call
from ivr.testing.hold import Hold
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

pytestmark = pytest.mark.slow

CALLS = 20


async def test_twenty_turns_ending_at_once_are_twenty_requests_in_flight(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.transcribe = lambda wav, form: "what are your opening hours"
    fake_openai.chat = ChatScript(text="We are open nine to five.")
    stt = fake_openai.holds["transcriptions"] = Hold(CALLS)
    llm = fake_openai.holds["chat"] = Hold(CALLS)
    # The hold keeps requests as long as it takes the last call to get there; the LLM's
    # first-token limit must not count that as a stalled provider.
    async with gateway_factory(llm_first_token_timeout=30.0) as server:
        reports = await asyncio.gather(
            *(
                place_call(
                    server.base_url,
                    script=["What are your opening hours?"],
                    auth_token=AUTH_TOKEN,
                    public_base_url=PUBLIC_URL,
                    from_=f"+1555000{n:04d}",
                )
                for n in range(CALLS)
            )
        )
    assert (stt.peak, llm.peak) == (CALLS, CALLS), (stt, llm)
    for report in reports:
        assert not report.errors, report.format_transcript()
        reply = report.turns[-1]  # the caller heard the answer
        assert reply.caller_text and reply.bot_audio_seconds > 0, report.format_transcript()
    asked = [r.json["messages"][-1]["content"] for r in fake_openai.requests_for("chat") if r.json]
    assert asked == ["what are your opening hours"] * CALLS
