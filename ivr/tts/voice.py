"""``StreamingVoice``: a streaming TTS (Cartesia, ElevenLabs) as the call's voice.

Replies are spoken through ``streaming`` directly, one session per reply, its mu-law written to
the caller as it comes (``ivr.call.streamed_speech``). What needs one whole text at a time
(the prompt cache's greetings, a flow's prompts, the gateway's warm-up) sees the batch seam
(``TextToSpeech``): each ``synthesize`` is a session of that one text, decoded to PCM16 at
8 kHz; ``synthesize_ulaw`` gives the provider's mu-law as it is, for the prompt cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from ivr.audio.codec import ulaw_to_pcm16
from ivr.providers.streaming import PHONE_AUDIO
from ivr.tts.base import StreamingTextToSpeech


class StreamingVoice:
    """``TextToSpeech`` over a ``StreamingTextToSpeech`` that speaks the phone's mu-law."""

    sample_rate = 8000

    def __init__(self, streaming: StreamingTextToSpeech) -> None:
        if streaming.output != PHONE_AUDIO:
            raise ValueError(f"a call's streaming voice must speak {PHONE_AUDIO}")
        self.streaming = streaming
        self.name = streaming.name
        self.voice = streaming.voice
        self.first_piece_words: int | None = None  # a session carries prosody across pieces
        self.providers: Sequence[object] = getattr(streaming, "providers", (streaming,))
        """For the gateway's per-provider metrics: the primary and its fallbacks."""

    async def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        async for ulaw in self._ulaw(text, first_output_limit):
            yield ulaw_to_pcm16(ulaw)

    async def synthesize_ulaw(self, text: str) -> bytes:
        """All of ``text`` in the provider's own 8 kHz mu-law (no decode, no resampling)."""
        return b"".join([ulaw async for ulaw in self._ulaw(text, None)])

    async def _ulaw(self, text: str, limit: float | None) -> AsyncIterator[bytes]:
        session = await self.streaming.open(first_output_limit=limit)
        try:
            session.push_text(text)
            session.end_input()
            async for part in session:
                if part.audio:
                    yield part.audio
        finally:
            await session.aclose()

    async def warm(self) -> None:
        await self.streaming.warm()

    async def aclose(self) -> None:
        await self.streaming.aclose()
