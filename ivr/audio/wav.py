"""Tiny WAV helpers for tests and fakes: mono PCM16 in, RIFF bytes out, and back."""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WavAudio:
    pcm16: bytes
    """Mono little-endian PCM16 samples."""
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.pcm16) / 2 / self.sample_rate


def pcm16_to_wav(pcm16: bytes, sample_rate: int) -> bytes:
    """Wrap mono PCM16 in a RIFF/WAVE container."""
    if len(pcm16) % 2:
        raise ValueError(f"PCM16 must hold whole samples; got {len(pcm16)} bytes")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16)
    return buf.getvalue()


def wav_to_pcm16(data: bytes) -> WavAudio:
    """Read a mono PCM16 WAV; anything else is rejected with the reason."""
    try:
        with wave.open(io.BytesIO(data), "rb") as src:
            channels, width, rate = src.getnchannels(), src.getsampwidth(), src.getframerate()
            frames = src.readframes(src.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a readable WAV file ({len(data)} bytes): {exc}") from exc
    if channels != 1 or width != 2:
        raise ValueError(f"expected mono 16-bit WAV, got {channels} channel(s) of {8 * width} bit")
    return WavAudio(pcm16=frames, sample_rate=rate)
