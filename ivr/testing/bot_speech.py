"""Known speech for echo tests and benchmarks, and which of its words a stretch of audio holds.

``BotVoice`` is the TTS stand-in's voice (``FakeOpenAIServer.speak``): the agent's reply pieces
rendered up front by the offline piper voice (espeak as a fallback), each brought to one
active speech level (-23 dBFS by default, measured at 8 kHz, as the caller's line carries it)
and served as OpenAI's 24 kHz PCM16. ``caller_lines`` renders the simulated caller's lines
once. Both keep their utterances at 8 kHz in a ``SpeechCatalogue``, which finds the words an
echo of the bot, or the caller's own voice, carries (``ivr.testing.line_stt``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import soxr

from ivr.sim.playout import ulaw_decode
from ivr.sim.script import to_line_audio
from ivr.testing.openai_wire import SPEECH_RATE

Pcm = npt.NDArray[np.float64]
Synthesize = Callable[[str], tuple[bytes, int]]
"""text -> (mono PCM16, sample rate)."""

RATE = 8000
FRAME = RATE // 50
PIECE_S = 0.4
MIN_RUN_FRAMES = 3
"""Audible runs shorter than 60 ms make no word."""
BRIDGE_FRAMES = 5
"""Gaps of up to 100 ms inside a run of heard frames are bridged (a stop consonant's closure)."""
SOUND_DBFS = -50.0
"""Without a mask of what was heard, frames above this level count."""
MATCH_MIN = 0.6
"""A run of audio correlating less than this with every utterance is none of them."""
_GAP = np.zeros(RATE // 2)


def best_match(needle: Pcm, haystack: Pcm) -> tuple[int, float]:
    """Where ``needle`` fits best in ``haystack``: (offset, normalised correlation 0..1)."""
    n = needle.size
    if n == 0 or haystack.size < n:
        return 0, 0.0
    size = 1 << (haystack.size + n).bit_length()
    corr = np.fft.irfft(np.fft.rfft(haystack, size) * np.conj(np.fft.rfft(needle, size)), size)
    lags = haystack.size - n + 1
    cums = np.concatenate([[0.0], np.cumsum(haystack * haystack)])
    own = max(float(np.dot(needle, needle)), 1e-9)
    # Near-silent stretches of the haystack: their energy is lost in the FFT's rounding.
    energy = np.maximum(cums[n : n + lags] - cums[:lags], 1e-3 * own)
    ncc = corr[:lags] / np.sqrt(energy * own)
    k = int(np.argmax(ncc))
    return k, float(ncc[k])


def frame_levels(x: Pcm, frame: int = FRAME) -> Pcm:
    """Mean square of each whole 20 ms frame of ``x``."""
    whole = x[: x.size - x.size % frame]
    levels: Pcm = np.mean(whole.reshape(-1, frame) ** 2, axis=1) if whole.size else np.zeros(0)
    return levels


def active_level_dbfs(x: Pcm) -> float:
    """Active speech level: the RMS of the 20 ms frames within 35 dB of the loudest."""
    levels = frame_levels(x)
    if not levels.size or levels.max() <= 0:
        return -120.0
    active = levels[levels >= levels.max() * 10 ** (-35 / 10)]
    return float(10 * np.log10(active.mean() / 32768.0**2))


@dataclass(frozen=True, slots=True)
class _Piece:
    text: str
    size: int
    offset: int
    """Where it starts in the catalogue (all pieces end to end, 0.5 s apart)."""
    active: tuple[int, int]
    """First and last sample above -40 dBFS: its words are spread over these."""


class SpeechCatalogue:
    """Known utterances at 8 kHz (as a phone line carries them), and which of their words a
    stretch of audio holds: each run of it (up to 400 ms at a time) is located in them by
    normalised cross-correlation, and the words at that place (by their share of the
    utterance's characters) are what it said. Thread-safe: a stand-in STT reads it from a
    server thread while a TTS stand-in adds to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: list[_Piece] = []
        self._audio: Pcm = np.zeros(0)

    def add(self, text: str, at_8k: Pcm) -> None:
        loud = np.flatnonzero(np.abs(at_8k) > 32768 * 10 ** (-40 / 20))
        active = (int(loud[0]), int(loud[-1]) + 1) if loud.size else (0, at_8k.size)
        with self._lock:
            self._pieces.append(_Piece(text, at_8k.size, self._audio.size, active))
            self._audio = np.concatenate([self._audio, at_8k, _GAP])

    @property
    def texts(self) -> list[str]:
        with self._lock:
            return [p.text for p in self._pieces]

    def audio_of(self, text: str) -> Pcm:
        """The 8 kHz audio of ``text`` (the last one added with it)."""
        with self._lock:
            for piece in reversed(self._pieces):
                if piece.text == text:
                    return self._audio[piece.offset : piece.offset + piece.size].copy()
        raise KeyError(f"SpeechCatalogue: no utterance {text!r}")

    def words_in(self, heard: Pcm, audible: npt.NDArray[np.bool_] | None = None) -> str:
        """The words in ``heard`` (8 kHz), counting only the 20 ms frames ``audible`` says
        were heard (all when None); each word once, in the order heard."""
        with self._lock:
            audio, pieces = self._audio, list(self._pieces)
        frames = heard.size // FRAME
        if audible is None:  # every frame with sound in it: runs break at the pauses
            audible = frame_levels(heard) > (32768 * 10 ** (SOUND_DBFS / 20)) ** 2
        spans: dict[int, tuple[_Piece, int, int]] = {}  # by piece, in the order first heard
        for lo, hi in _runs(audible[:frames], round(PIECE_S * RATE / FRAME)):
            for start, size, piece in _locate(heard[lo * FRAME : hi * FRAME], audio, pieces):
                _, a, b = spans.get(piece.offset, (piece, start, start + size))
                spans[piece.offset] = (piece, min(a, start), max(b, start + size))
        # Within an utterance, all that lies between the first and the last place heard: a
        # stretch too quiet or too short to locate on its own was heard all the same.
        return " ".join(w for piece, a, b in spans.values() for w in _words_between(piece, a, b))


def _locate(chunk: Pcm, audio: Pcm, pieces: list[_Piece]) -> list[tuple[int, int, _Piece]]:
    """(where in its utterance, how long, which utterance) for ``chunk`` or, if it matches
    none as a whole (it straddles two), for each half of it."""
    if chunk.size < MIN_RUN_FRAMES * FRAME or not chunk.any():
        return []
    at, score = best_match(chunk, audio)
    if score < MATCH_MIN:
        half = chunk.size // 2 // FRAME * FRAME
        return _locate(chunk[:half], audio, pieces) + _locate(chunk[half:], audio, pieces)
    for piece in pieces:
        if piece.offset <= at < piece.offset + piece.size + _GAP.size:
            return [(at - piece.offset, chunk.size, piece)]
    return []


def at_line_rate(pcm16: bytes, rate: int) -> Pcm:
    """Mono PCM16 at ``rate`` as 8 kHz float samples."""
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float64)
    out: Pcm = soxr.resample(x, rate, RATE) if rate != RATE else x
    return out


def caller_lines(
    texts: Iterable[str], synthesize: Synthesize
) -> tuple[SpeechCatalogue, Callable[[str], tuple[bytes, int]]]:
    """The simulated caller's lines rendered once: a catalogue of them exactly as the line
    carries them (trimmed, 8 kHz mu-law, as ``ivr.sim.script`` makes them), and the
    synthesiser to give ``place_call`` so it speaks those very renderings."""
    rendered = {text: synthesize(text) for text in dict.fromkeys(texts)}
    catalogue = SpeechCatalogue()
    for text, (pcm, rate) in rendered.items():
        line = np.frombuffer(ulaw_decode(to_line_audio(pcm, rate)), dtype="<i2")
        catalogue.add(text, line.astype(np.float64))

    def speak(text: str) -> tuple[bytes, int]:
        if text not in rendered:
            raise KeyError(f"caller_lines: {text!r} is not one of the rendered lines")
        return rendered[text]

    return catalogue, speak


class BotVoice:
    """See the module docstring. ``rendered``: text -> (PCM16, rate) for each reply piece;
    a text not rendered up front is rendered by ``fallback`` when asked for (and counted)."""

    def __init__(
        self,
        rendered: dict[str, tuple[bytes, int]],
        *,
        level_dbfs: float = -23.0,
        fallback: Synthesize | None = None,
    ) -> None:
        self.level_dbfs = level_dbfs
        self._fallback = fallback
        self._lock = threading.Lock()
        self._speech: dict[str, bytes] = {}
        self.catalogue = SpeechCatalogue()
        """Every piece at 8 kHz, as the gateway sends it (from the 24 kHz stream)."""
        self.unknown: list[str] = []
        """Texts the gateway asked for that were not rendered up front."""
        for text, (pcm, rate) in rendered.items():
            self._add(text, pcm, rate)

    @classmethod
    async def render(
        cls, texts: Iterable[str], *, voice: str = "piper", level_dbfs: float = -23.0
    ) -> BotVoice:
        """Render ``texts`` with ``voice`` (``piper`` or ``espeak``); espeak is the fallback."""
        from ivr.tts.espeak_local import synthesize_pcm16  # loads espeak-ng: only when asked

        wanted = list(dict.fromkeys(texts))
        if voice == "piper":
            from ivr.testing.audio import piper_voice

            speak = await piper_voice(wanted)
        elif voice == "espeak":
            speak = synthesize_pcm16
        else:
            raise ValueError(f"voice must be 'piper' or 'espeak', got {voice!r}")
        rendered = {t: speak(t) for t in wanted}
        return cls(rendered, level_dbfs=level_dbfs, fallback=synthesize_pcm16)

    def _add(self, text: str, pcm: bytes, rate: int) -> None:
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
        at_24k = soxr.resample(x, rate, SPEECH_RATE) if rate != SPEECH_RATE else x
        at_8k = soxr.resample(at_24k, SPEECH_RATE, RATE)  # as the gateway gets it: from 24 kHz
        gain = 10 ** ((self.level_dbfs - active_level_dbfs(at_8k)) / 20)
        speech = np.clip(np.rint(at_24k * gain), -32768, 32767).astype("<i2").tobytes()
        with self._lock:
            self._speech[text] = speech
        self.catalogue.add(text, at_8k * gain)

    def speak(self, text: str) -> bytes:
        """24 kHz PCM16 of ``text`` (``FakeOpenAIServer.speak``)."""
        with self._lock:
            speech = self._speech.get(text)
        if speech is not None:
            return speech
        if self._fallback is None:
            raise KeyError(f"BotVoice: {text!r} was not rendered and there is no fallback voice")
        self.unknown.append(text)
        self._add(text, *self._fallback(text))
        with self._lock:
            return self._speech[text]


def _runs(mask: npt.NDArray[np.bool_], longest: int) -> list[tuple[int, int]]:
    """The runs of True in ``mask`` as [lo, hi) frame ranges, gaps of up to ``BRIDGE_FRAMES``
    inside a run bridged (a stop consonant's closure is no pause), cut to at most
    ``longest``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    merged: list[list[int]] = []
    for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        if merged and lo - merged[-1][1] <= BRIDGE_FRAMES:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    return [(a, min(hi, a + longest)) for lo, hi in merged for a in range(lo, hi, longest)]


def _words_between(piece: _Piece, lo: int, hi: int) -> list[str]:
    """The words of ``piece`` whose middle falls in samples ``[lo, hi)`` of it (its words
    spread over its active samples by their share of its characters)."""
    a, b = piece.active
    out: list[str] = []
    pos = 0
    for word in piece.text.split():
        middle = (pos + len(word) / 2) / max(1, len(piece.text))
        pos += len(word) + 1
        if lo <= a + middle * (b - a) < hi:
            out.append(word)
    return out
