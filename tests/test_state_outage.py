"""ResilientCallStore over a private redis-server that we stop and restart mid-call."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_server import RedisServer
from structlog.testing import capture_logs

from ivr.state.base import CallRecord, CallStatus, StoreUnavailable
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore

CONTENT = {"exclude": {"version", "updated_at"}}


def resilient(redis_server: RedisServer, **kwargs: Any) -> ResilientCallStore:
    primary = RedisCallStore(redis_server.url, prefix="ivr:", socket_timeout=1.0, pool_timeout=1.0)
    options: dict[str, Any] = {"min_backoff": 0.02, "max_backoff": 0.2} | kwargs
    return ResilientCallStore(primary, instance_id="gw-1", **options)


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[ResilientCallStore]:
    s = resilient(redis_server)
    await s.start()
    yield s
    await s.aclose()


@pytest.fixture
async def direct(redis_server: RedisServer) -> AsyncIterator[RedisCallStore]:
    """Another view of the same Redis, as a second gateway instance would have."""
    s = RedisCallStore(redis_server.url, prefix="ivr:", socket_timeout=1.0)
    yield s
    await s.aclose()


def a_call(sid: str) -> CallRecord:
    return CallRecord(
        call_sid=sid, from_number="+14155550123", status=CallStatus.ACTIVE, instance_id="gw-1"
    )


def turn(i: int) -> Any:
    def mutate(r: CallRecord) -> None:
        r.variables["turns"] = r.variables.get("turns", 0) + 1
        r.node = f"node-{i}"
        r.add_message("user", f"said {i}")

    return mutate


async def until(condition: Any, within: float = 10.0) -> None:
    """Poll (the reconciler runs in the background) until ``condition()`` holds."""
    for _ in range(int(within / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not true within {within} s: {condition}")


async def test_a_call_survives_a_redis_outage_and_is_written_back(
    redis_server: RedisServer, store: ResilientCallStore, direct: RedisCallStore
) -> None:
    await store.create(a_call("CA-live"))
    for i in range(3):
        await store.update("CA-live", turn(i))
    with capture_logs() as logs:
        redis_server.stop()
        latest = None
        for i in range(3, 23):
            latest = await store.update("CA-live", turn(i))  # no exception reaches the call
        assert store.degraded is True
        newcomer = await store.create(a_call("CA-new"))  # new calls are still answered
        await store.update("CA-new", turn(0))
        await store.put_stream_token("CA-new", "tok-new", ttl=60)  # nothing to register
        assert await store.claim_stream_token("tok-new", "CA-new", ttl=60)
        during = await store.get("CA-live")
        active = {r.call_sid for r in await store.list_active(10)}
        redis_server.start()  # empty: no persistence, like a replacement Redis
        await until(lambda: not store.degraded)
    assert during == latest
    assert active == {"CA-live", "CA-new"} and newcomer.version == 1
    assert latest is not None and latest.variables["turns"] == 23
    in_redis = await direct.get("CA-live")
    assert in_redis is not None
    assert in_redis.model_dump(**CONTENT) == latest.model_dump(**CONTENT)
    assert in_redis == await store.get("CA-live")
    new_in_redis = await direct.get("CA-new")
    assert new_in_redis is not None and new_in_redis.node == "node-0"
    # The token spent during the outage is spent in the new Redis too (another instance
    # refuses its replay); one minted then and not used yet admits its stream once, anywhere.
    assert not await direct.claim_stream_token("tok-new", "CA-new", ttl=60)
    assert await direct.claim_stream_token("tok-later", "CA-new", ttl=60)
    assert not await store.claim_stream_token("tok-later", "CA-new", ttl=60)
    stats = store.statistics()
    assert stats.writes_queued >= 22 and stats.reconciled == 2 and stats.pending == 0
    assert stats.failures >= 1 and stats.dropped == 0
    events = [e["event"] for e in logs]
    assert events.index("call_store_degraded") < events.index("call_store_recovered")


async def test_a_call_ended_during_the_outage_ends_in_redis_with_its_ttl(
    redis_server: RedisServer, store: ResilientCallStore, direct: RedisCallStore
) -> None:
    await store.create(a_call("CA-end"))
    redis_server.stop()
    await store.update("CA-end", turn(1))
    await store.end("CA-end")
    redis_server.start()
    await until(lambda: not store.degraded)
    ended = await direct.get("CA-end")
    assert ended is not None and ended.status is CallStatus.ENDED and ended.node == "node-1"
    assert await direct.list_active(10) == []
    client = aioredis.Redis.from_url(redis_server.url)
    ttl = await client.pttl("ivr:call:CA-end")
    await client.aclose()
    assert 86_000_000 < ttl <= 86_400_000


async def test_our_latest_record_wins_and_the_conflict_is_counted(
    redis_server: RedisServer, direct: RedisCallStore
) -> None:
    store = resilient(redis_server)  # reconciler not started yet, so the race is deterministic
    try:
        await store.create(a_call("CA-x"))
        await store.update("CA-x", turn(1))
        redis_server.stop()
        ours = await store.update("CA-x", turn(2))
        redis_server.start()
        await direct.create(a_call("CA-x"))  # another instance wrote meanwhile
        await direct.update("CA-x", lambda r: setattr(r, "node", "theirs"))
        await store.start()
        await until(lambda: not store.degraded)
        in_redis = await direct.get("CA-x")
    finally:
        await store.aclose()
    assert in_redis is not None and in_redis.node == "node-2" == ours.node
    assert store.conflicts == 1


async def test_a_redis_that_restarted_empty_between_writes_gets_the_call_back(
    redis_server: RedisServer, store: ResilientCallStore, direct: RedisCallStore
) -> None:
    await store.create(a_call("CA-r"))
    redis_server.stop()
    redis_server.start()  # restarted before we noticed: nothing failed, the record is just gone
    after = await store.update("CA-r", turn(7))
    assert after.node == "node-7"
    await until(lambda: store.statistics().pending == 0)
    in_redis = await direct.get("CA-r")
    assert in_redis is not None and in_redis.model_dump(**CONTENT) == after.model_dump(**CONTENT)


async def test_the_write_queue_is_bounded_and_counts_what_it_drops(
    redis_server: RedisServer,
) -> None:
    store = resilient(redis_server, max_pending=2)
    try:
        redis_server.stop()
        for sid in ("CA-1", "CA-2", "CA-3"):
            await store.create(a_call(sid))
        stats = store.statistics()
    finally:
        redis_server.start()
        await store.aclose()
    assert stats.pending == 2 and stats.dropped == 1 and stats.degraded


async def test_an_unknown_call_while_redis_is_down_is_store_unavailable(
    redis_server: RedisServer, store: ResilientCallStore
) -> None:
    redis_server.stop()
    with pytest.raises(StoreUnavailable):
        await store.get("CA-elsewhere")
    with pytest.raises(StoreUnavailable, match="not carried"):
        await store.update("CA-elsewhere", turn(1))
    redis_server.start()


async def test_closing_with_redis_down_gives_up_after_the_close_timeout(
    redis_server: RedisServer,
) -> None:
    store = resilient(redis_server, close_timeout=0.5)
    await store.start()
    await store.create(a_call("CA-c"))
    redis_server.stop()
    await store.update("CA-c", turn(1))
    async with asyncio.timeout(5):
        await store.aclose()
    assert store.statistics().dropped == 1


async def test_the_ended_list_while_redis_is_down_holds_this_instances_ends_and_heals(
    redis_server: RedisServer, store: ResilientCallStore, direct: RedisCallStore
) -> None:
    await store.create(a_call("CA-before"))
    await store.end("CA-before")
    assert [r.call_sid for r in await direct.list_ended(10)] == ["CA-before"]
    redis_server.stop()
    await store.create(a_call("CA-during"))
    await store.end("CA-during")
    during = [r.call_sid for r in await store.list_ended(10)]
    assert store.degraded is True
    redis_server.start()  # empty: no persistence, like a replacement Redis
    await until(lambda: not store.degraded)
    assert during == ["CA-during", "CA-before"]
    # The outage's end reached the new Redis's index with its write-back.
    assert [r.call_sid for r in await direct.list_ended(10)] == ["CA-during"]
    assert [r.call_sid for r in await store.list_ended(10)] == ["CA-during"]


async def test_the_reconciler_tells_redis_of_tokens_spent_before_writing_records_back(
    redis_server: RedisServer,
) -> None:
    """Until Redis knows a stream token was used here, another instance would admit a replay
    of it; a record's write-back can take a while (many calls queued). So when Redis answers
    again, the spends go first (watched on Redis's own MONITOR)."""
    store = resilient(redis_server, budget=0.15)  # reconciler started below: order is ours
    commands: list[str] = []
    watcher = aioredis.from_url(redis_server.url)
    try:
        await store.create(a_call("CA-t"))
        await store.put_stream_token("CA-t", "tok-t", ttl=60.0)
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)  # keeps its data, answers nothing
        try:
            await store.update("CA-t", turn(1))  # queued for write-back
            assert await store.claim_stream_token("tok-t", "CA-t", ttl=60.0)  # spent here
            assert store.degraded
        finally:
            redis_server.process.send_signal(signal.SIGCONT)

        async def watch() -> None:
            async with watcher.monitor() as monitor:
                ready.set()
                async for event in monitor.listen():
                    commands.append(str(event["command"]))

        ready = asyncio.Event()
        watching = asyncio.create_task(watch())
        await asyncio.wait_for(ready.wait(), 5)
        await asyncio.sleep(0.1)  # MONITOR is on before the reconciler starts
        await store.start()
        await until(lambda: not store.degraded and not store.statistics().pending)
        await asyncio.sleep(0.1)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    finally:
        await store.aclose()
        await watcher.aclose()
    spend = next(i for i, c in enumerate(commands) if c.startswith("SET") and "spent:tok-t" in c)
    write = next(i for i, c in enumerate(commands) if "call:CA-t" in c and not c.startswith("GET "))
    assert spend < write, commands


