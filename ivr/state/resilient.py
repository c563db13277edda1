"""The gateway's call store: a shared store (Redis) with an in-memory fallback for its own calls.

Calls carried by this instance keep a local copy. When the primary store is unreachable the
store goes *degraded*: reads are served from memory, writes are applied in memory and queued
(latest record per call only, bounded), and new calls are still answered. A background
reconciler, owned by this store (``start()``/``aclose()``), probes the primary with backoff and
writes the queued records back. For the calls it carries, this instance's latest record wins;
if the primary changed meanwhile (someone else wrote), the overwrite is counted as a conflict
and logged.

Every primary operation on a call's path has a *budget* (``budget`` seconds, IVR_REDIS_BUDGET_MS):
a Redis that is slow, paused or black-holed costs a call at most that long once, then the store
is degraded and the call goes on from memory. A write cut off by the budget may still land; its
write-back finds the primary already holding our record (same content) and is not a conflict.

Ended calls: the primary's ended index is listed while it answers. While it does not, the list
holds what this instance knows: the calls it ended during the outage and the last
``max_recent_ended`` it saw end before (other instances' ends are missing until the primary is
back). The outage's ends reach the primary's index with their write-back (the same write lists
them), so nothing is missing from it afterwards.

Stream tokens: a token's signature proves it genuine, so the store only decides single use.
While the primary answers, its claim (Redis: SET NX of the spent token) decides it for every
instance, whichever instance minted the token and whether or not that instance could register
it. While it does not, a token is admitted once per instance, and the spend is replayed to the
primary when it returns (before the records' write-back).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from datetime import datetime

import structlog

from ivr.state.base import (
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    CallStore,
    Mutator,
    StoreError,
    StoreUnavailable,
    clone,
    ending,
    prepare_new,
)
from ivr.state.resilient_flows import FlowSources
from ivr.state.resilient_tokens import StreamTokens
from ivr.state.resilient_writeback import WriteBack

log = structlog.get_logger("ivr.state")


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
    over_budget: int = 0  # primary operations cut off by the budget


def statistics_of(store: object) -> StoreStatistics | None:
    """The statistics of a store that degrades to memory; None for a plain store."""
    return store.statistics() if isinstance(store, ResilientCallStore) else None


class ResilientCallStore(StreamTokens, FlowSources, WriteBack):
    """The ``CallStore`` the gateway uses (see the module's docstring). Its parts: the calls'
    local copies and the degraded state (``ResilientCore``), stream tokens, flow sources, the
    write-back of queued records; this class adds the records' operations and the reconciler
    that owns the write-back."""

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
        await self._settle_late_claims()
        if self._has_pending():
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
            over_budget=self.over_budget,
        )

    def shared(self) -> CallStore | None:
        """The primary, for what only it can decide for every instance (the sweep that ends
        calls nobody ended); None while it is unreachable."""
        return None if self.degraded else self.primary

    def unsynced(self, call_sid: str) -> bool:
        """Whether this instance holds a write of the call the primary has not seen yet."""
        return call_sid in self._pending

    def learn(self, record: CallRecord) -> None:
        """``record`` was just written to the primary on this instance's behalf (``shared``)."""
        if record.call_sid not in self._pending:
            self._remember(record, synced=True)

    # -- CallStore -------------------------------------------------------------------------

    async def create(self, record: CallRecord) -> CallRecord:
        if not self.degraded:
            try:
                stored = await self._within_budget("create", self.primary.create(record))
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
                found = await self._within_budget("get", self.primary.get(call_sid))
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
                work = self.primary.update(call_sid, mutate)
                stored = await self._within_budget("update", work)
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

    async def list_stale(self, written_before: datetime, limit: int = 100) -> list[CallRecord]:
        if not self.degraded:
            try:
                return await self.primary.list_stale(written_before, limit)
            except StoreUnavailable as exc:
                self._degrade("list_stale", exc)
        stale = [
            r for r in self._local.values() if r.ended_at is None and r.updated_at < written_before
        ]
        stale.sort(key=lambda r: r.updated_at)
        return [clone(r) for r in stale[: max(0, limit)]]

    async def list_ended(
        self, limit: int = 100, before: datetime | None = None
    ) -> list[CallRecord]:
        if not self.degraded:
            try:
                return await self.primary.list_ended(limit, before)  # no budget: not a call's
            except StoreUnavailable as exc:
                self._degrade("list_ended", exc)
        known = dict(self._recent_ended)
        known.update((sid, r) for sid, r in self._local.items() if r.ended_at is not None)
        ended = [
            r
            for r in known.values()
            if r.ended_at is not None and (before is None or r.ended_at < before)
        ]
        ended.sort(key=lambda r: r.ended_at or r.updated_at, reverse=True)
        return [clone(r) for r in ended[:limit]]

    async def ping(self) -> bool:
        try:
            return await self._within_budget("ping", self.primary.ping())
        except StoreUnavailable:
            return False

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
                if not self._has_pending():
                    self._wake.clear()
                    if self.degraded:
                        self._recover()
                continue
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.max_backoff)

    async def _flush(self) -> None:
        if not await self.primary.ping():
            raise StoreUnavailable("primary store did not answer ping")
        # Spends first: until the primary knows a token was used here, another instance
        # would admit a replay of it; the records' write-back can take a while.
        await self._flush_tokens()
        await self._flush_calls()
        await self._flush_flows()
