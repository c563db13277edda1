"""Text-to-speech over OpenAI's ``POST /v1/audio/speech`` with ``response_format="pcm"``:
raw 16-bit little-endian mono samples (24 kHz on OpenAI), streamed as they are synthesised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack
from typing import TypeVar

import openai

from ivr.errors import ProviderError, ProviderStatusError, ProviderTimeout

T = TypeVar("T")


class OpenAIHttpTts:
    """``TextToSpeech`` over HTTP.

    Iterate ``synthesize`` inside ``contextlib.aclosing`` or cancel its task: either closes
    the HTTP response, so the server stops synthesising (barge-in).
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
        first_byte_timeout: float = 3.0,
        stall_timeout: float = 5.0,
        name: str = "openai_tts",
    ) -> None:
        self.name = name
        self.model = model
        self.voice = voice
        self.sample_rate = sample_rate
        """Rate of the server's pcm output; OpenAI's is fixed at 24 kHz."""
        self.instructions = instructions
        """Speaking-style prompt for models that take one (gpt-4o-mini-tts)."""
        self.first_byte_timeout = first_byte_timeout
        """Seconds from sending the request to the first audio bytes."""
        self.stall_timeout = stall_timeout
        """Seconds allowed between later chunks before the stream counts as dead."""
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=stall_timeout
        )
        _ = self._client.audio.speech  # lazy SDK import, not on the first turn

    async def aclose(self) -> None:
        await self._client.close()

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        if not text.strip():
            return
        request = self._client.audio.speech.with_streaming_response.create(
            model=self.model,
            voice=self.voice,
            input=text,
            response_format="pcm",
            instructions=self.instructions or openai.omit,
        )
        async with AsyncExitStack() as stack:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.first_byte_timeout
            response = await self._wait(
                deadline, self.first_byte_timeout, stack.enter_async_context(request)
            )
            chunks = response.iter_bytes().__aiter__()
            carry = b""
            limit = self.first_byte_timeout
            while True:
                chunk = await self._wait(deadline, limit, anext(chunks, b""))
                if not chunk:
                    break
                deadline, limit = loop.time() + self.stall_timeout, self.stall_timeout
                data = carry + chunk
                whole = len(data) - len(data) % 2  # keep an odd trailing byte for the next chunk
                carry = data[whole:]
                if whole:
                    yield data[:whole]
        if carry:
            raise ProviderError(self.name, "stream ended inside a sample (odd byte count)")

    async def _wait(self, deadline: float, limit: float, step: Awaitable[T]) -> T:
        """Await one step of the request by ``deadline``, mapping failures to ProviderError."""
        try:
            async with asyncio.timeout_at(deadline):
                return await step
        except (TimeoutError, openai.APITimeoutError) as exc:
            raise ProviderTimeout(self.name, limit) from exc
        except openai.APIStatusError as exc:
            raise ProviderStatusError(self.name, exc.status_code, exc.message) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(self.name, f"connection failed: {exc}", retryable=True) from exc
        except openai.APIError as exc:
            raise ProviderError(self.name, f"bad response: {exc}") from exc
