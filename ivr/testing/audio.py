"""Audio helpers for the local stand-ins of remote services (a fake STT deciding what it
heard) in tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from ivr.audio.resample import resample
from ivr.audio.wav import wav_to_pcm16


def voiced_seconds(wav: bytes, threshold_db: float = -40.0) -> float:
    """Seconds of a WAV (as an STT request carries it) louder than ``threshold_db`` in 20 ms
    frames: how much the caller said, whatever silence surrounds it."""
    audio = wav_to_pcm16(wav)
    x = np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float64)
    frame = audio.sample_rate // 50
    rms = np.sqrt((x[: len(x) // frame * frame].reshape(-1, frame) ** 2).mean(axis=1))
    return float((rms > 32768 * 10 ** (threshold_db / 20)).sum()) / 50


async def piper_voice(texts: Iterable[str]) -> Callable[[str], tuple[bytes, int]]:
    """A caller voice for benchmarks that whisper hears well: each of ``texts`` rendered by
    the offline piper engine up front (``synthesize(text) -> (PCM16, rate)`` looks it up)."""
    from ivr.tts.piper_local import LocalPiperTts  # loads onnxruntime: only when asked

    tts = LocalPiperTts()
    try:
        rendered = {t: b"".join([c async for c in tts.synthesize(t)]) for t in texts}
        rate = tts.sample_rate
    finally:
        await tts.aclose()
    return lambda text: (rendered[text], rate)


class KnownSpeech:
    """A stand-in STT for scripted callers: which of the known utterances the request's audio
    begins with, and as much of its transcript as was said by the end of the audio (words in
    proportion), as a real STT asked mid-sentence would return "I would".

    ``said``: what the caller says -> what the STT returns for all of it; ``synthesize`` the
    caller's voice (text -> PCM16, rate), the same one the simulated caller speaks with.
    espeak varies a little from one synthesis to the next, so the first moments after the
    onset are compared as spectra (10 ms frames), with a few frames' slack in time.
    """

    HEAD_FRAMES = 30
    SLACK_FRAMES = 3

    def __init__(
        self, said: dict[str, str], synthesize: Callable[[str], tuple[bytes, int]]
    ) -> None:
        self._known: list[tuple[npt.NDArray[np.float64], int, str]] = []
        for spoken, transcript in said.items():
            pcm, rate = synthesize(spoken)
            speech = _active(_at_8k(pcm, rate))
            self._known.append((_spectra(speech), speech.size, transcript))

    def __call__(self, wav: bytes, form: object = None) -> str:
        audio = wav_to_pcm16(wav)
        speech = _active(_at_8k(audio.pcm16, audio.sample_rate))
        heard = _spectra(speech)
        best, transcript, covered = -2.0, "", 0.0
        for spectra, size, text in self._known:
            n = min(len(spectra), len(heard), self.HEAD_FRAMES)
            if n == 0:
                continue
            score = _best_aligned(heard, spectra, n, self.SLACK_FRAMES)
            if score > best:
                best, transcript, covered = score, text, min(1.0, speech.size / size)
        words = transcript.split()
        if not words or covered >= 0.95:
            return transcript
        return " ".join(words[: max(1, round(covered * len(words)))])


RATE = 8000
_FRAME, _HOP = 256, 80


def _at_8k(pcm16: bytes, rate: int) -> npt.NDArray[np.float64]:
    return np.frombuffer(resample(pcm16, rate, RATE), dtype="<i2").astype(np.float64)


def _active(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """From the first sample to the last above -40 dBFS: the speech, without the silence
    around it."""
    loud = np.flatnonzero(np.abs(x) > 32768 * 10 ** (-40 / 20))
    return x[loud[0] : loud[-1] + 1] if loud.size else x[:0]


def _spectra(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Log-magnitude spectra of 32 ms frames every 10 ms, each centred on its mean."""
    if x.size < _FRAME:
        return np.zeros((0, _FRAME // 2 + 1))
    starts = np.arange(0, x.size - _FRAME + 1, _HOP)
    frames = x[starts[:, None] + np.arange(_FRAME)] * np.hanning(_FRAME)
    logs = np.log(np.abs(np.fft.rfft(frames, axis=1)) + 1.0)
    centred: npt.NDArray[np.float64] = logs - logs.mean(axis=1, keepdims=True)
    return centred


def _best_aligned(
    a: npt.NDArray[np.float64], b: npt.NDArray[np.float64], n: int, slack: int
) -> float:
    """The best ``_mean_cosine`` of ``n`` frames of ``a`` and ``b``, either one shifted by up
    to ``slack`` frames against the other."""
    return max(
        _mean_cosine(a[max(0, shift) : max(0, shift) + n], b[max(0, -shift) : max(0, -shift) + n])
        for shift in range(-slack, slack + 1)
        if max(0, shift) + n <= len(a) and max(0, -shift) + n <= len(b)
    )


def _mean_cosine(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    dots = np.einsum("ij,ij->i", a, b)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return float(np.mean(dots / np.maximum(norms, 1e-9)))
