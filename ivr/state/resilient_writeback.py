"""The write-back of a ``ResilientCallStore``: the records of its calls queued while the
primary was away, written to the primary when it is back (this instance's latest record
wins; a change made elsewhere meanwhile is counted as a conflict)."""

from __future__ import annotations

import structlog

from ivr.state.base import CallExists, CallNotFound, CallRecord, CorruptRecord, StoreError
from ivr.state.resilient_core import ResilientCore, Stamp, stamp

log = structlog.get_logger("ivr.state")

# Fields a write-back copies onto the primary's record; the primary stamps the rest.
_COPIED = tuple(n for n in CallRecord.model_fields if n not in ("version", "updated_at"))


class WriteBack(ResilientCore):
    """Writes the queued records back to the primary (the reconciler's work on calls)."""

    async def _flush_calls(self) -> None:
        """Every queued record, written back; one queued again meanwhile stays queued."""
        for sid, record in list(self._pending.items()):
            if self._pending.get(sid) is not record:
                continue  # superseded while we were writing another; next pass takes it
            await self._write_back(record)
            if self._pending.get(sid) is record:
                del self._pending[sid]

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
            self._synced[sid] = stamp(stored)

    async def _create_only(self, record: CallRecord) -> CallRecord | None:
        try:
            return await self.primary.create(record)
        except CallExists:
            log.info("call_store_writeback_skipped", call_sid=record.call_sid)
            return None

    async def _overwrite(self, record: CallRecord, base: Stamp | None) -> CallRecord:
        """Make the primary hold ``record`` (this instance wins); count a conflict if the
        primary's version is not the one our queued changes were based on, unless it already
        holds our content (a write cut off by the budget that landed after all)."""
        seen: list[Stamp | None] = []  # per attempt: the primary's stamp, None: it had ours
        ours = record.model_dump(include=set(_COPIED))

        def take_ours(remote: CallRecord) -> None:
            landed = remote.model_dump(include=set(_COPIED)) == ours
            seen.append(None if landed else stamp(remote))
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

    def _conflict(self, call_sid: str, base: Stamp | None, found: Stamp) -> None:
        self.conflicts += 1
        expected = None if base is None else base[0]
        log.warning(
            "call_store_conflict", call_sid=call_sid, expected_version=expected, found=found[0]
        )
