"""In-process call store: the default when no Redis URL is configured (single instance only).

Records are kept as JSON so the semantics match Redis exactly: what a caller gets back is a fresh
object, and a value that cannot round-trip through JSON fails here too.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

from ivr.state.base import (
    DEFAULT_ENDED_TTL,
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    Mutator,
    apply_mutation,
    ending,
    flow_sources_from_json,
    prepare_new,
)
from ivr.state.expiring import ExpiringMap

_CALL_SWEEP_EVERY = 256
DEFAULT_ACTIVE_TTL = 6 * 3600.0
"""A live record not written for this long is orphaned (Twilio caps a call at 4 h): as in Redis."""


class MemoryCallStore:
    def __init__(
        self, *, ended_ttl: float = DEFAULT_ENDED_TTL, active_ttl: float = DEFAULT_ACTIVE_TTL
    ) -> None:
        self.ended_ttl = ended_ttl
        self.active_ttl = active_ttl
        self._calls: dict[str, str] = {}
        self._expires: dict[str, float] = {}  # call_sid -> monotonic deadline
        self._ended: dict[str, float] = {}  # calls whose deadline counts from their end:
        # their ended_at (epoch seconds), the ended index
        self._creates = 0
        self._spent_tokens: ExpiringMap[str] = ExpiringMap()  # token -> the call it admitted
        self._flows: ExpiringMap[str] = ExpiringMap()  # version -> its sources, as JSON
        self._lock = asyncio.Lock()

    def _load(self, call_sid: str) -> CallRecord | None:
        deadline = self._expires.get(call_sid)
        if deadline is not None and time.monotonic() >= deadline:
            self._forget(call_sid)
        raw = self._calls.get(call_sid)
        return None if raw is None else CallRecord.from_json(raw, f"memory:{call_sid}")

    async def create(self, record: CallRecord) -> CallRecord:
        async with self._lock:
            if self._load(record.call_sid) is not None:
                raise CallExists(record.call_sid)
            stored, raw = prepare_new(record)
            self._calls[record.call_sid] = raw
            self._forget_deadline(record.call_sid)
            self._set_expiry(stored)
            self._creates += 1
            if self._creates % _CALL_SWEEP_EVERY == 0:  # records nobody reads again
                self._sweep()
            return stored

    async def get(self, call_sid: str) -> CallRecord | None:
        async with self._lock:
            return self._load(call_sid)

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        async with self._lock:
            current = self._load(call_sid)
            if current is None:
                raise CallNotFound(call_sid)
            stored, raw = apply_mutation(current, mutate, owned=True)
            self._calls[call_sid] = raw
            self._set_expiry(stored)
            return stored

    def _set_expiry(self, record: CallRecord) -> None:
        sid = record.call_sid
        if record.ended_at is None:  # live: every write renews it, like the Redis key's TTL
            self._expires[sid] = time.monotonic() + self.active_ttl
            return
        # Measured from ended_at, so re-writing an ended call does not extend its life.
        if sid in self._ended:
            return
        elapsed = (record.updated_at - record.ended_at).total_seconds()
        self._expires[sid] = time.monotonic() + max(0.0, self.ended_ttl - elapsed)
        self._ended[sid] = record.ended_at.timestamp()

    def _forget_deadline(self, call_sid: str) -> None:
        self._expires.pop(call_sid, None)
        self._ended.pop(call_sid, None)

    def _forget(self, call_sid: str) -> None:
        self._calls.pop(call_sid, None)
        self._forget_deadline(call_sid)

    def _sweep(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, deadline in self._expires.items() if deadline <= now]:
            self._forget(sid)

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        await self.update(call_sid, ending(status))

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        async with self._lock:
            records = [self._load(sid) for sid in list(self._calls)]
        active = [r for r in records if r is not None and r.ended_at is None]
        active.sort(key=lambda r: r.updated_at, reverse=True)
        return active[:limit]

    async def list_stale(self, written_before: datetime, limit: int = 100) -> list[CallRecord]:
        async with self._lock:
            records = [self._load(sid) for sid in list(self._calls)]
        stale = [
            r
            for r in records
            if r is not None and r.ended_at is None and r.updated_at < written_before
        ]
        stale.sort(key=lambda r: r.updated_at)
        return stale[: max(0, limit)]

    async def list_ended(
        self, limit: int = 100, before: datetime | None = None
    ) -> list[CallRecord]:
        top = float("inf") if before is None else before.timestamp()
        async with self._lock:
            newest = sorted(
                ((at, sid) for sid, at in self._ended.items() if at < top), reverse=True
            )
            records: list[CallRecord] = []
            for _, sid in newest:
                if len(records) >= limit:
                    break
                record = self._load(sid)  # drops it if expired
                if record is not None:
                    records.append(record)
            return records

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        """No instance of an earlier release shares this store's memory: nothing to register."""

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        now = time.monotonic()
        if self._spent_tokens.holds(token, now):
            return False
        self._spent_tokens.put(token, call_sid, now + ttl, now)
        return True

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        now = time.monotonic()
        kept = self._flows.get(version, now)  # a version's sources never change: keep its JSON
        raw = kept if kept is not None else json.dumps(sources)
        self._flows.put(version, raw, now + ttl, now)

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        raw = self._flows.get(version, time.monotonic())
        if raw is None:
            return None
        return flow_sources_from_json(raw, f"memory:flow:{version}")

    async def ping(self) -> bool:
        return True

    async def start(self) -> None:
        """Nothing runs in the background of an in-memory store."""

    async def aclose(self) -> None:
        return None
