"""Call recording: two channels (caller left, bot right as heard), compressed, to a directory or
an S3-compatible bucket, expired after a retention period. See ``service.Recordings``."""

from __future__ import annotations

from ivr.config import Settings
from ivr.recording.recorder import CallRecorder
from ivr.recording.service import Recordings
from ivr.recording.sinks import LocalDirSink, RecordingSink, S3Config, S3Sink
from ivr.state.base import CallStore


def recordings_from_settings(settings: Settings, store: CallStore) -> Recordings | None:
    """The configured sink's ``Recordings``; None when no sink is set (nothing is recorded)."""
    sink: RecordingSink
    if settings.recording_dir:
        sink = LocalDirSink(settings.recording_dir)
    elif settings.recording_s3_bucket:
        sink = S3Sink(
            S3Config(
                bucket=settings.recording_s3_bucket,
                prefix=settings.recording_s3_prefix,
                endpoint_url=settings.recording_s3_url or None,
                region=settings.recording_s3_region,
            )
        )
    else:
        return None
    return Recordings(
        sink,
        store,
        fmt=settings.recording_format,
        max_seconds=settings.recording_max_minutes * 60,
        retention_days=settings.recording_retention_days,
    )


__all__ = ["CallRecorder", "Recordings", "recordings_from_settings"]
