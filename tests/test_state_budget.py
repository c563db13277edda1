"""Per-operation Redis budgets: a Redis that is paused (SIGSTOP) or black-holed (a TCP server
that accepts and never answers) costs a call at most the budget once; then the call goes on
from memory, and what was cut off is reconciled when Redis answers again."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import pytest
from redis_server import RedisServer

from ivr.control.tokens import StreamTokens, admit, derive_key, issue
from ivr.state.base import CallRecord, CallStatus
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore

BUDGET = 0.15
SLACK = 0.1  # scheduling on a shared 2-core machine
CONTENT = {"exclude": {"version", "updated_at"}}


def a_call(sid: str) -> CallRecord:
    return CallRecord(call_sid=sid, status=CallStatus.ACTIVE, instance_id="gw-1")


def store_on(url: str) -> ResilientCallStore:
    # The gateway's pool settings: 2 s socket timeout, a 10 s wait for a pooled connection.
    primary = RedisCallStore(url, prefix="ivr:", socket_timeout=2.0, pool_timeout=10.0)
    return ResilientCallStore(
        primary, instance_id="gw-1", budget=BUDGET, min_backoff=0.05, max_backoff=0.2
    )


@pytest.fixture
async def black_hole() -> AsyncIterator[str]:
    """redis:// URL of a real socket that accepts connections and never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    server.close()
    for writer in held:
        writer.close()
    await server.wait_closed()


async def timed(work: object) -> tuple[object, float]:
    assert asyncio.iscoroutine(work)
    started = time.monotonic()
    result = await work
    return result, time.monotonic() - started


async def test_a_black_holed_redis_costs_each_call_at_most_the_budget_once(
    black_hole: str,
) -> None:
    store = store_on(black_hole)
    await store.start()
    tokens = StreamTokens(derive_key("s"))
    try:
        _, first = await timed(store.create(a_call("CA1")))
        assert store.degraded
        waits = [first]
        for _ in range(5):  # a call's later writes: memory only, no waiting at all
            _, seconds = await timed(store.update("CA1", lambda r: r.variables.update(n=1)))
            waits.append(seconds)
        token, seconds = await timed(issue(tokens, store, "CA1", planned=False))
        waits.append(seconds)
        assert isinstance(token, str)
        claims, seconds = await timed(admit(tokens, store, token))
        waits.append(seconds)
        assert getattr(claims, "call_sid", None) == "CA1"
        record, seconds = await timed(store.get("CA1"))
        waits.append(seconds)
    finally:
        async with asyncio.timeout(10):
            await store.aclose()
    assert isinstance(record, CallRecord) and record.variables == {"n": 1}
    assert first < BUDGET + SLACK, waits
    assert max(waits[1:]) < 0.02, waits
    assert store.statistics().over_budget == 1
    print(f"\nblack-holed Redis: first operation {first * 1000:.0f} ms, then "
          f"{max(waits[1:]) * 1000:.1f} ms at most")  # fmt: skip


async def test_a_paused_redis_costs_the_budget_then_the_write_is_reconciled(
    redis_server: RedisServer,
) -> None:
    store = store_on(redis_server.url)
    direct = RedisCallStore(redis_server.url, prefix="ivr:")
    await store.start()
    assert redis_server.process is not None
    try:
        await store.create(a_call("CA1"))
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            _, paused = await timed(store.update("CA1", lambda r: setattr(r, "node", "n1")))
            _, after = await timed(store.update("CA1", lambda r: setattr(r, "node", "n2")))
            assert store.degraded
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while store.degraded or store.statistics().pending:
            assert time.monotonic() < deadline, store.statistics()
            await asyncio.sleep(0.05)
        in_redis = await direct.get("CA1")
    finally:
        await store.aclose()
        await direct.aclose()
    assert paused < BUDGET + SLACK and after < 0.02, (paused, after)
    assert in_redis is not None and in_redis.node == "n2"


