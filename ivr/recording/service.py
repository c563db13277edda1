"""The gateway's recordings: one recorder per recorded stream, saved after the call, expired.

``begin`` hands the stream a ``CallRecorder``; ``finish`` returns at once and leaves the rest to
a task this object owns: render and encode on a worker thread, store through the sink, then
note the location in the call record. Nothing here can delay or fail a call: a failing sink
(disk full, bucket unreachable) is logged with its reason and counted in
``ivr_recordings_total{outcome="failed"}``, and the call never knew. ``run_retention`` deletes
recordings older than the retention period, at start and every hour.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import structlog

from ivr.obs import metrics
from ivr.recording.encode import SUFFIX, RecordingFormat, encode
from ivr.recording.recorder import CallRecorder
from ivr.recording.sinks import RecordingBody, RecordingError, RecordingSink
from ivr.state.base import CallRecord, CallStore, StoreError

log = structlog.get_logger("ivr.recording")

WORKERS = 2
"""Threads that encode and upload: bounded, so a burst of hang-ups cannot take the CPU."""
MAX_PENDING = 64
"""Recordings waiting to be saved (each holds its call's audio): past this one is dropped."""
RETENTION_EVERY = 3600.0
CLOSE_WAIT = 30.0
"""On shutdown, how long saves in progress may finish before they are abandoned."""

T = TypeVar("T")


class Recordings:
    """Owned by the gateway; ``start``/``aclose`` bracket its background work."""

    def __init__(
        self,
        sink: RecordingSink,
        store: CallStore,
        *,
        fmt: RecordingFormat = "flac",
        max_seconds: float = 3600.0,
        retention_days: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self._store = store
        self._fmt = fmt
        self._max_seconds = max_seconds
        self._retention = retention_days * 86400.0
        self._clock = clock
        self._executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="recording")
        self._saving: set[asyncio.Task[None]] = set()
        self._retention_task: asyncio.Task[None] | None = None

    # -- calls ----------------------------------------------------------------------------

    def begin(self, call_sid: str, stream_sid: str) -> CallRecorder:
        """A recorder for one stream, starting now (its inbound timestamps refine when)."""
        return CallRecorder(call_sid, stream_sid, max_seconds=self._max_seconds, clock=self._clock)

    def finish(self, recorder: CallRecorder) -> None:
        """The stream ended: save its recording in the background (never waits, never raises)."""
        recorder.stop()
        if recorder.empty:
            return
        if len(self._saving) >= MAX_PENDING:
            metrics.RECORDINGS.labels("dropped").inc()
            log.error("recording.dropped", reason="backlog", pending=len(self._saving))
            return
        task = asyncio.create_task(self._save(recorder), name="recording-save")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    async def _save(self, recorder: CallRecorder) -> None:
        started = time.perf_counter()
        try:
            location, size, seconds = await self._in_thread(self._encode_and_store, recorder)
        except RecordingError as exc:
            metrics.RECORDINGS.labels("failed").inc()
            log.error("recording.failed", call_sid=recorder.call_sid, sink=self.sink.kind,
                      reason=exc.reason, error=str(exc))  # fmt: skip
            return
        except Exception as exc:  # an encoder bug: same outcome for the call (none)
            metrics.RECORDINGS.labels("failed").inc()
            log.error("recording.failed", call_sid=recorder.call_sid, reason="encode",
                      error=repr(exc))  # fmt: skip
            return
        metrics.RECORDINGS.labels("saved").inc()
        log.info("recording.saved", call_sid=recorder.call_sid, location=location, bytes=size,
                 seconds=round(seconds, 2), truncated=recorder.truncated,
                 save_s=round(time.perf_counter() - started, 3))  # fmt: skip
        await self._note(recorder.call_sid, location)

    def _encode_and_store(self, recorder: CallRecorder) -> tuple[str, int, float]:
        rendered = recorder.render()
        suffix = SUFFIX[self._fmt]
        fd, name = tempfile.mkstemp(prefix="ivr-recording-", suffix=suffix)
        os.close(fd)
        path = Path(name)
        try:
            try:
                size = encode(rendered, path, self._fmt)
            except OSError as exc:  # the temp directory itself is full or gone
                raise RecordingError("encode_io", str(exc)) from exc
            key = recording_key(recorder.call_sid, recorder.stream_sid, suffix)
            return self.sink.save(path, key), size, rendered.seconds
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    async def _note(self, call_sid: str, location: str) -> None:
        """Where the recording is, in the call record, for the console and the admin API."""

        def add(record: CallRecord) -> None:
            if location not in record.recordings:
                record.recordings.append(location)

        try:
            await self._store.update(call_sid, add)
        except StoreError as exc:  # the file exists; only the link from the record is lost
            log.error("recording.not_linked", call_sid=call_sid, location=location,
                      error=str(exc))  # fmt: skip

    # -- console --------------------------------------------------------------------------

    async def open(self, location: str) -> RecordingBody:
        """Read a stored recording (RecordingNotFound / RecordingError on failure)."""
        return await self._in_thread(self.sink.open, location)

    # -- retention ------------------------------------------------------------------------

    async def run_retention(self, every: float = RETENTION_EVERY) -> None:
        """Until cancelled: delete expired recordings now and every ``every`` seconds."""
        if self._retention <= 0:
            return
        while True:
            await self.expire()
            await asyncio.sleep(every)

    async def expire(self) -> int:
        """Delete recordings older than the retention period; returns how many (0 on error)."""
        cutoff = time.time() - self._retention
        try:
            deleted = await self._in_thread(self.sink.delete_older_than, cutoff)
        except RecordingError as exc:
            log.error("recording.retention_failed", sink=self.sink.kind, reason=exc.reason,
                      error=str(exc))  # fmt: skip
            return 0
        if deleted:
            metrics.RECORDINGS_EXPIRED.inc(deleted)
        log.info("recording.retention", deleted=deleted,
                 older_than=datetime.fromtimestamp(cutoff, UTC).isoformat())  # fmt: skip
        return deleted

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._retention_task = asyncio.create_task(self.run_retention(), name="recording-retention")

    async def wait_saved(self) -> None:
        """Until every recording handed over so far is saved or has failed."""
        while self._saving:
            await asyncio.gather(*self._saving, return_exceptions=True)

    async def aclose(self, wait: float = CLOSE_WAIT) -> None:
        if self._retention_task is not None:
            self._retention_task.cancel()
            await asyncio.gather(self._retention_task, return_exceptions=True)
        if self._saving:
            _, late = await asyncio.wait(set(self._saving), timeout=wait)
            for task in late:
                task.cancel()
                log.error("recording.abandoned", reason="shutdown")
            await asyncio.gather(*late, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def recording_key(call_sid: str, stream_sid: str, suffix: str) -> str:
    """``2026/11/23/CA.../MZ....flac``: by day (easy to browse and to expire), then by call."""
    day = datetime.now(UTC).strftime("%Y/%m/%d")
    call, stream = (re.sub(r"[^A-Za-z0-9]", "", sid) or "unknown" for sid in (call_sid, stream_sid))
    return f"{day}/{call}/{stream}{suffix}"
