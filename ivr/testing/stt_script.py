"""What the streaming STT stand-ins hear: speech found in the caller's mu-law by its level,
each stretch of it given the next scripted utterance, its words revealed as they are spoken
(one every ``word_seconds`` of speech) and all of them, spread over the stretch, at its end.

    script = SttScript(["I need a repair", "yes"], final_delay=0.15)

The clock is the audio's (seconds of it received), so a client pushing faster than real time
gets the same words at the same audio times; the final words' latency is wall time after the
last voiced frame arrived (``final_delay``), as a provider's is after the caller stops.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ivr.audio.codec import rms16, ulaw_to_pcm16

FRAME = 160
"""20 ms of 8 kHz mu-law."""


@dataclass(slots=True)
class SttScript:
    utterances: collections.deque[str] | list[str] = field(default_factory=collections.deque)
    """What each stretch of speech says, in order ("" once they are used up)."""
    final_delay: float = 0.15
    """Wall seconds from the end of speech to the final words."""
    word_seconds: float = 0.3
    """Speech per revealed interim word."""
    interim_every: float = 0.25
    """Audio seconds between interim results while speech goes on."""
    end_silence: float = 0.1
    """Silence (audio seconds) that ends a stretch of speech."""
    threshold: int = 300
    """PCM16 RMS level above which a 20 ms frame is speech."""
    word_tail: float = 0.0
    """Voiced seconds after the last final word's end (a breath, a trailing consonant): a
    provider's word timings end before the sound a VAD hears."""

    def next_text(self) -> str:
        if isinstance(self.utterances, list):
            self.utterances = collections.deque(self.utterances)
        return self.utterances.popleft() if self.utterances else ""


@dataclass(frozen=True, slots=True)
class Word:
    text: str
    start: float
    end: float


@dataclass(slots=True)
class Segment:
    """One stretch of speech and the utterance it says."""

    text: str
    start: float
    voiced_end: float
    """Audio time of the end of its last voiced frame."""
    reported: float = 0.0
    """Audio time of the last interim result."""

    def words_by(self, now: float, word_seconds: float) -> list[Word]:
        """Words spoken by audio time ``now`` (all but the last while speech goes on)."""
        names = self.text.split()
        spoken = min(len(names) - 1, int((now - self.start) / word_seconds))
        return self.timed(names, max(0, spoken), self.start + len(names) * word_seconds)

    def all_words(self, tail: float = 0.0) -> list[Word]:
        names = self.text.split()
        return self.timed(names, len(names), max(self.start, self.voiced_end - tail))

    def timed(self, names: list[str], count: int, end: float) -> list[Word]:
        step = (end - self.start) / max(1, len(names))
        return [
            Word(names[i], round(self.start + i * step, 3), round(self.start + (i + 1) * step, 3))
            for i in range(count)
        ]


class SpeechTracker:
    """Feeds on mu-law as the client sends it; says when speech starts, when interim words
    are due and when a stretch of speech has ended."""

    def __init__(self, script: SttScript) -> None:
        self.script = script
        self.clock = 0.0
        """Audio seconds received."""
        self.segment: Segment | None = None
        self._carry = b""

    def feed(self, audio: bytes) -> list[tuple[str, Segment]]:
        """What happened in ``audio``: ("start" | "interim" | "end", segment) in order."""
        data = self._carry + audio
        whole = len(data) - len(data) % FRAME
        self._carry = data[whole:]
        out: list[tuple[str, Segment]] = []
        for offset in range(0, whole, FRAME):
            voiced = rms16(ulaw_to_pcm16(data[offset : offset + FRAME])) > self.script.threshold
            start, self.clock = self.clock, self.clock + FRAME / 8000
            out.extend(self._frame(voiced, start))
        return out

    def _frame(self, voiced: bool, start: float) -> list[tuple[str, Segment]]:
        segment, script = self.segment, self.script
        if segment is None:
            if not voiced:
                return []
            self.segment = Segment(script.next_text(), start, self.clock, reported=start)
            return [("start", self.segment)]
        if voiced:
            segment.voiced_end = self.clock
            if self.clock - segment.reported >= script.interim_every:
                segment.reported = self.clock
                return [("interim", segment)]
            return []
        if self.clock - segment.voiced_end >= script.end_silence:
            self.segment = None
            return [("end", segment)]
        return []

    def cut(self) -> Segment | None:
        """End the speech in progress now (a client's finalize)."""
        segment, self.segment = self.segment, None
        return segment
