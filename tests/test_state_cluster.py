"""RedisCallStore on a real Redis Cluster (3 masters + 3 replicas) and a real Sentinel deployment
(1 master + 1 replica + 3 sentinels), both started here: the store contract, the key layout,
and a call that keeps every acknowledged update through a master failover mid-call."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis
import test_state_contract as contract
from redis.crc import key_slot
from redis_cluster import SERVICE, ClusterProcesses, Node, SentinelProcesses
from redis_server import LOCAL_REDIS_URL, delete_prefix, unique_prefix
from structlog.testing import capture_logs

from ivr.errors import ConfigError
from ivr.state import redis_link
from ivr.state.base import CallStore, apply_mutation
from ivr.state.redis_store import RedisCallStore
from ivr.state.redis_urls import RedisTarget, parse_redis_url

# -- URLs: no server needed --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", RedisTarget(mode="single", url="redis://127.0.0.1:6379/0")),
        (
            "redis+sentinel://:pw@s1,s2:26380/mymaster/2",
            RedisTarget(
                mode="sentinel",
                url="redis+sentinel://:pw@s1,s2:26380/mymaster/2",
                nodes=(("s1", 26379), ("s2", 26380)),
                service="mymaster",
                db=2,
                password="pw",
                failover_timeout=10.0,
                wait_replicas=1,
            ),
        ),
        (
            "redis+cluster://app:p%40ss@[::1]:7000,n2?wait_replicas=0&failover_timeout=2.5",
            RedisTarget(
                mode="cluster",
                url="redis+cluster://app:p%40ss@[::1]:7000,n2?wait_replicas=0&failover_timeout=2.5",
                nodes=(("::1", 7000), ("n2", 6379)),
                username="app",
                password="p@ss",
                failover_timeout=2.5,
                wait_replicas=0,
            ),
        ),
    ],
)
def test_each_url_form_names_its_deployment(url: str, expected: RedisTarget) -> None:
    assert parse_redis_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h:6379", "unknown scheme 'http'"),
        ("redis+sentinel://s1:26379", "no service name"),
        ("redis+sentinel://s1/mymaster/zero", "database 'zero' is not a number"),
        ("redis+sentinel://s1/a/b/c", "expected /<service> or /<service>/<db>"),
        ("redis+cluster://n1:7000/3", "a cluster has only database 0"),
        ("redis+cluster://n1:7000,n2:70a0", "host 2 ('n2:70a0'): port '70a0' is not a number"),
        ("redis+cluster://n1,,n3", "host 2 (''): empty host name"),
        ("redis+cluster://", "no host"),
        ("redis+cluster://[::1:7000", "Invalid IPv6 URL"),
        ("redis+cluster://n1?wait=1", "unknown option 'wait' for redis+cluster://"),
        ("redis+cluster://n1?sentinel_password=x", "unknown option 'sentinel_password'"),
        ("redis+cluster://n1?wait_replicas=-1", "wait_replicas='-1' must be a finite number"),
        ("redis+cluster://n1?failover_timeout=soon", "failover_timeout='soon' is not a float"),
        ("redis+cluster://n1?wait_replicas=1&wait_replicas=2", "'wait_replicas' is given twice"),
        ("rediss+cluster://n1", "TLS to a sentinel or cluster"),
    ],
)
def test_a_malformed_url_is_a_config_error_naming_the_bad_part(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match="redis URL") as caught:
        parse_redis_url(url)
    assert problem in str(caught.value)


def test_a_url_error_never_shows_a_password() -> None:
    for url in (
        "redis+sentinel://:hunter2@s1/svc/x",
        "redis+sentinel://s1/svc?sentinel_password=hunter2&nope=1",
        "redis+cluster://user:hunter2@[::1:7000",
    ):
        with pytest.raises(ConfigError) as caught:
            parse_redis_url(url)
        assert "hunter2" not in str(caught.value)


def test_a_cluster_prefix_with_braces_is_refused() -> None:
    # It would replace the per-call hash tag: every call in one slot, on one master.
    with pytest.raises(ConfigError, match="prefix '\\{ivr\\}:'"):
        RedisCallStore("redis+cluster://127.0.0.1:7000", prefix="{ivr}:")


# -- the deployments -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterProcesses]:
    with ClusterProcesses(masters=3, replicas=1, node_timeout_ms=1000) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelProcesses]:
    with SentinelProcesses(replicas=1, sentinels=3, down_after_ms=1000) as deployment:
        yield deployment


@pytest.fixture
def fresh_sentinel() -> Iterator[SentinelProcesses]:
    """A deployment of its own, for a test that fails its master over."""
    with SentinelProcesses(replicas=1, sentinels=3, down_after_ms=1000) as deployment:
        yield deployment


Deployment = ClusterProcesses | SentinelProcesses
StoreFactory = Callable[..., CallStore]
HA = [
    pytest.param("cluster", marks=pytest.mark.slow),
    pytest.param("sentinel", marks=pytest.mark.slow),
]


@pytest.fixture(params=HA)
def deployment(request: pytest.FixtureRequest) -> Deployment:
    found: Deployment = request.getfixturevalue(request.param)
    return found


@pytest.fixture
async def make_store(deployment: Deployment) -> AsyncIterator[StoreFactory]:
    prefix = unique_prefix()
    made: list[RedisCallStore] = []

    def make(**kwargs: Any) -> RedisCallStore:
        store = RedisCallStore(deployment.url, prefix=prefix, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()
    await asyncio.to_thread(deployment.delete_prefix, prefix)


@pytest.fixture
def store(make_store: StoreFactory) -> CallStore:
    return make_store()


# The store contract (test_state_contract.py) against the cluster and through sentinel: every
# async contract test that needs only ``store``/``make_store``, which here are the two above.
def _store_contract_test(name: str, test: object) -> bool:
    if not name.startswith("test_") or not inspect.iscoroutinefunction(test):
        return False
    return set(inspect.signature(test).parameters) <= {"store", "make_store"}


for _name, _test in vars(contract).items():
    if _store_contract_test(_name, _test):
        globals()[_name] = _test


# -- layout and pool ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_cluster_keys_carry_the_call_sid_as_hash_tag(cluster: ClusterProcesses) -> None:
    prefix = unique_prefix()
    store = RedisCallStore(cluster.url, prefix=prefix)
    try:
        await store.create(contract.a_call("CA-tag"))
        await store.update("CA-tag", contract.incr("n"))
        await store.put_stream_token("CA-tag", "tok1", ttl=60)
        await store.put_stream_token("CA-tag", "tok2", ttl=60)
        assert await store.claim_stream_token("tok2", "CA-tag", ttl=60)  # two keys, two slots
        await store.save_flow_sources("v1", {"a.yaml": "x"}, ttl=60)
        keys = set(await asyncio.to_thread(_all_keys, cluster, prefix))
    finally:
        await store.aclose()
        await asyncio.to_thread(cluster.delete_prefix, prefix)
    call_key = f"{prefix}call:{{CA-tag}}"
    tokens = {f"{prefix}token:tok1", f"{prefix}spent:tok2"}
    assert keys == {call_key, f"{prefix}active", f"{prefix}flow:v1", *tokens}
    assert key_slot(call_key.encode()) == key_slot(b"CA-tag")


@pytest.mark.slow
async def test_a_cluster_end_whose_ended_index_write_fails_still_ends_the_call(
    cluster: ClusterProcesses,
) -> None:
    """The ended index is another slot than the call: its write is a command of its own. When it
    fails (here: a key of the wrong type where the index goes) the end stands, counted and
    logged; the call is missing from the ended list only, and is listed once the index works
    and the record is written again."""
    prefix = unique_prefix()
    store = RedisCallStore(cluster.url, prefix=prefix)
    try:
        await store.create(contract.a_call("CA-x"))
        await store._redis.set(f"{prefix}ended", "not a sorted set")
        with capture_logs() as logs:
            await store.end("CA-x")
        ended = await store.get("CA-x")
        assert ended is not None and ended.ended_at is not None
        assert await store.list_active(10) == []
        assert store.unindexed_ends == 1
        assert [e["event"] for e in logs] == ["redis_ended_index_failed"]
        await store._redis.delete(f"{prefix}ended")
        assert await store.list_ended(10) == []
        await store.update("CA-x", contract.incr("n"))  # the next write lists it
        assert [r.call_sid for r in await store.list_ended(10)] == ["CA-x"]
    finally:
        await store.aclose()
        await asyncio.to_thread(cluster.delete_prefix, prefix)


def _all_keys(deployment: Deployment, prefix: str) -> list[str]:
    keys = []
    for node in deployment.nodes:
        if node.alive and not node.sentinel and node.role() == "master":
            with node.client() as c:
                keys += [str(k) for k in c.scan_iter(match=f"{prefix}*")]
    return keys


@pytest.mark.slow
async def test_sentinel_keeps_the_single_server_layout(sentinel: SentinelProcesses) -> None:
    """A call written through redis:// to the master is the same call through redis+sentinel://,
    so a deployment can move from one URL to the other with calls in flight."""
    prefix = unique_prefix()
    master_url = f"redis://127.0.0.1:{sentinel.master().port}/0"
    direct = RedisCallStore(master_url, prefix=prefix)
    through = RedisCallStore(sentinel.url, prefix=prefix)
    try:
        await direct.create(contract.a_call("CA-move"))
        moved = await through.update("CA-move", contract.incr("n"))
        listed = [r.call_sid for r in await through.list_active()]
        keys = set(await asyncio.to_thread(_all_keys, sentinel, prefix))
    finally:
        await direct.aclose()
        await through.aclose()
        await asyncio.to_thread(sentinel.delete_prefix, prefix)
    assert moved.version == 2 and moved.variables == {"n": 1} and listed == ["CA-move"]
    assert keys == {f"{prefix}call:CA-move", f"{prefix}active"}


@pytest.mark.parametrize("name", HA)
async def test_a_small_pool_serves_many_concurrent_calls(
    name: str, request: pytest.FixtureRequest
) -> None:
    """Past max_connections callers wait, as with one server (a cluster client would raise)."""
    deployment: Deployment = request.getfixturevalue(name)
    prefix = unique_prefix()
    store = RedisCallStore(deployment.url, prefix=prefix, max_connections=2)
    sids = [f"CA-{i}" for i in range(60)]
    try:
        await asyncio.gather(*(store.create(contract.a_call(s)) for s in sids))
        await asyncio.gather(*(store.update(s, contract.incr("n")) for s in sids))
        records = await asyncio.gather(*(store.get(s) for s in sids))
    finally:
        await store.aclose()
        await asyncio.to_thread(deployment.delete_prefix, prefix)
    assert [r.variables["n"] if r else None for r in records] == [1] * 60


@pytest.mark.parametrize("name", ["single", *HA])
async def test_two_writers_with_identical_records_do_not_both_count(
    name: str, request: pytest.FixtureRequest
) -> None:
    """Two instances updating the same version with the same mutation in the same microsecond
    write identical JSON. The second must see a conflict (and re-apply on the new version),
    not take the first's write for its own: that lost one update in about one run of 15 of
    test_two_processes_updating_one_call_lose_no_update."""
    url = LOCAL_REDIS_URL if name == "single" else request.getfixturevalue(name).url
    prefix = unique_prefix()
    store = RedisCallStore(url, prefix=prefix)
    try:
        current = await store.create(contract.a_call("CA-twin"))
        new, raw = apply_mutation(current, contract.incr("n"))
        first = await store._compare_and_set(current.version, new, raw, fresh=True)
        twin = await store._compare_and_set(current.version, new, raw, fresh=True)
        resent = await store._compare_and_set(current.version, new, raw)  # reply was lost
    finally:
        await store.aclose()
        if name == "single":
            await delete_prefix(LOCAL_REDIS_URL, prefix)
        else:
            await asyncio.to_thread(request.getfixturevalue(name).delete_prefix, prefix)
    assert (first, twin, resent) == (1, 0, 2)


# -- replication: WAIT after each write --------------------------------------------------------


@pytest.mark.parametrize("name", HA)
async def test_a_stalled_replica_is_still_waited_for_as_it_may_be_promoted(
    name: str, request: pytest.FixtureRequest
) -> None:
    deployment: Deployment = request.getfixturevalue(name)
    prefix = unique_prefix()
    store = RedisCallStore(deployment.url + "?wait_timeout_ms=200", prefix=prefix)
    try:
        await store.create(contract.a_call("CA-w"))
        assert store.link.unreplicated_writes == 0, "a healthy replica confirms at once"
        replica = _replica_for(deployment, store.keys.call_key("CA-w"))
        with _stalled(replica):  # the replica stops reading its link
            waits = await _timed_updates(store, "CA-w", 2)
        await store.update("CA-w", contract.incr("n"))
    finally:
        await store.aclose()
        await asyncio.to_thread(deployment.delete_prefix, prefix)
    # Still connected, so a failover could promote it: every write waits and is checked.
    assert min(waits) >= 0.2, waits
    assert store.link.unreplicated_writes == 2, "the write after SIGCONT is confirmed"


@pytest.mark.slow
async def test_a_master_whose_replica_died_stops_waiting_until_it_is_back(
    fresh_sentinel: SentinelProcesses,
) -> None:
    store = RedisCallStore(fresh_sentinel.url + "?wait_timeout_ms=200", prefix=PREFIX)
    replica = next(n for n in fresh_sentinel.data if n is not fresh_sentinel.master())

    async def timed_update() -> float:
        started = time.monotonic()
        await store.update("CA-dead", contract.incr("n"))
        return time.monotonic() - started

    try:
        await store.create(contract.a_call("CA-dead"))
        replica.kill()
        with capture_logs() as logs:
            first, second = await timed_update(), await timed_update()
        assert first >= 0.2 and second < 0.1, (first, second)  # one wait, not one per write
        assert store.link.unreplicated_writes == 2
        warned = [e for e in logs if e["event"] == "redis_write_not_replicated"]
        assert [(e["replicas_connected"], e["waiting"]) for e in warned] == [(0, False)]
        await asyncio.to_thread(replica.start)
        await asyncio.to_thread(fresh_sentinel.wait_healthy, 10.0)
        await timed_update()  # its ROLE shows the replica back
        assert await timed_update() < 0.1 and store.link.unreplicated_writes == 3, "confirmed again"
    finally:
        await store.aclose()


@pytest.mark.slow
async def test_a_stalled_sentinel_costs_an_unconfirmed_write_a_short_bound_not_a_socket_timeout(
    sentinel: SentinelProcesses,
) -> None:
    """A replica and a sentinel both stall (SIGSTOP, as on a black-holed host). Every write goes
    unconfirmed and asks the sentinels whether its master is being replaced: the stalled one
    must cost a short bound, not socket_timeout (2 s) per write, which every caller's turn
    would wait; and, not answering, it is no sign of a failover (the writes stand)."""
    prefix = unique_prefix()
    store = RedisCallStore(sentinel.url + "?wait_timeout_ms=50", prefix=prefix)
    replica = _replica_for(sentinel, store.keys.call_key("CA-ss"))
    stalled = sentinel.sentinels[0]  # the first in the URL: redis-py asks it first
    try:
        await store.create(contract.a_call("CA-ss"))
        await store.update("CA-ss", contract.incr("n"))  # the update script is now cached
        with _stalled(replica, stalled):
            waits = await _timed_updates(store, "CA-ss", 4)
        reader = RedisCallStore(sentinel.url, prefix=prefix)
        try:
            record = await reader.get("CA-ss")
        finally:
            await reader.aclose()
    finally:
        await store.aclose()
        await asyncio.to_thread(sentinel.delete_prefix, prefix)
    await asyncio.to_thread(sentinel.wait_healthy, 10.0)  # for the next test
    print(f"\nwrites with a replica and a sentinel stalled: {[round(w, 3) for w in waits]} s")
    # WAIT (50 ms, up to 100 at the server's 10 Hz) plus one round of questions bounded at
    # 0.1 s: well below one socket_timeout (2 s).
    assert max(waits) < 0.6, waits
    assert store.link.unreplicated_writes == len(waits), "each write was unconfirmed, so checked"
    assert store.link.resent_commands == 0, "a sentinel that does not answer is not failing over"
    assert record is not None
    assert record.variables["n"] == 1 + len(waits) and record.version == 2 + len(waits)


@pytest.mark.slow
async def test_a_stalled_master_costs_an_unconfirmed_cluster_write_a_short_bound() -> None:
    """The cluster's twin of the stalled sentinel: the call's replica and another shard's
    master both stall. Every write goes unconfirmed and asks the other masters who serves its
    slot: the stalled one must cost a short bound, not socket_timeout (2 s) per write. A
    cluster of its own, whose node timeout (15 s) outlasts the stall: no failover starts."""
    with ClusterProcesses(masters=3, replicas=1, node_timeout_ms=15000) as deployment:

        def master_of(key: str) -> Node:
            return deployment.master_of_slot(key_slot(key.encode()))

        # An update writes the call's key and the active-calls index: both on one master, so
        # that the stalled one holds neither (else the write itself would hang, not its check).
        prefix = next(
            p
            for p in (unique_prefix() for _ in range(100))
            if master_of(f"{p}call:{{CA-sm}}") is master_of(f"{p}active")
        )
        store = RedisCallStore(deployment.url + "?wait_timeout_ms=50", prefix=prefix)
        own = master_of(store.keys.call_key("CA-sm"))
        shards = (deployment.master_of_slot(slot) for slot in (0, 8000, 16000))  # one each
        other = next(master for master in shards if master is not own)
        # Its replica by its own ROLE (a fresh cluster's gossip may not list it yet).
        replica = next(n for n in deployment.nodes if n.run("ROLE")[2:3] == [own.port])
        try:
            await store.create(contract.a_call("CA-sm"))
            await store.update("CA-sm", contract.incr("n"))  # the update script is now cached
            # A fresh cluster's replica may not confirm these first writes either: count only
            # the writes made during the stall.
            unconfirmed_before = store.link.unreplicated_writes
            with _stalled(replica, other):
                waits = await _timed_updates(store, "CA-sm", 4)
            unconfirmed = store.link.unreplicated_writes - unconfirmed_before
            record = await store.get("CA-sm")
        finally:
            await store.aclose()
    print(f"\nwrites with a replica and another master stalled: {[round(w, 3) for w in waits]} s")
    # WAIT (up to 100 ms at the server's 10 Hz) plus questions bounded at 0.1 s each.
    assert max(waits) < 0.6, waits
    assert unconfirmed == len(waits), "each write was unconfirmed, so checked"
    assert store.link.resent_commands == 0, "a master that does not answer is not taking over"
    assert record is not None and record.variables["n"] == 1 + len(waits)


async def test_a_cancelled_write_leaves_no_question_to_a_sentinel_running() -> None:
    """The sentinels are asked at once; a write cancelled meanwhile (its caller hung up)
    cancels every question. Three "sentinels" that accept the connection and never answer
    (a black-holed host) are real sockets."""

    async def black_hole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes away
        writer.close()

    server = await asyncio.start_server(black_hole, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = [aioredis.Redis(port=port, socket_timeout=30) for _ in range(3)]
    sentinel: Any = SimpleNamespace(sentinels=clients)
    try:
        asking = asyncio.create_task(redis_link._sentinel_views(sentinel, SERVICE, 30.0))
        await asyncio.sleep(0.2)  # all three sent and waiting
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        questions = [
            t for t in asyncio.all_tasks() if "_sentinel_views" in t.get_coro().__qualname__
        ]
        assert questions == [], "a question to a sentinel outlived the cancelled write"
    finally:
        for client in clients:
            await client.aclose()
        server.close()
        await server.wait_closed()


def _replica_for(deployment: Deployment, key: str) -> Node:
    if isinstance(deployment, ClusterProcesses):
        return deployment.replicas_of(deployment.master_of_slot(key_slot(key.encode())))[0]
    master = deployment.master()
    return next(n for n in deployment.data if n is not master and n.alive)


def _pid(node: Node) -> int:
    assert node.process is not None
    return node.process.pid


@contextlib.contextmanager
def _stalled(*nodes: Node) -> Iterator[None]:
    """``nodes`` stop (SIGSTOP: connected, reading nothing, as a black-holed host) for the
    block, and go on (SIGCONT) whatever happens in it."""
    for node in nodes:
        os.kill(_pid(node), signal.SIGSTOP)
    try:
        yield
    finally:
        for node in reversed(nodes):
            os.kill(_pid(node), signal.SIGCONT)


async def _timed_updates(store: RedisCallStore, call_sid: str, times: int) -> list[float]:
    """Seconds each of ``times`` updates of ``call_sid`` took (each adds 1 to ``n``)."""
    waits = []
    for _ in range(times):
        started = time.monotonic()
        await store.update(call_sid, contract.incr("n"))
        waits.append(time.monotonic() - started)
    return waits


# -- failover mid-call -------------------------------------------------------------------------


PREFIX = unique_prefix()  # shared by the failover tests: each has a call sid of its own


@dataclass
class Ride:
    acked: int  # updates that returned
    during: int  # ... while the failover was under way
    unreplicated_before: int  # writes no replica had confirmed when the failover began
    slowest: float  # the longest single update(), seconds: how long a write was blocked


async def ride_through(store: RedisCallStore, sid: str, failover: Callable[[], None]) -> Ride:
    """Update the call every 10 ms. Once 5 updates are acknowledged run ``failover`` (in a
    thread; it returns once the new master serves), then stop after 5 more. The writer is never
    cancelled mid-write, so ``acked`` is exact."""
    acked, slowest = 0, 0.0
    stop, tick = asyncio.Event(), asyncio.Event()

    async def writer() -> None:
        nonlocal acked, slowest
        while not stop.is_set():
            started = time.monotonic()
            await store.update(sid, contract.incr("n"))
            slowest = max(slowest, time.monotonic() - started)
            acked += 1
            tick.set()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(writer(), name="failover-writer")
    task.add_done_callback(lambda _: tick.set())
    try:
        async with asyncio.timeout(30.0):
            await _until(tick, lambda: acked >= 5 or task.done())
            before, unreplicated = acked, store.link.unreplicated_writes
            await asyncio.to_thread(failover)
            after = acked
            await _until(tick, lambda: acked >= after + 5 or task.done())
    finally:
        stop.set()
        await asyncio.wait_for(task, 15.0)  # re-raises whatever failed the writer
    return Ride(acked, after - before, unreplicated, slowest)


async def _until(tick: asyncio.Event, condition: Callable[[], bool]) -> None:
    while not condition():
        tick.clear()
        await tick.wait()


async def assert_every_update_kept(url: str, sid: str, ride: Ride) -> None:
    """Read back through a fresh store, so from whichever master the deployment names now, not
    over a connection the writer may still hold to the old one."""
    assert ride.unreplicated_before == 0, "every write before the failover had a replica's ack"
    reader = RedisCallStore(url, prefix=PREFIX)
    try:
        record = await reader.get(sid)
    finally:
        await reader.aclose()
    assert record is not None
    assert record.variables["n"] == ride.acked and record.version == 1 + ride.acked
    print(f"\n{sid}: {ride.acked} updates kept, {ride.during} while failing over,", end=" ")
    print(f"longest update {ride.slowest:.3f} s")


def _sid_on_redundant_shard(cluster: ClusterProcesses, store: RedisCallStore, tag: str) -> str:
    """A call sid whose slot's master has a live replica (an earlier test may have used up one
    shard's replica)."""
    for i in range(200):
        sid = f"CA-{tag}-{i}"
        master = cluster.master_of_slot(key_slot(store.keys.call_key(sid).encode()))
        if cluster.replicas_of(master):
            return sid
    raise RuntimeError("no shard of the cluster has a live replica")


