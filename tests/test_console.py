"""The live call console (/console): auth, masking, the event stream during a real simulated
call against a real gateway, and a real browser (Debian's Chromium driven by Playwright)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from redis_server import LOCAL_REDIS_URL

from ivr.console import console_router, views
from ivr.console.auth import ConsoleAuth
from ivr.console.feed import ActiveFeed
from ivr.server import RunningServer
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.state.base import CallRecord, CallStatus, StoreUnavailable
from ivr.state.memory import MemoryCallStore
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall

ADMIN = "console-admin-token"
PII = "console-pii-token"
CALLER = "+15550001111"  # place_call's caller
MASKED_CALLER = "+*********11"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"

Events = list[tuple[str, Any]]

API_ROUTES = [
    ("POST", "/console/api/session"),
    ("POST", "/console/api/ticket"),
    ("GET", "/console/api/calls/CA00000000000000000000000000000000"),
    ("GET", "/console/api/ended"),
    ("GET", "/console/api/ended?pii=true"),
    ("GET", "/console/api/ended?before=2026-01-01T00:00:00%2B00:00&date=2026-01-01"),
    ("GET", "/console/api/events"),
    ("GET", "/console/api/calls/CA00000000000000000000000000000000/recording"),
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def ticket(http: httpx.AsyncClient, token: str = ADMIN, *, pii: bool = False) -> str:
    answer = await http.post("/console/api/ticket", params={"pii": pii}, headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return str(answer.json()["ticket"])


async def read_events(
    http: httpx.AsyncClient,
    query: str,
    until: Callable[[Events], bool],
    seconds: float = 15.0,
    into: Events | None = None,
) -> Events:
    """Server-sent events from /console/api/events until ``until`` holds for what came."""
    events: Events = [] if into is None else into
    name = ""
    async with asyncio.timeout(seconds), http.stream("GET", f"/console/api/events?{query}") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                if until(events):
                    break
    return events


async def watch(http: httpx.AsyncClient, query: str, seconds: float) -> Events:
    """Every event of a stream left open for ``seconds``."""
    events: Events = []
    with contextlib.suppress(TimeoutError):
        await read_events(http, query, lambda _: False, seconds, into=events)
    return events


def two_turn_call(fake: FakeOpenAIServer) -> list[Any]:
    """A question, an answer, then goodbye: the agent calls end_call and the flow moves on."""
    fake.transcripts.extend(["what are your opening hours", "thanks bye"])
    fake.chat = [
        ChatScript(text="Nine to five."),
        ChatScript(tool_calls=[ScriptToolCall("end_call")]),
    ]
    return ["What are your opening hours?", "Thanks, bye."]


def call_at(server: RunningServer, script: list[Any]) -> asyncio.Task[CallReport]:
    return asyncio.create_task(
        place_call(
            server.base_url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
        )
    )


# -- pure: tickets ----------------------------------------------------------------------------


def test_a_ticket_is_bound_to_its_token_its_scope_and_its_lifetime() -> None:
    now = [1000.0]
    auth = ConsoleAuth(ADMIN, PII, ticket_ttl=60, clock=lambda: now[0])
    masked, unmasked = auth.mint(pii=False), auth.mint(pii=True)
    assert auth.redeem(masked) is False and auth.redeem(unmasked) is True
    assert ConsoleAuth("another-token", PII).redeem(masked) is None  # rotated token: void
    body, _, signature = masked.rpartition(".")
    assert auth.redeem(body.replace(".0.", ".1.") + "." + signature) is None  # scope forged
    assert auth.redeem(ADMIN) is None and auth.redeem("") is None
    now[0] += 61
    assert auth.redeem(masked) is None  # expired
    assert ConsoleAuth(None).redeem(masked) is None  # console off
    assert auth.bearer(f"Bearer {PII}") == auth.bearer(f"bearer {PII}")
    assert auth.bearer(f"Basic {ADMIN}") is None and auth.bearer("Bearer") is None


class UnreachableStore(MemoryCallStore):
    """A store whose active list cannot be read (Redis away)."""

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        raise StoreUnavailable("redis: connection refused")


async def test_the_feed_notes_node_changes_and_transfers_and_lists_ended_calls() -> None:
    store = MemoryCallStore()
    feed = ActiveFeed(store)
    await store.create(CallRecord(call_sid="CA1", from_number=CALLER, flow_name="sales"))
    first = await feed.poll()
    assert first.summaries(pii=False)[0]["caller"] == MASKED_CALLER
    assert first.summaries(pii=False) is first.summaries(pii=False)  # once per snapshot

    def to_transfer(record: CallRecord) -> None:
        record.node, record.end_action, record.transfer_to = "agent", "transfer", "+15550009999"

    await store.update("CA1", to_transfer)
    await feed.poll()
    await store.end("CA1", CallStatus.ENDED)
    last = await feed.poll()
    assert last.records == {} and feed.reads == 3
    kinds = [(e["kind"], e.get("to")) for e in feed.events_of("CA1")]
    assert kinds == [
        ("seen", ""),
        ("node", "agent"),
        ("transfer", None),
        ("ended", "transferred_cold"),
    ]
    [row] = feed.ended(pii=False)
    assert row["caller"] == MASKED_CALLER and row["outcome"] == "transferred_cold"
    assert feed.ended(pii=True)[0]["caller"] == CALLER
    record = await store.get("CA1")
    assert record is not None
    shown = views.detail(record, pii=False, events=feed.events_of("CA1"))
    assert shown["transfer_to"] == "+*********99"
    assert [e["number"] for e in shown["events"] if e["kind"] == "transfer"] == ["+*********99"]


async def test_the_feed_reports_an_unreachable_store_and_keeps_the_last_list() -> None:
    feed = ActiveFeed(UnreachableStore())
    snapshot = await feed.poll()
    assert snapshot.error == "redis: connection refused" and snapshot.records == {}


def test_a_bot_line_cut_mid_sentence_before_the_caller_spoke_is_a_barge_in() -> None:
    record = CallRecord(call_sid="CA2")
    for role, text in [
        ("assistant", "Hello, how can I help?"),
        ("user", "opening hours"),
        ("assistant", "We open at nine and"),
        ("user", "and on saturdays"),
        ("assistant", "Ten to four"),
    ]:
        record.add_message(role, text)
    lines = views.transcript(record.view())
    assert [line.get("cut", False) for line in lines] == [False, False, True, False, False]


def test_the_waterfall_lays_stages_end_to_end_and_flags_slow_ones() -> None:
    turn = {
        "endpoint_silence": 0.3,
        "stt": 0.2,
        "llm_ttft": 0.7,
        "llm_first_clause": 0.8,
        "tts_ttfb": 0.1,
        "total": 1.45,
        "gateway": 0.05,
        "heard": 1.5,
    }
    shown = views.waterfall(turn)
    at = {s["key"]: (s["start"], s["length"], s["slow"]) for s in shown["stages"]}
    assert at["stt"] == (0.3, 0.2, False) and at["llm_ttft"] == (0.5, 0.7, True)
    assert at["tts_ttfb"][0] == pytest.approx(1.3) and at["gateway"][0] == pytest.approx(1.4)
    assert at["heard"] == (0.0, 1.5, False) and not shown["slow"]


async def test_an_event_stream_ends_itself_with_bye_so_the_page_gets_a_fresh_ticket() -> None:
    store = MemoryCallStore()
    feed = ActiveFeed(store)
    await store.create(CallRecord(call_sid="CA3", from_number=CALLER, flow_name="support"))
    await feed.poll()
    app = FastAPI()
    app.include_router(console_router(store, ADMIN, feed=feed, stream_seconds=0.3))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
        answer = await http.get(
            "/console/api/events", params={"ticket": await ticket(http), "call": "CA3"}
        )
    assert re.findall(r"^event: (\w+)$", answer.text, re.MULTILINE) == [
        "hello",
        "active",
        "call",
        "bye",
    ]
    assert CALLER not in answer.text and MASKED_CALLER in answer.text


def test_the_record_timeline_shows_keys_masked_barge_ins_and_its_own_node_changes() -> None:
    record = CallRecord(call_sid="CA4", from_number=CALLER)
    record.add_message("assistant", "Our opening hours are nine to")
    record.add_message("user", "thanks")
    record.add_events(
        [
            {"at": "2026-01-01T10:00:01+00:00", "kind": "node", "from": "", "to": "menu"},
            {"at": "2026-01-01T10:00:03+00:00", "kind": "dtmf", "node": "menu", "digits": "12"},
            {"at": "2026-01-01T10:00:04+00:00", "kind": "node", "from": "menu", "to": "agent"},
            {
                "at": "2026-01-01T10:00:06+00:00",
                "kind": "barge_in",
                "node": "agent",
                "heard": "Our opening hours are nine to",
            },
        ]
    )
    seen = [
        {"at": "2026-01-01T10:00:02+00:00", "kind": "seen", "to": "menu", "status": "active"},
        {"at": "2026-01-01T10:00:05+00:00", "kind": "node", "from": "menu", "to": "agent"},
        {"at": "2026-01-01T10:00:07+00:00", "kind": "transfer", "number": "+15550009999"},
    ]
    masked = views.detail(record, pii=False, events=seen)
    kinds = [
        (e["kind"], e.get("digits") or e.get("to") or e.get("number")) for e in masked["events"]
    ]
    assert kinds == [
        ("node", "menu"),
        ("dtmf", "**"),
        ("node", "agent"),
        ("barge_in", None),
        ("transfer", "+*********99"),
    ]  # the console's own node sightings give way to the record's
    assert views.detail(record, pii=True, events=[])["events"][1]["digits"] == "12"
    assert [line["cut"] for line in masked["transcript"] if line["who"] == "bot"] == [True]


def test_a_cut_bot_line_carries_the_words_the_caller_did_not_hear() -> None:
    record = CallRecord(call_sid="CA5", from_number=CALLER)
    record.add_message("assistant", "Call us on 555 0100 at")
    record.add_message("user", "thanks")
    heard, unheard = "Call us on 555 0100 at", "nine tomorrow, or write to us."
    at = "2026-01-01T10:00:06+00:00"
    record.add_events([{"at": at, "kind": "barge_in", "node": "a", "heard": heard,
                        "unheard": unheard}])  # fmt: skip
    [bot] = [line for line in views.detail(record, pii=True, events=[])["transcript"]
             if line["who"] == "bot"]  # fmt: skip
    assert bot == {"who": "bot", "text": heard, "cut": True, "unheard": unheard}
    masked = views.detail(record, pii=False, events=[])
    [event] = masked["events"]
    assert "555" not in event["heard"] and event["unheard"] == unheard


async def test_the_ended_search_pages_every_ended_call_and_refuses_a_bad_field() -> None:
    store = MemoryCallStore()
    for i in range(5):
        flow = "sales" if i % 2 else "support"
        await store.create(CallRecord(call_sid=f"CA-{i}", from_number=CALLER, flow_name=flow))
        await store.end(f"CA-{i}")
        await asyncio.sleep(0.002)
    await store.create(CallRecord(call_sid="CA-live", from_number=CALLER))
    app = FastAPI()
    app.include_router(console_router(store, ADMIN, PII))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:

        async def search(**params: Any) -> dict[str, Any]:
            answer = await http.get("/console/api/ended", params=params, headers=bearer(ADMIN))
            assert answer.status_code == 200, answer.text
            found: dict[str, Any] = answer.json()
            return found

        first = await search(limit=2)
        assert [c["call_sid"] for c in first["calls"]] == ["CA-4", "CA-3"] and first["next"]
        second = await search(limit=2, before=first["next"])
        assert [c["call_sid"] for c in second["calls"]] == ["CA-2", "CA-1"]
        last = await search(limit=2, before=second["next"])
        assert [c["call_sid"] for c in last["calls"]] == ["CA-0"] and last["next"] is None
        sales = await search(flow="sales")
        assert [c["call_sid"] for c in sales["calls"]] == ["CA-3", "CA-1"]
        assert sales["calls"][0]["caller"] == MASKED_CALLER and sales["partial"] is False
        today = first["calls"][0]["ended_at"][:10]
        assert len((await search(date=today))["calls"]) == 5
        assert (await search(date="2001-01-01"))["calls"] == []
        assert (await search(q="5550001111"))["calls"] == []  # masked: not searchable by digits
        unmasked = await http.get(
            "/console/api/ended",
            params={"q": "5550001111", "pii": "true"},
            headers=bearer(PII),
        )
        assert len(unmasked.json()["calls"]) == 5
        # Ended with no stream ever: never_connected, found by any spelling of it.
        assert len((await search(outcome="never connected"))["calls"]) == 5
        assert (await search(outcome="hangup"))["calls"] == []  # the old name: flow_hung_up
        for params, problem in (
            ({"outcome": "exploded"}, "outcome='exploded': not an outcome; one of caller_hung_up"),
            ({"date": "2026-13-01"}, "date='2026-13-01': expected a day as YYYY-MM-DD"),
            ({"before": "yesterday"}, "before='yesterday': expected an ISO 8601 time"),
            ({"before": "2026-01-01T00:00:00"}, "needs its UTC offset"),
        ):
            answer = await http.get("/console/api/ended", params=params, headers=bearer(ADMIN))
            assert answer.status_code == 422 and problem in answer.json()["detail"]


# -- through a real gateway: auth and masking -------------------------------------------------


async def test_without_an_admin_token_the_console_is_off_and_says_so(
    gateway_factory: GatewayFactory,
) -> None:
    async with gateway_factory() as server, httpx.AsyncClient(base_url=server.base_url) as http:
        page = await http.get("/console")
        assert page.status_code == 404 and "IVR_ADMIN_TOKEN is not set" in page.text
        assert (await http.get("/console/static/console.js")).status_code == 404
        for method, path in API_ROUTES:
            answer = await http.request(method, path, headers=bearer("anything"))
            assert answer.status_code == 404, (method, path)


async def test_every_console_api_refuses_a_missing_or_wrong_token_with_401(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    overrides = {"admin_token": ADMIN, "admin_pii_token": PII}
    async with (
        gateway_factory(**overrides) as server,
        httpx.AsyncClient(base_url=server.base_url) as http,
    ):
        wrong = [{}, bearer("wrong"), {"Authorization": f"Basic {ADMIN}"}, bearer(ADMIN + "x")]
        for method, path in API_ROUTES:
            for headers in wrong:
                answer = await http.request(method, path, headers=headers)
                assert answer.status_code == 401, (method, path, headers)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert set(answer.json()) == {"detail"}  # no partial data
        # The stream takes a ticket, never the token itself, nor a forged or foreign one.
        other = ConsoleAuth("other-token").mint(pii=False)
        for bad in (ADMIN, "1.0.abc.def", other):
            answer = await http.get("/console/api/events", params={"ticket": bad})
            assert answer.status_code == 401
        # The page and its code are public (a login form, no data) and locked down.
        page = await http.get("/console")
        assert page.status_code == 200 and 'id="login-form"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert (await http.get("/console/static/console.js")).status_code == 200
        assert (await http.get("/console/static/../routes.py")).status_code == 404
        # Unmasked numbers need the PII token.
        pii_ticket = await http.post("/console/api/ticket?pii=true", headers=bearer(ADMIN))
        assert pii_ticket.status_code == 403
        session = await http.post("/console/api/session", headers=bearer(PII))
        assert session.json()["pii_allowed"] is True


@pytest.mark.slow
async def test_the_event_stream_follows_a_call_and_the_ended_list_masks_it(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    script = two_turn_call(fake_openai)
    overrides = {"admin_token": ADMIN, "admin_pii_token": PII}
    async with (
        gateway_factory(**overrides) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as http,
    ):
        call = call_at(server, script)
        # The active list: the call appears, its number masked.
        listed = await read_events(
            http,
            f"ticket={await ticket(http)}",
            lambda ev: any(n == "active" and d["calls"] for n, d in ev),
        )
        assert listed[0] == ("hello", {"pii": False})
        row = next(d for n, d in listed if n == "active" and d["calls"])["calls"][0]
        assert row["caller"] == MASKED_CALLER and CALLER not in json.dumps(listed)
        assert (
            row["flow"] == "default" and row["instance"] and row["status"] in ("ringing", "active")
        )
        sid = row["call_sid"]
        unmasked = await read_events(
            http, f"ticket={await ticket(http, PII, pii=True)}", lambda ev: ev[-1][0] == "active"
        )
        assert unmasked[-1][1]["calls"][0]["caller"] == CALLER
        # The call itself: its transcript and waterfall fill in as it goes, then it ends.
        watched = await read_events(
            http, f"ticket={await ticket(http)}&call={sid}", lambda ev: ev[-1][0] == "ended", 30
        )
        report = await call
        assert not report.errors, report.format_transcript()
        details = [d for n, d in watched if n == "call"]
        assert len(details) >= 2, "the call is sent again each time its record changes"
        live = next(d for d in details if d["waterfall"])
        assert {"who": "caller", "text": "what are your opening hours"} in live["transcript"]
        assert any(line["who"] == "bot" for line in live["transcript"])
        stages = {s["key"] for s in live["waterfall"][0]["stages"]}
        assert {"endpoint_silence", "stt", "llm_ttft", "llm_first_clause", "tts_ttfb"} <= stages
        assert live["waterfall"][0]["total"] > 0 and live["totals"]["turns"] >= 1
        assert watched[-1] == ("ended", {"call_sid": sid})
        # Ended: listed and searchable, masked unless the PII token asks.
        await asyncio.sleep(1.2)  # the feed's next read sees it gone
        ended = (
            await http.get("/console/api/ended", params={"q": "default"}, headers=bearer(ADMIN))
        ).json()
        assert [c["call_sid"] for c in ended["calls"]] == [sid]
        assert (
            ended["calls"][0]["caller"] == MASKED_CALLER
            and ended["calls"][0]["outcome"] == "flow_hung_up"
        )
        assert ended["calls"][0]["node"] == "goodbye"
        none = await http.get(
            "/console/api/ended", params={"q": "5550001111"}, headers=bearer(ADMIN)
        )
        assert none.json()["calls"] == []  # masked numbers cannot be searched by their digits
        unmasked = await http.get(
            "/console/api/ended", params={"pii": "true", "q": "5550001111"}, headers=bearer(PII)
        )
        assert unmasked.json()["calls"][0]["caller"] == CALLER
        final = (await http.get(f"/console/api/calls/{sid}", headers=bearer(ADMIN))).json()
        assert final["outcome"] == "flow_hung_up" and final["status"] == "ended"
        assert any(e["kind"] == "node" and e["to"] == "goodbye" for e in final["events"])
        assert any(
            line["who"] == "tool" and "end_call" in line["text"] for line in final["transcript"]
        )
        assert CALLER not in json.dumps(final)


@pytest.mark.slow
async def test_one_instance_shows_a_call_another_instance_carries(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, prefix: str
) -> None:
    fake_openai.transcripts.append("hello")
    fake_openai.chat = [ChatScript(text="Hi there.")]
    shared = {"redis_url": LOCAL_REDIS_URL, "redis_prefix": prefix, "admin_token": ADMIN}
    async with (
        gateway_factory(instance_id="gw-a", **shared) as a,
        gateway_factory(instance_id="gw-b", **shared) as b,
        httpx.AsyncClient(base_url=a.base_url, timeout=10) as http,
    ):
        call = call_at(b, ["Hello."])
        listed = await read_events(  # carried: past the webhook's record, its stream is on b
            http,
            f"ticket={await ticket(http)}",
            lambda ev: bool(
                ev[-1][0] == "active" and any(c["instance"] for c in ev[-1][1]["calls"])
            ),
        )
        [row] = listed[-1][1]["calls"]
        assert row["instance"] == "gw-b" and row["caller"] == MASKED_CALLER
        report = await call
        for _ in range(30):  # a's feed sees it end within a read or two
            ended = await http.get("/console/api/ended", headers=bearer(ADMIN))
            if ended.json()["calls"]:
                break
            await asyncio.sleep(0.2)
    assert [c["call_sid"] for c in ended.json()["calls"]] == [report.call_sid]


async def test_many_consoles_share_one_store_read_per_second(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    async with (
        gateway_factory(admin_token=ADMIN) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as http,
    ):
        store = server.gateway.store
        reads: list[int] = []
        list_active = store.list_active

        async def counted(limit: int = 100) -> Any:
            reads.append(limit)
            return await list_active(limit)

        store.list_active = counted  # type: ignore[method-assign]
        tickets = [await ticket(http) for _ in range(8)]
        reads.clear()
        seen = await asyncio.gather(*(watch(http, f"ticket={t}", 2.5) for t in tickets))
    assert all(("active" in [n for n, _ in events]) for events in seen)
    # Eight consoles for 2.5 s: the reads of one (1 per second), not eight times that.
    assert 2 <= len(reads) <= 4, reads


# -- a real browser ----------------------------------------------------------------------------

LONG_REPLY = (
    "Our opening hours are nine to five on weekdays. On Saturdays we open at ten. "
    "We are closed on Sundays and public holidays."
)


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium (Playwright drives it; never `playwright install`)."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: run scripts/setup-ops")
    return CHROMIUM


@pytest.mark.slow
async def test_a_browser_sees_the_call_its_transcript_and_waterfall_live(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, chromium: str
) -> None:
    from playwright.async_api import async_playwright, expect

    fake_openai.transcripts.extend(["opening hours", "and on saturdays", "thanks bye"])
    fake_openai.chat = [
        ChatScript(text=LONG_REPLY, first_token_delay=0.7),  # a slow LLM: flagged in red
        ChatScript(text="On Saturdays we open at ten."),
        ChatScript(tool_calls=[ScriptToolCall("end_call")]),
    ]
    script = [
        "When are you open?",
        {"barge_in": {"say": "And on Saturdays?", "after": 1.5}},
        {"silence": 1.0},
        "Thanks, bye.",
    ]
    ARTIFACTS.mkdir(exist_ok=True)
    async with (
        gateway_factory(admin_token=ADMIN) as server,
        async_playwright() as pw,
    ):
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{server.base_url}/console")
        await page.fill("#token", "wrong")
        await page.click("#login-form button")
        await expect(page.locator("#login-error")).to_contain_text("refused")
        await page.fill("#token", ADMIN)
        await page.click("#login-form button")
        await expect(page.locator("#link-state")).to_have_text("live", timeout=5000)
        call = call_at(server, script)
        row = page.locator("#active-table tbody tr[data-sid]")
        await expect(row).to_have_count(1, timeout=10_000)
        await expect(row).to_contain_text(MASKED_CALLER)
        await expect(row).to_contain_text("default")
        await row.click()
        # The call's own pace (greeting, caller's sentence, endpoint, a slow LLM) decides when
        # these appear; under a loaded full suite that can take well over Playwright's 5 s.
        live = 20_000
        caller_lines = page.locator("#transcript li.caller")
        await expect(caller_lines.first).to_contain_text("opening hours", timeout=live)
        await expect(page.locator("#transcript li.bot.cut").first).to_be_visible(timeout=live)
        turns = page.locator("#waterfall .turn")
        await expect(turns.first.locator(".stage")).not_to_have_count(0, timeout=live)
        slow_llm = page.locator('#waterfall .stage.slow[data-stage="llm_ttft"]')
        await expect(slow_llm).to_be_visible(timeout=live)
        await expect(page.locator("#totals tbody tr")).not_to_have_count(0, timeout=live)
        await page.screenshot(path=str(ARTIFACTS / "console-live-call.png"), full_page=True)
        report = await call
        assert not report.errors, report.format_transcript()
        ended = page.locator("#ended-table tbody tr[data-sid]")
        await expect(ended).to_have_count(1, timeout=10_000)
        await expect(ended).to_contain_text("flow_hung_up")
        await expect(page.locator("#active-table tbody tr")).to_have_count(0)
        await expect(page.locator("#events")).to_contain_text("goodbye")
        await page.screenshot(path=str(ARTIFACTS / "console-ended-call.png"), full_page=True)
        assert CALLER not in await page.content()
        await browser.close()
    assert not errors, errors


KEYS_FLOW = """\
name: default
start: menu
nodes:
  menu:
    kind: menu
    prompt: For opening hours, press 1.
    options:
      - {key: "1", say: [hours], next: assistant}
    fallback: assistant
  assistant:
    kind: agent
    system: You answer questions about opening hours.
    tools:
      - {name: end_call, description: The caller is done., next: goodbye}
    max_turns: 5
    on_max_turns: goodbye
    on_no_input: goodbye
  goodbye:
    kind: hangup
    say: Goodbye!
