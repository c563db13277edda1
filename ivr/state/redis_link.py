"""The connection to Redis a call store writes through: one server, Sentinel, or Cluster (the
URL picks it, ``ivr/state/redis_urls.py``), its commands sent again over a failover, its writes
confirmed by the replicas.

Sentinel and Cluster ride over a failover: a command that fails to connect is sent again with
backoff for ``failover_timeout`` seconds (the new master needs a few; redis-py's own retries
are off, as they neither back off nor tell a script it is being resent), then
``StoreUnavailable``. Replication is asynchronous, so a write the old master acknowledged but
had not yet passed on is lost when a replica takes over. To close that window each write is
followed, on the same connection, by ``WAIT wait_replicas wait_timeout_ms``. When no replica
confirms in time the store asks who the master is now (the sentinels, all at once, or the
replica and the other masters of a cluster; a node silent for max(0.1 s, wait_timeout_ms) is
taken as not failing over): if that master is being replaced (a planned or forced failover
leaves the old one taking writes for seconds, then it drops them), the write is sent again to
the new one instead of being acknowledged. Otherwise the write stands, is counted and logged
(``redis_write_not_replicated``), and the master's ``ROLE`` says why. A replica still connected
but lagging or stalled could still be promoted, so writes go on waiting for it (each pays
``wait_timeout_ms`` and the same check: skipping them once lost every write a failover
caught in the next seconds). A master with fewer replicas connected than wanted has none to
lose them to: its writes stop waiting (so it costs one wait, not one per write) and carry a
``ROLE`` instead, which says when the replicas are back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    CrossSlotTransactionError,
    InvalidPipelineStack,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ivr.state.base import StoreUnavailable
from ivr.state.redis_scripts import Lua
from ivr.state.redis_urls import RedisTarget

log = structlog.get_logger("ivr.state")

T = TypeVar("T")

# redis_write_not_replicated is logged at most this often per master (every such write is
# counted in unreplicated_writes): a replica stalled for a minute would log every write.
UNREPLICATED_LOG_EVERY_S = 5.0
_FIRST_PAUSE, _MAX_PAUSE = 0.05, 0.5  # failover retry backoff, seconds
# What redis-py's blocking pool raises after pool_timeout: every connection busy is load, not
# a failover, and is not retried (the caller has already waited pool_timeout).
_POOL_EXHAUSTED = "No connection available."

# Failures a failover causes: the master is gone, not yet replaced, or just demoted.
_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
    RedisClusterException,
)
# ... except these, which waiting does not fix.
_PERMANENT = (
    AuthenticationError,
    AuthorizationError,
    CrossSlotTransactionError,
    InvalidPipelineStack,
)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel-managed (follows the master) and blocking past max_connections, like the
    single-server pool (ops.md §1: the non-blocking pool fails under 1000 calls)."""

    async def get_master_address(self) -> Any:
        before = self.master_address
        address = await super().get_master_address()  # type: ignore[no-untyped-call]
        if before is not None and address != before:
            # redis-py closes only idle connections here; the busy ones would go back to the
            # old master, which a planned failover or a partition leaves taking writes until
            # the sentinels demote it, seconds later, dropping them all.
            await self.disconnect(inuse_connections=True)
        return address


Client = aioredis.Redis | RedisCluster


def _connect(
    target: RedisTarget, max_connections: int, pool_timeout: float, socket_timeout: float
) -> tuple[Client, Sentinel | None]:
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
    }
    # redis-py resends nothing itself: RedisLink.run does, and tells the scripts when
    # a write is a resend (whose first send may have been applied).
    retry: dict[str, Any] = {"retry": Retry(NoBackoff(), 0)}
    if target.mode == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        cluster = RedisCluster(
            startup_nodes=nodes,
            max_connections=max_connections,
            username=target.username,
            password=target.password,
            **retry,
            **timeouts,
        )
        return cluster, None
    if target.mode == "sentinel":
        # No retries asking a sentinel either: redis-py's default (3, with backoff) made one
        # that does not answer cost 15-25 s, not socket_timeout, before the next was asked.
        sentinel_kwargs = timeouts | retry | {"password": target.sentinel_password}
        sentinels = list(target.nodes)
        sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        master = sentinel.master_for(
            target.service,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=pool_timeout,
            db=target.db,
            username=target.username,
            password=target.password,
            **timeouts,
            **retry,
        )
        return master, sentinel
    # Blocking pool: past max_connections callers wait instead of failing (ops.md §1).
    pool = aioredis.BlockingConnectionPool.from_url(
        target.url, max_connections=max_connections, timeout=pool_timeout, **timeouts, **retry
    )
    return aioredis.Redis.from_pool(pool), None


