"""The caller's words so far, transcribed before their sound is over, for a floor verdict.

Two moments ask for them (``ivr.call.barge_in``): a pause in a sound over a paused prompt (is
it a backchannel already?) and a sound the bot holds on over (are the words more than one?).
Each runs as one task at a time; a cancelled one is counted as wasted speculation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from ivr.audio.resample import resample
from ivr.errors import ProviderError
from ivr.obs import metrics
from ivr.stt.base import SpeechToText

log = structlog.get_logger("ivr.call")

Verdict = Callable[[str], Awaitable[None]]
"""What to do with the words, once in (only if the STT answered)."""


class EarlyWords:
    def __init__(self, stt: SpeechToText) -> None:
        self._stt = stt
        self._at_pause: asyncio.Task[None] | None = None
        """Transcribing the caller's words over a paused prompt at their first pause."""
        self._held: asyncio.Task[None] | None = None
        """Transcribing the words so far of a sound the caller's habit holds the bot over."""

    @property
    def probing_held(self) -> bool:
        """A held sound's words were asked for already (once per sound)."""
        return self._held is not None

    def judge_at_pause(self, pcm16_8k: bytes, verdict: Verdict) -> None:
        self.cancel_at_pause()
        self._at_pause = asyncio.create_task(
            self._judge(pcm16_8k, "barge_in.early_verdict_failed", verdict),
            name="early-barge-in-verdict",
        )

    def probe_held(self, pcm16_8k: bytes, verdict: Verdict) -> None:
        self._held = asyncio.create_task(
            self._judge(pcm16_8k, "barge_in.held_words_failed", verdict), name="held-words"
        )

    def cancel_at_pause(self) -> None:
        task, self._at_pause = self._at_pause, None
        _cancel(task)  # the caller went on, or stopped: the utterance's words decide

    def cancel_held(self) -> None:
        task, self._held = self._held, None
        _cancel(task)  # the sound ended first: its whole transcript decides

    async def _judge(self, pcm16_8k: bytes, failed_event: str, verdict: Verdict) -> None:
        text = await self._words_so_far(pcm16_8k, failed_event)
        if text is not None:  # else the utterance's own transcript (or the hold) decides
            await verdict(text)

    async def _words_so_far(self, pcm16_8k: bytes, failed_event: str) -> str | None:
        """The caller's words in a sound not over yet, for a verdict on it; None if the STT
        fails (counted) or a bug does (logged): a call never ends for want of this answer,
        the sound's own transcript (or the hold) decides without it."""
        audio = resample(pcm16_8k, 8000, self._stt.sample_rate)
        try:
            return (await self._stt.transcribe(audio)).text.strip()
        except ProviderError:
            metrics.SPECULATION.labels("stt", "failed").inc()
        except Exception:
            log.exception(failed_event)
        return None

    async def aclose(self) -> None:
        for task in (self._at_pause, self._held):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._at_pause = self._held = None


def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        metrics.SPECULATION.labels("stt", "wasted").inc()
