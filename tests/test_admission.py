"""Admission on a real gateway (uvicorn on a free port, providers behind a local OpenAI-wire
server): whether the instance takes a call (``/readyz``, ``ivr_ready``), what a call hears when
it cannot (the overflow TwiML), and what makes it unready (full, a late event loop, a drain) or
does not (Redis away). Calls are the simulator's: signed webhooks and real Media Streams.

The gateway runs on this test's event loop, so blocking that loop blocks the gateway for real.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from redis_server import RedisServer, unique_prefix
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection, connect

from ivr.admission import OVERFLOW_APOLOGY
from ivr.config import Settings
from ivr.obs.loop_lag import LoopLagMonitor
from ivr.server import RunningServer, free_port
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.sim.script import Script, script_from_data
from ivr.sim.webhook import CallIds, TwilioSide, parse_stream, rebase

pytestmark = pytest.mark.timeout(60)

OVERFLOW_NUMBER = "+14155550100"
LAG_LIMIT_MS = 100  # the default; the blocks below are 4-6 times longer


# -- HTTP helpers ----------------------------------------------------------------------------


async def readyz(server: RunningServer) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.get(server.base_url + "/readyz")
    return response.status_code, response.json()


async def until_readyz(server: RunningServer, status: int, within: float = 10.0) -> dict[str, Any]:
    """Poll /readyz until it answers ``status``; its body then."""
    deadline = time.monotonic() + within
    while (seen := await readyz(server))[0] != status:
        if time.monotonic() > deadline:
            pytest.fail(f"/readyz did not answer {status} within {within} s; last: {seen}")
        await asyncio.sleep(0.05)
    return seen[1]


async def metrics_text(server: RunningServer) -> str:
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.get(server.base_url + "/metrics")
    assert response.status_code == 200
    return response.text


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of the Prometheus exposition ``text`` (None if absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def lag_samples_over(text: str, seconds: str) -> float:
    """How many ivr_event_loop_lag_seconds observations were above the bucket ``seconds``."""
    total = sample(text, "ivr_event_loop_lag_seconds_bucket", le="+Inf")
    below = sample(text, "ivr_event_loop_lag_seconds_bucket", le=seconds)
    assert total is not None and below is not None, "ivr_event_loop_lag_seconds not exported"
    return total - below


def twilio_side(http: httpx.AsyncClient, server: RunningServer) -> TwilioSide:
    ids = CallIds("CA" + secrets.token_hex(16), "AC" + secrets.token_hex(16), "+15550001111",
                  "+15550002222")  # fmt: skip
    return TwilioSide(http, server.base_url, PUBLIC_URL, AUTH_TOKEN, ids)


async def voice_webhook(server: RunningServer) -> str:
    """A new call's signed voice webhook, as Twilio sends it; the TwiML that comes back."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        side = twilio_side(http, server)
        return await side.request("/twilio/voice", side.params("ringing"))


def verbs(twiml: str) -> list[ET.Element]:
    root = ET.fromstring(twiml)
    assert root.tag == "Response", twiml
    return list(root)


def assert_stream(twiml: str) -> None:
    stream = parse_stream(twiml)
    assert stream is not None and stream.url.startswith("wss://gw.example.com/"), twiml


def assert_apology(twiml: str) -> None:
    say, hangup = verbs(twiml)  # exactly these two verbs, in this order
    assert (say.tag, say.text, hangup.tag) == ("Say", OVERFLOW_APOLOGY, "Hangup"), twiml


# -- calls -----------------------------------------------------------------------------------


def script(*steps: dict[str, Any]) -> Script:
    # No waiting for the greeting: the caller's line stays open exactly as long as the steps.
    return script_from_data({"steps": list(steps), "wait_for_greeting": False})


async def call(server: RunningServer, *steps: dict[str, Any]) -> CallReport:
    return await place_call(
        server.base_url, script=script(*steps), auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
    )


