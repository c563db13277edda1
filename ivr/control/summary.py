"""One summary log line per call (structlog's canonical log line): the call at a glance.

``call.ended`` is written once per call, by whoever settled how it ended (``ivr.control.endings``:
its stream, Twilio's status callback, the sweep of calls that never connected or were dropped);
a stream that ends while its call goes on (it resumes on a new stream) writes
``call.stream_ended``. Latencies cover every turn in the call record, so a call resumed
elsewhere is summarised whole; counters cover this stream. No personal data: no numbers, no
transcripts.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog

from ivr.state.base import CallRecord

log = structlog.get_logger("ivr.call")


class StreamStats(Protocol):
    """What one stream counted (``ivr.call.turns.CallStats``)."""

    @property
    def barge_ins(self) -> int: ...
    @property
    def provider_errors(self) -> int: ...


STAGES = ("heard", "total", "gateway")
"""Per-turn latencies summarised (see TurnTimings.breakdown)."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; ``values`` must not be empty."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(
    record: CallRecord | None, stats: StreamStats | None, *, outcome: str, started: float | None
) -> dict[str, Any]:
    """The fields of the summary line; ``record`` as last stored (None if unknown), ``started``
    the monotonic time this stream started (None: ended without a stream here)."""
    fields: dict[str, Any] = {"outcome": outcome}
    if started is not None:
        fields["stream_s"] = round(time.monotonic() - started, 3)
    if stats is not None:
        fields.update(barge_ins=stats.barge_ins, provider_errors=stats.provider_errors)
    if record is None:
        return fields
    ended = record.ended_at or datetime.now(UTC)
    fields.update(
        call_sid=record.call_sid,  # also where no stream's context names it (the sweep)
        flow=record.flow_name,
        flow_version=record.flow_version,
        node=record.node,
        duration_s=round((ended - record.created_at).total_seconds(), 3),
        turns=len(record.turns),
        resumes=max(0, record.stream_count - 1),
    )
    for stage in STAGES:
        values = [float(t[stage]) for t in record.turns if isinstance(t.get(stage), int | float)]
        if values:
            fields[f"{stage}_p50_ms"] = round(percentile(values, 0.5) * 1000, 1)
            fields[f"{stage}_p95_ms"] = round(percentile(values, 0.95) * 1000, 1)
    return fields


def log_summary(
    record: CallRecord | None,
    stats: StreamStats | None,
    *,
    outcome: str,
    final: bool,
    started: float | None,
    **extra: Any,
) -> None:
    """``call.ended`` (``outcome``: how the call ended, ``ivr.state.outcomes``) or, for a stream
    its call outlives, ``call.stream_ended`` (``reason``: why it left the stream)."""
    fields = summary(record, stats, outcome=outcome, started=started)
    if not final:
        fields["reason"] = fields.pop("outcome")
    log.info("call.ended" if final else "call.stream_ended", **fields, **extra)
