"""Ending the calls nobody ends: answered but never connected, or dropped and never resumed.

A call waits for a stream twice: after the webhook answered it (status ``ringing``) and after
its stream dropped without ``stop`` (``reconnecting``: Twilio asks the ``<Connect action>``
URL, which hands out a new stream). Either wait is bounded: a stream can connect only with a
token, which expires (``IVR_STREAM_TOKEN_TTL_S``); every new token is preceded by a write of
the record (``ivr.control.endings.expect_stream``), so a call whose record has not been written
since longer than a token lives can no longer get a stream. Then it ends:

- ``ringing``, no stream ever: ``never_connected`` once its token is past (plus the clock skew
  allowed between instances); an outbound call may ring first, for as long as Twilio lets one
  ring (its status callback usually ends it sooner);
- ``reconnecting``: ``dropped`` once the resume window (``IVR_RESUME_WINDOW_S``) is past;
- anything else not written for longer than Twilio lets a call last (4 h): ``dropped``.

Every instance sweeps (its ``run`` task, owned by the gateway), reading the oldest records of
the shared store's active index; whichever instance gets there first ends the call, through
``settle``'s compare-and-set, so it is logged and counted once across the fleet. While the
shared store is unreachable an instance does not sweep: what it holds in memory is not the
fleet's view.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog

from ivr.config import CLOCK_SKEW_S
from ivr.control.endings import settle
from ivr.state.base import CallRecord, CallStatus, CallStore, StoreError
from ivr.state.outcomes import Outcome
from ivr.state.resilient import ResilientCallStore

log = structlog.get_logger("ivr.call")

TWILIO_MAX_RING_S = 600.0
"""The longest Twilio rings an outbound call (its ``Timeout`` is capped at 600 s)."""
TWILIO_MAX_CALL_S = 4 * 3600.0
"""Twilio ends a call after 4 hours."""
BATCH = 200
"""Stale records read per sweep; the rest wait for the next one."""


@dataclass(frozen=True, slots=True)
class Windows:
    """How long a call may wait for a stream, in seconds."""

    token_ttl: float
    resume: float

    def due(self, record: CallRecord, now: datetime) -> Outcome | None:
        """How ``record``'s call has ended if nobody writes it until ``now``; None: not yet."""
        if record.outcome is not None or record.is_ended:
            return None
        idle = (now - record.updated_at).total_seconds()
        if record.status == CallStatus.RINGING and record.stream_count == 0:
            limit = self.token_ttl + CLOCK_SKEW_S
            if record.direction == "outbound":  # it may ring before a token is minted at all
                limit = max(limit, TWILIO_MAX_RING_S + CLOCK_SKEW_S)
            return Outcome.NEVER_CONNECTED if idle > limit else None
        if record.status in (CallStatus.RECONNECTING, CallStatus.RINGING):
            return Outcome.DROPPED if idle > self.resume else None
        return Outcome.DROPPED if idle > TWILIO_MAX_CALL_S else None

    @property
    def shortest(self) -> float:
        """No call is due before its record is this old."""
        return min(self.token_ttl + CLOCK_SKEW_S, self.resume)


class CallSweeper:
    """Ends, once across the fleet, the calls that can no longer get a stream."""

    def __init__(self, store: CallStore, windows: Windows, *, interval: float | None = None):
        self._store = store
        self.windows = windows
        # A few sweeps per window: a call ends at most ~a quarter window late.
        self.interval = interval or min(15.0, max(0.5, windows.shortest / 4))
        self.ended = 0
        """Calls this instance ended (for tests and the log)."""

    async def run(self) -> None:
        """Sweep every ``interval`` (jittered, so instances do not sweep in step) until
        cancelled; a failed sweep is logged and the next one tries again."""
        while True:
            await asyncio.sleep(self.interval * random.uniform(0.75, 1.25))
            try:
                await self.sweep()
            except StoreError as exc:
                log.warning("call.sweep_failed", error=str(exc))

    async def sweep(self) -> int:
        """End every call that is due now; how many this instance ended."""
        shared = self._shared()
        if shared is None:
            return 0
        now = datetime.now(UTC)
        stale = await shared.list_stale(now - timedelta(seconds=self.windows.shortest), BATCH)
        ended = 0
        for record in stale:
            outcome = self.windows.due(record, now)
            if outcome is None or self._unsynced(record.call_sid):
                continue
            if await self._end(shared, record.call_sid, outcome):
                ended += 1
        self.ended += ended
        return ended

    async def _end(self, shared: CallStore, call_sid: str, outcome: Outcome) -> bool:
        windows = self.windows

        def still_due(record: CallRecord) -> bool:  # as stored now: a stream may have come
            return windows.due(record, datetime.now(UTC)) == outcome

        try:
            settled = await settle(shared, call_sid, outcome, by="sweep", when=still_due)
        except StoreError as exc:  # gone (expired) or unreachable: the next sweep sees
            log.info("call.sweep_skipped", call_sid=call_sid, error=str(exc))
            return False
        if isinstance(self._store, ResilientCallStore):
            self._store.learn(settled.record)
        return settled.ours

    def _shared(self) -> CallStore | None:
        """The store every instance reads; None while this instance cannot reach it."""
        if isinstance(self._store, ResilientCallStore):
            return self._store.shared()
        return self._store

    def _unsynced(self, call_sid: str) -> bool:
        """A call this instance wrote while the shared store was away, not written back yet:
        its record there is older than the call."""
        return isinstance(self._store, ResilientCallStore) and self._store.unsynced(call_sid)
