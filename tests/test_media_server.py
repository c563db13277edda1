"""The media streams' two servers, picows (``ivr serve``'s default, ``ivr.media_server``) and
uvicorn + Starlette (``IVR_MEDIA_SERVER=asgi``), held to the same behaviour at the socket: the
same answers to a refused upgrade, messages put back together from fragments, bad frames counted
while the call goes on, a flood read without loss, and streams closed 1012 at shutdown.

Twilio's side is a raw WebSocket client (``Line`` from the edge-case tests) against a real
gateway under uvicorn on a free port.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import websockets
from gateway_support import GatewayFactory
from prometheus_client import REGISTRY
from redis_server import RedisServer, unique_prefix
from structlog.testing import capture_logs
from test_call_edge_cases import (
    MENU_FLOW,
    SILENCE,
    VALIDATOR,
    Line,
    eventually,
    handshake,
    record,
    start_event,
    stream_path,
    voice,
    write_flow,
)

from ivr.server import RunningServer
from ivr.state.base import CallStatus

pytestmark = pytest.mark.slow

SERVERS = ["picows", "asgi"]


def protocol_errors(reason: str) -> float:
    value = REGISTRY.get_sample_value("ivr_protocol_errors_total", {"reason": reason})
    return value or 0.0


def menu_gateway(
    factory: GatewayFactory, tmp_path: Path, media_server: str = "picows"
) -> AbstractAsyncContextManager[RunningServer]:
    return factory(flows_dir=write_flow(tmp_path, MENU_FLOW), media_server=media_server)


async def answered_call(server: RunningServer, call_sid: str) -> Line:
    """A call's stream, opened and past the menu's prompt (its mark echoed)."""
    path = stream_path(await voice(server.base_url, call_sid))
    assert path
    line = await Line.open(server.base_url, path, call_sid, "MZ" + call_sid)
    await line.feed_silence_until(lambda: line.count("mark") >= 1)
    return line


async def wait_until(done: object, within: float = 5.0) -> None:
    assert callable(done)
    deadline = asyncio.get_running_loop().time() + within
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("media_server", SERVERS)
async def test_a_call_is_carried_by_the_configured_server(
    gateway_factory: GatewayFactory, tmp_path: Path, media_server: str
) -> None:
    async with menu_gateway(gateway_factory, tmp_path, media_server) as server:
        line = await answered_call(server, "CA1")
        if media_server == "picows":
            assert server.media is not None and server.media.open_streams == 1
        else:
            assert server.media is None
        await line.dtmf("1")  # the menu moves on: the caller's messages reach the flow
        await eventually(server, "CA1", lambda r: r.node == "second")
        await line.drop()
        await eventually(server, "CA1", lambda r: r.status != CallStatus.ACTIVE)
        if server.media is not None:
            await wait_until(lambda: server.media is not None and server.media.open_streams == 0)


@pytest.mark.parametrize("media_server", SERVERS)
async def test_refused_upgrades_are_answered_alike(
    gateway_factory: GatewayFactory, tmp_path: Path, media_server: str
) -> None:
    async with menu_gateway(gateway_factory, tmp_path, media_server) as server:
        ws_base = server.base_url.replace("http://", "ws://")
        path = stream_path(await voice(server.base_url, "CA2"))
        assert path
        statuses = []
        # No signature; a token no webhook minted; a path no route has.
        for attempt in (
            websockets.connect(ws_base + path),
            handshake(server.base_url, "/twilio/stream/not-a-token"),
            handshake(server.base_url, "/elsewhere"),
        ):
            with pytest.raises(websockets.InvalidStatus) as info:
                await attempt
            statuses.append(info.value.response.status_code)
        assert statuses == [403, 403, 403]
        # The token is still good after those: the real stream is taken.
        line = await Line.open(server.base_url, path, "CA2", "MZ2")
        await line.feed_silence_until(lambda: line.count("media") > 0)
        await line.drop()


@pytest.mark.parametrize("media_server", SERVERS)
async def test_a_message_sent_in_fragments_is_taken_whole(
    gateway_factory: GatewayFactory, tmp_path: Path, media_server: str
) -> None:
    async with menu_gateway(gateway_factory, tmp_path, media_server) as server:
        path = stream_path(await voice(server.base_url, "CA3"))
        assert path
        ws = await handshake(server.base_url, path)
        line = Line(ws, "MZ3")
        start = json.dumps({**start_event("CA3", "MZ3"), "sequenceNumber": "1"})
        thirds = len(start) // 3
        await ws.send([start[:thirds], start[thirds : 2 * thirds], start[2 * thirds :]])
        await line.feed_silence_until(lambda: line.count("media") > 0)  # the call started
        assert (await record(server, "CA3")).stream_sid == "MZ3"
        await line.drop()


@pytest.mark.parametrize("media_server", SERVERS)
async def test_binary_broken_and_oversized_messages_are_counted_and_the_call_goes_on(
    gateway_factory: GatewayFactory, tmp_path: Path, media_server: str
) -> None:
    async with menu_gateway(gateway_factory, tmp_path, media_server) as server:
        line = await answered_call(server, "CA4")
        before = {r: protocol_errors(r) for r in ("binary_frame", "bad_json", "oversized_frame")}
        await line.ws.send(b"\x00\x01binary")
        if media_server == "picows":  # uvicorn's own protocol drops the socket for this one
            await line.ws.send(b"\xff\xfe not utf-8", text=True)  # invalid UTF-8 as text
        await line.ws.send("x" * (100 * 1024))  # 100 KiB: past what Twilio ever sends
        await line.feed([SILENCE] * 5)
        await line.dtmf("1")
        await eventually(server, "CA4", lambda r: r.node == "second")
        after = {r: protocol_errors(r) for r in before}
        assert after["oversized_frame"] - before["oversized_frame"] == 1
        # The bad UTF-8 is passed on as bytes and reported as a binary frame.
        binary = 2 if media_server == "picows" else 1
        assert after["binary_frame"] - before["binary_frame"] == binary, (before, after)
        assert after["bad_json"] == before["bad_json"]
        await line.drop()


async def test_a_flood_of_messages_is_read_as_the_call_catches_up_and_none_is_lost(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    async with menu_gateway(gateway_factory, tmp_path) as server:
        assert server.media is not None
        line = await answered_call(server, "CA5")
        gaps = protocol_errors("sequence_gap")
        # 40 s of audio at once, more than the 500 messages the socket queues before it stops
        # reading: TCP holds the rest until the call has taken them.
        for _ in range(2000):
            await line.send_media(SILENCE)
        await line.dtmf("1")
        await eventually(server, "CA5", lambda r: r.node == "second", within=30.0)
        assert protocol_errors("sequence_gap") == gaps  # every message read, in order
        await line.drop()


@pytest.mark.parametrize("media_server", SERVERS)
async def test_a_stream_still_open_at_shutdown_is_closed_with_1012(
    gateway_factory: GatewayFactory, tmp_path: Path, media_server: str
) -> None:
    async with menu_gateway(gateway_factory, tmp_path, media_server) as server:
        line = await answered_call(server, "CA6")
    assert await line.closed_by_gateway(within=10.0) == 1012


async def test_a_caller_gone_while_its_stream_is_admitted_leaves_nothing_behind(
    gateway_factory: GatewayFactory, tmp_path: Path, redis_server: RedisServer
) -> None:
    # The store stalls (SIGSTOP) while the upgrade's token is redeemed, and the caller's side
    # drops the connection meanwhile: once the store answers, the stream must not be upgraded
    # on the dead connection, nor be left open, and the next call must be carried as usual.
    flows = write_flow(tmp_path, MENU_FLOW)
    settings = {"redis_url": redis_server.url, "redis_prefix": unique_prefix(),
                "redis_budget_ms": 3000}  # fmt: skip
    async with gateway_factory(flows_dir=flows, **settings) as server:
        assert server.media is not None and redis_server.process is not None
        path = stream_path(await voice(server.base_url, "CA7"))
        assert path
        signature = VALIDATOR.compute_signature(f"wss://gw.example.com{path}", {})
        with capture_logs() as logs:
            redis_server.process.send_signal(signal.SIGSTOP)
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(
                    f"GET {path} HTTP/1.1\r\nHost: gw.example.com\r\nUpgrade: websocket\r\n"
                    "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                    f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                    f"X-Twilio-Signature: {signature}\r\n\r\n".encode()
                )
                await writer.drain()
                await asyncio.sleep(0.3)  # the gateway is redeeming the token, on the stall
                writer.close()
                await writer.wait_closed()
                await asyncio.sleep(0.2)
            finally:
                redis_server.process.send_signal(signal.SIGCONT)
            await wait_until(lambda: server.media is not None and server.media.open_streams == 0)
            await asyncio.sleep(0.5)  # time for a late failure to be logged
        # Nothing written, not even a 101: the token was still being redeemed when it left.
        assert not await reader.read(), "nothing may be written to a connection that left"
        failures = [e for e in logs if e["log_level"] in ("error", "critical")]
        assert failures == [], failures
        line = await answered_call(server, "CA8")  # the next call is carried as usual
        await line.drop()
