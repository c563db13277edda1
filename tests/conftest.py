"""Shared fixtures: a real gateway under uvicorn whose providers are a real local server
speaking OpenAI's wire formats (``FakeOpenAIServer``), so the production HTTP clients run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import structlog
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from redis_server import LOCAL_REDIS_URL, RedisServer, delete_prefix, unique_prefix

from ivr.config import Settings
from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.openai_http import OpenAIHttpTts

STT_KEY = "stt-key"


@pytest.fixture(autouse=True)
def fresh_logging_config() -> Iterator[None]:
    """Tests that run the CLI or the demo in-process configure structlog (level filter,
    renderer); restore the defaults so later tests and capture_logs() see every event."""
    yield
    structlog.reset_defaults()


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of its own on the local Redis; its keys are deleted after the test."""
    value = unique_prefix()
    yield value
    await delete_prefix(LOCAL_REDIS_URL, value)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, for tests that stop, pause or restart it."""
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="sk-test") as server:
        yield server


@pytest.fixture
async def dg() -> AsyncIterator[FakeDeepgramServer]:
    """A local Deepgram (Nova and Flux) checking the key ``stream_calls.KEY``."""
    async with FakeDeepgramServer(api_key=STT_KEY) as server:
        yield server  # type: ignore[misc]


@pytest.fixture
async def rt() -> AsyncIterator[FakeOpenAIRealtimeServer]:
    """A local OpenAI Realtime transcription server checking ``stream_calls.KEY``."""
    async with FakeOpenAIRealtimeServer(api_key=STT_KEY) as server:
        yield server  # type: ignore[misc]


def provider_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "public_url": PUBLIC_URL,
        "twilio_auth_token": AUTH_TOKEN,
        "llm_api_key": "sk-test",
        "redis_url": "",
        "flows_dir": "flows",
        "vad": "webrtc",
        # Tests script transcripts in request order, and speculative turns make the number of
        # STT requests per turn depend on the pauses inside the caller's speech. Speculation
        # is on in tests/test_speculative_turns.py and in every test that runs `ivr serve`
        # with its defaults (the fault suites, the multi-instance and drain tests).
        "speculate_after_ms": 0,
        # This gateway shares its event loop with the test's simulated Twilio, callers and
        # fake servers, on a machine running another test suite worker: that loop's lag is
        # not the gateway's load, and shedding calls on it would fail unrelated tests at
        # random. tests/test_admission.py sets its own limit to test the shedding.
        "max_loop_lag_ms": 0,
        "max_inbound_backlog_ms": 0,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def gateway_factory(fake_openai: FakeOpenAIServer) -> GatewayFactory:
    """``async with gateway_factory(**settings) as server:`` runs a gateway on a free port.
    ``tts_first_piece_words=N``: the voice cuts a reply's first piece as piper does."""

    @asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[RunningServer]:
        tts = OpenAIHttpTts(base_url=fake_openai.base_url, api_key="sk-test")
        tts.first_piece_words = overrides.pop("tts_first_piece_words", None)
        settings = provider_settings(**overrides)
        base = fake_openai.base_url
        gateway = build_gateway(
            settings,
            stt=OpenAIHttpStt(base_url=base, api_key="sk-test"),
            tts=tts,
            llm=OpenAICompatLlm(
                base_url=base,
                api_key="sk-test",
                model="gemma-test",
                first_token_timeout=overrides.get("llm_first_token_timeout", 3.0),
            ),
        )
        async with running_server(gateway) as server:
            yield server

    return start
