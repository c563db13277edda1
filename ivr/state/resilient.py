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

Stream tokens: while the primary answers, its GETDEL decides single use for every instance
(a token it says was spent is refused even if this instance minted it). While it does not, a
token whose signature the caller checked (``claim_stream_token``) is admitted once per instance,
and the spend is replayed to the primary when it returns. Tokens minted while degraded are not
written back: a spend elsewhere during the outage could not be ordered against that write.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, TypeVar

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

T = TypeVar("T")
_Stamp = tuple[int, datetime]
MAX_LOCAL_FLOWS = 256  # flow versions whose sources are kept here (a few KB to MB each)
DEFAULT_BUDGET = 0.15  # seconds a call may wait on the primary for one operation
_SWEEP_AT = 1024  # token maps are swept of expired entries past this size
MAX_RECENT_ENDED = 100  # ended records kept here for the ended list while the primary is away


class _Token(NamedTuple):
    call_sid: str
    deadline: float  # monotonic
    in_primary: bool  # the primary acknowledged it (else minted here while degraded)


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
    over_budget: int = 0  # primary operations cut off by the budget


def statistics_of(store: object) -> StoreStatistics | None:
    """The statistics of a store that degrades to memory; None for a plain store."""
    return store.statistics() if isinstance(store, ResilientCallStore) else None


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
        budget: float = DEFAULT_BUDGET,
        max_recent_ended: int = MAX_RECENT_ENDED,
    ) -> None:
        if budget <= 0:
            raise ValueError(f"store budget must be > 0 seconds, got {budget}")
        self.primary = primary
        self.budget = budget
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
        self.over_budget = 0
        self._local: OrderedDict[str, CallRecord] = OrderedDict()
        self.max_recent_ended = max_recent_ended
        self._recent_ended: OrderedDict[str, CallRecord] = OrderedDict()
        # What the primary last held for each call, None: never stored there. Version plus
        # updated_at, since a Redis restarted empty hands out the same version numbers again.
        self._synced: dict[str, _Stamp | None] = {}
        self._pending: OrderedDict[str, CallRecord] = OrderedDict()
        self._tokens: dict[str, _Token] = {}  # minted here, not yet spent
        self._spent: dict[str, float] = {}  # spent here -> monotonic deadline
        self._pending_spends: dict[str, float] = {}  # spent while degraded: GETDEL on return
        # Flow sources this instance saved (version -> (sources, deadline)), newest last; the
        # pending ones are written back with their remaining TTL.
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

    def _has_pending(self) -> bool:
        return bool(self._pending or self._pending_spends or self._pending_flows)

    async def _within_budget(self, op: str, work: Awaitable[T]) -> T:
        """``work`` on the primary, or ``StoreUnavailable`` once the budget is spent."""
        try:
            async with asyncio.timeout(self.budget):
                return await work
        except TimeoutError:
            self.over_budget += 1
            ms = round(self.budget * 1000)
            raise StoreUnavailable(f"{op}: no answer from the store within {ms} ms") from None

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

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        self._sweep_tokens()
        in_primary = False
        if not self.degraded:
            try:
                work = self.primary.put_stream_token(call_sid, token, ttl)
                await self._within_budget("put_stream_token", work)
                in_primary = True
            except StoreUnavailable as exc:
                self._degrade("put_stream_token", exc)
        self._tokens[token] = _Token(call_sid, time.monotonic() + ttl, in_primary)

    async def redeem_stream_token(self, token: str) -> str | None:
        return await self._spend(token, None, 0.0)

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        """Spend ``token``, which the caller verified belongs to ``call_sid`` and is good for
        ``ttl`` more seconds: True on its first use. While the primary is unreachable, first
        use means first on this instance."""
        return await self._spend(token, call_sid, ttl) == call_sid

    async def _spend(self, token: str, authentic: str | None, ttl: float) -> str | None:
        now = time.monotonic()
        if self._spent.get(token, 0.0) > now:
            return None  # used here already: a replay
        mine = self._tokens.pop(token, None)
        if mine is not None and mine.deadline <= now:
            mine = None
        if not self.degraded:
            try:
                work = self.primary.redeem_stream_token(token)
                sid = await self._within_budget("redeem_stream_token", work)
            except StoreUnavailable as exc:
                self._degrade("redeem_stream_token", exc)
            else:
                if sid is None and mine is not None and not mine.in_primary:
                    sid = mine.call_sid  # minted here while degraded: the primary never had it
                if sid is not None:
                    self._spent[token] = now + max(ttl, mine.deadline - now if mine else 0.0)
                return sid  # the primary's answer wins over any local copy
        sid = authentic or (mine.call_sid if mine is not None else None)
        if sid is None:
            return None
        deadline = now + max(ttl, mine.deadline - now if mine else 0.0)
        self._spent[token] = deadline
        self._pending_spends[token] = deadline  # tell the primary when it is back
        self._wake.set()
        return sid

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
                work = self.primary.save_flow_sources(version, sources, ttl)
                await self._within_budget("save_flow_sources", work)
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
            work = self.primary.load_flow_sources(version)
            return await self._within_budget("load_flow_sources", work)
        except StoreUnavailable as exc:
            self._degrade("load_flow_sources", exc)
            return None

    async def ping(self) -> bool:
        try:
            return await self._within_budget("ping", self.primary.ping())
        except StoreUnavailable:
            return False

    # -- local state -----------------------------------------------------------------------

    def _carries(self, record: CallRecord) -> bool:
        return self.instance_id is None or record.instance_id in (None, self.instance_id)

    def _remember(self, record: CallRecord, *, synced: bool, force: bool = False) -> None:
        sid = record.call_sid
        if record.ended_at is not None:
            self._note_ended(record)
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

    def _note_ended(self, record: CallRecord) -> None:
        """Keep a copy for the ended list while the primary is away (newest only)."""
        if self.max_recent_ended <= 0:
            return
        self._recent_ended[record.call_sid] = clone(record)
        self._recent_ended.move_to_end(record.call_sid)
        while len(self._recent_ended) > self.max_recent_ended:
            self._recent_ended.popitem(last=False)

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
        now = time.monotonic()
        if len(self._tokens) >= _SWEEP_AT:
            self._tokens = {t: e for t, e in self._tokens.items() if e.deadline > now}
        if len(self._spent) >= _SWEEP_AT:
            self._spent = {t: d for t, d in self._spent.items() if d > now}

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
        for sid, record in list(self._pending.items()):
            if self._pending.get(sid) is not record:
                continue  # superseded while we were writing another; next pass takes it
            await self._write_back(record)
            if self._pending.get(sid) is record:
                del self._pending[sid]
        await self._flush_tokens()
        await self._flush_flows()

    async def _flush_tokens(self) -> None:
        """Spend on the primary what was spent here while it was unreachable, so a replay
        cannot use a token the primary still holds."""
        for token, deadline in list(self._pending_spends.items()):
            if deadline > time.monotonic():
                await self.primary.redeem_stream_token(token)
            self._pending_spends.pop(token, None)

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
            if record.instance_id is None:
                # Answered here, carried by no stream here: the instance that carried it
                # (Redis away) writes its record back; ours only fills a gap, never overwrites.
                stored = await self._create_only(record)
            else:
                stored = await self._overwrite(record, base)
        except CorruptRecord as exc:
            self.dropped += 1
            log.error("call_store_reconcile_dropped", call_sid=sid, error=str(exc))
            return
        if stored is None:
            if self._pending.get(sid) is record:
                self._forget(sid)
            return
        self.reconciled += 1
        if self._pending.get(sid) is record:
            self._remember(stored, synced=True, force=True)
        else:
            self._synced[sid] = _stamp(stored)

    async def _create_only(self, record: CallRecord) -> CallRecord | None:
        try:
            return await self.primary.create(record)
        except CallExists:
            log.info("call_store_writeback_skipped", call_sid=record.call_sid)
            return None

    async def _overwrite(self, record: CallRecord, base: _Stamp | None) -> CallRecord:
        """Make the primary hold ``record`` (this instance wins); count a conflict if the
        primary's version is not the one our queued changes were based on, unless it already
        holds our content (a write cut off by the budget that landed after all)."""
        seen: list[_Stamp | None] = []  # per attempt: the primary's stamp, None: it had ours
        ours = record.model_dump(include=set(_COPIED))

        def take_ours(remote: CallRecord) -> None:
            landed = remote.model_dump(include=set(_COPIED)) == ours
            seen.append(None if landed else _stamp(remote))
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
            found = seen[-1] if seen else None
            if found is not None and found != base:
                self._conflict(record.call_sid, base, found)
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
