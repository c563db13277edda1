"""Call state in Redis, shared by every gateway instance: one server, Sentinel, or Cluster.

The URL picks the deployment (``ivr/state/redis_urls.py``). Layout, all keys under a
configurable prefix:
    {prefix}call:<sid>     one JSON CallRecord; PX = active_ttl while live, ended_ttl after end.
                           In a cluster the sid is a hash tag, {prefix}call:{<sid>}, so every
                           key a call may ever have lands in its slot.
    {prefix}active         sorted set of live call sids, scored by updated_at (epoch seconds)
    {prefix}ended          sorted set of ended call sids, scored by ended_at (epoch seconds);
                           what is older than ended_ttl is trimmed on every end and every read
    {prefix}token:<token>  call_sid a webhook-minted stream token belongs to; PX = token ttl
    {prefix}flow:<version> JSON {relative path: text} of the files a flow version was loaded
                           from, so any instance can run calls pinned to it; PX = given ttl

Atomic update is a compare-and-set on ``version`` done by a Lua script, not WATCH/MULTI:
a read (GET) plus one EVALSHA is 2 round trips on any pooled connection, while WATCH needs
4 round trips (WATCH, GET, MULTI..EXEC) and pins one connection of the bounded pool for the
whole read-modify-write, which under 1000 calls means more waiting on the pool. On one server
(or Sentinel) the script also moves the sid in or out of the active set in the same atomic step.
A cluster cannot run a script over two slots, so there the script touches the call's key only
and the active set is updated by a separate command after it; the set is an index that
list_active() cross-checks against the records, so a crash between the two costs at most a
stale or missing listing until the call's next write. The ended index is kept the same way:
in the script on one server (a call is listed as ended in the same atomic step that ends it),
by a separate command after it in a cluster. There a failed index write does not fail the end
(the record is ended either way): it is counted (``unindexed_ends``) and logged
(``redis_ended_index_failed``), and the call is missing from the ended list, still readable by
its sid, until its record is written again or expires.

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

A rolling upgrade keeps calls in flight: on one server and through Sentinel the layout is the
one earlier versions wrote (so moving from redis:// to redis+sentinel:// keeps them too), and
the scripts keep their meaning; the hash-tagged layout exists only in a cluster, which earlier
versions could not use (their scripts spanned two slots).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
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

from ivr.errors import ConfigError
from ivr.state.base import (
    DEFAULT_ENDED_TTL,
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    Mutator,
    StoreUnavailable,
    UpdateConflict,
    apply_mutation,
    ending,
    flow_sources_from_json,
    prepare_new,
)
from ivr.state.redis_urls import RedisTarget, parse_redis_url

log = structlog.get_logger("ivr.state")

T = TypeVar("T")
DEFAULT_ACTIVE_TTL = 6 * 3600.0  # Twilio caps a call at 4 h; a live key older than this is orphaned
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


class _Lua:
    """A script run by EVALSHA, falling back to EVAL (which caches it) on NOSCRIPT: a restarted
    server or a just-promoted replica has an empty script cache."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


# ARGV: json, ttl ms, live ('1'/'0'), score (updated_at if live, else ended_at), sid, ended
# index cutoff (epoch s), resend ('1'/'0'). Returns 0 if another record has the sid. KEYS[2]
# and KEYS[3] (the active and ended sets) are left out in a cluster. On a resend (the first
# send may have landed, its reply lost) the very JSON already stored means it did land.
_CREATE = _Lua("""
local cur = redis.call('GET', KEYS[1])
if cur then
  if ARGV[7] == '1' and cur == ARGV[1] then return 1 end
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if #KEYS > 1 then
  if ARGV[3] == '1' then
    redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
  else
    redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[6])
  end
end
return 1
""")

