"""G.711 mu-law <-> PCM16 (little-endian, mono) for Twilio Media Streams audio.

Twilio sends and expects 8 kHz mu-law in 20 ms frames. The conversion runs in C:
the stdlib ``audioop`` on Python < 3.13, the ``audioop-lts`` package (same module
name) on 3.13+.
"""

from __future__ import annotations

import warnings
from typing import Final

import numpy as np

with warnings.catch_warnings():
    # Python 3.11/3.12 warn that stdlib audioop goes away in 3.13 (audioop-lts takes over).
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

SAMPLE_RATE: Final = 8000
FRAME_MS: Final = 20
FRAME_SAMPLES: Final = SAMPLE_RATE * FRAME_MS // 1000  # 160
FRAME_BYTES_ULAW: Final = FRAME_SAMPLES  # one byte per sample
FRAME_BYTES_PCM16: Final = FRAME_SAMPLES * 2  # 320
ULAW_SILENCE: Final = b"\xff"  # mu-law code for 0 (positive zero)


def ulaw_to_pcm16(b: bytes) -> bytes:
    """Decode mu-law bytes to PCM16 little-endian (two bytes per input byte)."""
    return audioop.ulaw2lin(b, 2)


_ULAW_OF: Final = np.frombuffer(
    audioop.lin2ulaw(np.arange(1 << 16, dtype=np.uint16).view("<i2").tobytes(), 2), dtype=np.uint8
)
"""audioop's mu-law code of every 16-bit sample, indexed by the sample's bits: a lookup gives
audioop's own bytes (``tests/test_audio_codec_resample.py``) at ~1.5 ns a sample against its
8-17 (a segment search per sample), which a reply's ~11 s of audio paid on every chunk."""
_LOOKUP_FROM_BYTES: Final = 2048
"""Below this numpy's call overhead costs more than the lookup saves (a 20 ms frame: 1.9 us
looked up, 1.0 by audioop)."""


def pcm16_to_ulaw(b: bytes) -> bytes:
    """Encode PCM16 little-endian to mu-law; ``b`` must hold whole samples."""
    if len(b) % 2:
        raise ValueError(f"PCM16 buffer has an odd length ({len(b)} bytes): a half sample")
    if len(b) < _LOOKUP_FROM_BYTES:
        return audioop.lin2ulaw(b, 2)
    return _ULAW_OF.take(np.frombuffer(b, dtype="<u2")).tobytes()


def rms16(b: bytes) -> int:
    """Root-mean-square level of PCM16 samples (0-32767), in C: ~1 µs per 20 ms frame."""
    return int(audioop.rms(b, 2))


def ulaw_silence(ms: int) -> bytes:
    """``ms`` milliseconds of mu-law silence at 8 kHz."""
    return ULAW_SILENCE * (SAMPLE_RATE * ms // 1000)
