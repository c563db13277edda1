"""What the far end of an outbound call sounds like: people answering and answering machines.

Real speech (espeak-ng, through the phone channel: ``audio_fixtures.speech_pcm16``), a beep, line
noise. A person says a short greeting and waits for us; a machine plays a greeting monologue,
beeps and records silence. ``CALLEES`` is the labelled set the tests and ``bench/amd.py`` use.
"""

from __future__ import annotations

import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from audio_fixtures import RATE, noise_pcm16, speech_pcm16, trimmed


@dataclass(frozen=True, slots=True)
class Callee:
    name: str
    kind: str
    """``human`` or ``machine``: what the detector should say."""
    greeting: str
    beep_hz: float | None = None
    beep_s: float = 0.5
    noise_dbfs: float | None = None
    noise_color: str = "brown"
    """``brown`` (line rumble, mostly below the voice band) or ``white`` (hiss, in it)."""
    lead_s: float = 0.3
    """Silence between the answer and the first word."""


HUMAN_GREETINGS = (
    "Hello?",
    "Hi, this is Sam.",
    "Hello, who is this?",
    "Yeah?",
    "Good morning, Acme dental.",
    "Sam speaking.",
)
MACHINE_GREETINGS = (
    "Hi, you have reached Sam. I can't take your call right now. "
    "Please leave a message after the tone.",
    "The person you are calling is not available. Please leave your message after the beep.",
    "Hello, this is Jordan. Sorry I missed you, leave your name and number and I will call "
    "you back.",
    "You have reached the voicemail of five five five, zero one, nine nine. Please record "
    "your message.",
)
BEEPS = (1000.0, 850.0, 1400.0, 440.0)

CALLEES: tuple[Callee, ...] = (
    *(Callee(f"human-{i}", "human", g) for i, g in enumerate(HUMAN_GREETINGS)),
    *(
        Callee(f"human-noisy-{i}", "human", g, noise_dbfs=-45.0, lead_s=0.6)
        for i, g in enumerate(HUMAN_GREETINGS[:3])
    ),
    *(
        Callee(f"machine-{i}", "machine", g, beep_hz=BEEPS[i % len(BEEPS)])
        for i, g in enumerate(MACHINE_GREETINGS)
    ),
    *(
        Callee(f"machine-noisy-{i}", "machine", g, beep_hz=1000.0, noise_dbfs=-45.0)
        for i, g in enumerate(MACHINE_GREETINGS[:2])
    ),
    Callee("machine-no-beep", "machine", MACHINE_GREETINGS[1]),
    *(
        Callee(f"human-hiss-{i}", "human", g, noise_dbfs=-50.0, noise_color="white")
        for i, g in enumerate(HUMAN_GREETINGS[:3])
    ),
    *(
        Callee(f"machine-hiss-{i}", "machine", g, 1000.0, noise_dbfs=-50.0, noise_color="white")
        for i, g in enumerate(MACHINE_GREETINGS[:2])
    ),
)


def tone_pcm16(hz: float, seconds: float, dbfs: float = -12.0) -> bytes:
    n = round(RATE * seconds)
    t = np.arange(n) / RATE
    ramp = np.minimum(1.0, np.minimum(np.arange(n), n - 1 - np.arange(n)) / (0.005 * RATE))
    x = np.sin(2 * np.pi * hz * t) * ramp * 32768 * 10 ** (dbfs / 20)
    return np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes()


def silence_pcm16(seconds: float) -> bytes:
    return bytes(2 * round(RATE * seconds))


@dataclass(frozen=True, slots=True)
class CalleeAudio:
    pcm16: bytes
    """The whole clip, 8 kHz: lead silence, greeting (, beep, recording silence)."""
    speech_end_s: float
    beep_end_s: float | None


def callee_audio(callee: Callee, tail_s: float = 3.0) -> CalleeAudio:
    """The far end's audio from the moment it answers."""
    speech = trimmed(speech_pcm16(callee.greeting))
    parts = [silence_pcm16(callee.lead_s), speech]
    speech_end = callee.lead_s + len(speech) / 2 / RATE
    beep_end = None
    if callee.kind == "machine" and callee.beep_hz is not None:
        parts += [silence_pcm16(0.4), tone_pcm16(callee.beep_hz, callee.beep_s)]
        beep_end = speech_end + 0.4 + callee.beep_s
    parts.append(silence_pcm16(tail_s))
    pcm = b"".join(parts)
    if callee.noise_dbfs is not None:
        seconds = len(pcm) / 2 / RATE
        noise_clip = noise_pcm16(seconds, callee.noise_dbfs, color=callee.noise_color)
        noise = np.frombuffer(noise_clip, "<i2")
        mixed = np.frombuffer(pcm, "<i2").astype(np.int32)
        mixed[: noise.size] += noise
        pcm = np.clip(mixed, -32768, 32767).astype("<i2").tobytes()
    return CalleeAudio(pcm, speech_end, beep_end)


def write_wav(path: Path, pcm16: bytes) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm16)
    return path