# ARGV: expected version, new json, ttl ms, live ('1'/'0'), score (updated_at if live, else
# ended_at), sid, ended index cutoff (epoch s), resend ('1'/'0').
# Returns -1 missing, 0 version conflict, 1 written, 2 this exact write is already stored (a
# resend after a lost reply must not apply the mutation twice). Only a resend may take the
# same JSON as its own: two writers can produce identical records (same base, same mutation,
# same microsecond), and the second must then see a conflict, not count as written.
_UPDATE = _Lua("""
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if ARGV[8] == '1' and cur == ARGV[2] then return 2 end
if cjson.decode(cur)['version'] ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if #KEYS > 1 then
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
  else
    redis.call('ZREM', KEYS[2], ARGV[6])
    redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
  end
end
return 1
""")

# ARGV: json, ttl ms. Stored only if absent (a version names its content); TTL renewed anyway.
_SAVE_FLOW = _Lua("""
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")


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
    # redis-py resends nothing itself: RedisCallStore._run does, and tells the scripts when
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


class RedisCallStore:
    def __init__(
        self,
        url: str,
        prefix: str = "ivr:",
        ended_ttl: float = DEFAULT_ENDED_TTL,
        max_connections: int = 50,
        *,
        active_ttl: float = DEFAULT_ACTIVE_TTL,
        pool_timeout: float = 10.0,
        socket_timeout: float = 2.0,
        max_attempts: int = 100,
    ) -> None:
        self.target = parse_redis_url(url)
        self.cluster = self.target.mode == "cluster"
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise ConfigError(
                f"redis prefix {prefix!r}: braces would override the per-call hash tag "
                "in a cluster; use a prefix without '{' or '}'"
            )
        self.prefix = prefix
        self.ended_ttl = ended_ttl
        self.active_ttl = active_ttl
        self.max_attempts = max_attempts
        self.pool_timeout = pool_timeout
        # How long an unconfirmed write waits for each node (replica, master, sentinel) it asks
        # whether its master is being replaced: one that says nothing by then is not failing
        # over (a stalled one would otherwise cost every write socket_timeout).
        self._ask_timeout = max(0.1, self.target.wait_timeout_ms / 1000)
        self._redis, self._sentinel = _connect(
            self.target, max_connections, pool_timeout, socket_timeout
        )
        # A cluster client raises at max_connections per node instead of waiting: this gate
        # gives it the blocking pool's semantics (each command holds one connection per node).
        self._gate = asyncio.Semaphore(max_connections) if self.cluster else None
        self._active_key = f"{prefix}active"
        self._ended_key = f"{prefix}ended"
        self._short_of_replicas: set[str] = set()  # masters with too few replicas connected
        self._unreplicated_logged: dict[str, float] = {}
        self.resent_commands = 0  # sent again after a connection failure (restart, failover)
        self.unreplicated_writes = 0  # writes no replica confirmed within wait_timeout_ms
        self.unindexed_ends = 0  # cluster: ended calls whose ended-index write failed

    def call_key(self, call_sid: str) -> str:
        if self.cluster:
            return f"{self.prefix}call:{{{call_sid}}}"
        return f"{self.prefix}call:{call_sid}"

    def token_key(self, token: str) -> str:
        return f"{self.prefix}token:{token}"

    def flow_key(self, version: str) -> str:
        return f"{self.prefix}flow:{version}"

    def _ttl_ms(self, record: CallRecord) -> int:
        if record.ended_at is None:
            return max(1, int(self.active_ttl * 1000))
        # Measured from ended_at, so re-writing an ended call does not extend its life.
        spent = (record.updated_at - record.ended_at).total_seconds()
        return max(1, int((self.ended_ttl - spent) * 1000))

    # -- CallStore -------------------------------------------------------------------------

    async def create(self, record: CallRecord) -> CallRecord:
        stored, raw = prepare_new(record)
        sid, live = stored.call_sid, stored.ended_at is None
        args: list[Any] = [raw, self._ttl_ms(stored), "1" if live else "0"]
        args += [self._index_score(stored), sid, self._ended_cutoff()]
        created = await self._run("create", sid, self._resendable(_CREATE, sid, args, fresh=True))
        if not created:
            raise CallExists(sid)
        await self._index(stored)
        return stored

    async def get(self, call_sid: str) -> CallRecord | None:
        key = self.call_key(call_sid)
        raw = await self._run("get", call_sid, lambda: self._redis.get(key))
        return None if raw is None else CallRecord.from_json(raw, key)

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        for attempt in range(self.max_attempts):
            current = await self.get(call_sid)
            if current is None:
                raise CallNotFound(call_sid)
            expected = current.version  # read before the in-place mutation bumps it
            stored, raw = apply_mutation(current, mutate, owned=True)
            outcome = await self._compare_and_set(expected, stored, raw, fresh=True)
            if outcome == -1:
                raise CallNotFound(call_sid)
            if outcome > 0:
                await self._index(stored)
                return stored
            # Lost the race: back off a little (jittered) so the writers interleave.
            await asyncio.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))
        raise UpdateConflict(call_sid, self.max_attempts)

    async def _compare_and_set(
        self, expected: int, stored: CallRecord, raw: str, *, fresh: bool = False
    ) -> int:
        """1 written, 0 conflict, -1 missing, 2 already stored. ``fresh``: this write was never
        sent before, so the same JSON in Redis is someone else's write, not ours."""
        sid, live = stored.call_sid, stored.ended_at is None
        args: list[Any] = [expected, raw, self._ttl_ms(stored), "1" if live else "0"]
        args += [self._index_score(stored), sid, self._ended_cutoff()]
        return int(await self._run("update", sid, self._resendable(_UPDATE, sid, args, fresh)))

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        await self.update(call_sid, ending(status))

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        if limit <= 0:
            return []
        sids, raws = await self._run("list_active", "", lambda: self._active_records(limit))
        records = []
        for sid, raw in zip(sids, raws, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.call_key(sid)))
        return [r for r in records if r.ended_at is None]

    async def _active_records(self, limit: int) -> tuple[list[str], Sequence[Any]]:
        # Orphans (instance died, call never ended) age out of the index with their key.
        oldest = time.time() - self.active_ttl
        await self._redis.zremrangebyscore(self._active_key, "-inf", oldest)
        sids = [_text(s) for s in await self._redis.zrevrange(self._active_key, 0, limit - 1)]
        return await self._records_of(sids)

    async def list_stale(self, written_before: datetime, limit: int = 100) -> list[CallRecord]:
        if limit <= 0:
            return []
        top = f"({_score(written_before)!r}"
        read = await self._run("list_stale", "", lambda: self._stale_records(limit, top))
        records = []
        for sid, raw in zip(*read, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.call_key(sid)))
        return [r for r in records if r.ended_at is None and r.updated_at < written_before]

    async def _stale_records(self, limit: int, top: str) -> tuple[list[str], Sequence[Any]]:
        # The active set is scored by updated_at: its oldest entries are the stale calls.
        found = await self._redis.zrangebyscore(self._active_key, "-inf", top, 0, limit)
        return await self._records_of([_text(s) for s in found])

    async def _records_of(self, sids: list[str]) -> tuple[list[str], Sequence[Any]]:
        if not sids:
            return [], []
        keys = [self.call_key(s) for s in sids]
        if isinstance(self._redis, RedisCluster):  # the records sit in many slots
            return sids, await self._redis.mget_nonatomic(keys)
        return sids, await self._redis.mget(keys)

    async def list_ended(
        self, limit: int = 100, before: datetime | None = None
    ) -> list[CallRecord]:
        if limit <= 0:
            return []
        top = "+inf" if before is None else f"({_score(before)!r}"
        read = await self._run("list_ended", "", lambda: self._ended_records(limit, top))
        records = []
        for sid, raw in zip(*read, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.call_key(sid)))
        return [r for r in records if r.ended_at is not None]

    async def _ended_records(self, limit: int, top: str) -> tuple[list[str], Sequence[Any]]:
        await self._redis.zremrangebyscore(self._ended_key, "-inf", self._ended_cutoff())
        found = await self._redis.zrevrangebyscore(self._ended_key, top, "-inf", 0, limit)
        return await self._records_of([_text(s) for s in found])

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        key, ttl_ms = self.token_key(token), max(1, int(ttl * 1000))
        await self._run(
            "put_stream_token",
            call_sid,
            lambda: self._write(key, "SET", key, call_sid, "PX", ttl_ms),
        )

    async def redeem_stream_token(self, token: str) -> str | None:
        # A GETDEL whose reply is lost and then retried reads None: the token counts as spent
        # (refused, never admitted twice).
        key = self.token_key(token)
        raw = await self._run("redeem_stream_token", "", lambda: self._write(key, "GETDEL", key))
        return None if raw is None else _text(raw)

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        key, ttl_ms = self.flow_key(version), max(1, int(ttl * 1000))
        args = [json.dumps(sources), ttl_ms]
        await self._run("save_flow_sources", "", lambda: self._eval(_SAVE_FLOW, [key], args))

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        key = self.flow_key(version)
        raw = await self._run("load_flow_sources", "", lambda: self._redis.get(key))
        return None if raw is None else flow_sources_from_json(raw, key)

    async def ping(self) -> bool:
        try:
            if isinstance(self._redis, RedisCluster):  # every master must answer
                return bool(await self._redis.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(await self._redis.ping())
        except (RedisError, RedisClusterException, OSError):
            return False

    async def start(self) -> None:
        """Nothing to start: connections are made, and a cluster's slot map loaded, on first use."""

    async def aclose(self) -> None:
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    # -- commands ----------------------------------------------------------------------------

    def _resendable(
        self, script: _Lua, call_sid: str, args: list[Any], fresh: bool
    ) -> Callable[[], Awaitable[Any]]:
        """A call record script for _run; its ARGV ends with the resend flag, set from the
        second attempt on (or from the first, unless ``fresh``)."""
        keys = [self.call_key(call_sid)]
        if not self.cluster:
            keys += [self._active_key, self._ended_key]
        sent = not fresh

        async def attempt() -> Any:
            nonlocal sent
            resend, sent = sent, True
            return await self._eval(script, keys, [*args, "1" if resend else "0"])

        return attempt

    def _index_score(self, record: CallRecord) -> float:
        """Where the record sits in its index: the active set by updated_at, the ended one by
        ended_at (constant: re-writing an ended call does not move it)."""
        return _score(record.ended_at or record.updated_at)

    def _ended_cutoff(self) -> float:
        """Ended calls older than this have expired: the ended index drops them."""
        return time.time() - self.ended_ttl

    async def _index(self, record: CallRecord) -> None:
        """A cluster's indexes, kept after the record's script (they are in other slots)."""
        if not self.cluster:
            return
        sid = record.call_sid
        if record.ended_at is None:
            index = {sid: self._index_score(record)}
            await self._run("index", sid, lambda: self._redis.zadd(self._active_key, index))
            return
        await self._run("index", sid, lambda: self._redis.zrem(self._active_key, sid))
        try:
            await self._run("index_ended", sid, lambda: self._index_ended(record))
        except StoreUnavailable as exc:  # the call is ended; only its listing is missing
            self.unindexed_ends += 1
            log.warning("redis_ended_index_failed", call_sid=sid, error=str(exc))

    async def _index_ended(self, record: CallRecord) -> None:
        await self._redis.zadd(self._ended_key, {record.call_sid: self._index_score(record)})
        await self._redis.zremrangebyscore(self._ended_key, "-inf", self._ended_cutoff())

    async def _eval(self, script: _Lua, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._write(keys[0], "EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._write(keys[0], "EVAL", script.text, len(keys), *keys, *args)

    async def _write(self, key: str, *command: Any) -> Any:
        """Run one write; with replicas to wait for, WAIT follows it on the same connection
        (WAIT counts the replicas that have this connection's writes), or ROLE on a master
        short of replicas."""
        if self.target.wait_replicas <= 0:
            return await self._redis.execute_command(*command)
        name, node = await self._master_of(key)
        # A cluster routes a keyless command to every node: pin it to the write's master.
        routing: dict[str, Any] = {} if node is None else {"target_nodes": node}
        short = name in self._short_of_replicas
        pipe = self._redis.pipeline(transaction=False)
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
        if isinstance(self._redis, RedisCluster):
            await self._redis.initialize()  # no-op once the slot map is loaded
            node = self._redis.get_node_from_key(key)
            if node is None:  # the slot map has a hole mid-failover: retried like one
                raise SlotNotCoveredError(f"no master known for {key!r}")
            return str(node.name), node
        return _address(getattr(self._redis.connection_pool, "master_address", None)), None

    async def _unconfirmed(
        self, key: str, master: str, acked: Any, routing: dict[str, Any]
    ) -> None:
        """No replica confirmed a write in time. If its master is being replaced the write
        may vanish with it: raise, so _run sends it again (to the new master once there is
        one). Otherwise the write stands, counted and logged; a master with too few replicas
        connected stops waiting until they are back (see the module's docstring)."""
        replaced = await self._master_replaced(key, master)
        if replaced:
            raise RedisConnectionError(f"write to {master} unconfirmed: {replaced}")
        self.unreplicated_writes += 1
        try:
            connected = _connected_replicas(await self._redis.execute_command("ROLE", **routing))
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
        if isinstance(self._redis, RedisCluster):
            # The promoted replica knows at once; the other masters learn it by gossip.
            why = await self._replica_took_over(key)
            owner = "" if why else await self._slot_owner(key, master)
            if owner and owner != master:
                why = f"the cluster moved its slot to {owner}"
            if why:
                await self._redis.aclose()  # reload the slot map before the resend
            return why
        pool = self._redis.connection_pool
        assert isinstance(pool, _BlockingSentinelPool) and self._sentinel is not None
        service = self.target.service
        views = await _sentinel_views(self._sentinel, service, self._ask_timeout)
        if not views or not all(
            self._sentinel.check_master_state(view, service)
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
        assert isinstance(self._redis, RedisCluster)
        serving = self._redis.nodes_manager.slots_cache.get(self._redis.keyslot(key), [])
        for replica in serving[1:]:  # [master, *replicas]
            try:
                async with asyncio.timeout(self._ask_timeout):
                    role: Any = await self._redis.execute_command("ROLE", target_nodes=replica)
            except (RedisError, RedisClusterException, OSError):  # TimeoutError is an OSError
                continue
            if role and _text(role[0]) == "master":
                return f"its replica {replica.name} has taken over"
        return ""

    async def _slot_owner(self, key: str, master: str) -> str:
        """Who serves ``key``'s slot according to another master (the old one may not know
        yet); "" if none answers."""
        assert isinstance(self._redis, RedisCluster)
        slot = self._redis.keyslot(key)
        for other in self._redis.get_primaries():
            if other.name == master:
                continue
            try:  # bounded as the replica's ROLE: a stalled master is no owner, not 2 s a write
                async with asyncio.timeout(self._ask_timeout):
                    slots: Any = await self._redis.cluster_slots(target_nodes=other)
            except (RedisError, RedisClusterException, OSError):  # TimeoutError is an OSError
                continue
            for (first, last), owners in slots.items():
                if first <= slot <= last:
                    host, port = owners["primary"][:2]
                    return f"{_text(host)}:{port}"
        return ""

    async def _run(self, op: str, call_sid: str, command: Callable[[], Awaitable[T]]) -> T:
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
    if isinstance(role, list) and len(role) >= 3 and _text(role[0]) == "master":
        return len(role[2])
    return 0


def _address(address: Any) -> str:
    return "" if address is None else f"{_text(address[0])}:{address[1]}"


def _unavailable(op: str, call_sid: str, exc: BaseException) -> StoreUnavailable:
    where = f" {call_sid}" if call_sid else ""
    return StoreUnavailable(f"redis {op}{where}: {type(exc).__name__}: {exc}")


def _score(when: datetime) -> float:
    return when.timestamp()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
