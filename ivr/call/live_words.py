"""The caller's words as a streaming STT has heard them since the last turn.

``LiveWords`` keeps the final words the provider settled since the last turn was taken and the
interim words of the speech in progress, in the call's stream clock (seconds from the first
audio pushed). The turn worker (``ivr.call.live_hearing``) takes the finals at the end of each
turn; a sound that was no turn (echo, a cough, speech too short) drops the words about it.

It also answers ``SpeechToText.transcribe`` with the words so far, no request: the parts of a
call that ask for "the caller's words so far" at a pause (``ivr.call.pause_turns``,
``ivr.call.early_words``) ask it, whatever audio they hand in, because with a streaming STT
those words are already here (the audio they pass is the same speech, by construction).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ivr.stt.base import FinalWords, InterimWords, Transcript

WORD_SLACK = 0.1
"""Seconds past a dropped sound's end that its words may still be placed (provider timing)."""


@dataclass(frozen=True, slots=True)
class HeardFinal:
    text: str
    about: float
    """Stream seconds of the end of the audio the words are about (last word, or the final's
    ``audio_end``)."""
    last_word_probability: float | None


class LiveWords:
    """See the module docstring. ``sample_rate`` is the phone's: no resampling for nothing."""

    sample_rate = 8000

    def __init__(self, name: str) -> None:
        self.name = name
        self._finals: list[HeardFinal] = []
        self._interim = ""
        self._horizon = -math.inf
        """Words about audio before this (stream seconds) belong to a sound that was no turn."""

    def heard(self, event: InterimWords | FinalWords, now: float) -> None:
        """An event already in the stream clock; ``now``: the audio pushed so far (s)."""
        if isinstance(event, InterimWords):
            self._interim = event.text.strip()
            return
        self._interim = ""
        words = [w for w in event.words if w.end > self._horizon + WORD_SLACK]
        if event.words:
            if not words:
                return
            text = " ".join(w.text for w in words)
            about = words[-1].end
        else:
            text = event.text.strip()
            about = now if event.audio_end is None else event.audio_end
            if about <= self._horizon + WORD_SLACK:
                return
        if text:
            self._finals.append(HeardFinal(text, about, event.last_word_probability))

    def drop_through(self, t: float) -> None:
        """The sound that ended at stream second ``t`` was no turn: its words, had or to come,
        are not the caller's next turn."""
        self._horizon = max(self._horizon, t)
        self._finals = [f for f in self._finals if f.about > t + WORD_SLACK]
        self._interim = ""

    def settled_through(self, t: float) -> bool:
        """Final words reach stream second ``t`` and none are pending after them."""
        return not self._interim and bool(self._finals) and self._finals[-1].about >= t - WORD_SLACK

    def so_far(self) -> str:
        return " ".join([f.text for f in self._finals] + ([self._interim] if self._interim else []))

    def take(self, through: float) -> tuple[str, float | None]:
        """The turn's words (the finals since the last turn) and how sure the provider is of
        the last; they are gone from here, and so is any later word about audio before
        ``through`` (stream seconds: what the turn's final words settled)."""
        finals, self._finals = self._finals, []
        self._interim = ""
        self._horizon = max(self._horizon, through - WORD_SLACK)
        text = " ".join(f.text for f in finals)
        return text, (finals[-1].last_word_probability if finals else None)

    # ---- SpeechToText, for the words so far -------------------------------------------------

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        probability = self._finals[-1].last_word_probability if self._finals else None
        return Transcript(self.so_far(), 0.0, None if self._interim else probability)

    async def warm(self) -> None:
        """Nothing to load: the call's session is opened by ``LiveHearing``."""

    async def aclose(self) -> None:
        """The session is closed by ``LiveHearing``."""


def same_words(a: str, b: str) -> bool:
    """The same words, whatever the case and punctuation ("What time?" = "what time")."""
    return _plain(a) == _plain(b)


def _plain(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())
