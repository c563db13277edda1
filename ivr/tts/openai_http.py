"""Text-to-speech over OpenAI's ``POST /v1/audio/speech`` with ``response_format="pcm"``:
raw 16-bit little-endian mono samples (24 kHz on OpenAI), streamed as they are synthesised.

Servers stream far faster than real time, in small pieces (40 ms every 10 ms is typical), and
every piece the event loop reads off the socket costs it a wakeup and a parse: an 11 s reply was
~275 of them. So the socket is read only while whoever iterates ``synthesize`` is waiting for
audio: a consumer with enough in hand waits before asking again (``ivr.call.speech``), the
kernel gathers what the server sends meanwhile, and one read takes it all (bench/provider_cost.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import aiohttp

from ivr.providers.openai_http import OpenAIEndpoint, StageLimits, WaitClock, payload_error

# A JSON error or an HTML proxy page served with status 200 is not audio, whatever its bytes.
_NOT_AUDIO = ("application/json", "text/")


class OpenAIHttpTts:
    """``TextToSpeech`` over HTTP.

    Iterate ``synthesize`` inside ``contextlib.aclosing`` or cancel its task: either closes
    the HTTP response, so the server stops synthesising (barge-in). Every failure is a
    ``ProviderError``; no retries here (they are ``the kind's resilient wrapper's decision).
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
        self.first_piece_words: int | None = None
        self.sample_rate = sample_rate
        """Rate of the server's pcm output; OpenAI's is fixed at 24 kHz."""
        self.instructions = instructions
        """Speaking-style prompt for models that take one (gpt-4o-mini-tts)."""
        self.limits = StageLimits(
            first=first_byte_timeout, stall=stall_timeout, total=total_timeout
        )
        """First audio byte, gap between later chunks, time waiting on the server in all."""
        self._http = OpenAIEndpoint(
            base_url,
            api_key,
            provider=name,
            read_timeout=total_timeout + 1.0,
        )

    @property
    def first_byte_timeout(self) -> float:
        return self.limits.first

    async def warm(self) -> None:
        """Nothing to load: the voice runs at the provider."""

    async def aclose(self) -> None:
        await self._http.aclose()

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
        body: dict[str, object] = {
            "model": self.model,
            "voice": self.voice,
            "input": text,
            "response_format": "pcm",
        }
        if self.instructions:
            body["instructions"] = self.instructions
        async with AsyncExitStack() as stack:
            response = await clock.wait(
                stack.enter_async_context(self._http.post("/audio/speech", json_body=body))
            )
            kind = response.headers.get("content-type", "")
            if kind.startswith(_NOT_AUDIO):
                answer = await clock.wait(response.content.read(200))
                raise payload_error(self.name, f"{kind} instead of audio: {answer[:120]!r}")
            carry = b""
            socket = _SocketHold(response)
            try:
                while True:
                    socket.read()
                    chunk = await clock.wait(response.content.readany())
                    socket.hold()
                    if not chunk:
                        break
                    clock.output_started()
                    data = carry + chunk
                    whole = len(data) - len(data) % 2  # an odd trailing byte waits for the next
                    carry = data[whole:]
                    if whole:
                        yield data[:whole]
            finally:
                socket.read()  # a connection goes back to the pool reading, as it came
        if carry:
            raise payload_error(self.name, "stream ended inside a sample (odd byte count)")
        if not clock.flowing:
            raise payload_error(self.name, f"no audio for {len(text)} characters of text")


class _SocketHold:
    """The answer's socket, read only while the consumer waits for audio (see the module
    docstring). aiohttp's own flow control stays out of it: it pauses only past 128 KiB held."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        connection = response.connection
        self._transport = connection.transport if connection is not None else None
        self._content = response.content

    def read(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def hold(self) -> None:
        # Once the answer's end is parsed, aiohttp has put the connection back in the pool: it
        # may already carry another request, whose answer a pause would hold back until this
        # stream's next read (up to a second later in ivr.call.speech's pacing; a whole
        # first-byte limit if never).
        if self._content.is_eof():
            self._transport = None
        elif self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()
