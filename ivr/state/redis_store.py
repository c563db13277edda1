"""Call state in Redis, shared by every gateway instance.

Layout (all keys under a configurable prefix):
    {prefix}call:{sid}     one JSON CallRecord; PX = active_ttl while live, ended_ttl after end
    {prefix}active         sorted set of live call sids, scored by updated_at (epoch seconds)
    {prefix}token:{token}  call_sid a webhook-minted stream token belongs to; PX = token ttl
    {prefix}flow:{version} JSON {relative path: text} of the files a flow version was loaded
                           from, so any instance can run calls pinned to it; PX = given ttl

Atomic update is a compare-and-set on ``version`` done by a Lua script, not WATCH/MULTI:
a read (GET) plus one EVALSHA is 2 round trips on any pooled connection, while WATCH needs
4 round trips (WATCH, GET, MULTI..EXEC) and pins one connection of the bounded pool for the
whole read-modify-write, which under 1000 calls means more waiting on the pool. The script
also moves the sid in or out of the active set and sets the TTL in the same atomic step.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

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

DEFAULT_ACTIVE_TTL = 6 * 3600.0  # Twilio caps a call at 4 h; a live key older than this is orphaned

# ARGV: json, ttl ms, live ('1'/'0'), score, sid. Returns 0 if the call exists.
_CREATE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
if ARGV[3] == '1' then redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5]) end
return 1
"""

# ARGV: expected version, new json, ttl ms, live ('1'/'0'), score, sid.
# Returns -1 missing, 0 version conflict, 1 written, 2 this exact write is already stored
# (a retry after a lost reply must not apply the mutation twice).
_UPDATE = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur == ARGV[2] then return 2 end
if cjson.decode(cur)['version'] ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
else
  redis.call('ZREM', KEYS[2], ARGV[6])
end
return 1
"""


@contextmanager
def _mapped(op: str, call_sid: str = "") -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        where = f" {call_sid}" if call_sid else ""
        raise StoreUnavailable(f"redis {op}{where}: {type(exc).__name__}: {exc}") from exc


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
        self.prefix = prefix
        self.ended_ttl = ended_ttl
        self.active_ttl = active_ttl
        self.max_attempts = max_attempts
        # Blocking pool: past max_connections callers wait instead of failing (ops.md §1).
        # One retry on a dropped connection rides over a Redis restart without degrading.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        self._redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._create = self._redis.register_script(_CREATE)
        self._update = self._redis.register_script(_UPDATE)
        self._active_key = f"{prefix}active"

    def call_key(self, call_sid: str) -> str:
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

    async def create(self, record: CallRecord) -> CallRecord:
        stored, raw = prepare_new(record)
        keys = [self.call_key(stored.call_sid), self._active_key]
        live = "1" if stored.ended_at is None else "0"
        ttl = self._ttl_ms(stored)
        args: list[Any] = [raw, ttl, live, _score(stored.updated_at), stored.call_sid]
        with _mapped("create", stored.call_sid):
            created = await self._create(keys=keys, args=args)
        if not created:
            raise CallExists(stored.call_sid)
        return stored

    async def get(self, call_sid: str) -> CallRecord | None:
        key = self.call_key(call_sid)
        with _mapped("get", call_sid):
            raw = await self._redis.get(key)
        return None if raw is None else CallRecord.from_json(raw, key)

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        for attempt in range(self.max_attempts):
            current = await self.get(call_sid)
            if current is None:
                raise CallNotFound(call_sid)
            expected = current.version  # read before the in-place mutation bumps it
            stored, raw = apply_mutation(current, mutate, owned=True)
            outcome = await self._compare_and_set(expected, stored, raw)
            if outcome == -1:
                raise CallNotFound(call_sid)
            if outcome > 0:
                return stored
            # Lost the race: back off a little (jittered) so the writers interleave.
            await asyncio.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))
        raise UpdateConflict(call_sid, self.max_attempts)

    async def _compare_and_set(self, expected: int, stored: CallRecord, raw: str) -> int:
        live = "1" if stored.ended_at is None else "0"
        keys = [self.call_key(stored.call_sid), self._active_key]
        args: list[Any] = [
            expected,
            raw,
            self._ttl_ms(stored),
            live,
            _score(stored.updated_at),
            stored.call_sid,
        ]
        with _mapped("update", stored.call_sid):
            return int(await self._update(keys=keys, args=args))

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        await self.update(call_sid, ending(status))

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        if limit <= 0:
            return []
        with _mapped("list_active"):
            # Orphans (instance died, call never ended) age out of the index with their key.
            await self._redis.zremrangebyscore(
                self._active_key, "-inf", time.time() - self.active_ttl
            )
            sids = [_text(s) for s in await self._redis.zrevrange(self._active_key, 0, limit - 1)]
            raws = await self._redis.mget([self.call_key(s) for s in sids]) if sids else []
        records = []
        for sid, raw in zip(sids, raws, strict=True):
            if raw is not None:
                records.append(CallRecord.from_json(raw, self.call_key(sid)))
        return [r for r in records if r.ended_at is None]

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        with _mapped("put_stream_token", call_sid):
            await self._redis.set(self.token_key(token), call_sid, px=max(1, int(ttl * 1000)))

    async def redeem_stream_token(self, token: str) -> str | None:
        with _mapped("redeem_stream_token"):
            raw = await self._redis.getdel(self.token_key(token))
        return None if raw is None else _text(raw)

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        key, ttl_ms = self.flow_key(version), max(1, int(ttl * 1000))
        with _mapped("save_flow_sources"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(key, json.dumps(sources), nx=True, px=ttl_ms)
                pipe.pexpire(key, ttl_ms)  # renew: the version is still being pinned
                await pipe.execute()

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        key = self.flow_key(version)
        with _mapped("load_flow_sources"):
            raw = await self._redis.get(key)
        return None if raw is None else flow_sources_from_json(raw, key)

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def aclose(self) -> None:
        await self._redis.aclose()


def _score(when: datetime) -> float:
    return when.timestamp()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
