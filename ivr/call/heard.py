"""What a turn's transcription ends in, whichever STT made it (``ivr.call.hearing``'s batch
worker, ``ivr.call.live_hearing``'s session): the utterance handed to the floor, timed from the
endpoint, or ``NotUnderstood`` (the re-ask) when the provider failed."""

from __future__ import annotations

import structlog

from ivr.call.inputs import NotUnderstood
from ivr.call.speaking import Speaker
from ivr.call.turns import TurnTimings
from ivr.callio.io import Utterance
from ivr.errors import ProviderError
from ivr.obs import metrics

log = structlog.get_logger("ivr.call")


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
