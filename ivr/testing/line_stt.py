"""A stand-in STT that transcribes exactly what the caller's line carried.

The gateway uploads an utterance (a WAV at the STT rate) cut from what the caller's line sent.
``LineTranscriber`` finds it in the call's ``LineRecord`` (normalised cross-correlation of the
upload, brought back to 8 kHz, with the last ``search_s`` of what the line sent) and answers
with the words that were on the line there:

- the caller's own words (located in their rendered lines, over the frames where their
  microphone carried them) where their speech carries more energy than the echo under it;
- else the bot's words that were echoing there (located in the bot's rendered pieces, from
  what the caller heard, over the 20 ms frames where the echo stood 6 dB or more above the
  line noise);

in proportion to how much of each utterance the span holds (``SpeechCatalogue.words_in``);
- else nothing (line noise, or an echo lost in it).

So an echo the gateway lets through comes back as the bot's own words, as it would from a real
STT, and the bot answers itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import soxr

from ivr.audio.wav import wav_to_pcm16
from ivr.sim.echo import LineRecord
from ivr.testing.bot_speech import FRAME, RATE, SpeechCatalogue, best_match, frame_levels

FOUND_MIN = 0.8
"""The upload correlates at least this well with the line where it was cut from."""
ECHO_OVER_NOISE = 4.0
"""Echo power over noise power (6 dB) for a frame of echo to be heard as words."""
AUDIBLE_FLOOR = (32768 * 10 ** (-70 / 20)) ** 2
MIN_ECHO_FRAMES = 5
"""Fewer audible 20 ms frames of echo than this make no word."""

Source = Literal["caller", "echo", "noise", "lost"]


@dataclass(frozen=True, slots=True)
class Heard:
    """One transcription: what was on the line and what was answered."""

    source: Source
    """``lost``: the upload was not found on the line (another call's audio?)."""
    text: str
    start_s: float
    """Where the upload starts on the call's sample clock (seconds since it was placed)."""
    seconds: float
    match: float


class LineTranscriber:
    """See the module docstring. ``bot``: what the TTS stand-in said (``BotVoice.catalogue``);
    ``caller``: the caller's lines (``caller_lines``)."""

    def __init__(
        self,
        record: LineRecord,
        bot: SpeechCatalogue,
        caller: SpeechCatalogue,
        *,
        search_s: float = 30.0,
    ) -> None:
        self.record = record
        self.bot = bot
        self.caller = caller
        self.search_s = search_s
        self._lock = threading.Lock()
        self.heard: list[Heard] = []
        """Every answer, in order (appended from the fake server's worker threads)."""

    def __call__(self, wav: bytes, form: object = None) -> str:
        audio = wav_to_pcm16(wav)
        x = np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float64)
        upload = soxr.resample(x, audio.sample_rate, RATE) if audio.sample_rate != RATE else x
        end = self.record.end
        lo = max(0, end - round(self.search_s * RATE))
        line = self.record.span(lo, end)
        at, match = best_match(upload, line.sent)
        start, seconds = (lo + at) / RATE, upload.size / RATE
        if match < FOUND_MIN:
            return self._answer(Heard("lost", "", start, seconds, match))
        span = slice(at, at + upload.size)
        near, echo = line.near[span], line.echo[span]
        said = float(np.sum(near[line.speech[span]] ** 2))
        if said > 0 and said > float(np.sum(echo**2)):
            speaking = line.speech[span][: near.size // FRAME * FRAME].reshape(-1, FRAME)
            text = self.caller.words_in(near, np.asarray(speaking.any(axis=1), dtype=bool))
            return self._answer(Heard("caller", text, start, seconds, match))
        noise = frame_levels(line.noise[span])
        echo_power = frame_levels(echo)
        audible = echo_power > np.maximum(noise * ECHO_OVER_NOISE, AUDIBLE_FLOOR)
        if int(audible.sum()) < MIN_ECHO_FRAMES:
            return self._answer(Heard("noise", "", start, seconds, match))
        text = self.bot.words_in(line.source[span], audible)
        return self._answer(Heard("echo", text, start, seconds, match))

    def _answer(self, heard: Heard) -> str:
        with self._lock:
            self.heard.append(heard)
        return heard.text
