"""What the streaming TTS stand-ins say: each word of the text as a tone (its length in
proportion to its letters) and a short gap, in 8 kHz mu-law, with the word's times; the first
audio ``first_audio`` seconds after the first text, then chunks paced at ``speed`` x real time
(0: as fast as the socket takes them).

Text may arrive cut anywhere (LLM tokens): only words followed by a space (or the end of the
input) are spoken, the rest waits for the next piece.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from ivr.audio.codec import pcm16_to_ulaw

RATE = 8000


@dataclass(slots=True)
class TtsScript:
    first_audio: float = 0.12
    """Seconds from the first text to the first audio."""
    speed: float = 2.0
    """Audio sent at this many times real time after the first chunk (0: unpaced)."""
    chunk_seconds: float = 0.1
    seconds_per_char: float = 0.06
    gap_seconds: float = 0.05
    hz: float = 220.0
    """The tone's pitch: a test may tell apart what two scripts said by it."""


@dataclass(frozen=True, slots=True)
class SpokenWord:
    text: str
    start: float
    end: float
    """Seconds from the generation's first audio."""


def _tone(seconds: float, hz: float) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    return pcm16_to_ulaw((np.sin(2 * np.pi * hz * t) * 6000).astype("<i2").tobytes())


class Speaker:
    """One generation's text in, its audio and word times out, paced."""

    def __init__(self, script: TtsScript) -> None:
        self.script = script
        self.pending = ""
        self.seconds = 0.0
        """Audio made so far."""
        self.started: float | None = None
        self.sent_seconds = 0.0

    def add(self, text: str, *, final: bool = False) -> tuple[bytes, list[SpokenWord]]:
        """Audio and words for the complete words of what came so far."""
        self.pending += text
        if final:
            ready, self.pending = self.pending, ""
        else:
            cut = max(self.pending.rfind(" "), self.pending.rfind("\n"))
            ready, self.pending = self.pending[: cut + 1], self.pending[cut + 1 :]
        audio, words = bytearray(), []
        for word in ready.split():
            length = max(0.1, len(word) * self.script.seconds_per_char)
            words.append(SpokenWord(word, round(self.seconds, 3), round(self.seconds + length, 3)))
            audio += _tone(length, self.script.hz) + b"\xff" * int(self.script.gap_seconds * RATE)
            self.seconds += length + self.script.gap_seconds
        return bytes(audio), words

    async def pace(self, chunk: bytes, texted_at: float) -> None:
        """Wait until ``chunk`` is due (the first ``first_audio`` after the first text)."""
        loop = asyncio.get_running_loop()
        if self.started is None:
            self.started = texted_at + self.script.first_audio
        due = self.started
        if self.script.speed > 0:
            due += self.sent_seconds / self.script.speed
        await asyncio.sleep(max(0.0, due - loop.time()))
        self.sent_seconds += len(chunk) / RATE

    def chunks(self, audio: bytes) -> list[bytes]:
        size = max(1, int(self.script.chunk_seconds * RATE))
        return [audio[i : i + size] for i in range(0, len(audio), size)]
