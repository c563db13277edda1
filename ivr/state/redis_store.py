"""Call state in Redis, shared by every gateway instance: one server, Sentinel, or Cluster.

The URL picks the deployment (``ivr/state/redis_urls.py``). Layout, all keys under a
configurable prefix:
    {prefix}call:<sid>     one JSON CallRecord; PX = active_ttl while live, ended_ttl after end.
                           In a cluster the sid is a hash tag, {prefix}call:{<sid>}, so every
                           key a call may ever have lands in its slot.
    {prefix}active         sorted set of live call sids, scored by updated_at (epoch seconds)
    {prefix}ended          sorted set of ended call sids, scored by ended_at (epoch seconds);
                           what is older than ended_ttl is trimmed on every end and every read
    {prefix}spent:<token>  call_sid of a stream token that admitted its stream; PX = the
                           token's remaining life. Set NX: the first handshake wins everywhere
    {prefix}token:<token>  call_sid a webhook-minted stream token belongs to; PX = token ttl.
                           Only for instances of earlier releases (they spend it by GETDEL);
                           a claim deletes it, so those refuse a token claimed here
    {prefix}flow:<version> JSON {relative path: text} of the files a flow version was loaded
                           from, so any instance can run calls pinned to it; PX = given ttl

Atomic update is a compare-and-set on ``version`` done by a Lua script, not WATCH/MULTI:
a read (GET) plus one EVALSHA is 2 round trips on any pooled connection, while WATCH needs
4 round trips (WATCH, GET, MULTI..EXEC) and pins one connection of the bounded pool for the
whole read-modify-write, which under 1000 calls means more waiting on the pool. And the read is
mostly skipped: a store remembers the JSON it last read or wrote for each of its live calls
(``KNOWN_RECORDS`` of them), bases the change on that and sends its SHA-1 along; the script
writes only if the record is still exactly that, else the update reads and tries again (not in
a cluster, whose client finds a failed-over slot's new master on the read). A
turn's state save is then one round trip on its critical path, not two (at 100 talking calls
on one core the save was the gateway's largest share of a slow turn: p95 110 ms). On one server
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

Sentinel and Cluster ride over a failover, and writes wait for the replicas to confirm them:
``ivr/state/redis_link.py`` sends every command. The key schema is ``ivr/state/redis_keys.py``;
the scripts are ``ivr/state/redis_scripts.py``.

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
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import structlog
from redis.asyncio.cluster import RedisCluster

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
from ivr.state.redis_keys import RedisKeys, score
from ivr.state.redis_link import RedisLink, as_text
from ivr.state.redis_scripts import CREATE, SAVE_FLOW, UPDATE, Lua
from ivr.state.redis_urls import parse_redis_url

log = structlog.get_logger("ivr.state")

DEFAULT_ACTIVE_TTL = 6 * 3600.0  # Twilio caps a call at 4 h; a live key older than this is orphaned
KNOWN_RECORDS = 2000
"""Live calls whose last JSON a store remembers (a process carries a few hundred)."""


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
        self.keys = RedisKeys(
            prefix, cluster=self.cluster, active_ttl=active_ttl, ended_ttl=ended_ttl
        )
        self.link = RedisLink(self.target, max_connections, pool_timeout, socket_timeout)
        self._redis = self.link.redis  # reads, and a cluster's indexes, go to it directly
        self.unindexed_ends = 0  # cluster: ended calls whose ended-index write failed
        self._known: OrderedDict[str, str | bytes] = OrderedDict()
        """call_sid -> the JSON this store last read or wrote for it (live calls only)."""

    # -- CallStore -------------------------------------------------------------------------

    async def create(self, record: CallRecord) -> CallRecord:
        stored, raw = prepare_new(record)
        sid, live = stored.call_sid, stored.ended_at is None
        args: list[Any] = [raw, self.keys.ttl_ms(stored), "1" if live else "0"]
        args += [self.keys.index_score(stored), sid, self.keys.ended_cutoff()]
        created = await self.link.run(
            "create", sid, self._resendable(CREATE, sid, args, fresh=True)
        )
        if not created:
            raise CallExists(sid)
        self._know(stored, raw)
        await self._index(stored)
        return stored

    async def get(self, call_sid: str) -> CallRecord | None:
        key = self.keys.call_key(call_sid)
        raw = await self.link.run("get", call_sid, lambda: self._redis.get(key))
        if raw is None:
            return None
        record = CallRecord.from_json(raw, key)
        self._know(record, raw)
        return record

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        known = self._known.pop(call_sid, None)
        # The JSON last seen here: if Redis still holds it, no read. Not in a cluster: there
        # the read is what finds a failed-over slot's new master before the write goes.
        if known is not None and not self.cluster:
            base = CallRecord.from_json(known, self.keys.call_key(call_sid))
            expected = base.version  # before the in-place mutation bumps it
            try:
                stored, raw = apply_mutation(base, mutate, owned=True)
            except Exception:  # judged on a copy that may be stale: judged again on a read
                pass
            else:
                if await self._write(expected, stored, raw, based_on=known):
                    return stored
        for attempt in range(self.max_attempts):
            current = await self.get(call_sid)
            if current is None:
                raise CallNotFound(call_sid)
            expected = current.version
            stored, raw = apply_mutation(current, mutate, owned=True)
            if await self._write(expected, stored, raw):
                return stored
            # Lost the race: back off a little (jittered) so the writers interleave.
            await asyncio.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))
        raise UpdateConflict(call_sid, self.max_attempts)

    async def _write(
        self, expected: int, stored: CallRecord, raw: str, *, based_on: str | bytes | None = None
    ) -> bool:
        """Store ``stored`` if Redis still holds version ``expected`` (or, ``based_on``,
        exactly that JSON); False: it changed meanwhile."""
        outcome = await self._compare_and_set(expected, stored, raw, fresh=True, based_on=based_on)
        if outcome == -1:
            self._known.pop(stored.call_sid, None)
            raise CallNotFound(stored.call_sid)
        if outcome == 0:
            return False
        self._know(stored, raw)
        await self._index(stored)
        return True

    async def _compare_and_set(
        self,
        expected: int,
        stored: CallRecord,
        raw: str,
        *,
        fresh: bool = False,
        based_on: str | bytes | None = None,
    ) -> int:
        """1 written, 0 conflict, -1 missing, 2 already stored. ``fresh``: this write was never
        sent before, so the same JSON in Redis is someone else's write, not ours."""
        sid, live = stored.call_sid, stored.ended_at is None
        args: list[Any] = [expected, raw, self.keys.ttl_ms(stored), "1" if live else "0"]
        args += [self.keys.index_score(stored), sid, self.keys.ended_cutoff()]
        after = [_sha1(based_on) if based_on is not None else ""]
        write = self._resendable(UPDATE, sid, args, fresh, after=after)
        return int(await self.link.run("update", sid, write))

    def _know(self, record: CallRecord, raw: str | bytes) -> None:
        """Remember ``raw`` as what Redis holds for a live ``record`` (an ended one: forget)."""
        sid = record.call_sid
        self._known.pop(sid, None)
        if record.ended_at is not None or self.cluster:
            return
        self._known[sid] = raw
        if len(self._known) > KNOWN_RECORDS:
            self._known.popitem(last=False)

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        await self.update(call_sid, ending(status))

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        if limit <= 0:
            return []
        sids, raws = await self.link.run("list_active", "", lambda: self._active_records(limit))
        records = []
        for sid, raw in zip(sids, raws, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.keys.call_key(sid)))
        return [r for r in records if r.ended_at is None]

    async def _active_records(self, limit: int) -> tuple[list[str], Sequence[Any]]:
        # Orphans (instance died, call never ended) age out of the index with their key.
        oldest = time.time() - self.active_ttl
        await self._redis.zremrangebyscore(self.keys.active, "-inf", oldest)
        sids = [as_text(s) for s in await self._redis.zrevrange(self.keys.active, 0, limit - 1)]
        return await self._records_of(sids)

    async def list_stale(self, written_before: datetime, limit: int = 100) -> list[CallRecord]:
        if limit <= 0:
            return []
        top = f"({score(written_before)!r}"
        read = await self.link.run("list_stale", "", lambda: self._stale_records(limit, top))
        records = []
        for sid, raw in zip(*read, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.keys.call_key(sid)))
        return [r for r in records if r.ended_at is None and r.updated_at < written_before]

    async def _stale_records(self, limit: int, top: str) -> tuple[list[str], Sequence[Any]]:
        # The active set is scored by updated_at: its oldest entries are the stale calls.
        found = await self._redis.zrangebyscore(self.keys.active, "-inf", top, 0, limit)
        return await self._records_of([as_text(s) for s in found])

    async def _records_of(self, sids: list[str]) -> tuple[list[str], Sequence[Any]]:
        if not sids:
            return [], []
        keys = [self.keys.call_key(s) for s in sids]
        if isinstance(self._redis, RedisCluster):  # the records sit in many slots
            return sids, await self._redis.mget_nonatomic(keys)
        return sids, await self._redis.mget(keys)

    async def list_ended(
        self, limit: int = 100, before: datetime | None = None
    ) -> list[CallRecord]:
        if limit <= 0:
            return []
        top = "+inf" if before is None else f"({score(before)!r}"
        read = await self.link.run("list_ended", "", lambda: self._ended_records(limit, top))
        records = []
        for sid, raw in zip(*read, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.keys.call_key(sid)))
        return [r for r in records if r.ended_at is not None]

    async def _ended_records(self, limit: int, top: str) -> tuple[list[str], Sequence[Any]]:
        await self._redis.zremrangebyscore(self.keys.ended, "-inf", self.keys.ended_cutoff())
        found = await self._redis.zrevrangebyscore(self.keys.ended, top, "-inf", 0, limit)
        return await self._records_of([as_text(s) for s in found])

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        key, ttl_ms = self.keys.token_key(token), max(1, int(ttl * 1000))
        await self.link.run(
            "put_stream_token",
            call_sid,
            lambda: self.link.write(key, "SET", key, call_sid, "PX", ttl_ms),
        )

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        # A SET NX whose reply is lost and then retried reads None: the token counts as spent
        # (refused, never admitted twice). The token's signature proves it genuine, so a
        # registered key is not required: one the webhook's instance could not write (its
        # Redis over budget) or wrote late must not refuse the call's stream.
        spent, ttl_ms = self.keys.spent_key(token), max(1, int(ttl * 1000))
        first = await self.link.run(
            "claim_stream_token",
            call_sid,
            lambda: self.link.write(spent, "SET", spent, call_sid, "NX", "PX", ttl_ms),
        )
        if first is None:
            return False
        # Delete the registration too, so an instance of an earlier release refuses the token.
        # Two keys in maybe two cluster slots: not one script; a failed delete leaves only that.
        minted = self.keys.token_key(token)
        try:
            await self.link.run(
                "claim_stream_token", call_sid, lambda: self.link.write(minted, "DEL", minted)
            )
        except StoreUnavailable as exc:
            log.warning("redis_minted_token_kept", call_sid=call_sid, error=str(exc)[:200])
        return True

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        key, ttl_ms = self.keys.flow_key(version), max(1, int(ttl * 1000))
        args = [json.dumps(sources), ttl_ms]
        await self.link.run("save_flow_sources", "", lambda: self.link.eval(SAVE_FLOW, [key], args))

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        key = self.keys.flow_key(version)
        raw = await self.link.run("load_flow_sources", "", lambda: self._redis.get(key))
        return None if raw is None else flow_sources_from_json(raw, key)

    async def ping(self) -> bool:
        return await self.link.ping()

    async def start(self) -> None:
        """Nothing to start: connections are made, and a cluster's slot map loaded, on first use."""

    async def aclose(self) -> None:
        await self.link.aclose()

    # -- commands ----------------------------------------------------------------------------

    def _resendable(
        self, script: Lua, call_sid: str, args: list[Any], fresh: bool, after: Sequence[Any] = ()
    ) -> Callable[[], Awaitable[Any]]:
        """A call record script for ``link.run``; its ARGV is ``args``, the resend flag (set from
        the second attempt on, or from the first unless ``fresh``), then ``after``."""
        keys = [self.keys.call_key(call_sid)]
        if not self.cluster:
            keys += [self.keys.active, self.keys.ended]
        sent = not fresh

        async def attempt() -> Any:
            nonlocal sent
            resend, sent = sent, True
            return await self.link.eval(script, keys, [*args, "1" if resend else "0", *after])

        return attempt

    async def _index(self, record: CallRecord) -> None:
        """A cluster's indexes, kept after the record's script (they are in other slots)."""
        if not self.cluster:
            return
        sid = record.call_sid
        if record.ended_at is None:
            index = {sid: self.keys.index_score(record)}
            await self.link.run("index", sid, lambda: self._redis.zadd(self.keys.active, index))
            return
        await self.link.run("index", sid, lambda: self._redis.zrem(self.keys.active, sid))
        try:
            await self.link.run("index_ended", sid, lambda: self._index_ended(record))
        except StoreUnavailable as exc:  # the call is ended; only its listing is missing
            self.unindexed_ends += 1
            log.warning("redis_ended_index_failed", call_sid=sid, error=str(exc))

    async def _index_ended(self, record: CallRecord) -> None:
        await self._redis.zadd(self.keys.ended, {record.call_sid: self.keys.index_score(record)})
        await self._redis.zremrangebyscore(self.keys.ended, "-inf", self.keys.ended_cutoff())


def _sha1(raw: str | bytes) -> str:
    """What Redis's ``redis.sha1hex`` says of ``raw`` as stored (UTF-8)."""
    return hashlib.sha1(raw.encode() if isinstance(raw, str) else raw).hexdigest()