@asynccontextmanager
async def held_call(server: RunningServer) -> AsyncIterator[None]:
    """One call whose stream stays open until the block exits (then the caller hangs up):
    signed webhook, signed stream handshake, ``connected``/``start``, ``stop``."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        side = twilio_side(http, server)
        twiml = await side.request("/twilio/voice", side.params("ringing"))
    stream = parse_stream(twiml)
    assert stream is not None, twiml
    headers = {"X-Twilio-Signature": side.validator.compute_signature(stream.url, {})}
    ws_base = server.base_url.replace("http://", "ws://")
    async with connect(rebase(stream.url, ws_base), additional_headers=headers) as ws:
        sid = "MZ" + secrets.token_hex(16)
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        start = {
            "accountSid": side.ids.account_sid,
            "streamSid": sid,
            "callSid": side.ids.call_sid,
            "tracks": ["inbound"],
            "customParameters": stream.parameters,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        }
        await ws.send(json.dumps({"event": "start", "sequenceNumber": "1", "start": start,
                                  "streamSid": sid}))  # fmt: skip
        listener = asyncio.create_task(_discard(ws))  # the greeting's audio and marks
        try:
            await until_counted(server, calls=1)
            yield
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            stop = {"accountSid": side.ids.account_sid, "callSid": side.ids.call_sid}
            await ws.send(json.dumps({"event": "stop", "sequenceNumber": "2", "stop": stop,
                                      "streamSid": sid}))  # fmt: skip


async def until_counted(server: RunningServer, calls: int, within: float = 5.0) -> None:
    """Until the gateway counts ``calls`` live streams (/healthz?verbose, always 200)."""
    async with httpx.AsyncClient(timeout=10.0) as http, asyncio.timeout(within):
        while True:
            response = await http.get(server.base_url + "/healthz", params={"verbose": "true"})
            if response.json()["calls"] == calls:
                return
            await asyncio.sleep(0.05)


async def _discard(ws: ClientConnection) -> None:
    async for _ in ws:
        pass


# -- 1. full -----------------------------------------------------------------------------------


async def test_a_full_instance_is_unready_and_overflows_new_calls_until_its_call_ends(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(max_calls=1) as server:
        status, body = await readyz(server)
        assert status == 200 and body["ready"] is True and body["capacity"] == 1, body
        # The first caller stays on the line for 3 s of silence, then hangs up.
        first = asyncio.create_task(call(server, {"silence": 3.0}))
        try:
            body = await until_readyz(server, 503)
            # Why: one call of one allowed, and nothing else wrong.
            why = {k: body.get(k) for k in ("ready", "calls", "capacity", "draining", "overloaded")}
            assert why == {"ready": False, "calls": 1, "capacity": 1, "draining": False,
                           "overloaded": False}, body  # fmt: skip
            metrics = await metrics_text(server)
            assert sample(metrics, "ivr_ready") == 0.0
            assert sample(metrics, "ivr_capacity_calls") == 1.0
            overflowed = sample(metrics, "ivr_webhooks_total", outcome="overflow") or 0.0
            with capture_logs() as logs:
                second = await call(server, {"hangup": None})
            assert not first.done(), "the first call ended before the second one came"
        finally:
            report = await first
        assert not report.errors and len(report.streams) == 1, report.format_transcript()
        assert report.streams[0].ended_by == "caller", report.format_transcript()
        # The second caller heard the apology and never got a stream.
        assert not second.errors and second.streams == [], second.format_transcript()
        assert second.closing_twiml is not None and parse_stream(second.closing_twiml) is None
        assert_apology(second.closing_twiml)
        assert [e for e in logs if e["event"] == "webhook.overflow"], logs
        after = sample(await metrics_text(server), "ivr_webhooks_total", outcome="overflow")
        assert after == overflowed + 1

        # The first call is over: ready again, and a new call gets a stream.
        body = await until_readyz(server, 200, within=5.0)
        assert body["ready"] is True and body["calls"] == 0, body
        assert sample(await metrics_text(server), "ivr_ready") == 1.0
        third = await call(server, {"silence": 1.0})
    assert not third.errors, third.format_transcript()
    assert_stream(third.twiml[0])
    assert len(third.streams) == 1 and third.streams[0].ended_by == "caller"


async def test_a_burst_of_webhooks_is_admitted_only_up_to_the_capacity(
    gateway_factory: GatewayFactory,
) -> None:
    # Streams arrive a moment after their webhooks: counting only connected streams would
    # let a burst of webhooks through before any of them is live.
    async with gateway_factory(max_calls=1) as server:
        answers = await asyncio.gather(voice_webhook(server), voice_webhook(server))
        status, body = await readyz(server)
    streams = [a for a in answers if parse_stream(a) is not None]
    assert len(streams) == 1, answers
    assert_apology(next(a for a in answers if parse_stream(a) is None))
    # The answered call's stream has not arrived, yet it holds the one place.
    assert status == 503 and body["calls"] == 1, body


async def test_healthz_stays_200_while_full_and_verbose_says_why(
    gateway_factory: GatewayFactory,
) -> None:
    async with (
        gateway_factory(max_calls=1) as server,
        held_call(server),
        httpx.AsyncClient(timeout=10.0) as http,
    ):
        plain = await http.get(server.base_url + "/healthz")
        verbose = await http.get(server.base_url + "/healthz", params={"verbose": "true"})
    assert plain.status_code == 200 and plain.json() == {"status": "ok"}
    assert verbose.status_code == 200
    body = verbose.json()
    assert body["status"] == "ok" and body["ready"] is False, body
    assert (body["calls"], body["capacity"]) == (1, 1), body


async def test_max_calls_zero_means_unlimited(gateway_factory: GatewayFactory) -> None:
    async with gateway_factory(max_calls=0) as server:
        assert sample(await metrics_text(server), "ivr_capacity_calls") == 0.0
        async with held_call(server):
            status, body = await readyz(server)
            assert status == 200 and body["calls"] == 1 and body["capacity"] == 0, body
            assert_stream(await voice_webhook(server))


# -- 2. overflow kinds -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overflow", "expected"),
    [
        ("apology", [("Say", {}, OVERFLOW_APOLOGY), ("Hangup", {}, None)]),
        ("reject", [("Reject", {"reason": "busy"}, None)]),
        ("redirect", [("Dial", {}, None)]),
    ],
)
async def test_each_overflow_kind_is_what_a_call_hears_when_the_instance_is_full(
    gateway_factory: GatewayFactory,
    overflow: str,
    expected: list[tuple[str, dict[str, str], str | None]],
) -> None:
    async with gateway_factory(
        max_calls=1, overflow=overflow, overflow_number=OVERFLOW_NUMBER
    ) as server:
        async with held_call(server):
            twiml = await voice_webhook(server)
        # Nothing sticks: once the line is free, a new call gets a stream again.
        await until_readyz(server, 200, within=5.0)
        assert_stream(await voice_webhook(server))
    got = [(v.tag, dict(v.attrib), v.text) for v in verbs(twiml)]
    assert got == expected, twiml
    if overflow == "redirect":
        (dial,) = verbs(twiml)
        assert [(n.tag, n.text) for n in dial] == [("Number", OVERFLOW_NUMBER)], twiml


async def test_an_unsigned_webhook_is_refused_before_any_overflow(
    gateway_factory: GatewayFactory,
) -> None:
    async with (
        gateway_factory(max_calls=1) as server,
        held_call(server),
        httpx.AsyncClient(timeout=10.0) as http,
    ):
        side = twilio_side(http, server)
        response = await http.post(server.base_url + "/twilio/voice", data=side.params("ringing"))
    assert response.status_code == 403, response.text


@pytest.mark.parametrize("number", ["", "4155550100", "+1 415 555 0100", "+0415555010", "+1"])
def test_redirect_without_a_valid_e164_number_is_a_settings_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, number: str
) -> None:
    monkeypatch.setenv("IVR_OVERFLOW", "redirect")
    monkeypatch.setenv("IVR_OVERFLOW_NUMBER", number)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert "IVR_OVERFLOW_NUMBER" in str(info.value) and "E.164" in str(info.value)


@pytest.mark.slow
def test_ivr_serve_refuses_redirect_without_a_number_and_names_the_setting() -> None:
    # What an operator sees: the process stops before serving, no traceback. (Had it started,
    # the timeout below would end it and the test would fail.)
    env = {**os.environ, "IVR_OVERFLOW": "redirect", "IVR_PORT": str(free_port())}
    env.pop("IVR_OVERFLOW_NUMBER", None)
    result = subprocess.run(
        [sys.executable, "-m", "ivr.cli", "serve"],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "invalid settings" in result.stderr and "IVR_OVERFLOW_NUMBER" in result.stderr
    assert "Traceback" not in result.stderr


def test_redirect_with_an_e164_number_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IVR_MAX_CALLS", "7")
    monkeypatch.setenv("IVR_OVERFLOW", "redirect")
    monkeypatch.setenv("IVR_OVERFLOW_NUMBER", OVERFLOW_NUMBER)
    settings = Settings()
    assert (settings.max_calls, settings.overflow, settings.overflow_number) == (
        7,
        "redirect",
        OVERFLOW_NUMBER,
    )
    monkeypatch.setenv("IVR_OVERFLOW", "voicemail")
    with pytest.raises(ValidationError, match="overflow"):
        Settings()


# -- 3. event-loop lag, drain, Redis ---------------------------------------------------------


def block_loop(seconds: float) -> None:
    time.sleep(seconds)  # blocking the gateway's event loop is the point


async def keep_blocking(stop: asyncio.Event, seconds: float) -> None:
    """Block the loop ``seconds`` at a time with a 20 ms breath between: every timer on it,
    the lag monitor's included, fires hundreds of ms late, while requests still get served."""
    while not stop.is_set():
        block_loop(seconds)
        await asyncio.sleep(0.02)


