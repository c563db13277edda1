"""ElevenLabs' stream-input WebSocket (``/v1/text-to-speech/{voice_id}/stream-input``): one
socket per reply, opened with the BOS message (``text: " "``, voice settings, the chunk
schedule), fed text as it comes (``try_trigger_generation``; a sentence's end is flushed so
its audio is not held for more text), ended with EOS (``text: ""``). Audio comes back in
``ulaw_8000`` (the phone's format: no resampling) as ``{"audio": base64, "alignment":
{"chars", "charStartTimesMs", "charDurationsMs"}}`` (times from that message's first audio),
and ``{"isFinal": true}`` ends it. An error is a JSON message (``message``/``error``) and a
close (1008 for a bad key or quota, 1011 for the server's own failure). Barge-in closes the
socket: stream-input has no cancel, and a closed socket stops the generation.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from ivr.errors import ProviderError, ProviderErrorKind
from ivr.providers.openai_http import payload_error
from ivr.providers.streaming import PHONE_AUDIO, TimedWord
from ivr.providers.websocket import closed_error, open_socket, parse_json
from ivr.tts.base import SpeechAudio
from ivr.tts.live import Cancelled, Outbox, SpeechClock, words_from_chars

ELEVENLABS_URL = "wss://api.elevenlabs.io"
_SENTENCE_END = (".", "!", "?", ";", ":")


class ElevenLabsTts:
    """``StreamingTextToSpeech`` over ElevenLabs (see the module docstring)."""

    output = PHONE_AUDIO

    def __init__(
        self,
        *,
        api_key: str,
        voice: str,
        model: str = "eleven_flash_v2_5",
        base_url: str = ELEVENLABS_URL,
        stability: float = 0.5,
        similarity_boost: float = 0.75,
        connect_timeout: float = 1.0,
        first_audio_timeout: float = 1.0,
        stall_timeout: float = 1.0,
        name: str = "elevenlabs",
    ) -> None:
        self.name = name
        self.voice = voice
        query = urlencode({"model_id": model, "output_format": "ulaw_8000"})
        path = f"/v1/text-to-speech/{quote(voice, safe='')}/stream-input?{query}"
        self.url = base_url.rstrip("/") + path
        self._headers = {"xi-api-key": api_key}
        self.opening = {
            "text": " ",
            "voice_settings": {"stability": stability, "similarity_boost": similarity_boost},
            # Small first chunks: the first audio sooner (ElevenLabs' defaults wait for more).
            "generation_config": {"chunk_length_schedule": [50, 90, 120, 150]},
        }
        self.connect_timeout = connect_timeout
        self.first_audio_timeout = first_audio_timeout
        self.stall_timeout = stall_timeout

    async def open(self, *, first_output_limit: float | None = None) -> ElevenLabsSession:
        first = self.first_audio_timeout if first_output_limit is None else first_output_limit
        limit = min(first, self.connect_timeout)
        socket = await open_socket(self.name, self.url, self._headers, limit=limit)
        clock = SpeechClock(self.name, first=first, stall=self.stall_timeout)
        return ElevenLabsSession(self.name, socket, self.opening, clock)

    async def warm(self) -> None:
        """Nothing shared to open: each reply has its own socket."""

    async def aclose(self) -> None:
        """Sessions own their sockets."""


class ElevenLabsSession:
    """One reply on its own socket (``TextToSpeechSession``)."""

    def __init__(
        self, provider: str, socket: ClientConnection, opening: dict[str, Any], clock: SpeechClock
    ) -> None:
        self.provider = provider
        self._socket = socket
        self._clock = clock
        self._outbox = Outbox(provider, socket)
        self._outbox.send(opening)
        self._sent = False
        self._audio_seconds = 0.0  # audio yielded so far: where the next message's times start
        self._partial: tuple[str, float, float] | None = None

    def push_text(self, text: str) -> None:
        if not text or self._clock.ended:
            return
        message: dict[str, Any] = {"text": text, "try_trigger_generation": True}
        if text.rstrip().endswith(_SENTENCE_END):
            message["flush"] = True
        self._outbox.send(message)
        self._sent = True
        self._clock.text_pushed()

    def end_input(self) -> None:
        if not self._clock.ended:
            self._outbox.send({"text": ""})
        self._clock.input_ended()

    def cancel(self) -> None:
        self._outbox.close_after()
        self._clock.cancel()

    async def __aiter__(self) -> AsyncIterator[SpeechAudio]:
        while True:
            if self._clock.ended and not self._sent:
                return
            try:
                message = await self._clock.wait(self._socket.recv)
            except Cancelled:
                return
            except ConnectionClosedOK as exc:
                if self._clock.cancelled:
                    return
                raise closed_error(self.provider, exc, expected=self._clock.ended) from exc
            except ConnectionClosed as exc:
                raise closed_error(self.provider, exc) from exc
            body = parse_json(self.provider, message)
            if body.get("audio"):
                yield self._audio(body)
            elif (error := body.get("message") or body.get("error")) and not body.get("isFinal"):
                raise ProviderError(
                    self.provider, f"error message: {error}", kind=ProviderErrorKind.STATUS,
                    retryable=False,
                )  # fmt: skip
            if body.get("isFinal"):
                if self._partial is not None:
                    text, start, end = self._partial
                    self._partial = None
                    yield SpeechAudio(b"", (TimedWord(text, start, end),))
                return

    def _audio(self, body: dict[str, Any]) -> SpeechAudio:
        try:
            audio = base64.b64decode(body["audio"], validate=True)
        except (TypeError, binascii.Error) as exc:
            raise payload_error(self.provider, f"audio is not base64: {exc}") from exc
        self._clock.audio_arrived()
        words = self._words(body.get("alignment") or body.get("normalizedAlignment"))
        self._audio_seconds += len(audio) / 8000
        return SpeechAudio(audio, words)

    def _words(self, alignment: object) -> tuple[TimedWord, ...]:
        if not alignment:
            return ()
        try:
            assert isinstance(alignment, dict)
            chars = [str(c) for c in alignment["chars"]]
            starts = [float(t) / 1000 for t in alignment["charStartTimesMs"]]
            ends = [
                s + float(d) / 1000
                for s, d in zip(starts, alignment["charDurationsMs"], strict=True)
            ]
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise payload_error(self.provider, f"alignment unusable: {exc}") from exc
        if self._partial is not None:  # a word the last message left unfinished
            text, start, end = self._partial
            chars = list(text) + chars
            starts = [start - self._audio_seconds] * len(text) + starts
            ends = [end - self._audio_seconds] * len(text) + ends
        words, self._partial = words_from_chars(chars, starts, ends, self._audio_seconds)
        return tuple(words)

    async def aclose(self) -> None:
        await self._outbox.aclose()
        await self._socket.close()
