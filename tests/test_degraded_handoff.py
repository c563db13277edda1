"""Two gateways on one private redis-server, in this process (real uvicorn servers, real
sockets): what happens when Twilio's requests for one call land on different instances while
Redis is away, and what a replayed stream handshake gets.

The webhook's instance (A) and the stream's (B) share nothing but the signing secret: B checks
the stream token's signature without Redis and carries the call from what Twilio sends."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import websockets
from conftest import provider_settings
from gateway_procs import LAST_TRANSCRIPT, agent_replies
from gateway_support import AUTH_TOKEN, PUBLIC_URL
from redis_server import RedisServer, unique_prefix
from structlog.testing import capture_logs
from twilio.request_validator import RequestValidator

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.caller import place_call
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.state.base import CallStatus
from ivr.state.redis_store import RedisCallStore
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.telephony import twilio
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.openai_http import OpenAIHttpTts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

VALIDATOR = RequestValidator(AUTH_TOKEN)
GREETING = "Hello, you've reached Acme. How can I help you today?"  # flows/default.yaml


@asynccontextmanager
async def gateways(
    fake: FakeOpenAIServer,
    redis_url: str,
    names: tuple[str, ...] = ("gw-a", "gw-b"),
    **extra: Any,
) -> AsyncIterator[list[RunningServer]]:
    prefix = unique_prefix()
    async with AsyncExitStack() as stack:
        servers = []
        for name in names:
            settings = provider_settings(
                redis_url=redis_url,
                redis_prefix=prefix,
                instance_id=name,
                redis_budget_ms=150,
                **extra,
            )
            base = fake.base_url
            gateway = build_gateway(
                settings,
                stt=OpenAIHttpStt(base_url=base, api_key="sk-test"),
                tts=OpenAIHttpTts(base_url=base, api_key="sk-test"),
                llm=OpenAICompatLlm(base_url=base, api_key="sk-test", model="gemma-test"),
            )
            servers.append(await stack.enter_async_context(running_server(gateway)))
        yield servers


def ws_base(server: RunningServer) -> str:
    return server.base_url.replace("http://", "ws://")


async def until_recovered(*servers: RunningServer, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while any(_degraded(s) for s in servers):  # noqa: ASYNC110 - polls another object's state
            await asyncio.sleep(0.05)


def _degraded(server: RunningServer) -> bool:
    statistics = getattr(server.gateway.store, "statistics", None)
    assert statistics is not None
    return bool(statistics().degraded or statistics().pending)


async def test_redis_down_webhook_on_a_stream_on_b_the_call_is_carried_by_b(
    fake_openai: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    fake_openai.transcripts.extend(["what are your opening hours", LAST_TRANSCRIPT])
    fake_openai.chat = agent_replies
    async with gateways(fake_openai, redis_server.url) as (a, b):
        redis_server.stop()
        with capture_logs() as logs:
            report = await place_call(
                a.base_url, ws_base=ws_base(b), script=["What are your hours?", "Thanks, bye."],
                auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
            )  # fmt: skip
        assert not report.errors and not report.violations, report.format_transcript()
        spoken = [t for t in report.turns if t.bot_audio_seconds > 0]
        assert len(spoken) == 3, report.format_transcript()  # greeting, reply, goodbye
        # A cannot know that B's flow hung up, so B keeps the line open after the goodbye
        # until the caller hangs up: one stream, not a resume after the goodbye.
        assert len(report.streams) == 1, report.format_transcript()
        assert report.streams[0].ended_by == "caller", report.format_transcript()
        assert any(e["event"] == "call.hangup_held" for e in logs), [e["event"] for e in logs]
        rebuilt = [e for e in logs if e["event"] == "call.record_rebuilt"]
        assert len(rebuilt) == 1, [e["event"] for e in logs]
        # B ran the flow version A pinned (it came in the stream's parameters).
        params = report.streams[0].custom_parameters
        assert params["FlowName"] == "default" and params["FlowVersion"]
        redis_server.start()  # empty, like a replacement
        await until_recovered(a, b)
        store = RedisCallStore(redis_server.url, prefix=b.gateway.settings.redis_prefix)
        try:
            record = await store.get(report.call_sid)
        finally:
            await store.aclose()
    # B's record (the one that carried the call) won; A's webhook-only copy filled no gap.
    assert record is not None
    assert record.instance_id == "gw-b" and record.status == CallStatus.ENDED
    assert record.flow_version == params["FlowVersion"]
    users = [m.content for m in record.history if m.role == "user"]
    assert users == ["what are your opening hours", LAST_TRANSCRIPT]


def signed_post(path: str, params: dict[str, str]) -> tuple[str, dict[str, str]]:
    return path, {"X-Twilio-Signature": VALIDATOR.compute_signature(PUBLIC_URL + path, params)}


async def post(server: RunningServer, path: str, params: dict[str, str]) -> str:
    _, headers = signed_post(path, params)
    async with httpx.AsyncClient() as http:
        response = await http.post(server.base_url + path, data=params, headers=headers)
    assert response.status_code == 200, response.text
    return response.text


def action_params(call_sid: str, status: str) -> dict[str, str]:
    return {"CallSid": call_sid, "AccountSid": "AC1", "From": "+15550001111",
            "To": "+15550002222", "CallStatus": status}  # fmt: skip


async def test_redis_down_the_action_url_on_an_instance_without_the_record_still_answers(
    fake_openai: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    async with gateways(fake_openai, redis_server.url, names=("gw-a",)) as (a,):
        twiml = await post(a, "/twilio/voice", action_params("CA-x", "ringing"))
        action = re.search(r'action="https://gw\.example\.com([^"]+)"', twiml)
        assert action is not None, twiml
        path = action.group(1).replace("&amp;", "&")
        assert "flow=default" in path and "streams=0" in path
        redis_server.stop()
        unknown = path.replace("CA-x", "CA-y")  # a call this instance never saw
        gone = await post(a, unknown, action_params("CA-y", "completed"))
        resumed = await post(a, unknown, action_params("CA-y", "in-progress"))
        looping = await post(
            a, unknown.replace("streams=0", "streams=3"), action_params("CA-y", "in-progress")
        )
    assert "<Hangup" in gone and "<Connect" not in gone
    # A new stream, pinned to the same flow, counting the one that just ended.
    assert "<Connect" in resumed and 'name="FlowName" value="default"' in resumed
    assert "streams=1" in resumed
    assert "technical problems" in looping and "<Connect" not in looping


async def test_redis_down_with_rest_credentials_b_hangs_up_over_rest_after_the_goodbye(
    fake_openai: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    fake_openai.transcripts.append(LAST_TRANSCRIPT)
    fake_openai.chat = agent_replies
    async with (
        FakeTwilioRestApi(auth_token=AUTH_TOKEN) as api,
        gateways(
            fake_openai,
            redis_server.url,
            twilio_account_sid=api.account_sid,
            twilio_api_base_url=api.url,
        ) as (a, b),
    ):
        await asyncio.to_thread(redis_server.stop)
        with capture_logs() as logs:
            report = await place_call(
                a.base_url, ws_base=ws_base(b), script=["Thanks, bye."],
                auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL, rest_api=api,
            )  # fmt: skip
    assert not report.errors and not report.violations, report.format_transcript()
    # The goodbye played, then B ended the call itself: no <Connect action> request for A to
    # answer from its webhook-only copy, no line held open.
    assert [u.twiml for u in api.updates] == [twilio.hangup_twiml()], api.updates
    assert len(report.streams) == 1 and report.streams[0].ended_by == "rest"
    events = [e["event"] for e in logs]
    assert "call.hangup_redirected" in events and "call.hangup_held" not in events, events


async def test_redis_down_the_resume_limit_holds_on_the_instance_holding_only_the_webhook_copy(
    fake_openai: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    # A answered the webhook from memory; the streams went elsewhere, so A's copy never
    # counted one. The count in the action URL stops the resume loop all the same.
    async with gateways(fake_openai, redis_server.url, names=("gw-a",)) as (a,):
        # Off the loop: a stop that blocks the gateway's loop for seconds reads as overload.
        await asyncio.to_thread(redis_server.stop)
        twiml = await post(a, "/twilio/voice", action_params("CA-w", "ringing"))
        action = re.search(r'action="https://gw\.example\.com([^"]+)"', twiml)
        assert action is not None, twiml
        path = action.group(1).replace("&amp;", "&")
        resumed = await post(a, path, action_params("CA-w", "in-progress"))
        looping = await post(
            a, path.replace("streams=0", "streams=3"), action_params("CA-w", "in-progress")
        )
    assert "<Connect" in resumed
    assert "technical problems" in looping and "<Connect" not in looping


async def open_stream(server: RunningServer, path: str, call_sid: str) -> Any:
    signature = VALIDATOR.compute_signature(f"wss://gw.example.com{path}", {})
    ws = await websockets.connect(
        ws_base(server) + path, additional_headers={"X-Twilio-Signature": signature}
    )
    await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
    stream_sid = "MZ" + secrets.token_hex(16)
    media_format = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
    start = {"accountSid": "AC1", "streamSid": stream_sid, "callSid": call_sid,
             "tracks": ["inbound"], "customParameters": {},
             "mediaFormat": media_format}  # fmt: skip
    await ws.send(json.dumps({"event": "start", "sequenceNumber": "1", "start": start,
                              "streamSid": stream_sid}))  # fmt: skip
    return ws, stream_sid


async def media_flows(ws: Any, seconds: float) -> None:
    """Until ``seconds`` of bot audio came (marks may come between), none more than 5 s apart."""
    heard = 0.0
    while heard < seconds:
        message = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert message["event"] in ("media", "mark"), message
        if message["event"] == "media":
            heard += len(base64.b64decode(message["media"]["payload"])) / 8000


async def replay_refused(server: RunningServer, path: str) -> int:
    signature = VALIDATOR.compute_signature(f"wss://gw.example.com{path}", {})
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(
            ws_base(server) + path, additional_headers={"X-Twilio-Signature": signature}
        )
    return info.value.response.status_code


@pytest.mark.parametrize("redis_up", [True, False], ids=["redis-up", "redis-down"])
async def test_a_replayed_stream_handshake_is_refused_and_the_real_call_goes_on(
    fake_openai: FakeOpenAIServer, redis_server: RedisServer, redis_up: bool
) -> None:
    async with gateways(fake_openai, redis_server.url) as (a, b):
        if not redis_up:
            redis_server.stop()
        twiml = await post(a, "/twilio/voice", action_params("CA-real", "ringing"))
        match = re.search(r'url="wss://gw\.example\.com(/twilio/stream/[^"]+)"', twiml)
        assert match is not None, twiml
        path = match.group(1)
        real, stream_sid = await open_stream(b, path, "CA-real")
        await media_flows(real, 0.5)  # the greeting plays on the real stream
        # The same signed handshake again: on B (which admitted it) and on A (which minted
        # it and, with Redis up, used to trust its own copy over Redis's answer).
        replays = [await replay_refused(b, path)]
        if redis_up:
            replays.append(await replay_refused(a, path))
        await media_flows(real, 2.0)  # the real call is unaffected: the rest of it plays
        record = await b.gateway.store.get("CA-real")
        await real.close()
    assert replays == [403] * len(replays)
    assert record is not None and record.stream_sid == stream_sid and record.stream_count == 1
