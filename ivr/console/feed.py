"""One reader of the shared store per instance, for every console connection on it.

``ActiveFeed.run`` reads the active calls (``CallStore.list_active``: every instance's calls)
once per ``interval`` while anyone watches, and once per ``idle_interval`` otherwise, and hands
each ``Snapshot`` to every subscriber (a one-slot queue each: a slow browser gets the newest
snapshot, never a backlog). A hundred open consoles cost the store what one does.

The feed also remembers what the record's timeline does not keep: when it saw a call change
status, move to another stream or instance, or start a transfer (``events``; node changes too,
for records written before the timeline existed), and the calls it saw end (``ended``, newest
first, bounded). The console's ended list reads the store's ended index instead
(``ivr.console.ended``): every instance's ended calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog

from ivr.console import views
from ivr.state.base import CallRecord, CallStore, StoreError

log = structlog.get_logger("ivr.console")

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The active calls as one store read saw them; views are computed once per snapshot."""

    seq: int
    taken_at: datetime
    records: dict[str, CallRecord]
    """By CallSid, most recently updated first."""
    events: dict[str, tuple[Event, ...]]
    error: str | None = None
    _views: dict[tuple[str, bool], Any] = field(default_factory=dict, compare=False)

    def summaries(self, *, pii: bool) -> list[dict[str, Any]]:
        key = ("", pii)
        if key not in self._views:
            self._views[key] = [views.summary(r, pii=pii) for r in self.records.values()]
        rows: list[dict[str, Any]] = self._views[key]
        return rows

    def detail(self, call_sid: str, *, pii: bool) -> dict[str, Any] | None:
        record = self.records.get(call_sid)
        if record is None:
            return None
        key = (call_sid, pii)
        if key not in self._views:
            events = list(self.events.get(call_sid, ()))
            self._views[key] = views.detail(record, pii=pii, events=events)
        found: dict[str, Any] = self._views[key]
        return found

    def version_of(self, call_sid: str) -> int | None:
        record = self.records.get(call_sid)
        return None if record is None else record.version

    @property
    def versions(self) -> tuple[tuple[str, int], ...]:
        return tuple((sid, r.version) for sid, r in self.records.items())


@dataclass(slots=True)
class EndedCall:
    rows: dict[bool, dict[str, Any]]
    """Its list row, by whether numbers are shown."""
    events: list[Event]


