"""RedisCallStore against the real Redis at 127.0.0.1:6379, plus the admin API and CLI on top."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from redis_server import LOCAL_REDIS_URL, RedisServer, free_port

from ivr.state.admin import admin_router
from ivr.state.base import CallRecord, CorruptRecord, StoreUnavailable, apply_mutation
from ivr.state.cli import add_commands
from ivr.state.outcomes import Outcome
from ivr.state.redis_store import RedisCallStore


@pytest.fixture
async def store(prefix: str) -> AsyncIterator[RedisCallStore]:
    s = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix, ended_ttl=3600, active_ttl=7200)
    yield s
    await s.aclose()


@pytest.fixture
async def raw() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(LOCAL_REDIS_URL)
    yield client
    await client.aclose()


def a_call(sid: str = "CA0001") -> CallRecord:
    return CallRecord(
        call_sid=sid, from_number="+14155550123", to_number="+14155550999", flow_name="support"
    )


def bump(record: CallRecord) -> None:
    record.variables["n"] = record.variables.get("n", 0) + 1


def settled(outcome: Outcome, *, billed: int) -> Callable[[CallRecord], None]:
    """A mutator that settles the call's outcome and Twilio's final word on it."""

    def settle(record: CallRecord) -> None:
        record.outcome, record.twilio_status, record.billed_seconds = outcome, "completed", billed

    return settle


async def test_every_key_lives_under_the_configured_prefix(
    store: RedisCallStore, prefix: str, raw: aioredis.Redis
) -> None:
    await store.create(a_call())
    await store.put_stream_token("CA0001", "tok1", ttl=60)
    await store.put_stream_token("CA0001", "tok2", ttl=60)
    assert await store.claim_stream_token("tok2", "CA0001", ttl=60)
    keys = {k.decode() async for k in raw.scan_iter(match=f"{prefix}*")}
    call, active = f"{prefix}call:CA0001", f"{prefix}active"
    assert keys == {call, active, f"{prefix}token:tok1", f"{prefix}spent:tok2"}
    stored = json.loads(await raw.get(f"{prefix}call:CA0001"))
    assert stored["call_sid"] == "CA0001" and stored["version"] == 1


async def test_what_redis_holds_leaves_out_the_new_fields_until_they_are_set(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    # A rolling upgrade's previous-version instances forbid unknown fields: a live call's
    # record, created and updated here, must not carry them at their defaults.
    key = store.keys.call_key("CA0001")
    new_fields = {"outcome", "twilio_status", "billed_seconds"}
    await store.create(a_call())
    assert not new_fields & set(json.loads(await raw.get(key)))
    await store.update("CA0001", bump)
    assert not new_fields & set(json.loads(await raw.get(key)))

    await store.update("CA0001", settled(Outcome.CALLER_HUNG_UP, billed=42))
    stored = json.loads(await raw.get(key))
    assert (stored["outcome"], stored["twilio_status"], stored["billed_seconds"]) == (
        Outcome.CALLER_HUNG_UP.value,
        "completed",
        42,
    )


async def test_a_live_call_has_the_active_ttl_and_an_ended_one_the_ended_ttl(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    key = store.keys.call_key("CA0001")
    await store.create(a_call())
    live_ttl = await raw.pttl(key)
    await store.end("CA0001")
    ended_ttl = await raw.pttl(key)
    assert 7_190_000 < live_ttl <= 7_200_000
    assert 3_590_000 < ended_ttl <= 3_600_000
    assert await raw.zscore(f"{store.prefix}active", "CA0001") is None
    await asyncio.sleep(0.2)
    await store.update("CA0001", bump)  # a late write must not give the call a new lease
    assert await raw.pttl(key) <= ended_ttl - 150


def _increment_many(prefix: str, times: int) -> None:
    async def run() -> None:
        store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix, max_connections=4)
        try:
            for _ in range(times):
                await store.update("CA-race", bump)
        finally:
            await store.aclose()

    asyncio.run(run())


async def test_two_processes_updating_one_call_lose_no_update(
    store: RedisCallStore, prefix: str
) -> None:
    await store.create(a_call("CA-race"))
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_increment_many, args=(prefix, 200)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        await asyncio.to_thread(w.join, 60)
        assert w.exitcode == 0
    final = await store.get("CA-race")
    assert final is not None
    assert final.variables["n"] == 400 and final.version == 401


async def calls_of(client: aioredis.Redis) -> dict[str, int]:
    """Commands the server has run, by name (``INFO commandstats``)."""
    stats = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


async def test_a_call_this_store_wrote_is_updated_in_one_round_trip(
    redis_server: RedisServer,
) -> None:
    """A turn's state save is on the caller's critical path: no read before the write while
    the record is the one this store last wrote (a private server, so every command counts)."""
    store = RedisCallStore(redis_server.url)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.create(a_call())
        await store.update("CA0001", bump)  # a new server loads the script (EVAL) once
        before = await calls_of(client)
        for _ in range(3):
            await store.update("CA0001", bump)
        after = await calls_of(client)
        final = await store.get("CA0001")
    finally:
        await store.aclose()
        await client.aclose()
    ran = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    ran.pop("info", None)
    # The script's own GET, SET and ZADD count too: a read before it would make "get" 6.
    assert ran == {"evalsha": 3, "get": 3, "set": 3, "zadd": 3}, ran
    assert final is not None and final.variables == {"n": 4} and final.version == 5


async def test_a_call_changed_elsewhere_is_read_again_even_at_the_same_version(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    """What this store remembers is only a guess: Redis restarted empty and the call written
    back by another instance holds the same version with other content. The update must build
    on that content (a version check alone would have written the stale copy over it)."""
    await store.create(a_call())
    key = store.keys.call_key("CA0001")
    other = json.loads(await raw.get(key))
    other["variables"] = {"n": 10, "written": "elsewhere"}
    await raw.set(key, json.dumps(other))  # the same version 1, other content
    updated = await store.update("CA0001", bump)
    assert updated.variables == {"n": 11, "written": "elsewhere"} and updated.version == 2
    assert json.loads(await raw.get(key))["variables"] == updated.variables


async def test_a_change_refused_on_the_remembered_copy_is_judged_again_on_a_read(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    """A mutator may refuse (raise) on what it sees: on a copy that is out of date it must get
    to see the record Redis holds before its refusal counts."""
    await store.create(a_call())
    key = store.keys.call_key("CA0001")
    other = json.loads(await raw.get(key))
    other["variables"] = {"ready": True}
    await raw.set(key, json.dumps(other))  # changed elsewhere; this store remembers the old

    def only_when_ready(record: CallRecord) -> None:
        if not record.variables.get("ready"):
            raise RuntimeError("not ready")
        record.variables["done"] = True

    updated = await store.update("CA0001", only_when_ready)
    assert updated.variables == {"ready": True, "done": True}
    with pytest.raises(RuntimeError, match="not ready"):  # a real refusal still stands
        await store.update("CA0001", lambda r: (r.variables.clear(), only_when_ready(r)))


async def test_an_unreachable_redis_raises_store_unavailable_quickly() -> None:
    store = RedisCallStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="redis get CA0001"):
        await store.get("CA0001")
    assert time.monotonic() - started < 1.0
    assert await store.ping() is False
    await store.aclose()


async def test_a_corrupt_stored_value_names_its_key(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    await raw.set(store.keys.call_key("CA-bad"), b'{"call_sid": "CA-bad", "version": "x"')
    with pytest.raises(CorruptRecord, match=f"{store.prefix}call:CA-bad"):
        await store.get("CA-bad")


async def test_a_small_blocking_pool_serves_many_concurrent_calls(prefix: str) -> None:
    store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix, max_connections=2)
    try:
        sids = [f"CA-{i}" for i in range(60)]
        await asyncio.gather(*(store.create(a_call(s)) for s in sids))
        await asyncio.gather(*(store.update(s, bump) for s in sids))
        records = await asyncio.gather(*(store.get(s) for s in sids))
    finally:
        await store.aclose()
    assert [r.variables["n"] if r else None for r in records] == [1] * 60


async def test_updates_still_work_after_redis_forgets_its_scripts(
    store: RedisCallStore, raw: aioredis.Redis
) -> None:
    await store.create(a_call())
    await raw.script_flush()  # what a Redis restart does to EVALSHA
    updated = await store.update("CA0001", bump)
    assert updated.variables == {"n": 1} and updated.version == 2


async def test_a_write_retried_after_a_lost_reply_is_not_applied_twice(
    store: RedisCallStore,
) -> None:
    current = await store.create(a_call())
    new, raw_json = apply_mutation(current, bump)
    assert await store._compare_and_set(current.version, new, raw_json) == 1
    assert await store._compare_and_set(current.version, new, raw_json) == 2
    stale, stale_json = apply_mutation(current, bump)
    assert await store._compare_and_set(current.version, stale, stale_json) == 0
    got = await store.get("CA0001")
    assert got == new


# -- admin API over a real uvicorn server ------------------------------------------------


async def _serve(app: FastAPI) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


@pytest.fixture
async def admin_url(store: RedisCallStore) -> AsyncIterator[str]:
    app = FastAPI()
    app.include_router(admin_router(store, token="s3cret"))
    server, task, url = await _serve(app)
    yield url
    server.should_exit = True
    await task


async def test_admin_lists_active_calls_with_numbers_redacted(
    store: RedisCallStore, admin_url: str
) -> None:
    await store.create(a_call("CA-1"))
    await store.create(a_call("CA-2"))
    await store.end("CA-2")
    async with httpx.AsyncClient(base_url=admin_url) as client:
        resp = await client.get("/admin/calls", headers={"Authorization": "Bearer s3cret"})
    assert resp.status_code == 200
    calls = resp.json()["calls"]
    assert [c["call_sid"] for c in calls] == ["CA-1"]
    assert calls[0]["from_number"] == "+*********23" and "4155550" not in resp.text


async def test_admin_shows_one_call_and_404s_an_unknown_one(
    store: RedisCallStore, admin_url: str
) -> None:
    await store.create(a_call("CA-1"))
    auth = {"Authorization": "Bearer s3cret"}
    async with httpx.AsyncClient(base_url=admin_url, headers=auth) as client:
        one = await client.get("/admin/calls/CA-1")
        missing = await client.get("/admin/calls/CA-nope")
    assert one.status_code == 200
    assert one.json()["call_sid"] == "CA-1" and one.json()["to_number"] == "+*********99"
    assert missing.status_code == 404


async def test_admin_refuses_a_wrong_or_missing_token(admin_url: str) -> None:
    async with httpx.AsyncClient(base_url=admin_url) as client:
        wrong = await client.get("/admin/calls", headers={"Authorization": "Bearer nope"})
        missing = await client.get("/admin/calls/CA-1")
    assert wrong.status_code == 403 and missing.status_code == 403


async def test_admin_without_a_token_is_disabled(store: RedisCallStore) -> None:
    app = FastAPI()
    app.include_router(admin_router(store, token=None))
    server, task, url = await _serve(app)
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            resp = await client.get("/admin/calls", headers={"Authorization": "Bearer x"})
    finally:
        server.should_exit = True
        await task
    assert resp.status_code == 404


# -- CLI -----------------------------------------------------------------------------------


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ivr")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def _seed(prefix: str) -> None:
    async def run() -> None:
        store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix)
        await store.create(a_call("CA-cli"))
        await store.update("CA-cli", lambda r: setattr(r, "node", "menu"))
        await store.aclose()

    asyncio.run(run())


def test_cli_lists_and_shows_calls_as_json_and_table(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _seed(prefix)
    common = ("--redis-url", LOCAL_REDIS_URL, "--redis-prefix", prefix)
    assert _cli("calls", "list", *common, "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["call_sid"] for c in listed] == ["CA-cli"]
    assert listed[0]["from_number"] == "+*********23"
    assert _cli("calls", "list", *common) == 0
    table = capsys.readouterr().out
    assert "CA-cli" in table and "menu" in table and "(1 active)" in table
    assert _cli("calls", "show", "CA-cli", *common, "--json") == 0
    assert json.loads(capsys.readouterr().out)["version"] == 2
    assert _cli("calls", "show", "CA-nope", *common) == 1
    assert "not found" in capsys.readouterr().err


def test_cli_lists_ended_calls_with_the_consoles_outcome_names(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def seed() -> None:
        store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix)
        await store.create(a_call("CA-gone"))
        await store.update("CA-gone", settled(Outcome.DROPPED, billed=31))
        await store.end("CA-gone")
        await store.create(a_call("CA-live"))
        await store.aclose()

    asyncio.run(seed())
    common = ("--redis-url", LOCAL_REDIS_URL, "--redis-prefix", prefix)
    assert _cli("calls", "list", "--ended", *common) == 0
    table = capsys.readouterr().out
    [row] = [line.split() for line in table.splitlines() if line.startswith("CA-")]
    assert row[:4] == ["CA-gone", "dropped", "completed", "31"] and "(1 ended)" in table
    assert _cli("calls", "show", "CA-gone", *common, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["outcome"], shown["twilio_status"], shown["billed_seconds"]) == (
        "dropped",
        "completed",
        31,
    )


def test_cli_without_a_redis_url_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("IVR_REDIS_URL", raising=False)
    assert _cli("calls", "list") == 2
    assert "IVR_REDIS_URL" in capsys.readouterr().err


def test_cli_reports_an_unreachable_redis(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert _cli("calls", "list", "--redis-url", url) == 1
    assert "ConnectionError" in capsys.readouterr().err