class RedisLink:
    """The client (and sentinels) of one ``RedisTarget``; ``run`` sends a command, again over
    a failover, and ``write`` confirms it with the replicas."""

    def __init__(
        self, target: RedisTarget, max_connections: int, pool_timeout: float, socket_timeout: float
    ) -> None:
        self.target = target
        self.pool_timeout = pool_timeout
        # How long an unconfirmed write waits for each node (replica, master, sentinel) it asks
        # whether its master is being replaced: one that says nothing by then is not failing
        # over (a stalled one would otherwise cost every write socket_timeout).
        self._ask_timeout = max(0.1, self.target.wait_timeout_ms / 1000)
        self.redis, self.sentinel = _connect(
            self.target, max_connections, pool_timeout, socket_timeout
        )
        # A cluster client raises at max_connections per node instead of waiting: this gate
        # gives it the blocking pool's semantics (each command holds one connection per node).
        self._gate = asyncio.Semaphore(max_connections) if target.mode == "cluster" else None
        self._short_of_replicas: set[str] = set()  # masters with too few replicas connected
        self._unreplicated_logged: dict[str, float] = {}
        self.resent_commands = 0  # sent again after a connection failure (restart, failover)
        self.unreplicated_writes = 0  # writes no replica confirmed within wait_timeout_ms

    async def ping(self) -> bool:
        try:
            if isinstance(self.redis, RedisCluster):  # every master must answer
                return bool(await self.redis.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(await self.redis.ping())
        except (RedisError, RedisClusterException, OSError):
            return False

    async def aclose(self) -> None:
        await self.redis.aclose()
        if self.sentinel is not None:
            await self.sentinel.aclose()

    async def eval(self, script: Lua, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.write(keys[0], "EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.write(keys[0], "EVAL", script.text, len(keys), *keys, *args)

    async def write(self, key: str, *command: Any) -> Any:
        """Run one write; with replicas to wait for, WAIT follows it on the same connection
        (WAIT counts the replicas that have this connection's writes), or ROLE on a master
        short of replicas."""
        if self.target.wait_replicas <= 0:
            return await self.redis.execute_command(*command)
        name, node = await self._master_of(key)
        # A cluster routes a keyless command to every node: pin it to the write's master.
        routing: dict[str, Any] = {} if node is None else {"target_nodes": node}
        short = name in self._short_of_replicas
        pipe = self.redis.pipeline(transaction=False)
        pipe.execute_command(*command)
        if short:
            pipe.execute_command("ROLE", **routing)
        else:
            pipe.execute_command(
                "WAIT", self.target.wait_replicas, self.target.wait_timeout_ms, **routing
            )
        result, check = await pipe.execute(raise_on_error=False)
        if isinstance(result, Exception):
            raise result
        if short:
            self.unreplicated_writes += 1  # unconfirmed, like every write to such a master
            if _connected_replicas(check) >= self.target.wait_replicas:
                self._short_of_replicas.discard(name)  # back: the next write waits again
                log.info("redis_replicas_back", master=name)
        elif not isinstance(check, int) or check < self.target.wait_replicas:
            await self._unconfirmed(key, name, check, routing)
        return result

    async def _master_of(self, key: str) -> tuple[str, ClusterNode | None]:
        """The master a write of ``key`` goes to, as host:port (and the cluster node)."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()  # no-op once the slot map is loaded
            node = self.redis.get_node_from_key(key)
            if node is None:  # the slot map has a hole mid-failover: retried like one
                raise SlotNotCoveredError(f"no master known for {key!r}")
            return str(node.name), node
        return _address(getattr(self.redis.connection_pool, "master_address", None)), None

    async def _unconfirmed(
        self, key: str, master: str, acked: Any, routing: dict[str, Any]
    ) -> None:
        """No replica confirmed a write in time. If its master is being replaced the write
        may vanish with it: raise, so run sends it again (to the new master once there is
        one). Otherwise the write stands, counted and logged; a master with too few replicas
        connected stops waiting until they are back (see the module's docstring)."""
        replaced = await self._master_replaced(key, master)
        if replaced:
            raise RedisConnectionError(f"write to {master} unconfirmed: {replaced}")
        self.unreplicated_writes += 1
        try:
            connected = _connected_replicas(await self.redis.execute_command("ROLE", **routing))
        except RedisError:
            connected = self.target.wait_replicas  # unknown: go on waiting, the safe side
        short = connected < self.target.wait_replicas
        if short:
            self._short_of_replicas.add(master)
        now = time.monotonic()
        if short or now - self._unreplicated_logged.get(master, -1e9) >= UNREPLICATED_LOG_EVERY_S:
            self._unreplicated_logged[master] = now
            log.warning(
                "redis_write_not_replicated",
                master=master,
                replicas_acked=acked if isinstance(acked, int) else repr(acked),
                replicas_wanted=self.target.wait_replicas,
                replicas_connected=connected,
                wait_timeout_ms=self.target.wait_timeout_ms,
                # Connected but slow: it may still be promoted, so writes go on waiting.
                waiting=not short,
            )

    async def _master_replaced(self, key: str, master: str) -> str:
        """Why ``master`` is no longer, or soon not, the master for ``key``; "" if it is."""
        if isinstance(self.redis, RedisCluster):
            # The promoted replica knows at once; the other masters learn it by gossip.
            why = await self._replica_took_over(key)
            owner = "" if why else await self._slot_owner(key, master)
            if owner and owner != master:
                why = f"the cluster moved its slot to {owner}"
            if why:
                await self.redis.aclose()  # reload the slot map before the resend
            return why
        pool = self.redis.connection_pool
        assert isinstance(pool, _BlockingSentinelPool) and self.sentinel is not None
        service = self.target.service
        views = await _sentinel_views(self.sentinel, service, self._ask_timeout)
        if not views or not all(
            self.sentinel.check_master_state(view, service)
            and _address((view["ip"], view["port"])) == master
            for view in views
        ):
            # None answered in time, or one sees the master down or names another: ask as
            # redis-py does (in turn, up to socket_timeout each, the first to answer kept
            # first), which also moves the pool to the master named. Raises
            # MasterNotFoundError (retried) while the sentinels see the master down.
            current = _address(await pool.get_master_address())
            if current != master:
                return f"the sentinels now name {current}"
        if any("failover_in_progress" in str(view["flags"]) for view in views):
            return "a sentinel is failing it over"  # only the leader flags it
        return ""

    async def _replica_took_over(self, key: str) -> str:
        """Which replica of ``key``'s master now says it is a master; "" if none (a replica
        that does not answer in time is down, not promoted)."""
        assert isinstance(self.redis, RedisCluster)
        serving = self.redis.nodes_manager.slots_cache.get(self.redis.keyslot(key), [])
        for replica in serving[1:]:  # [master, *replicas]
            try:
                async with asyncio.timeout(self._ask_timeout):
                    role: Any = await self.redis.execute_command("ROLE", target_nodes=replica)
            except (RedisError, RedisClusterException, OSError):  # TimeoutError is an OSError
                continue
            if role and as_text(role[0]) == "master":
                return f"its replica {replica.name} has taken over"
        return ""

    async def _slot_owner(self, key: str, master: str) -> str:
        """Who serves ``key``'s slot according to another master (the old one may not know
        yet); "" if none answers."""
        assert isinstance(self.redis, RedisCluster)
        slot = self.redis.keyslot(key)
        for other in self.redis.get_primaries():
            if other.name == master:
                continue
            try:  # bounded as the replica's ROLE: a stalled master is no owner, not 2 s a write
                async with asyncio.timeout(self._ask_timeout):
                    slots: Any = await self.redis.cluster_slots(target_nodes=other)
            except (RedisError, RedisClusterException, OSError):  # TimeoutError is an OSError
                continue
            for (first, last), owners in slots.items():
                if first <= slot <= last:
                    host, port = owners["primary"][:2]
                    return f"{as_text(host)}:{port}"
        return ""

    async def run(self, op: str, call_sid: str, command: Callable[[], Awaitable[T]]) -> T:
        """``command``, sent again when the connection fails: at once (a pooled connection gone
        stale when the server restarted), then with backoff while a failover is in progress, up
        to the URL's failover_timeout (0 for one server). ``StoreUnavailable`` after that."""
        started = time.monotonic()
        deadline, pause, attempts = started + self.target.failover_timeout, _FIRST_PAUSE, 0
        while True:
            attempts += 1
            try:
                async with self._connection_slot():
                    result = await command()
            except _PERMANENT as exc:
                raise _unavailable(op, call_sid, exc) from exc
            except _TRANSIENT as exc:
                left = deadline - time.monotonic()
                if (attempts > 1 and left <= 0) or str(exc) == _POOL_EXHAUSTED:
                    raise _unavailable(op, call_sid, exc) from exc
                self.resent_commands += 1
                if attempts > 1:
                    await asyncio.sleep(min(pause, left))
                    pause = min(pause * 2, _MAX_PAUSE)
                continue
            except (RedisError, OSError) as exc:
                raise _unavailable(op, call_sid, exc) from exc
            if attempts > 1:
                seconds = round(time.monotonic() - started, 3)
                log.info("redis_command_recovered", op=op, seconds=seconds, attempts=attempts)
            return result

    @asynccontextmanager
    async def _connection_slot(self) -> AsyncIterator[None]:
        if self._gate is None:
            yield
            return
        try:
            async with asyncio.timeout(self.pool_timeout):
                await self._gate.acquire()
        except TimeoutError:
            raise RedisConnectionError(_POOL_EXHAUSTED) from None
        try:
            yield
        finally:
            self._gate.release()


async def _sentinel_views(sentinel: Sentinel, service: str, bound: float) -> list[Any]:
    """``service`` as seen by each sentinel that answers within ``bound`` seconds. All are
    asked at once, so a stalled or black-holed one costs ``bound`` once, not socket_timeout
    per sentinel in turn. One that does not answer (or does not monitor ``service``) is left
    out: its silence is no sign of a failover."""

    async def ask(client: aioredis.Redis) -> Any:
        async with asyncio.timeout(bound):
            return await client.sentinel_masters()

    # return_exceptions: gather returns only once every task has ended (none is left running
    # when one fails), and cancelling the caller cancels and awaits them all.
    answers = await asyncio.gather(*map(ask, sentinel.sentinels), return_exceptions=True)
    views = []
    for answer in answers:
        if isinstance(answer, (RedisError, OSError)):  # TimeoutError is an OSError
            continue
        if isinstance(answer, BaseException):
            raise answer
        if view := answer.get(service):
            views.append(view)
    return views


def _connected_replicas(role: Any) -> int:
    """How many replicas a master's ROLE reply lists as connected; 0 for anything else (an
    error, or a node that is no longer a master)."""
    if isinstance(role, list) and len(role) >= 3 and as_text(role[0]) == "master":
        return len(role[2])
    return 0


def _address(address: Any) -> str:
    return "" if address is None else f"{as_text(address[0])}:{address[1]}"


def _unavailable(op: str, call_sid: str, exc: BaseException) -> StoreUnavailable:
    where = f" {call_sid}" if call_sid else ""
    return StoreUnavailable(f"redis {op}{where}: {type(exc).__name__}: {exc}")


def as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
