"""A streaming STT used as a batch one (``SpeechToText``): one session per utterance.

A call with a streaming provider hears through its own session (``ivr.call.live_hearing``);
what is not a call and still asks for a transcript of finished audio (the demo, ``ivr flows
test --audio``, anything built on ``Gateway.stt``) gets this: the utterance pushed at once,
``finalize()``, the final words, the session closed.
"""

from __future__ import annotations

import time

from ivr.audio.codec import pcm16_to_ulaw
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import FinalWords, StreamingSpeechToText, Transcript


class StreamedBatchStt:
    sample_rate = PHONE_AUDIO.sample_rate
    """The phone's rate: the session takes its mu-law."""

    def __init__(self, stream: StreamingSpeechToText) -> None:
        self.stream = stream
        self.name = stream.name
        self.providers = getattr(stream, "providers", [stream])
        """The providers behind it, for per-provider metrics (as a resilient wrapper's)."""

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        started = time.monotonic()
        session = await self.stream.open(PHONE_AUDIO, first_output_limit=first_output_limit)
        texts: list[str] = []
        last: float | None = None
        try:
            session.push(pcm16_to_ulaw(pcm16))
            session.finalize()
            async for event in session:
                if isinstance(event, FinalWords):
                    if event.text:
                        texts.append(event.text.strip())
                        last = event.last_word_probability
                    if event.flushed:
                        break
        finally:
            await session.aclose()
        return Transcript(" ".join(texts), time.monotonic() - started, last)

    async def warm(self) -> None:
        await self.stream.warm()

    async def aclose(self) -> None:
        await self.stream.aclose()