class ActiveFeed:
    def __init__(
        self,
        store: CallStore,
        *,
        interval: float = 1.0,
        idle_interval: float = 5.0,
        limit: int = 200,
        keep_ended: int = 1000,
        keep_events: int = 100,
    ) -> None:
        self.interval, self.idle_interval = interval, idle_interval
        self.latest: Snapshot | None = None
        self.reads = 0
        self._store = store
        self._limit, self._keep_ended, self._keep_events = limit, keep_ended, keep_events
        self._subscribers: set[asyncio.Queue[Snapshot]] = set()
        self._wake = asyncio.Event()
        self._idle = False
        self._live: dict[str, CallRecord] = {}
        self._events: dict[str, list[Event]] = {}
        self._ended: OrderedDict[str, EndedCall] = OrderedDict()

    async def run(self) -> None:
        """Read, publish, wait; until cancelled."""
        while True:
            try:
                await self.poll()
            except Exception:  # the boundary: a bad read must not end the console for good
                log.exception("console.feed_failed")
            await self._pause()

    async def _pause(self) -> None:
        """Until the next read: ``interval`` while watched, ``idle_interval`` otherwise, cut
        short when someone starts watching; never less than ``interval`` after the last read."""
        self._idle = not self._subscribers
        delay = self.idle_interval if self._idle else self.interval
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
        self._idle = False
        self._wake.clear()
        if self.latest is not None and (age := _age(self.latest)) < self.interval:
            await asyncio.sleep(self.interval - age)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[Snapshot]]:
        """A queue that always holds the newest snapshot not yet taken."""
        queue: asyncio.Queue[Snapshot] = asyncio.Queue(maxsize=1)
        self._subscribers.add(queue)
        latest = self.latest
        if latest is not None:
            queue.put_nowait(latest)
        if self._idle:
            self._wake.set()  # idle reads are slower: a new watcher gets a fresh one soon
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)

    @property
    def watchers(self) -> int:
        return len(self._subscribers)

    def ended(self, *, pii: bool) -> list[dict[str, Any]]:
        """Rows of the calls seen ending, newest first."""
        return [entry.rows[pii] for entry in reversed(self._ended.values())]

    def events_of(self, call_sid: str) -> list[Event]:
        ended = self._ended.get(call_sid)
        return list(ended.events if ended else self._events.get(call_sid, []))

    async def poll(self) -> Snapshot:
        """One store read; publishes and returns the snapshot."""
        seq = self.latest.seq + 1 if self.latest else 1
        self.reads += 1
        try:
            records = await self._store.list_active(self._limit)
        except StoreError as exc:
            log.warning("console.store_read_failed", error=str(exc))
            return self._publish(Snapshot(seq, _now(), dict(self._live), self._frozen(), str(exc)))
        current = {r.call_sid: r for r in records}
        for sid, record in current.items():
            self._track(record, self._live.get(sid))
        for sid in [s for s in self._live if s not in current]:
            await self._gone(sid)
        self._live = current
        return self._publish(Snapshot(seq, _now(), current, self._frozen()))

    def _publish(self, snapshot: Snapshot) -> Snapshot:
        self.latest = snapshot
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(snapshot)
        return snapshot

    def _frozen(self) -> dict[str, tuple[Event, ...]]:
        return {sid: tuple(events) for sid, events in self._events.items()}

    def _track(self, record: CallRecord, before: CallRecord | None) -> None:
        events = self._events.setdefault(record.call_sid, [])
        for event in _changes(record, before):
            events.append(event)
        del events[: max(0, len(events) - self._keep_events)]

    async def _gone(self, call_sid: str) -> None:
        """A call left the active list: ended (remember it), expired, or past the limit."""
        try:
            record = await self._store.get(call_sid)
        except StoreError as exc:
            log.warning("console.store_read_failed", call_sid=call_sid, error=str(exc))
            return
        if record is None:
            self._events.pop(call_sid, None)
            return
        if not record.is_ended:
            return  # still live, outside the newest ``limit``: keep its events
        events = self._events.pop(call_sid, [])
        changes = _changes(record, self._live.get(call_sid))
        events.extend(e for e in changes if e["kind"] != "status")  # "ended" says it
        outcome = views.outcome_of(record)
        events.append({"at": _iso(record.ended_at), "kind": "ended", "to": outcome})
        rows = {pii: views.summary(record, pii=pii) for pii in (False, True)}
        self._ended[call_sid] = EndedCall(rows, events)
        while len(self._ended) > self._keep_ended:
            self._ended.popitem(last=False)


def _changes(record: CallRecord, before: CallRecord | None) -> Iterator[Event]:
    at = _iso(record.updated_at)
    if before is None:
        yield {"at": at, "kind": "seen", "to": record.node or "", "status": str(record.status)}
        return
    if record.node != before.node:
        yield {"at": at, "kind": "node", "from": before.node or "", "to": record.node or ""}
    if record.status != before.status:
        yield {"at": at, "kind": "status", "from": str(before.status), "to": str(record.status)}
    if record.stream_count > before.stream_count or record.instance_id != before.instance_id:
        streams = record.stream_count
        yield {"at": at, "kind": "stream", "to": record.instance_id or "", "streams": streams}
    if record.end_action == "transfer" and before.end_action != "transfer":
        yield {"at": at, "kind": "transfer", "number": record.transfer_to}


def _now() -> datetime:
    return datetime.now(UTC)


def _age(snapshot: Snapshot) -> float:
    return (_now() - snapshot.taken_at).total_seconds()


def _iso(when: datetime | None) -> str:
    return (when or _now()).isoformat()
