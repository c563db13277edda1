"""Text-to-speech over OpenAI's ``POST /v1/audio/speech`` with ``response_format="pcm"``:
raw 16-bit little-endian mono samples (24 kHz on OpenAI), streamed as they are synthesised."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import openai

from ivr.openai_calls import StageLimits, WaitClock, payload_error

# A JSON error or an HTML proxy page served with status 200 is not audio, whatever its bytes.
_NOT_AUDIO = ("application/json", "text/")


class OpenAIHttpTts:
    """``TextToSpeech`` over HTTP.

    Iterate ``synthesize`` inside ``contextlib.aclosing`` or cancel its task: either closes
    the HTTP response, so the server stops synthesising (barge-in). Every failure is a
    ``ProviderError``; no retries here (they are ``ivr.providers_resilience``'s decision).
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str = "gpt-4o-mini-tts",
        voice: str = "alloy",
        sample_rate: int = 24_000,
        instructions: str | None = None,
        # Lenient defaults for tools and tests on a busy machine; the gateway passes the
        # IVR_TTS_* settings (ivr/providers.py), which keep dead air under 2 s.
        first_byte_timeout: float = 3.0,
        stall_timeout: float = 5.0,
        total_timeout: float = 10.0,
        name: str = "openai_tts",
    ) -> None:
        self.name = name
        self.model = model
        self.voice = voice
        self.sample_rate = sample_rate
        """Rate of the server's pcm output; OpenAI's is fixed at 24 kHz."""
        self.instructions = instructions
        """Speaking-style prompt for models that take one (gpt-4o-mini-tts)."""
        self.limits = StageLimits(
            first=first_byte_timeout, stall=stall_timeout, total=total_timeout
        )
        """First audio byte, gap between later chunks, time waiting on the server in all."""
        # The SDK's timeout is only a backstop: every wait is bounded (and named) by self.limits.
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=total_timeout + 1.0
        )
        _ = self._client.audio.speech  # lazy SDK import, not on the first turn

    @property
    def first_byte_timeout(self) -> float:
        return self.limits.first

    async def warm(self) -> None:
        """Nothing to load: the voice runs at the provider."""

    async def aclose(self) -> None:
        await self._client.close()

    async def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """Stream ``text`` as PCM16; ``first_output_limit`` replaces the first-byte timeout
        for this call."""
        if not text.strip():
            return
        limits = self.limits
        if first_output_limit is not None:
            limits = StageLimits(first_output_limit, limits.stall, limits.total)
        clock = WaitClock(
            self.name,
            limits,
            first_phase="first audio byte",
            transport_timeout=limits.total + 1.0,
        )
        request = self._client.audio.speech.with_streaming_response.create(
            model=self.model,
            voice=self.voice,
            input=text,
            response_format="pcm",
            instructions=self.instructions or openai.omit,
        )
        async with AsyncExitStack() as stack:
            response = await clock.wait(stack.enter_async_context(request))
            kind = response.headers.get("content-type", "")
            if kind.startswith(_NOT_AUDIO):
                body = await clock.wait(response.read())
                raise payload_error(self.name, f"{kind} instead of audio: {body[:120]!r}")
            chunks = response.iter_bytes().__aiter__()
            carry = b""
            while chunk := await clock.wait(anext(chunks, b"")):
                clock.output_started()
                data = carry + chunk
                whole = len(data) - len(data) % 2  # keep an odd trailing byte for the next chunk
                carry = data[whole:]
                if whole:
                    yield data[:whole]
        if carry:
            raise payload_error(self.name, "stream ended inside a sample (odd byte count)")
        if not clock.flowing:
            raise payload_error(self.name, f"no audio for {len(text)} characters of text")