async def test_a_loop_kept_late_makes_the_instance_overloaded_until_it_keeps_time_again(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(max_loop_lag_ms=LAG_LIMIT_MS) as server:
        await asyncio.sleep(0.5)  # some on-time samples first
        status, body = await readyz(server)
        assert status == 200 and body["overloaded"] is False, body
        before = lag_samples_over(await metrics_text(server), "0.25")
        stop = asyncio.Event()
        blocker = asyncio.create_task(keep_blocking(stop, 0.5))
        try:
            body = await until_readyz(server, 503, within=15.0)
            assert body["overloaded"] is True and body["ready"] is False, body
            assert body["loop_lag_ms"] > 2 * LAG_LIMIT_MS, body
            assert (body["calls"], body["draining"]) == (0, False), body  # not full, not draining
            metrics = await metrics_text(server)
            assert sample(metrics, "ivr_ready") == 0.0
            assert lag_samples_over(metrics, "0.25") >= before + 2
            # A call arriving now would stutter: it hears the overflow instead.
            overflow = await voice_webhook(server)
        finally:
            stop.set()
            await blocker
        body = await until_readyz(server, 200, within=10.0)
        assert body["overloaded"] is False and body["loop_lag_ms"] < LAG_LIMIT_MS, body
        assert sample(await metrics_text(server), "ivr_ready") == 1.0
        assert_stream(await voice_webhook(server))
    assert_apology(overflow)


async def test_one_long_pause_does_not_make_the_instance_overloaded(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(max_loop_lag_ms=LAG_LIMIT_MS) as server:
        await asyncio.sleep(1.0)  # a window's worth of on-time samples
        before = lag_samples_over(await metrics_text(server), "0.25")
        block_loop(0.6)  # one garbage-collection-like stall, 6 times the limit
        await asyncio.sleep(0.15)  # the monitor wakes and records it
        metrics = await metrics_text(server)
        status, body = await readyz(server)
    assert lag_samples_over(metrics, "0.25") >= before + 1  # measured and exported...
    assert status == 200 and body["overloaded"] is False, body  # ...but one is not a trend


async def test_what_startup_blocks_is_not_held_against_a_new_instance() -> None:
    # The monitor runs from the gateway's start; startup then blocks the loop on purpose
    # (prompts, flows, a heap collection) and restarts it: the sample under way is dropped.
    # The control, not restarted, holds the same stall against the instance.
    restarted, control = (LoopLagMonitor(LAG_LIMIT_MS / 1000, interval=0.05) for _ in "ab")
    tasks = [asyncio.create_task(m.run()) for m in (restarted, control)]
    try:
        await asyncio.sleep(0.01)
        block_loop(0.4)  # startup's stall, mid-sample
        restarted.restart()
        await asyncio.sleep(0.02)  # both wake late and record (or drop) that sample
        assert control.overloaded and control.lag > 0.3, control.lag
        assert not restarted.overloaded and restarted.lag == 0.0, restarted.lag
        await asyncio.sleep(0.2)
        assert not restarted.overloaded and restarted.lag < LAG_LIMIT_MS / 1000
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_max_loop_lag_zero_never_reports_overloaded(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory(max_loop_lag_ms=0) as server:
        stop = asyncio.Event()
        blocker = asyncio.create_task(keep_blocking(stop, 0.3))
        try:
            await asyncio.sleep(2.5)  # a whole window of late wake-ups
            status, body = await readyz(server)
        finally:
            stop.set()
            await blocker
    assert body["loop_lag_ms"] > LAG_LIMIT_MS, body  # measured...
    assert status == 200 and body["overloaded"] is False, body  # ...never held against it


async def test_a_draining_instance_is_unready_and_without_shared_state_overflows_new_calls(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory() as server:
        result = await server.gateway.drain()  # what SIGTERM starts; no calls: returns at once
        assert result.left == 0
        status, body = await readyz(server)
        twiml = await voice_webhook(server)
    assert status == 503 and body["draining"] is True and body["ready"] is False, body
    # The store is this process's memory: a stream elsewhere could not find the call.
    assert_apology(twiml)


@pytest.mark.slow
async def test_readyz_does_not_depend_on_redis_and_reports_the_store(
    gateway_factory: GatewayFactory, redis_server: RedisServer
) -> None:
    # A generous budget: a /readyz that waited on the store, even within it, would be seen.
    settings = {"redis_url": redis_server.url, "redis_prefix": unique_prefix(),
                "redis_budget_ms": 2000}  # fmt: skip
    async with gateway_factory(**settings) as server:
        status, body = await readyz(server)
        assert status == 200 and body["store"] == "ok", body
        metrics = await metrics_text(server)
        assert sample(metrics, "ivr_store_degraded") == 0.0

        # Frozen (accepts, never answers): /readyz must not wait on it.
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            status, body = await readyz(server)
            assert time.monotonic() - began < 1.0
            assert status == 200 and body["ready"] is True, body
        finally:
            redis_server.process.send_signal(signal.SIGCONT)

        # Gone: calls still come in (from memory); the store says so, readiness does not care.
        redis_server.stop()
        status, body = await readyz(server)
        assert status == 200 and body["ready"] is True, body
        assert_stream(await voice_webhook(server))
        status, body = await readyz(server)
        assert status == 200 and body["ready"] is True and body["store"] == "degraded", body
        assert sample(await metrics_text(server), "ivr_store_degraded") == 1.0

        # Back: the store reports ok again once the reconciler has caught up.
        redis_server.start()
        async with asyncio.timeout(10.0):
            while (await readyz(server))[1]["store"] != "ok":  # noqa: ASYNC110 - over HTTP
                await asyncio.sleep(0.1)
        status, body = await readyz(server)
    assert status == 200 and body["ready"] is True, body