@pytest.mark.slow
async def test_cluster_call_survives_sigkill_of_its_master(cluster: ClusterProcesses) -> None:
    store = RedisCallStore(cluster.url, prefix=PREFIX)
    sid = _sid_on_redundant_shard(cluster, store, "kill")
    master = cluster.master_of_slot(key_slot(store.keys.call_key(sid).encode()))
    replica = cluster.replicas_of(master)[0]
    try:
        await store.create(contract.a_call(sid))

        def failover() -> None:
            master.kill()
            cluster.wait_promoted(replica, 10.0)

        ride = await ride_through(store, sid, failover)
        await assert_every_update_kept(cluster.url, sid, ride)
    finally:
        await store.aclose()
        await asyncio.to_thread(cluster.delete_prefix, PREFIX)
    assert not master.alive and ride.slowest > 0.5, "the failover did block a write"


@pytest.mark.slow
async def test_cluster_call_survives_a_manual_failover(cluster: ClusterProcesses) -> None:
    store = RedisCallStore(cluster.url, prefix=PREFIX)
    sid = _sid_on_redundant_shard(cluster, store, "manual")
    master = cluster.master_of_slot(key_slot(store.keys.call_key(sid).encode()))
    replica = cluster.replicas_of(master)[0]
    try:
        await store.create(contract.a_call(sid))

        def failover() -> None:
            replica.run("CLUSTER", "FAILOVER")
            cluster.wait_promoted(replica, 10.0)

        ride = await ride_through(store, sid, failover)
        await assert_every_update_kept(cluster.url, sid, ride)
    finally:
        await store.aclose()
        await asyncio.to_thread(cluster.delete_prefix, PREFIX)
    assert master.role() == "slave", "the old master now replicates the new one"


