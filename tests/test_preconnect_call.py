"""A caller who starts to speak gets the providers' connections opened while they talk, so the
turn's STT and LLM requests skip the TCP and TLS handshakes (``IVR_PRECONNECT_IDLE_MS``).

Through the real gateway, a simulated Twilio caller and a real local server speaking OpenAI's
wire formats; which connection a request came over is read at the server (the client port)."""

from __future__ import annotations

import pytest
from gateway_support import GatewayFactory, dial

from ivr.testing.openai_server import FakeOpenAIServer

pytestmark = pytest.mark.slow


async def one_turn(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, preconnect_idle_ms: int
) -> None:
    fake_openai.transcripts.append("what are your opening hours")
    async with gateway_factory(preconnect_idle_ms=preconnect_idle_ms) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()


async def test_the_turns_requests_come_over_connections_opened_while_the_caller_spoke(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    await one_turn(gateway_factory, fake_openai, preconnect_idle_ms=1)
    warmed = fake_openai.requests_for("models")
    assert warmed and all(r.method == "HEAD" for r in warmed)
    opened = {r.peer for r in warmed}
    stt = fake_openai.requests_for("transcriptions")[0]
    chat = fake_openai.requests_for("chat")[0]
    assert stt.peer in opened and chat.peer in opened
    assert max(r.time for r in warmed) < stt.time  # opened before the turn needed them


async def test_with_preconnect_off_nothing_is_asked_beyond_the_turn(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    await one_turn(gateway_factory, fake_openai, preconnect_idle_ms=0)
    assert fake_openai.requests_for("transcriptions")
    assert not fake_openai.requests_for("models")
