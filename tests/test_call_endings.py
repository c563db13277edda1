"""Every call ends in its record, once, with the outcome that happened (issue 25).

Real gateways (in-process under uvicorn, or ``ivr serve`` processes sharing a real Redis), real
WebSockets, Twilio played by tests/call_bursts.py: a stream killed mid-call and never resumed,
a handshake forged so the call never connects, Twilio's status callbacks in every order. After
each: the console's lists (its event stream and ended search), the store, the metrics and the
``call.ended`` lines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from call_bursts import RawCall, burst, call_in_progress, ring
from gateway_procs import API_KEY, GatewayProcesses, fast_speak, gateway_env
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from prometheus_client import REGISTRY
from redis_server import LOCAL_REDIS_URL
from structlog.testing import capture_logs

from ivr.config import CLOCK_SKEW_S
from ivr.control.sweeper import CallSweeper, Windows
from ivr.server import RunningServer
from ivr.state.base import CallRecord, CallStatus, CallStore
from ivr.state.outcomes import Outcome
from ivr.state.redis_store import RedisCallStore
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

ADMIN = "endings-admin-token"
TOKEN_TTL, RESUME_WINDOW = 2.0, 7.0  # a token's expiry is whole seconds: it lives 1-2 s
NEVER_CONNECTED_AFTER = TOKEN_TTL + CLOCK_SKEW_S
SETTINGS = {
    "admin_token": ADMIN,
    "stream_token_ttl_s": TOKEN_TTL,
    "resume_window_s": RESUME_WINDOW,
}
Logs = list[dict[str, Any]]


def calls_total(outcome: str) -> float:
    return REGISTRY.get_sample_value("ivr_calls_total", {"outcome": outcome}) or 0.0


def stream_events(event: str) -> float:
    labels = {"event": event}
    return REGISTRY.get_sample_value("ivr_twilio_stream_events_total", labels) or 0.0


def active_streams() -> float:
    return REGISTRY.get_sample_value("ivr_active_calls") or 0.0


def ended_lines(logs: Logs, call_sid: str) -> Logs:
    return [e for e in logs if e["event"] == "call.ended" and e.get("call_sid") == call_sid]


async def until(check: Callable[[], bool | Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while True:
        done = check()
        if done if isinstance(done, bool) else await done:
            return
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        await asyncio.sleep(0.1)


async def ended(store: CallStore, call_sid: str, within: float = 15.0) -> CallRecord:
    async def over() -> bool:
        record = await store.get(call_sid)
        return record is not None and record.is_ended

    await until(over, within, f"{call_sid} ended")
    record = await store.get(call_sid)
    assert record is not None
    return record


class Console:
    """What an operator sees: the console's active list (its event stream, as the page gets
    it) and its ended search."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.auth = {"Authorization": f"Bearer {ADMIN}"}

    async def active(self) -> list[str]:
        ticket = (await self.http.post("/console/api/ticket", headers=self.auth)).json()["ticket"]
        async with self.http.stream("GET", f"/console/api/events?ticket={ticket}") as answer:
            name = ""
            async for line in answer.aiter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and name == "active":
                    return [c["call_sid"] for c in json.loads(line[6:])["calls"]]
        raise AssertionError("the console's event stream sent no active list")

    async def settled_active(self, expected: list[str], within: float = 5.0) -> None:
        """The active list is ``expected`` once the console's feed has read the store."""
        seen: list[str] = []

        async def same() -> bool:
            nonlocal seen
            seen = await self.active()
            return sorted(seen) == sorted(expected)

        try:
            await until(same, within, "the console's active list")
        except AssertionError:
            raise AssertionError(f"console lists {seen}, expected {expected}") from None

    async def ended(self, **search: str) -> dict[str, dict[str, Any]]:
        answer = await self.http.get("/console/api/ended", params=search, headers=self.auth)
        assert answer.status_code == 200, answer.text
        return {c["call_sid"]: c for c in answer.json()["calls"]}


@asynccontextmanager
async def gateway_with_console(
    factory: GatewayFactory, **overrides: Any
) -> AsyncIterator[tuple[RunningServer, httpx.AsyncClient, Console]]:
    async with (
        factory(**(SETTINGS | overrides)) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as http,
    ):
        yield server, http, Console(http)


