"""What a turn's transcription ends in, whichever STT made it (``ivr.call.hearing``'s batch
worker, ``ivr.call.live_hearing``'s session): the utterance handed to the floor, timed from the
endpoint, or ``NotUnderstood`` (the re-ask) when the provider failed; and ``TurnsToHear``, the
bounded queue of ended turns both hearings transcribe in order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

from ivr.call.inputs import NotUnderstood
from ivr.call.speaking import Speaker
from ivr.call.turns import TurnTimings
from ivr.callio.io import Utterance
from ivr.errors import ProviderError
from ivr.obs import metrics

log = structlog.get_logger("ivr.call")

TurnT = TypeVar("TurnT")
Heard = Utterance | NotUnderstood


def words_heard(
    stt: str, speaker: Speaker, timings: TurnTimings, text: str, stt_end: float
) -> Utterance:
    timings.stt_end = stt_end
    start = timings.stt_start if timings.stt_start is not None else stt_end
    metrics.STT_LATENCY.labels(stt).observe(stt_end - timings.endpoint)
    speaker.answering = timings
    log.info("caller.said", pii_text=text, stt_s=round(stt_end - start, 3))
    return Utterance(text=text, latency={"stt": stt_end - start})


def not_understood(speaker: Speaker, exc: ProviderError) -> NotUnderstood:
    metrics.count_provider_error("stt", exc.provider, exc)
    speaker.stats.provider_errors += 1
    log.warning("stt.failed", error=str(exc), kind=exc.kind.value)
    return NotUnderstood()


class TurnsToHear(Generic[TurnT]):
    """A call's ended turns waiting for their words, oldest first, and the count being
    transcribed. Bounded: a turn past ``size`` pushes out the oldest waiting (counted in
    ``ivr_inbound_dropped_total``), a caller's words are never queued without end."""

    def __init__(self, size: int) -> None:
        self._waiting: asyncio.Queue[TurnT] = asyncio.Queue(size)
        self._busy = 0

    def put(self, turn: TurnT) -> TurnT | None:
        """Queue ``turn``; the turn it pushed out, if any."""
        dropped = None
        if self._waiting.full():
            metrics.INBOUND_DROPPED.inc()
            dropped = self._waiting.get_nowait()
        self._waiting.put_nowait(turn)
        return dropped

    def pending(self) -> bool:
        """A turn's words are being, or wait to be, transcribed."""
        return self._busy > 0 or not self._waiting.empty()

    async def serve(
        self,
        transcribe: Callable[[TurnT], Awaitable[Heard]],
        deliver: Callable[[Heard], Awaitable[None]],
        done: Callable[[TurnT], None] | None = None,
    ) -> None:
        """Each turn in order: its words (``transcribe``; ``done`` after, whatever happened)
        handed to ``deliver``. Runs until cancelled."""
        while True:
            turn = await self._waiting.get()
            self._busy += 1
            try:
                heard = await transcribe(turn)
            finally:
                self._busy -= 1
                if done is not None:
                    done(turn)
            await deliver(heard)
