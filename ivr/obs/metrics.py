"""Every Prometheus metric the gateway exports, declared in one place.

Labels stay bounded: provider, stage, outcome, reason. Never a call SID or a phone number.

A labelled counter has no series until its first use, so "nothing went wrong" and "the metric
is broken" look the same on a dashboard, and ``rate()`` never sees a series' first increment.
``start_at_zero`` gives every label set the gateway knows (stages, the configured providers,
failure kinds, outcomes) a series at 0 when it starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from ivr.errors import ProviderError, ProviderErrorKind

# Voice turns land between ~0.3 s and a few seconds; stages between ~10 ms and ~2 s.
TURN_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0)
STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

TURN_LATENCY = Histogram(
    "ivr_turn_latency_seconds",
    "Voice-to-voice latency: end of caller speech to first bot audio sent to Twilio.",
    buckets=TURN_BUCKETS,
)
STT_LATENCY = Histogram(
    "ivr_stt_latency_seconds",
    "End of utterance to final transcript.",
    ["provider"],
    buckets=STAGE_BUCKETS,
)
LLM_TTFT = Histogram(
    "ivr_llm_time_to_first_token_seconds",
    "LLM request to first streamed token.",
    ["provider"],
    buckets=STAGE_BUCKETS,
)
TTS_TTFB = Histogram(
    "ivr_tts_time_to_first_byte_seconds",
    "TTS request to first audio byte.",
    ["provider"],
    buckets=STAGE_BUCKETS,
)
TURN_HEARD_LATENCY = Histogram(
    "ivr_turn_heard_latency_seconds",
    "Voice-to-voice latency as heard: end of caller speech to Twilio playing the first reply "
    "audio (from the echo of a mark placed after the reply's first frame).",
    buckets=TURN_BUCKETS,
)
GATEWAY_OVERHEAD = Histogram(
    "ivr_gateway_overhead_seconds",
    "Turn latency not spent in providers or endpoint silence: what the gateway itself adds.",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
)
FIRST_AUDIO = Histogram(
    "ivr_stream_first_audio_seconds",
    "Stream start to the first bot audio sent (the greeting, or the resume prompt).",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
PROVIDER_ERRORS = Counter(
    "ivr_provider_errors_total",
    "Provider failures, by stage (stt, llm, tts), provider and kind (ivr.errors).",
    ["stage", "provider", "kind"],
)
ACTIVE_CALLS = Gauge("ivr_active_calls", "Media streams currently connected to this instance.")
CALLS = Counter(
    "ivr_calls_total",
    "Calls ended, by how (ivr.state.outcomes): counted once per call, on the instance that "
    "settled its ending.",
    ["outcome"],
)
STREAMS = Counter(
    "ivr_streams_total",
    "Media streams ended on this instance, by why they left the stream (stop, hangup, "
    "transfer, error, disconnect, moved, superseded); a call may have several.",
    ["reason"],
)
TWILIO_STREAM_EVENTS = Counter(
    "ivr_twilio_stream_events_total",
    "Twilio's <Stream statusCallback> reports: stream-started, stream-stopped, stream-error.",
    ["event"],
)
WEBHOOKS = Counter("ivr_webhooks_total", "Voice webhooks, by outcome.", ["outcome"])
PROTOCOL_ERRORS = Counter(
    "ivr_protocol_errors_total", "Inbound stream messages we could not use.", ["reason"]
)
UNKNOWN_EVENTS = Counter("ivr_unknown_events_total", "Inbound stream events we do not know.")
BARGE_INS = Counter(
    "ivr_barge_ins_total",
    "Caller sound or keys over bot speech, by what became of it: interrupted (the bot stopped),"
    " resumed (paused, no words came), backchannel, echo, noise (the bot went on).",
    ["trigger", "outcome"],
)
TURN_MODEL = Counter(
    "ivr_turn_model_total",
    "End-of-turn model answers at a caller's pause: complete, incomplete, or why there was "
    "none (unavailable, timeout, error) and silence alone decided.",
    ["outcome"],
)
WARM_TRANSFERS = Counter(
    "ivr_warm_transfers_total",
    "Warm transfer steps: held, connected, or why the caller came back (no-answer, busy, ...).",
    ["outcome"],
)
INBOUND_DROPPED = Counter(
    "ivr_inbound_frames_dropped_total", "Caller audio frames dropped because a queue was full."
)
SPECULATION = Counter(
    "ivr_speculations_total",
    "Provider requests started during the endpoint silence, by stage (stt, llm, tts) and "
    "outcome: used by the turn, wasted (the caller went on) or failed (the live turn retried).",
    ["stage", "outcome"],
)
STT_TURN_HINTS = Counter(
    "ivr_stt_turn_hints_total",
    "A streaming STT's own end-of-turn signals, by provider, kind and verdict against the "
    "gateway's endpointer: agreed (it heard a pause), early (it heard speech), idle (no speech "
    "in progress), used (agreed, and ended the pause sooner).",
    ["provider", "kind", "verdict"],
)
PROMPT_CACHE = Counter("ivr_prompt_cache_total", "Static prompt audio lookups.", ["result"])
RECORDINGS = Counter(
    "ivr_recordings_total",
    "Call recordings by outcome: saved, failed (the sink failed; the call was unaffected) or "
    "dropped (too many waiting to be saved).",
    ["outcome"],
)
RECORDINGS_EXPIRED = Counter(
    "ivr_recordings_expired_total", "Recordings deleted by the retention setting."
)
STORE_DEGRADED = Gauge("ivr_store_degraded", "1 while the call store (Redis) is unreachable.")
STORE_PENDING = Gauge("ivr_store_pending_writes", "Call-state writes waiting for Redis to return.")
STORE_RECONCILED = Gauge(
    "ivr_store_reconciled_writes", "Call-state writes replayed to Redis after an outage (total)."
)
STORE_FAILURES = Gauge("ivr_store_failures", "Call-state store operations that failed (total).")
INBOUND_BACKLOG = Histogram(
    "ivr_inbound_backlog_seconds",
    "How late the caller's audio is heard: a frame taken up past its call's least delay "
    "(Twilio's timestamp against our clock), sampled twice a second per call. Above ~50 ms "
    "the process is behind the calls it carries: every turn ends that much later.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
# Admission: whether this instance takes new calls, and why not.
LOOP_LAG = Histogram(
    "ivr_event_loop_lag_seconds",
    "How late a periodic asyncio wake-up ran beyond its schedule.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
CAPACITY_CALLS = Gauge(
    "ivr_capacity_calls",
    "The configured maximum of concurrent calls on this instance (0 = unlimited).",
)
READY = Gauge("ivr_ready", "1 while this instance takes new calls (what /readyz says), else 0.")


WEBHOOK_OUTCOMES = ("accepted", "forbidden", "overflow", "bad_request", "no_flow", "replay")
PROTOCOL_REASONS = (
    "bad_signature",
    "bad_token",
    "bad_token_signature",
    "expired_token",
    "spent_token",
    "callsid_mismatch",
    "sequence_gap",
    "bad_json",
    "binary_frame",
    "oversized_frame",
)
BARGE_IN_LABELS = (
    *(
        ("speech", o)
        for o in ("interrupted", "resumed", "backchannel", "echo", "noise", "background")
    ),
    ("dtmf", "interrupted"),
    ("before_start", "interrupted"),
)
SPECULATION_STAGES, SPECULATION_OUTCOMES = ("stt", "llm", "tts"), ("used", "wasted", "failed")
TURN_MODEL_OUTCOMES = ("complete", "incomplete", "unavailable", "timeout", "error")
WARM_TRANSFER_OUTCOMES = (
    "held",
    "connected",
    "busy",
    "no-answer",
    "failed",
    "canceled",
    "not-joined",
    "timeout",
    "caller-left",
    "other",
)
TWILIO_STREAM_EVENT_NAMES = ("stream-started", "stream-stopped", "stream-error")


def start_at_zero(
    providers: Mapping[str, Iterable[str]], outcomes: Iterable[str], stream_reasons: Iterable[str]
) -> None:
    """A series at 0 for every label set the gateway knows: ``providers`` by stage (the
    configured ones, fallbacks included) with every failure kind, the call ``outcomes`` and
    stream end ``stream_reasons``, and the fixed label sets of the other counters."""
    for stage, names in providers.items():
        for name in names:
            for kind in ProviderErrorKind:
                PROVIDER_ERRORS.labels(stage, name, kind.value)
    for outcome in outcomes:
        CALLS.labels(outcome)
    for reason in stream_reasons:
        STREAMS.labels(reason)
    fixed: list[tuple[Counter, Iterable[tuple[str, ...]]]] = [
        (WEBHOOKS, ((o,) for o in WEBHOOK_OUTCOMES)),
        (PROTOCOL_ERRORS, ((r,) for r in PROTOCOL_REASONS)),
        (BARGE_INS, BARGE_IN_LABELS),
        (SPECULATION, ((s, o) for s in SPECULATION_STAGES for o in SPECULATION_OUTCOMES)),
        (PROMPT_CACHE, (("hit",), ("miss",))),
        (RECORDINGS, (("saved",), ("failed",), ("dropped",))),
        (TURN_MODEL, ((o,) for o in TURN_MODEL_OUTCOMES)),
        (WARM_TRANSFERS, ((o,) for o in WARM_TRANSFER_OUTCOMES)),
        (TWILIO_STREAM_EVENTS, ((e,) for e in TWILIO_STREAM_EVENT_NAMES)),
    ]
    for counter, label_sets in fixed:
        for labels in label_sets:
            counter.labels(*labels)


def count_provider_error(stage: str, provider: str, error: ProviderError) -> None:
    """Count one provider failure, once, where it is handled: retried or failed over (in
    ivr.providers.resilience), or given up on (by the caller that gets the error)."""
    PROVIDER_ERRORS.labels(stage, provider, error.kind.value).inc()


def watch_store(store: object) -> None:
    """Export a ResilientCallStore's statistics(); a plain store exports nothing."""
    statistics = getattr(store, "statistics", None)
    if statistics is None:
        return
    STORE_DEGRADED.set_function(lambda: float(statistics().degraded))
    STORE_PENDING.set_function(lambda: float(statistics().pending))
    STORE_RECONCILED.set_function(lambda: float(statistics().reconciled))
    STORE_FAILURES.set_function(lambda: float(statistics().failures))