async def answer(server: RunningServer, http: httpx.AsyncClient) -> RawCall:
    return await RawCall.answer(http, server.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL)


async def connected(server: RunningServer, http: httpx.AsyncClient) -> RawCall:
    return await call_in_progress(
        http, server.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL
    )


@pytest.fixture
def fake(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.chat = lambda request: ChatScript(text="Happy to help.")
    return fake_openai


# -- never connected, dropped --------------------------------------------------------------------


@pytest.mark.slow
async def test_a_call_whose_handshake_is_forged_ends_never_connected_once_its_token_is_past(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    before, streams = calls_total("never_connected"), active_streams()
    async with gateway_with_console(gateway_factory) as (server, http, console):
        store = server.gateway.store
        with capture_logs() as logs:
            call = await answer(server, http)
            assert await call.forge_handshake() == 403
            await console.settled_active([call.call_sid])  # answered: ringing, waiting
            record = await ended(store, call.call_sid, within=NEVER_CONNECTED_AFTER + 6)
            await console.settled_active([])
        listed = await console.ended()
    waited = (record.ended_at - record.created_at).total_seconds() if record.ended_at else 0
    assert record.outcome == Outcome.NEVER_CONNECTED and record.status == CallStatus.ENDED
    assert waited >= NEVER_CONNECTED_AFTER, "ended while its token could still connect"
    assert listed[call.call_sid]["outcome"] == "never_connected"
    assert calls_total("never_connected") == before + 1
    assert active_streams() == streams  # no stream ever counted
    [line] = ended_lines(logs, call.call_sid)
    assert line["outcome"] == "never_connected" and line["ended_by"] == "sweep"


@pytest.mark.slow
async def test_a_stream_killed_mid_call_and_never_resumed_ends_dropped(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    before, streams = calls_total("dropped"), active_streams()
    async with gateway_with_console(gateway_factory) as (server, http, console):
        store = server.gateway.store
        with capture_logs() as logs:
            call = await connected(server, http)
            assert active_streams() == streams + 1
            await call.talk(0.3)
            await call.kill()  # no stop, and no <Connect action> request ever follows
            killed = datetime.now(UTC)
            await until(lambda: active_streams() == streams, 5, "the stream let go")
            waiting = await store.get(call.call_sid)
            assert waiting is not None and waiting.status == CallStatus.RECONNECTING
            await console.settled_active([call.call_sid])  # waiting for its resume
            record = await ended(store, call.call_sid, within=RESUME_WINDOW + 6)
            await console.settled_active([])
        listed = await console.ended(outcome="dropped")
    assert record.outcome == Outcome.DROPPED and record.ended_at is not None
    assert (record.ended_at - killed).total_seconds() >= RESUME_WINDOW - 0.5
    assert list(listed) == [call.call_sid]
    assert calls_total("dropped") == before + 1
    assert [e["event"] for e in logs if e.get("call_sid") == call.call_sid].count("call.ended") == 1
    [line] = ended_lines(logs, call.call_sid)
    assert (line["outcome"], line["ended_by"], line["resumes"]) == ("dropped", "sweep", 0)


@pytest.mark.slow
async def test_a_killed_stream_resumed_within_the_window_is_not_ended(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    dropped, hung_up = calls_total("dropped"), calls_total("caller_hung_up")
    async with gateway_with_console(gateway_factory) as (server, http, console):
        store = server.gateway.store
        with capture_logs() as logs:
            first = await connected(server, http)
            await first.kill()
            await asyncio.sleep(RESUME_WINDOW - 2)  # Twilio asks late, well inside the window
            resumed = first.follow(await first.action())
            await resumed.connect()
            await resumed.bot_spoke()
            await asyncio.sleep(RESUME_WINDOW + 2)  # past the first drop's window: still live
            live = await store.get(first.call_sid)
            await console.settled_active([first.call_sid])
            await resumed.hang_up()
            record = await ended(store, first.call_sid)
    assert live is not None and live.status == CallStatus.ACTIVE and not live.is_ended
    assert record.outcome == Outcome.CALLER_HUNG_UP and record.stream_count == 2
    assert calls_total("dropped") == dropped and calls_total("caller_hung_up") == hung_up + 1
    [line] = ended_lines(logs, first.call_sid)
    assert line["resumes"] == 1


# -- Twilio's callbacks --------------------------------------------------------------------------

STEPS = ("stop", "stream-stopped", "completed")


async def _step(call: RawCall, step: str, seconds: int) -> None:
    if step == "stop":
        await call.hang_up()
    elif step == "stream-stopped":
        assert await call.stream_status("stream-stopped") == 204
    else:
        assert await call.call_status("completed", seconds) == 204


@pytest.mark.slow
async def test_twilio_callbacks_in_every_order_end_the_call_once_and_are_kept_once(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    async with gateway_with_console(gateway_factory) as (server, http, console):
        store = server.gateway.store
        for order in itertools.permutations(STEPS):
            hung_up = calls_total("caller_hung_up")
            started, stopped = stream_events("stream-started"), stream_events("stream-stopped")
            with capture_logs() as logs:
                call = await connected(server, http)
                assert await call.stream_status("stream-started") == 204
                for step in order:
                    await _step(call, step, seconds=42)
                # Twilio repeats a callback, and one comes late: nothing changes twice.
                assert await call.stream_status("stream-stopped") == 204
                assert await call.stream_status("stream-started") == 204
                assert await call.call_status("completed", 99) == 204
                record = await ended(store, call.call_sid)
                await console.settled_active([])
            where = f"order {order}"
            assert record.outcome == Outcome.CALLER_HUNG_UP, where
            assert (record.twilio_status, record.billed_seconds) == ("completed", 42), where
            kinds = [(e["kind"], e.get("event") or e.get("status")) for e in record.timeline]
            assert sorted(k for k in kinds if k[0].startswith("twilio")) == [
                ("twilio_status", "completed"),
                ("twilio_stream", "stream-started"),
                ("twilio_stream", "stream-stopped"),
            ], where
            assert calls_total("caller_hung_up") == hung_up + 1, where
            assert stream_events("stream-started") == started + 1, where
            assert stream_events("stream-stopped") == stopped + 1, where
            assert len(ended_lines(logs, call.call_sid)) == 1, (where, logs)
            row = (await console.ended())[call.call_sid]
            assert (row["outcome"], row["twilio_status"], row["billed_s"]) == (
                "caller_hung_up",
                "completed",
                42,
            ), where


@pytest.mark.slow
async def test_twilio_ending_a_call_that_never_connected_ends_it_at_once_and_the_sweep_after(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    async with gateway_with_console(gateway_factory) as (server, http, console):
        store = server.gateway.store
        for status in ("completed", "busy", "no-answer", "failed", "canceled"):
            before = calls_total("never_connected")
            with capture_logs() as logs:
                call = await answer(server, http)
                assert await call.forge_handshake() == 403
                assert await call.stream_status("stream-error", "31920 handshake: 403") == 204
                assert await call.call_status(status, 0 if status == "completed" else None) == 204
                record = await store.get(call.call_sid)
                assert record is not None and record.outcome == Outcome.NEVER_CONNECTED, status
                assert record.twilio_status == status
                await asyncio.sleep(0.2)
            [line] = ended_lines(logs, call.call_sid)
            assert line["ended_by"] == "twilio", status
            errors = [e for e in record.timeline if e.get("event") == "stream-error"]
            assert [e["error"] for e in errors] == ["31920 handshake: 403"]
            assert calls_total("never_connected") == before + 1
        # The sweep, past every token, finds nothing left to end.
        swept = calls_total("never_connected")
        await asyncio.sleep(NEVER_CONNECTED_AFTER + 2)
        assert await server.gateway.sweeper.sweep() == 0
        assert calls_total("never_connected") == swept
        await console.settled_active([])


@pytest.mark.slow
async def test_a_status_callback_after_the_sweep_is_kept_but_changes_no_ending(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    async with gateway_with_console(gateway_factory) as (server, http, _):
        store = server.gateway.store
        call = await answer(server, http)
        swept = await ended(store, call.call_sid, within=NEVER_CONNECTED_AFTER + 6)
        before = calls_total("never_connected")
        with capture_logs() as logs:
            assert await call.call_status("completed", 7) == 204
            assert await call.call_status("completed", 7) == 204
        record = await store.get(call.call_sid)
    assert record is not None and record.outcome == swept.outcome == Outcome.NEVER_CONNECTED
    assert record.ended_at == swept.ended_at and record.twilio_status == "completed"
    assert calls_total("never_connected") == before and not ended_lines(logs, call.call_sid)


async def test_status_callbacks_must_be_signed_and_well_formed(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    async with gateway_with_console(gateway_factory) as (server, http, _):
        call = await answer(server, http)
        assert call.stream.status_callback == PUBLIC_URL + "/twilio/stream-status"
        form = call.tw.params("completed") | {"CallDuration": "5"}
        stream = {"CallSid": call.call_sid, "StreamSid": "MZ1", "StreamEvent": "stream-error"}
        for path, params in (
            ("/twilio/status", form),
            ("/twilio/outbound-status", form),
            ("/twilio/stream-status", stream),
        ):
            assert await call.post(path, params, signed=False) == 403, path
            forged = await http.post(path, data=params, headers={"X-Twilio-Signature": "forged"})
            assert forged.status_code == 403, path
        record = await server.gateway.store.get(call.call_sid)
        assert record is not None and not record.is_ended and not record.twilio_status
        assert not [e for e in record.timeline if e["kind"].startswith("twilio")]
        bad = await call.call_status("completed", None, CallDuration="12s")
        assert bad == 400
        assert await call.stream_status("stream-exploded") == 400
        unknown = call.tw.params("completed") | {"CallSid": "CA" + "f" * 32}
        assert await call.post("/twilio/status", unknown) == 204
        assert await call.call_status("in-progress") == 204  # not final: nothing to keep
        record = await server.gateway.store.get(call.call_sid)
        assert record is not None and not record.is_ended


# -- overflow ------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_call_refused_for_overflow_is_ended_listed_and_counted(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    before = calls_total("overflow")
    async with gateway_with_console(gateway_factory, max_calls=1) as (server, http, console):
        await answer(server, http)  # holds the one place until its stream comes
        refused, twiml = await ring(
            http, server.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL
        )
        assert "<Connect" not in twiml  # the overflow answer
        record = await server.gateway.store.get(refused.ids.call_sid)
        listed = await console.ended(outcome="overflow")
    assert record is not None and record.outcome == Outcome.OVERFLOW and record.is_ended
    assert list(listed) == [refused.ids.call_sid]
    assert calls_total("overflow") == before + 1


# -- exactly once across instances ---------------------------------------------------------------


async def test_two_instances_sweeping_the_same_calls_end_each_once(prefix: str) -> None:
    """Two sweepers on two Redis connections race over the same stale calls: each call is
    ended, logged and counted once (the compare-and-set decides)."""
    stores = [RedisCallStore(LOCAL_REDIS_URL, prefix=prefix) for _ in range(2)]
    windows = Windows(token_ttl=0.1, resume=CLOCK_SKEW_S + 0.1)
    sweepers = [CallSweeper(store, windows) for store in stores]
    sids = [f"CA-race-{i}" for i in range(20)]
    for i, sid in enumerate(sids):
        await stores[0].create(CallRecord(call_sid=sid))
        if i % 2:  # half were connected once, then dropped
            await stores[0].update(sid, lambda r: setattr(r, "stream_count", 1))
            await stores[0].update(sid, lambda r: setattr(r, "status", CallStatus.RECONNECTING))
    await asyncio.sleep(CLOCK_SKEW_S + 0.3)
    before = {o: calls_total(o) for o in ("never_connected", "dropped")}
    try:
        with capture_logs() as logs:
            done = await asyncio.gather(*(s.sweep() for s in sweepers))
        records = [await stores[1].get(sid) for sid in sids]
    finally:
        for store in stores:
            await store.aclose()
    assert sum(done) == len(sids), done
    assert all(r is not None and r.is_ended for r in records)
    outcomes = [r.outcome for r in records if r is not None]
    assert outcomes == [Outcome.NEVER_CONNECTED, Outcome.DROPPED] * 10
    for sid in sids:
        assert len(ended_lines(logs, sid)) == 1, sid
    assert calls_total("never_connected") == before["never_connected"] + 10
    assert calls_total("dropped") == before["dropped"] + 10


# -- the console after a burst, in a browser -----------------------------------------------------


@pytest.mark.slow
async def test_after_a_burst_the_console_lists_only_calls_in_progress_with_true_outcomes(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    from gateway_procs import agent_replies
    from ops_stack import fake_transcribe
    from playwright.async_api import async_playwright, expect

    fake_openai.transcribe, fake_openai.chat = fake_transcribe, agent_replies
    async with gateway_with_console(gateway_factory) as (server, http, console):
        sent = await burst(server.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL)
        for sid in sent.expected():
            await ended(server.gateway.store, sid, within=RESUME_WINDOW + 8)
        live = await connected(server, http)
        await console.settled_active([live.call_sid])
        listed = await console.ended()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"]
            )
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            await page.goto(f"{server.base_url}/console")
            await page.fill("#token", ADMIN)
            await page.click("#login-form button")
            await expect(page.locator("#link-state")).to_have_text("live", timeout=10_000)
            active = page.locator("#active-table tbody tr[data-sid]")
            await expect(active).to_have_count(1)
            await expect(active).to_have_attribute("data-sid", live.call_sid)
            for sid, outcome in sent.expected().items():
                row = page.locator(f'#ended-table tbody tr[data-sid="{sid}"]')
                await expect(row.locator("td.outcome")).to_have_text(outcome)
            await browser.close()
        await live.hang_up()
    assert {sid: listed[sid]["outcome"] for sid in sent.expected()} == sent.expected()


@pytest.mark.slow
async def test_two_gateway_processes_end_each_stale_call_once(tmp_path: Path, prefix: str) -> None:
    """Two ``ivr serve`` processes on one Redis, both sweeping: calls answered on either that
    never connected, or whose stream died, are ended once across the two (one ``call.ended``
    line, one count in the sum of both instances' ``ivr_calls_total``)."""
    windows = {"IVR_STREAM_TOKEN_TTL_S": str(TOKEN_TTL), "IVR_RESUME_WINDOW_S": str(RESUME_WINDOW)}
    with FakeOpenAIServer(api_key=API_KEY) as fake, GatewayProcesses(tmp_path) as group:
        fake.speak = fast_speak
        env = gateway_env(
            providers_url=fake.base_url,
            api_key=API_KEY,
            public_url=PUBLIC_URL,
            auth_token=AUTH_TOKEN,
            redis_url=LOCAL_REDIS_URL,
            redis_prefix=prefix,
            **windows,
        )
        gateways = [group.start(f"gw-{i}", env) for i in (1, 2)]
        await group.wait_healthy()
        never, dropped = [], []
        async with httpx.AsyncClient(timeout=10) as http:
            for i in range(6):
                base = gateways[i % 2].base_url
                call = await RawCall.answer(
                    http, base, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL
                )
                if i % 2:
                    assert await call.forge_handshake() == 403
                    never.append(call.call_sid)
                else:
                    await call.connect()
                    await call.bot_spoke()
                    await call.kill()
                    dropped.append(call.call_sid)
        await asyncio.sleep(RESUME_WINDOW + 6)  # past both windows, with sweeps on both
        counted = {
            outcome: sum(
                [await g.metric(f'ivr_calls_total{{outcome="{outcome}"}}') or 0.0 for g in gateways]
            )
            for outcome in ("never_connected", "dropped")
        }
        lines = {
            sid: [e for g in gateways for e in g.log_events("call.ended", call_sid=sid)]
            for sid in never + dropped
        }
    assert counted == {"never_connected": 3.0, "dropped": 3.0}
    for sid, found in lines.items():
        assert len(found) == 1, (sid, found)
        expected = "never_connected" if sid in never else "dropped"
        assert (found[0]["outcome"], found[0]["ended_by"]) == (expected, "sweep")
