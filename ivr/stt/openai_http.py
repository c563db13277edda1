"""Speech-to-text over OpenAI's ``POST /v1/audio/transcriptions`` (OpenAI, Groq, the HF router,
faster-whisper-server, vLLM ...): one finished utterance goes up as a WAV file, text comes back.

A request whose asker leaves (a speculative transcript the caller talked past) is not aborted:
aborting an HTTP/1.1 request closes its connection, so the turn's real request, a second or two
later, paid a new TCP and TLS handshake (two round trips to the provider) on the caller's wait.
The provider transcribes the upload anyway; the answer is read and dropped, and the connection
goes back to the pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from ivr.audio.wav import pcm16_to_wav
from ivr.providers.openai_http import OpenAIEndpoint, StageLimits, WaitClock, payload_error
from ivr.stt.base import Transcript

MAX_ABANDONED = 16
"""Abandoned requests left to finish at once; past that one is aborted (its connection too)."""


class OpenAIHttpStt:
    """``SpeechToText`` over HTTP. Every failure is a ``ProviderError``; no retries here (they
    are ``the kind's resilient wrapper's decision)."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str = "whisper-1",
        language: str | None = "en",
        prompt: str | None = None,
        sample_rate: int = 8000,
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
        """The rate of the PCM ``transcribe`` is given, uploaded as it is: the line's 8 kHz by
        default (``Settings.stt_sample_rate`` says why)."""
        self.timeout = timeout
        """Seconds for the whole request, upload to answer."""
        # Its timeout is a backstop: ours (asyncio) fires first and says which limit.
        self._http = OpenAIEndpoint(base_url, api_key, provider=name, read_timeout=timeout + 1.0)
        self._abandoned: set[asyncio.Task[Any]] = set()

    async def warm(self) -> None:
        """Nothing to load: the model runs at the provider."""

    async def aclose(self) -> None:
        for request in self._abandoned:
            request.cancel()
        await asyncio.gather(*self._abandoned, return_exceptions=True)
        await self._http.aclose()

    async def transcribe(
        self, pcm16: bytes, *, first_output_limit: float | None = None
    ) -> Transcript:
        """Transcribe ``pcm16``; ``first_output_limit`` replaces ``self.timeout`` for this call."""
        if len(pcm16) % 2:
            raise ValueError(f"{self.name}: PCM16 must hold whole samples; got {len(pcm16)} bytes")
        started = time.perf_counter()
        if not pcm16:
            return Transcript(text="", seconds=0.0)
        wav = pcm16_to_wav(pcm16, self.sample_rate)
        limit = self.timeout if first_output_limit is None else first_output_limit
        clock = WaitClock(
            self.name,
            StageLimits(first=limit, stall=limit, total=limit),
            first_phase="answer",
            transport_timeout=self.timeout + 1.0,
        )
        request = asyncio.ensure_future(self._post(wav, max(limit, self.timeout) + 1.0))
        try:
            result = await clock.wait(asyncio.shield(request))
        except asyncio.CancelledError:
            self._let_finish(request)
            raise
        except BaseException:
            request.cancel()  # timed out: the connection is suspect, drop it
            raise
        return Transcript(text=self._text(result), seconds=time.perf_counter() - started)

    def _let_finish(self, request: asyncio.Task[Any]) -> None:
        """Keep ``request`` (its asker left) running to its end so its connection is reused;
        its own deadline bounds it (``_post``)."""
        if request.done():
            return
        if len(self._abandoned) >= MAX_ABANDONED:
            request.cancel()
            return
        self._abandoned.add(request)
        request.add_done_callback(self._finished)

    def _finished(self, request: asyncio.Task[Any]) -> None:
        self._abandoned.discard(request)
        if not request.cancelled():
            request.exception()  # nobody waits for it: a failure here is not an error to log

    async def _post(self, wav: bytes, deadline: float) -> Any:
        async with asyncio.timeout(deadline):  # also ends one nobody waits for any more
            return await self._post_form(wav)

    async def _post_form(self, wav: bytes) -> Any:
        form = aiohttp.FormData()
        form.add_field("file", wav, filename="utterance.wav", content_type="audio/wav")
        form.add_field("model", self.model)
        form.add_field("response_format", "json")
        if self.language:
            form.add_field("language", self.language)
        if self.prompt:
            form.add_field("prompt", self.prompt)
        async with AsyncExitStack() as stack:
            response = await stack.enter_async_context(
                self._http.post("/audio/transcriptions", form=form)
            )
            body = await response.read()
        try:
            return json.loads(body)
        except ValueError as exc:
            kind = response.headers.get("content-type", "")
            raise payload_error(self.name, f"{kind} answer is not JSON: {body[:120]!r}") from exc

    def _text(self, result: Any) -> str:
        # {"text": null}, {} or a list must not pass for a transcript.
        text = result.get("text") if isinstance(result, dict) else None
        if not isinstance(text, str):
            shown = type(text).__name__ if text is not None else "null or missing"
            raise payload_error(self.name, f'"text" is {shown}, not a string')
        return text.strip()
