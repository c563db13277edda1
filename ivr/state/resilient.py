"""The gateway's call store: a shared store (Redis) with an in-memory fallback for its own calls.

Calls carried by this instance keep a local copy. When the primary store is unreachable the
store goes *degraded*: reads are served from memory, writes are applied in memory and queued
(latest record per call only, bounded), and new calls are still answered. A background
reconciler, owned by this store (``start()``/``aclose()``), probes the primary with backoff and
writes the queued records back. For the calls it carries, this instance's latest record wins;
if the primary changed meanwhile (someone else wrote), the overwrite is counted as a conflict
and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

import structlog

from ivr.state.base import (
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    CallStore,
    CorruptRecord,
    Mutator,
    StoreError,
    StoreUnavailable,
    apply_mutation,
    clone,
    ending,
    prepare_new,
)

log = structlog.get_logger("ivr.state")

_Stamp = tuple[int, datetime]
MAX_LOCAL_FLOWS = 256  # flow versions whose sources are kept here (a few KB to MB each)


def _stamp(record: CallRecord) -> _Stamp:
    return (record.version, record.updated_at)


# Fields a write-back copies onto the primary's record; the primary stamps the rest.
_COPIED = tuple(n for n in CallRecord.model_fields if n not in ("version", "updated_at"))


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    degraded: bool
    pending: int  # calls with a write not yet in the primary
    local_calls: int
    writes_queued: int  # total writes applied in memory while the primary was unusable
    reconciled: int  # queued records written back
    failures: int  # primary operations that failed as unavailable
    conflicts: int  # write-backs that overwrote a change made elsewhere
    dropped: int  # queued records lost (queue full, close with primary down, corrupt remote)


class ResilientCallStore:
    def __init__(
        self,
        primary: CallStore,
        *,
        instance_id: str | None = None,
        max_pending: int = 10_000,
        max_local: int = 10_000,
        min_backoff: float = 0.1,
        max_backoff: float = 5.0,
        close_timeout: float = 2.0,
    ) -> None:
        self.primary = primary
        self.instance_id = instance_id
        self.max_pending = max_pending
        self.max_local = max_local
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.close_timeout = close_timeout
        self.degraded = False
        self.writes_queued = 0
        self.reconciled = 0
        self.failures = 0
        self.conflicts = 0
        self.dropped = 0
        self._local: OrderedDict[str, CallRecord] = OrderedDict()
        # What the primary last held for each call, None: never stored there. Version plus
        # updated_at, since a Redis restarted empty hands out the same version numbers again.
        self._synced: dict[str, _Stamp | None] = {}
        self._pending: OrderedDict[str, CallRecord] = OrderedDict()
        self._tokens: dict[str, tuple[str, float]] = {}
        self._pending_tokens: dict[str, tuple[str, float]] = {}
        # Flow sources this instance saved (version -> (sources, deadline)), newest last; the
        # pending ones are written back with their remaining TTL, like tokens.
        self._flows: OrderedDict[str, tuple[dict[str, str], float]] = OrderedDict()
        self._pending_flows: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._degraded_since = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._reconcile_loop(), name="call-store-reconciler")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending or self._pending_tokens or self._pending_flows:
            await self._final_flush()
        await self.primary.aclose()

    async def _final_flush(self) -> None:
        try:
            async with asyncio.timeout(self.close_timeout):
                await self._flush()
        except (StoreError, TimeoutError) as exc:
            self.dropped += len(self._pending)
            log.error("call_store_closed_with_pending", pending=len(self._pending), error=str(exc))

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            degraded=self.degraded,
            pending=len(self._pending),
            local_calls=len(self._local),
            writes_queued=self.writes_queued,
            reconciled=self.reconciled,
            failures=self.failures,
            conflicts=self.conflicts,
            dropped=self.dropped,
        )

    # -- CallStore -------------------------------------------------------------------------

    async def create(self, record: CallRecord) -> CallRecord:
        if not self.degraded:
            try:
                stored = await self.primary.create(record)
            except StoreUnavailable as exc:
                self._degrade("create", exc)
            else:
                self._remember(stored, synced=True)
                return stored
        if record.call_sid in self._local:
            raise CallExists(record.call_sid)
        stored, _ = prepare_new(record)
        self._remember(stored, synced=False, force=True)
        self._queue(stored)
        return clone(stored)

    async def get(self, call_sid: str) -> CallRecord | None:
        if not self.degraded and call_sid not in self._pending:
            try:
                found = await self.primary.get(call_sid)
            except StoreUnavailable as exc:
                self._degrade("get", exc)
            else:
                if found is not None or call_sid not in self._local:
                    return found
                self._primary_lost(call_sid)
        return self._local_copy(call_sid)

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        if not self.degraded and call_sid not in self._pending:
            try:
                stored = await self.primary.update(call_sid, mutate)
            except StoreUnavailable as exc:
                self._degrade("update", exc)
            except CallNotFound:
                if call_sid not in self._local:
                    raise
                self._primary_lost(call_sid)
            else:
                self._after_primary_write(stored, mutate)
                return stored
        return self._apply_local(call_sid, mutate)

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        await self.update(call_sid, ending(status))

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        if not self.degraded:
            try:
                return await self.primary.list_active(limit)
            except StoreUnavailable as exc:
                self._degrade("list_active", exc)
        live = [r for r in self._local.values() if r.ended_at is None]
        live.sort(key=lambda r: r.updated_at, reverse=True)
        return [clone(r) for r in live[:limit]]

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        entry = (call_sid, time.monotonic() + ttl)
        self._sweep_tokens()
        self._tokens[token] = entry
        if not self.degraded:
            try:
                await self.primary.put_stream_token(call_sid, token, ttl)
                return
            except StoreUnavailable as exc:
                self._degrade("put_stream_token", exc)
        self._pending_tokens[token] = entry
        self._wake.set()

    async def redeem_stream_token(self, token: str) -> str | None:
        entry = self._tokens.pop(token, None)
        self._pending_tokens.pop(token, None)
        if entry is not None and entry[1] > time.monotonic():
            if not self.degraded:
                with contextlib.suppress(StoreUnavailable):
                    await self.primary.redeem_stream_token(token)  # spend it everywhere
            return entry[0]
        if self.degraded:
            return None
        try:
            return await self.primary.redeem_stream_token(token)
        except StoreUnavailable as exc:
            self._degrade("redeem_stream_token", exc)
            return None

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        kept = self._flows.get(version)
        if kept is None or kept[1] <= time.monotonic():  # stored if absent, like the primary
            kept = (dict(sources), 0.0)
        self._flows[version] = (kept[0], time.monotonic() + ttl)
        self._flows.move_to_end(version)
        while len(self._flows) > MAX_LOCAL_FLOWS:
            old, _ = self._flows.popitem(last=False)
            self._pending_flows.discard(old)
        if not self.degraded:
            try:
                await self.primary.save_flow_sources(version, sources, ttl)
                return
            except StoreUnavailable as exc:
                self._degrade("save_flow_sources", exc)
        self._pending_flows.add(version)
        self._wake.set()

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        entry = self._flows.get(version)
        if entry is not None and entry[1] > time.monotonic():
            return dict(entry[0])
        if self.degraded:
            return None
        try:
            return await self.primary.load_flow_sources(version)
        except StoreUnavailable as exc:
            self._degrade("load_flow_sources", exc)
            return None

    async def ping(self) -> bool:
        return await self.primary.ping()

    # -- local state -----------------------------------------------------------------------

    def _carries(self, record: CallRecord) -> bool:
        return self.instance_id is None or record.instance_id in (None, self.instance_id)

    def _remember(self, record: CallRecord, *, synced: bool, force: bool = False) -> None:
        sid = record.call_sid
        if record.ended_at is not None or not (force or self._carries(record)):
            self._forget(sid)
            return
        self._local[sid] = clone(record)  # the caller keeps (and may edit) ``record``
        self._local.move_to_end(sid)
        self._synced[sid] = _stamp(record) if synced else None
        while len(self._local) > self.max_local:
            oldest = next((s for s in self._local if s not in self._pending), None)
            if oldest is None:
                break
            self._forget(oldest)

    def _forget(self, call_sid: str) -> None:
        self._local.pop(call_sid, None)
        self._synced.pop(call_sid, None)

    def _local_copy(self, call_sid: str) -> CallRecord:
        record = self._local.get(call_sid)
        if record is None:
            raise _not_carried(call_sid)
        return clone(record)

    def _apply_local(self, call_sid: str, mutate: Mutator) -> CallRecord:
        current = self._local.get(call_sid)
        if current is None:
            raise _not_carried(call_sid) if self.degraded else CallNotFound(call_sid)
        stored, _ = apply_mutation(current, mutate)
        self._local[call_sid] = stored
        self._queue(stored)
        return clone(stored)

    def _after_primary_write(self, stored: CallRecord, mutate: Mutator) -> None:
        sid = stored.call_sid
        queued = self._pending.get(sid)
        if queued is None:
            self._remember(stored, synced=True)
            return
        # A local write was queued while this one was in flight: fold this change into it,
        # so the write-back carries both and the primary's version is known to include ours.
        merged, _ = apply_mutation(queued, mutate)
        self._local[sid] = merged
        self._pending[sid] = merged
        self._synced[sid] = _stamp(stored)

    def _primary_lost(self, call_sid: str) -> None:
        """The primary no longer has a call we carry (restarted empty): write ours back."""
        log.warning("call_store_record_lost", call_sid=call_sid)
        self._synced[call_sid] = None
        self._queue(self._local[call_sid])

    def _queue(self, record: CallRecord) -> None:
        sid = record.call_sid
        self._pending[sid] = record
        self._pending.move_to_end(sid)
        self.writes_queued += 1
        if len(self._pending) > self.max_pending:
            lost, _ = self._pending.popitem(last=False)
            self.dropped += 1
            log.error("call_store_queue_full", dropped_call_sid=lost, limit=self.max_pending)
        self._wake.set()

    def _sweep_tokens(self) -> None:
        if len(self._tokens) < 1024:
            return
        now = time.monotonic()
        self._tokens = {t: e for t, e in self._tokens.items() if e[1] > now}

    def _degrade(self, op: str, exc: StoreUnavailable) -> None:
        self.failures += 1
        if not self.degraded:
            self.degraded = True
            self._degraded_since = time.monotonic()
            log.warning("call_store_degraded", op=op, error=str(exc))
        self._wake.set()

    def _recover(self) -> None:
        self.degraded = False
        seconds = round(time.monotonic() - self._degraded_since, 3)
        log.info("call_store_recovered", seconds_degraded=seconds, reconciled=self.reconciled)

    # -- reconciler ------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        delay = self.min_backoff
        while True:
            await self._wake.wait()
            try:
                await self._flush()
            except StoreUnavailable as exc:
                self.failures += 1
                log.debug("call_store_reconcile_retry", delay=delay, error=str(exc))
            except Exception:  # the reconciler must outlive any single bad record
                self.failures += 1
                log.exception("call_store_reconcile_failed")
            else:
                delay = self.min_backoff
                if not self._pending and not self._pending_tokens and not self._pending_flows:
                    self._wake.clear()
                    if self.degraded:
                        self._recover()
                continue
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.max_backoff)

    async def _flush(self) -> None:
        if not await self.primary.ping():
            raise StoreUnavailable("primary store did not answer ping")
        for sid, record in list(self._pending.items()):
            if self._pending.get(sid) is not record:
                continue  # superseded while we were writing another; next pass takes it
            await self._write_back(record)
            if self._pending.get(sid) is record:
                del self._pending[sid]
        await self._flush_tokens()
        await self._flush_flows()

    async def _flush_tokens(self) -> None:
        for token, (sid, deadline) in list(self._pending_tokens.items()):
            left = deadline - time.monotonic()
            if left > 0:
                await self.primary.put_stream_token(sid, token, left)
            self._pending_tokens.pop(token, None)

    async def _flush_flows(self) -> None:
        for version in list(self._pending_flows):
            entry = self._flows.get(version)
            left = entry[1] - time.monotonic() if entry is not None else 0.0
            if entry is not None and left > 0:
                await self.primary.save_flow_sources(version, entry[0], left)
            self._pending_flows.discard(version)

    async def _write_back(self, record: CallRecord) -> None:
        sid = record.call_sid
        base = self._synced.get(sid)
        try:
            stored = await self._overwrite(record, base)
        except CorruptRecord as exc:
            self.dropped += 1
            log.error("call_store_reconcile_dropped", call_sid=sid, error=str(exc))
            return
        self.reconciled += 1
        if self._pending.get(sid) is record:
            self._remember(stored, synced=True, force=True)
        else:
            self._synced[sid] = _stamp(stored)

    async def _overwrite(self, record: CallRecord, base: _Stamp | None) -> CallRecord:
        """Make the primary hold ``record`` (this instance wins); count a conflict if the
        primary's version is not the one our queued changes were based on."""
        seen: list[_Stamp] = []

        def take_ours(remote: CallRecord) -> None:
            seen.append(_stamp(remote))
            for name in _COPIED:
                setattr(remote, name, getattr(record, name))

        for _ in range(2):
            try:
                stored = await self.primary.update(record.call_sid, take_ours)
            except CallNotFound:
                try:
                    return await self.primary.create(record)
                except CallExists:
                    continue  # created elsewhere in between: overwrite it on the next try
            if seen and seen[-1] != base:
                self._conflict(record.call_sid, base, seen[-1])
            return stored
        raise StoreError(f"call {record.call_sid!r}: could not write back (created concurrently)")

    def _conflict(self, call_sid: str, base: _Stamp | None, found: _Stamp) -> None:
        self.conflicts += 1
        expected = None if base is None else base[0]
        log.warning(
            "call_store_conflict", call_sid=call_sid, expected_version=expected, found=found[0]
        )


def _not_carried(call_sid: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"call {call_sid!r} is not carried by this instance and the store is unreachable"
    )
