"""Speech-to-text over OpenAI's ``POST /v1/audio/transcriptions`` (OpenAI, Groq, the HF router,
faster-whisper-server, vLLM ...): one finished utterance goes up as a WAV file, text comes back."""

from __future__ import annotations

import asyncio
import time

import openai

from ivr.audio.wav import pcm16_to_wav
from ivr.errors import ProviderError, ProviderStatusError, ProviderTimeout
from ivr.stt.base import Transcript


class OpenAIHttpStt:
    """``SpeechToText`` over HTTP. No retries here: ``ProviderError.retryable`` tells the caller."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str = "whisper-1",
        language: str | None = "en",
        prompt: str | None = None,
        sample_rate: int = 16_000,
        timeout: float = 8.0,
        name: str = "openai_stt",
    ) -> None:
        self.name = name
        self.model = model
        self.language = language
        """ISO-639-1 hint; None lets the server detect it."""
        self.prompt = prompt
        """Vocabulary hint (names, account words) passed to Whisper-style models."""
        self.sample_rate = sample_rate
        self.timeout = timeout
        """Seconds for the whole request, upload to answer."""
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout
        )
        _ = self._client.audio.transcriptions  # lazy SDK import, not on the first turn

    async def aclose(self) -> None:
        await self._client.close()

    async def transcribe(self, pcm16: bytes) -> Transcript:
        if len(pcm16) % 2:
            raise ValueError(f"{self.name}: PCM16 must hold whole samples; got {len(pcm16)} bytes")
        started = time.perf_counter()
        if not pcm16:
            return Transcript(text="", seconds=0.0)
        wav = pcm16_to_wav(pcm16, self.sample_rate)
        try:
            async with asyncio.timeout(self.timeout):
                result = await self._client.audio.transcriptions.create(
                    file=("utterance.wav", wav, "audio/wav"),
                    model=self.model,
                    response_format="json",
                    language=self.language or openai.omit,
                    prompt=self.prompt or openai.omit,
                )
        except (TimeoutError, openai.APITimeoutError) as exc:
            raise ProviderTimeout(self.name, self.timeout) from exc
        except openai.APIStatusError as exc:
            raise ProviderStatusError(self.name, exc.status_code, exc.message) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(self.name, f"connection failed: {exc}", retryable=True) from exc
        except (openai.APIError, ValueError) as exc:
            raise ProviderError(self.name, f"bad response: {exc}") from exc
        return Transcript(text=result.text.strip(), seconds=time.perf_counter() - started)