async def test_a_token_minted_by_a_degraded_instance_admits_its_stream_on_a_healthy_one(
    redis_server: RedisServer,
) -> None:
    """The webhook reached one worker while Redis was too slow for its budget (it went
    degraded and kept the token in memory); the stream reaches another worker after Redis is
    answering again. The token is genuine and unused: the caller's stream connects, once.
    (Two workers on a loaded machine lost 50 of 800 calls' streams this way, stop 42.)"""
    minting = resilient(redis_server, budget=0.15)  # no reconciler: it stays degraded
    admitting = resilient(redis_server, budget=0.15)
    try:
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable):
                await minting.get("CA-unknown")  # no local copy: the outage is felt
            assert minting.degraded
            await minting.put_stream_token("CA-d", "tok-d", ttl=60.0)  # registered nowhere
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        assert not admitting.degraded
        assert await admitting.claim_stream_token("tok-d", "CA-d", ttl=60.0)
        assert not await admitting.claim_stream_token("tok-d", "CA-d", ttl=60.0)
        await minting.start()  # back to the primary: it says spent, whatever it minted
        await until(lambda: not minting.degraded)
        assert not await minting.claim_stream_token("tok-d", "CA-d", ttl=60.0)
    finally:
        await minting.aclose()
        await admitting.aclose()