@pytest.mark.slow
async def test_cluster_call_survives_a_forced_failover(cluster: ClusterProcesses) -> None:
    """FORCE: the replica takes over without the old master's agreement; the old master takes
    writes until gossip tells it, and those must not be acknowledged."""
    store = RedisCallStore(cluster.url, prefix=PREFIX)
    sid = _sid_on_redundant_shard(cluster, store, "forced")
    master = cluster.master_of_slot(key_slot(store.keys.call_key(sid).encode()))
    replica = cluster.replicas_of(master)[0]
    try:
        await store.create(contract.a_call(sid))

        def failover() -> None:
            replica.run("CLUSTER", "FAILOVER", "FORCE")
            cluster.wait_promoted(replica, 10.0)

        ride = await ride_through(store, sid, failover)
        await assert_every_update_kept(cluster.url, sid, ride)
    finally:
        await store.aclose()
        await asyncio.to_thread(cluster.delete_prefix, PREFIX)


@pytest.mark.slow
async def test_sentinel_call_survives_sigkill_of_the_master(
    fresh_sentinel: SentinelProcesses,
) -> None:
    store = RedisCallStore(fresh_sentinel.url, prefix=PREFIX)
    old = fresh_sentinel.master()
    try:
        await store.create(contract.a_call("CA-s-kill"))

        def failover() -> None:
            old.kill()
            fresh_sentinel.wait_switched(old, 10.0)

        ride = await ride_through(store, "CA-s-kill", failover)
        await assert_every_update_kept(fresh_sentinel.url, "CA-s-kill", ride)
    finally:
        await store.aclose()
    assert ride.slowest > 0.5, "the failover did block a write"