"""


@pytest.mark.slow
async def test_a_browser_on_another_instance_lists_an_ended_call_with_its_keys_and_barge_in(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    chromium: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    """The call runs and ends on instance A; instance B starts only afterwards (its console
    never saw the call live), lists it from the store's ended index and shows its timeline."""
    from playwright.async_api import async_playwright, expect

    flows = tmp_path / "flows"
    flows.mkdir()
    (flows / "default.yaml").write_text(KEYS_FLOW)
    fake_openai.transcripts.extend(["opening hours", "and on saturdays", "thanks bye"])
    fake_openai.chat = [
        ChatScript(text=LONG_REPLY),
        ChatScript(text="On Saturdays we open at ten."),
        ChatScript(tool_calls=[ScriptToolCall("end_call")]),
    ]
    script = [
        {"press": "1"},
        "When are you open?",
        {"barge_in": {"say": "And on Saturdays?", "after": 1.5}},
        {"silence": 1.0},
        "Thanks, bye.",
    ]
    shared = {
        "redis_url": LOCAL_REDIS_URL,
        "redis_prefix": prefix,
        "admin_token": ADMIN,
        "admin_pii_token": PII,
        "flows_dir": str(flows),
    }
    async with gateway_factory(instance_id="gw-a", **shared) as a:
        report = await call_at(a, script)
    assert not report.errors, report.format_transcript()
    ARTIFACTS.mkdir(exist_ok=True)
    async with (
        gateway_factory(instance_id="gw-b", **shared) as b,
        httpx.AsyncClient(base_url=b.base_url, timeout=10) as http,
        async_playwright() as pw,
    ):
        # The record, through B's API: keys masked but for the PII token, node changes.
        shown = await http.get(f"/console/api/calls/{report.call_sid}", headers=bearer(ADMIN))
        events = shown.json()["events"]
        assert [e["digits"] for e in events if e["kind"] == "dtmf"] == ["*"]
        assert [e["to"] for e in events if e["kind"] == "node"] == ["menu", "assistant", "goodbye"]
        [barge_in] = [e for e in events if e["kind"] == "barge_in"]
        assert barge_in["node"] == "assistant" and LONG_REPLY.startswith(barge_in["heard"])
        said = f"{barge_in['heard']} {barge_in['unheard']}"  # and what was cut off
        assert barge_in["unheard"] and LONG_REPLY.startswith(said), barge_in
        unmasked = await http.get(
            f"/console/api/calls/{report.call_sid}", params={"pii": "true"}, headers=bearer(PII)
        )
        assert [e["digits"] for e in unmasked.json()["events"] if e["kind"] == "dtmf"] == ["1"]
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{b.base_url}/console")
        await page.fill("#token", ADMIN)
        await page.click("#login-form button")
        await expect(page.locator("#link-state")).to_have_text("live", timeout=5000)
        ended = page.locator("#ended-table tbody tr[data-sid]")
        await expect(ended).to_have_count(1, timeout=10_000)
        await expect(ended).to_contain_text(MASKED_CALLER)
        await expect(ended).to_contain_text("flow_hung_up")
        await page.fill("#flow", "nosuchflow")
        await page.click("#ended-form button")
        await expect(ended).to_have_count(0)
        await page.fill("#flow", "default")
        await page.click("#ended-form button")
        await expect(ended).to_have_count(1)
        await ended.click()
        await expect(page.locator("#call-title")).to_have_text(report.call_sid)
        await expect(page.locator("#events li.dtmf")).to_have_count(1)
        await expect(page.locator("#events li.dtmf")).to_contain_text("key press * at menu")
        await expect(page.locator("#events li.barge_in")).to_contain_text("barge-in at assistant")
        await expect(page.locator("#events li.node")).to_have_count(3)
        cut = page.locator("#transcript li.bot.cut").first
        await expect(cut).to_be_visible()
        # Each word on its side of the cut: heard, then the ones written and never heard.
        heard = await cut.locator(".word.heard").all_inner_texts()
        unheard = await cut.locator(".word.unheard").all_inner_texts()
        assert heard == barge_in["heard"].split() and unheard == barge_in["unheard"].split()
        await page.screenshot(path=str(ARTIFACTS / "console-ended-elsewhere.png"), full_page=True)
        assert CALLER not in await page.content()
        await browser.close()
    assert not errors, errors
