"""Pre-synthesised prompt audio, so static prompts (greetings, menus) start playing at once.

Keyed by (voice, text) and stored as 8 kHz mu-law, ready to send (a streaming voice's own
mu-law is kept as it comes). Static prompt texts are
synthesised at startup; other texts said through ``say`` are cached too, in a bounded LRU, so
callers may add phrases they repeat via ``put``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

import structlog

from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import resample
from ivr.errors import ProviderError
from ivr.obs import metrics
from ivr.tts.base import TextToSpeech
from ivr.tts.voice import StreamingVoice

log = structlog.get_logger("ivr.prompts")

WARM_CONCURRENCY = 4
"""Prompts synthesised at once at startup: a few requests in flight, not a burst."""


class PromptCache:
    def __init__(self, max_dynamic: int = 256) -> None:
        self._static: dict[tuple[str, str], bytes] = {}
        self._dynamic: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._max_dynamic = max_dynamic

    def get(self, voice: str, text: str) -> bytes | None:
        key = (voice, text)
        audio = self._static.get(key)
        if audio is None:
            audio = self._dynamic.get(key)
            if audio is not None:
                self._dynamic.move_to_end(key)
        metrics.PROMPT_CACHE.labels("hit" if audio is not None else "miss").inc()
        return audio

    def put(self, voice: str, text: str, ulaw: bytes, *, static: bool = False) -> None:
        key = (voice, text)
        if static:
            self._static[key] = ulaw
            return
        self._dynamic[key] = ulaw
        self._dynamic.move_to_end(key)
        while len(self._dynamic) > self._max_dynamic:
            self._dynamic.popitem(last=False)

    def __len__(self) -> int:
        return len(self._static) + len(self._dynamic)

    async def warm(
        self, tts: TextToSpeech, texts: Iterable[str], *, concurrency: int = WARM_CONCURRENCY
    ) -> int:
        """Synthesise every text not cached yet, ``concurrency`` at a time; returns how many
        were added. One at a time, a remote voice made startup wait for every prompt's whole
        audio in turn (~27 s for the sample flows at 4x real time); the local engines queue
        their work themselves (piper's worker thread, espeak's lock)."""
        todo = list(dict.fromkeys(t for t in texts if (tts.voice, t) not in self._static))
        gate = asyncio.Semaphore(max(1, concurrency))
        added = 0

        async def one(text: str) -> None:
            nonlocal added
            async with gate:
                try:
                    ulaw = await synthesise_ulaw(tts, text)
                except ProviderError as exc:
                    log.warning("prompt.warm_failed", error=str(exc), text_len=len(text))
                    return
            self.put(tts.voice, text, ulaw, static=True)
            added += 1

        async with asyncio.TaskGroup() as group:
            for text in todo:
                group.create_task(one(text))
        return added


async def synthesise_ulaw(tts: TextToSpeech, text: str) -> bytes:
    if isinstance(tts, StreamingVoice):  # the phone's own mu-law already: keep it as it is
        return await tts.synthesize_ulaw(text)
    pcm = b"".join([chunk async for chunk in tts.synthesize(text)])
    return pcm16_to_ulaw(resample(pcm, tts.sample_rate, 8000))