class HeldReplies:
    """A TCP proxy in front of Redis that passes commands at once and, while ``hold`` is set,
    keeps Redis's replies back: a write that Redis applied but whose answer came too late."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.hold = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> HeldReplies:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_w, held=False)),
            asyncio.create_task(self._pipe(up_r, writer, held=True)),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)
        writer.close()
        up_w.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool
    ) -> None:
        while data := await reader.read(65536):
            while held and self.hold:  # noqa: ASYNC110 - the test flips `hold` directly
                await asyncio.sleep(0.01)
            writer.write(data)
            await writer.drain()


async def test_a_write_cut_off_by_the_budget_that_landed_is_not_a_conflict(
    redis_server: RedisServer,
) -> None:
    """Redis applies the compare-and-set but its answer comes after the budget: the call went
    on from memory with the same change. The write-back finds our own record in Redis, not
    someone else's change: no conflict, and the change is applied once."""
    direct = RedisCallStore(redis_server.url, prefix="ivr:")
    async with HeldReplies(redis_server.port) as proxy:
        store = store_on(proxy.url)  # reconciler not started yet: the order below is fixed

        def step(record: CallRecord) -> None:
            record.node = "after"
            record.add_message("user", "hello")
            proxy.hold = True  # runs between the store's GET and its compare-and-set

        try:
            await store.create(a_call("CA1"))
            await store.update("CA1", lambda r: None)  # Redis now has the script cached
            ours, seconds = await timed(store.update("CA1", step))
            assert isinstance(ours, CallRecord)
            proxy.hold = False
            assert store.degraded and store.statistics().over_budget == 1
            assert seconds < BUDGET + SLACK
            landed = await direct.get("CA1")  # Redis did apply it
            assert landed is not None and landed.version == 3, landed
            assert landed.model_dump(**CONTENT) == ours.model_dump(**CONTENT)
            await store.start()
            deadline = time.monotonic() + 10
            while store.degraded or store.statistics().pending:
                assert time.monotonic() < deadline, store.statistics()
                await asyncio.sleep(0.05)
            final = await direct.get("CA1")
        finally:
            await store.aclose()
            await direct.aclose()
    assert store.conflicts == 0
    assert final is not None and final.model_dump(**CONTENT) == ours.model_dump(**CONTENT)
    assert [m.content for m in final.history] == ["hello"]  # applied once, not twice


async def test_a_token_claim_that_overruns_the_budget_still_spends_the_token_in_redis(
    redis_server: RedisServer,
) -> None:
    """The claim waits past the budget (for the store's one connection, which a slow command
    holds): the handshake is let in from memory, and the claim still goes out once it can, so
    Redis refuses the same token to another instance without waiting for the reconciler
    (not started here). Cancelled at the budget, it would never leave."""
    primary = RedisCallStore(redis_server.url, prefix="ivr:", max_connections=1)
    store = ResilientCallStore(primary, instance_id="gw-1", budget=BUDGET)
    direct = RedisCallStore(redis_server.url, prefix="ivr:")
    spent = primary.keys.spent_key("tok-1")
    try:
        await store.put_stream_token("CA1", "tok-1", ttl=60.0)
        hog = asyncio.create_task(primary.link.redis.blpop(["ivr:nothing"], timeout=0.6))
        await asyncio.sleep(0.05)  # the slow command has the connection
        first, seconds = await timed(store.claim_stream_token("tok-1", "CA1", ttl=60.0))
        assert first is True and store.degraded and seconds < BUDGET + SLACK, (first, seconds)
        await hog
        deadline = time.monotonic() + 5
        while not await direct.link.redis.exists(spent):
            assert time.monotonic() < deadline, "the overrun claim never reached Redis"
            await asyncio.sleep(0.02)
        assert not await direct.claim_stream_token("tok-1", "CA1", ttl=60.0)  # another instance
        assert not await store.claim_stream_token("tok-1", "CA1", ttl=60.0)  # a replay here
    finally:
        await store.aclose()
        await direct.aclose()
