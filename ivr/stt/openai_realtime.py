"""OpenAI's Realtime API as a transcription session (``/v1/realtime?intent=transcription``):
the phone's mu-law appended as it arrives (``audio/pcmu``, what the beta interface called
``input_audio_format: g711_ulaw``), the server's VAD committing each utterance
(``input_audio_buffer.speech_started`` / ``speech_stopped`` / ``committed``), and its words
as ``conversation.item.input_audio_transcription.delta`` (interim) and ``.completed``
(final; with ``logprobs``, how sure the model is of the last word). ``finalize()`` commits
what the server's VAD has not yet; an ``error`` event or a ``.failed`` transcription ends the
session with a ``ProviderError``.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

from ivr.errors import ProviderError, ProviderErrorKind
from ivr.providers.openai_http import payload_error
from ivr.providers.streaming import PHONE_AUDIO, AudioFormat
from ivr.providers.websocket import parse_json
from ivr.stt.base import FinalWords, InterimWords, SttStreamEvent, TurnHint, TurnHintKind
from ivr.stt.live import Finalizing, LiveLimits, LiveSttSession, open_live

OPENAI_REALTIME_URL = "wss://api.openai.com/v1/realtime"
_COMMIT = json.dumps({"type": "input_audio_buffer.commit"})
_EMPTY_COMMIT = "input_audio_buffer_commit_empty"


class OpenAIRealtimeStt:
    """``StreamingSpeechToText`` over an OpenAI Realtime transcription session."""

    accepts: tuple[AudioFormat, ...] = (PHONE_AUDIO,)

    def __init__(
        self,
        *,
        api_key: str,
        model: str = "gpt-4o-transcribe",
        base_url: str = OPENAI_REALTIME_URL,
        language: str | None = "en",
        prompt: str = "",
        silence_ms: int = 300,
        connect_timeout: float = 1.5,
        finalize_timeout: float = 1.5,
        name: str = "openai_realtime",
    ) -> None:
        self.name = name
        self.model = model
        self.url = base_url.rstrip("/") + "?intent=transcription"
        self._headers = {"Authorization": f"Bearer {api_key}"}
        transcription: dict[str, Any] = {"model": model}
        if language:
            transcription["language"] = language
        if prompt:
            transcription["prompt"] = prompt
        self.session_config = {
            "type": "transcription",
            "audio": {"input": {
                "format": {"type": "audio/pcmu"},
                "transcription": transcription,
                "turn_detection": {
                    "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                    "silence_duration_ms": silence_ms,
                },
            }},
            "include": ["item.input_audio_transcription.logprobs"],
        }  # fmt: skip
        self.connect_timeout = connect_timeout
        self.limits = LiveLimits(finalize=finalize_timeout)

    async def open(
        self, audio: AudioFormat, *, first_output_limit: float | None = None
    ) -> LiveSttSession:
        if audio not in self.accepts:
            raise ValueError(f"{self.name} takes {self.accepts}, not {audio}")
        wire = RealtimeWire(self.name, self.session_config)
        limit = self.connect_timeout if first_output_limit is None else first_output_limit
        return await open_live(
            self.name, self.url, self._headers, wire, audio, self.limits, limit=limit
        )

    async def warm(self) -> None:
        """Nothing to load; each call opens its own socket."""

    async def aclose(self) -> None:
        """Sessions own their sockets."""


class RealtimeWire:
    """The transcription session's events for one connection (see the module docstring)."""

    def __init__(self, provider: str, config: dict[str, Any]) -> None:
        self.provider = provider
        self._config = config
        self._in_speech = False
        self._appended = False  # audio sent since the last commit
        self._pending: dict[str, float | None] = {}  # committed items -> their audio end
        self._stopped_at: dict[str, float] = {}
        self._deltas: dict[str, str] = {}
        self._flush = False  # a finalize() waits for the items pending now

    def opening(self) -> list[str]:
        return [json.dumps({"type": "session.update", "session": self._config})]

    def audio(self, chunk: bytes) -> str:
        self._appended = True
        encoded = base64.b64encode(chunk).decode("ascii")
        return json.dumps({"type": "input_audio_buffer.append", "audio": encoded})

    def keepalive(self) -> None:
        return None  # the gateway's audio flows all call long; pings do the rest

    def finalize(self, unsent: bool) -> Finalizing:
        # Audio sent since the last commit (or about to be) is committed whatever this side
        # has read of the server's VAD (its speech_started may still be in flight): an empty
        # buffer is an error event that answers the finalize just the same.
        if self._appended or unsent:
            self._flush = True
            return Finalizing(_COMMIT, settled=False)
        if self._pending:
            self._flush = True
            return Finalizing(None, settled=False)
        return Finalizing(None, settled=True)

    def close_input(self) -> None:
        return None

    def owes_words(self) -> bool:
        # A commit always gets an answer (committed, or the empty buffer's error).
        return self._in_speech or bool(self._pending) or self._flush

    def parse(self, message: str | bytes) -> list[SttStreamEvent]:
        body = parse_json(self.provider, message)
        kind = body.get("type")
        try:
            return self._event(str(kind), body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise payload_error(self.provider, f"{kind}: {type(exc).__name__} {exc}") from exc

    def _event(self, kind: str, body: dict[str, Any]) -> list[SttStreamEvent]:
        prefix = "conversation.item.input_audio_transcription."
        if kind == "input_audio_buffer.speech_started":
            self._in_speech = True
            return [TurnHint(TurnHintKind.SPEECH_STARTED, body["audio_start_ms"] / 1000)]
        if kind == "input_audio_buffer.speech_stopped":
            self._in_speech = False
            self._stopped_at[body["item_id"]] = body["audio_end_ms"] / 1000
            return [TurnHint(TurnHintKind.END_OF_TURN, body["audio_end_ms"] / 1000)]
        if kind == "input_audio_buffer.committed":
            self._in_speech, self._appended = False, False
            item = body["item_id"]
            self._pending[item] = self._stopped_at.pop(item, None)
            return []
        if kind == prefix + "delta":
            item = body["item_id"]
            self._deltas[item] = self._deltas.get(item, "") + str(body["delta"])
            return [InterimWords(self._deltas[item].strip())]
        if kind == prefix + "completed":
            return self._completed(body)
        if kind == prefix + "failed":
            raise self._error(body.get("error") or {}, retryable=True)
        if kind == "error":
            return self._error_event(body["error"])
        return []  # session.created / updated, conversation.item.*, later kinds

    def _completed(self, body: dict[str, Any]) -> list[SttStreamEvent]:
        item = body["item_id"]
        self._deltas.pop(item, None)
        end = self._pending.pop(item, None)
        flushed = self._flush and not self._pending and not self._in_speech
        self._flush = self._flush and not flushed
        text = str(body["transcript"]).strip()
        return [FinalWords(text, (), _last_word_probability(body), end, flushed)]

    def _error_event(self, error: dict[str, Any]) -> list[SttStreamEvent]:
        if error.get("code") == _EMPTY_COMMIT:  # the server's VAD committed it first
            if self._flush and not self._pending:
                self._flush = False
                return [FinalWords("", flushed=True)]
            return []
        raise self._error(error, retryable=error.get("type") == "server_error")

    def _error(self, error: dict[str, Any], *, retryable: bool) -> ProviderError:
        code = error.get("code") or error.get("type") or "error"
        detail = f"{code}: {error.get('message') or json.dumps(error)[:200]}"
        return ProviderError(
            self.provider, detail, kind=ProviderErrorKind.STATUS, retryable=retryable
        )


def _last_word_probability(body: dict[str, Any]) -> float | None:
    """The probability of the last word's tokens together (``logprobs``, when included)."""
    logprobs = body.get("logprobs")
    if not isinstance(logprobs, list) or not logprobs:
        return None
    total = 0.0
    for entry in reversed(logprobs):
        token = str(entry.get("token", ""))
        if token.strip(" .,?!"):
            total += float(entry["logprob"])
        if token.startswith(" ") or not token.strip():
            break
    return math.exp(total)
