"""A reply's text as the LLM streams it, cut into pieces a voice speaks well (``SentenceChunker``:
sentences, a first clause early), with the LLM stages of the turn timed on the way. Both
producers of a ``SpeechHandle`` read it: the batch one (a TTS request a piece) and the streamed
one (``ivr.call.streamed_speech``: every piece into one session).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import structlog

from ivr.call.reply_timing import ReplyTiming
from ivr.call.turns import CallStats, TurnTimings
from ivr.callio.sentences import SentenceChunker
from ivr.errors import ProviderError
from ivr.obs import metrics

log = structlog.get_logger("ivr.call")

LLM_READ_EVERY_S = 0.05
"""Once a piece has gone to the voice, the LLM's stream is asked for more at most this often:
the voice has at least that piece to say (a second or more) before it needs the next one, and
each ask then takes every token that arrived meanwhile as one delta, not one trip through the
flow, the prefetch and the splitter per token (~34 a turn in bench/capacity.py's reply, ~9 so).
It relies on the sources handing on what they hold as one delta: the LLM adapter what one
read found, a prefetch what it drained before adoption (``join_text``)."""


class ReplyText:
    """``pieces()`` once; ``failed`` afterwards says whether the LLM gave up (counted, logged)."""

    def __init__(
        self,
        timing: ReplyTiming,
        stats: CallStats,
        clock: Callable[[], float],
        *,
        first_words: int | None = None,
    ) -> None:
        """``first_words``: the voice's ``first_piece_words`` (see ``SentenceChunker``)."""
        self._timing = timing
        self._stats = stats
        self._clock = clock
        self._first_words = first_words
        self.failed = False

    async def pieces(
        self, chunks: AsyncIterator[str], turn: TurnTimings | None
    ) -> AsyncGenerator[str, None]:
        """The speakable pieces of ``chunks``; an LLM failure ends them (``failed``). Closing
        this iteration closes ``chunks`` (the LLM's HTTP stream, on a barge-in too)."""
        chunker = SentenceChunker(first_words=self._first_words)
        deltas = aiter(chunks)
        asked_at: float | None = None  # set once a piece has gone to the voice
        try:
            if turn is not None:
                turn.llm_start = self._clock()
            while True:
                if asked_at is not None:
                    if (wait := asked_at + LLM_READ_EVERY_S - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                    asked_at = time.monotonic()
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    break
                self._timing.first_token(turn)
                for piece in chunker.push(delta):
                    self._timing.first_clause(turn)
                    asked_at = asked_at or time.monotonic()
                    yield piece
            for piece in chunker.flush():
                self._timing.first_clause(turn)
                yield piece
        except ProviderError as exc:
            provider_failed("llm", exc, self._stats)
            self.failed = True
        finally:
            aclose = getattr(chunks, "aclose", None)  # the seams promise only an AsyncIterator
            if aclose is not None:
                await aclose()


def provider_failed(stage: str, exc: ProviderError, stats: CallStats) -> None:
    """A provider gave up on this reply (``llm``, ``tts``): counted and logged, once."""
    metrics.count_provider_error(stage, exc.provider, exc)
    stats.provider_errors += 1
    log.warning(f"{stage}.failed", error=str(exc), kind=exc.kind.value)
