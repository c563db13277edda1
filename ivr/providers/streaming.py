"""What the streaming seams of STT and TTS share (``ivr.stt.base``, ``ivr.tts.base``): the
format of the audio a stream carries, and words with their times in it.

A streaming provider may take or give the phone's own audio (8 kHz mu-law: Deepgram's
``encoding=mulaw``, OpenAI Realtime's ``g711_ulaw``, Cartesia's ``pcm_mulaw``, ElevenLabs'
``ulaw_8000``), which spares the gateway a resampling step each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AudioEncoding(StrEnum):
    MULAW = "mulaw"
    """G.711 mu-law, one byte a sample: what Twilio sends and plays."""
    PCM16 = "pcm16"
    """Signed 16-bit little-endian samples."""


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """Mono audio as a stream carries it."""

    encoding: AudioEncoding
    sample_rate: int
    """Samples a second."""


PHONE_AUDIO = AudioFormat(AudioEncoding.MULAW, 8000)
"""The caller's line as Twilio carries it, both ways."""


@dataclass(frozen=True, slots=True)
class TimedWord:
    """One word and where it lies in a stream's audio."""

    text: str
    """As the provider writes it (punctuation attached, when it adds any)."""
    start: float
    """Seconds from the stream's first audio (STT: the first frame pushed; TTS: the first
    byte of audio yielded) to the word's start."""
    end: float
    """Seconds from the stream's first audio to the word's end."""
    confidence: float | None = None
    """How sure the provider is of the word (0-1), when it says."""
