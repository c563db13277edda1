"""Compress a rendered call to a file (libsndfile through ``soundfile``; worker thread only).

FLAC (the default) is lossless, so the file holds exactly the mu-law both sides heard, and
costs about 12 ms of CPU per minute of call for ~0.5 MB. Ogg/Opus is six times smaller
(~85 kB a minute at the highest compression) but costs ~0.9 s of CPU per minute; pick it when
storage matters more than CPU. Both play in browsers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import soundfile

from ivr.audio.codec import SAMPLE_RATE
from ivr.recording.recorder import RenderedCall

RecordingFormat = Literal["flac", "opus"]

SUFFIX: dict[RecordingFormat, str] = {"flac": ".flac", "opus": ".ogg"}
MEDIA_TYPE = {".flac": "audio/flac", ".ogg": "audio/ogg"}


def encode(call: RenderedCall, path: Path, fmt: RecordingFormat) -> int:
    """Write ``call`` to ``path`` in ``fmt``; returns the file's size in bytes."""
    if fmt == "flac":
        soundfile.write(path, call.stereo, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    else:
        # libsndfile maps compression_level 1.0 to Opus's lowest bitrate: ample for 8 kHz speech.
        soundfile.write(
            path, call.stereo, SAMPLE_RATE, format="OGG", subtype="OPUS", compression_level=1.0
        )
    return path.stat().st_size