@pytest.mark.slow
async def test_a_replica_that_lagged_a_moment_ago_does_not_cost_writes_in_a_failover(
    fresh_sentinel: SentinelProcesses,
) -> None:
    """A replica stalls for a moment (SIGSTOP): one write goes unconfirmed and stands (no
    failover then). A planned failover follows within seconds, while the caller's call is
    being updated: every acknowledged update must still be there on the new master."""
    store = RedisCallStore(fresh_sentinel.url, prefix=PREFIX)
    old = fresh_sentinel.master()
    replica = next(n for n in fresh_sentinel.data if n is not old)
    try:
        await store.create(contract.a_call("CA-s-lagged"))
        with _stalled(replica):
            await store.update("CA-s-lagged", contract.incr("n"))
        assert store.link.unreplicated_writes == 1, "the stalled replica left a write unconfirmed"
        fresh_sentinel.wait_healthy(5.0)

        def failover() -> None:
            fresh_sentinel.sentinels[0].run("SENTINEL", "FAILOVER", SERVICE)
            fresh_sentinel.wait_switched(old, 10.0)

        ride = await ride_through(store, "CA-s-lagged", failover)
    finally:
        await store.aclose()
    reader = RedisCallStore(fresh_sentinel.url, prefix=PREFIX)
    try:
        record = await reader.get("CA-s-lagged")
    finally:
        await reader.aclose()
    assert record is not None
    assert record.variables["n"] == 1 + ride.acked, (record.variables, ride)


@pytest.mark.slow
async def test_sentinel_call_survives_a_sentinel_failover(
    fresh_sentinel: SentinelProcesses,
) -> None:
    """The old master stays up and takes writes until the sentinels demote it, seconds after the
    switch, and then drops them: a write it took but no replica confirmed must be sent again to
    the new master, not acknowledged."""
    store = RedisCallStore(fresh_sentinel.url, prefix=PREFIX)
    old = fresh_sentinel.master()
    asker = fresh_sentinel.sentinels[0]
    try:
        await store.create(contract.a_call("CA-s-planned"))

        def failover() -> None:
            asker.run("SENTINEL", "FAILOVER", SERVICE)
            fresh_sentinel.wait_switched(old, 10.0)

        ride = await ride_through(store, "CA-s-planned", failover)
        await assert_every_update_kept(fresh_sentinel.url, "CA-s-planned", ride)
    finally:
        await store.aclose()
