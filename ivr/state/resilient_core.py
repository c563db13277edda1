"""What a ``ResilientCallStore`` (``ivr.state.resilient``, whose docstring tells the whole
story) knows of the calls it carries: their local copies, the queue of writes the primary has
not seen yet, what the primary last held; and whether the primary is usable at all."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable
from datetime import datetime
from typing import NamedTuple, TypeVar

import structlog

from ivr.state.base import (
    CallNotFound,
    CallRecord,
    CallStore,
    Mutator,
    StoreUnavailable,
    apply_mutation,
    clone,
)
from ivr.state.expiring import ExpiringMap

log = structlog.get_logger("ivr.state")

T = TypeVar("T")
Stamp = tuple[int, datetime]
DEFAULT_BUDGET = 0.15  # seconds a call may wait on the primary for one operation
MAX_RECENT_ENDED = 100  # ended records kept here for the ended list while the primary is away


class PendingSpend(NamedTuple):
    """A stream token spent here while the primary was unreachable: claimed there on return."""

    call_sid: str
    deadline: float  # monotonic: when the token expires


def stamp(record: CallRecord) -> Stamp:
    return (record.version, record.updated_at)


class ResilientCore:
    """The state the parts of ``ResilientCallStore`` share (the stream tokens, the flow
    sources, the write-back each keep theirs here too, so one ``__init__`` makes it all), and
    this instance's memory of its calls."""

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
        self._synced: dict[str, Stamp | None] = {}
        self._pending: OrderedDict[str, CallRecord] = OrderedDict()
        # Stream tokens spent here -> the call each admitted (decided here while degraded)
        self._spent: ExpiringMap[str] = ExpiringMap()
        self._pending_spends: dict[str, PendingSpend] = {}  # spent while degraded
        # Token claims that overran the budget, left to land (``StreamTokens``)
        self._late_claims: set[asyncio.Future[bool]] = set()
        # Flow sources this instance saved (version -> (sources, deadline)), newest last; the
        # pending ones are written back with their remaining TTL.
        self._flows: OrderedDict[str, tuple[dict[str, str], float]] = OrderedDict()
        self._pending_flows: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._degraded_since = 0.0

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
        self._synced[sid] = stamp(record) if synced else None
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
        self._synced[sid] = stamp(stored)

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


def _not_carried(call_sid: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"call {call_sid!r} is not carried by this instance and the store is unreachable"
    )
