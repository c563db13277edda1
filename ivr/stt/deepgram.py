"""Deepgram's streaming STT: Nova live (``/v1/listen``) and Flux (``/v2/listen``), both taking
the phone's 8 kHz mu-law as it is (``encoding=mulaw&sample_rate=8000``).

Nova sends ``Results`` (interim with ``is_final: false``, then final; ``speech_final`` when
its endpointing heard the pause, ``from_finalize`` when our ``Finalize`` asked), and with
``vad_events`` / ``utterance_end_ms`` the ``SpeechStarted`` and ``UtteranceEnd`` events; it
closes a socket that gets no audio for 10 s, so ``KeepAlive`` goes out when pushes stop.
Flux sends ``TurnInfo`` events: ``Update`` (interim words, every ~0.25 s of audio),
``StartOfTurn``, ``EagerEndOfTurn`` (with ``eager_eot_threshold``), ``TurnResumed`` and
``EndOfTurn`` (the turn's final words); ``ForceEndTurn`` is its ``Finalize``. Both close the
socket with a code and a reason on a fatal error (``1008 DATA-0000``: audio it cannot decode,
``1011 NET-0001``: no audio) and refuse a bad key at the handshake (HTTP 401, ``err_msg``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from ivr.errors import ProviderError, ProviderErrorKind
from ivr.providers.openai_http import payload_error
from ivr.providers.streaming import PHONE_AUDIO, AudioFormat, TimedWord
from ivr.providers.websocket import parse_json
from ivr.stt.base import (
    FinalWords,
    InterimWords,
    SttStreamEvent,
    TurnHint,
    TurnHintKind,
)
from ivr.stt.live import Finalizing, LiveLimits, LiveSttSession, open_live

DEEPGRAM_URL = "wss://api.deepgram.com"
_KEEPALIVE = json.dumps({"type": "KeepAlive"})
_CLOSE = json.dumps({"type": "CloseStream"})


class DeepgramStt:
    """``StreamingSpeechToText`` over Deepgram: Nova (``flux=False``) or Flux."""

    accepts: tuple[AudioFormat, ...] = (PHONE_AUDIO,)

    def __init__(
        self,
        *,
        api_key: str,
        model: str = "nova-3",
        flux: bool = False,
        base_url: str = DEEPGRAM_URL,
        language: str = "en",
        keyterms: tuple[str, ...] = (),
        endpointing_ms: int = 300,
        utterance_end_ms: int = 1000,
        eot_threshold: float | None = None,
        eager_eot_threshold: float | None = None,
        eot_timeout_ms: int | None = None,
        connect_timeout: float = 1.5,
        finalize_timeout: float = 1.5,
        name: str = "",
    ) -> None:
        self.name = name or ("deepgram_flux" if flux else "deepgram")
        self.model = model
        self.flux = flux
        self._headers = {"Authorization": f"Token {api_key}"}
        params: list[tuple[str, str]] = [
            ("model", model), ("encoding", "mulaw"), ("sample_rate", "8000"),
        ]  # fmt: skip
        params += [("keyterm", term) for term in keyterms]
        if flux:
            for key, value in (
                ("eot_threshold", eot_threshold),
                ("eager_eot_threshold", eager_eot_threshold),
                ("eot_timeout_ms", eot_timeout_ms),
            ):
                if value is not None:
                    params.append((key, str(value)))
            path = "/v2/listen"
        else:
            params += [
                ("channels", "1"), ("language", language), ("interim_results", "true"),
                ("punctuate", "true"), ("smart_format", "true"), ("vad_events", "true"),
                ("endpointing", str(endpointing_ms)), ("utterance_end_ms", str(utterance_end_ms)),
            ]  # fmt: skip
            path = "/v1/listen"
        self.url = base_url.rstrip("/") + path + "?" + urlencode(params)
        self.connect_timeout = connect_timeout
        self.limits = LiveLimits(finalize=finalize_timeout)

    async def open(
        self, audio: AudioFormat, *, first_output_limit: float | None = None
    ) -> LiveSttSession:
        if audio not in self.accepts:
            raise ValueError(f"{self.name} takes {self.accepts}, not {audio}")
        wire = FluxWire(self.name) if self.flux else NovaWire(self.name)
        limit = self.connect_timeout if first_output_limit is None else first_output_limit
        return await open_live(
            self.name, self.url, self._headers, wire, audio, self.limits, limit=limit
        )

    async def warm(self) -> None:
        """Nothing to load; each call opens its own socket."""

    async def aclose(self) -> None:
        """Sessions own their sockets."""


def _words(provider: str, raw: object) -> tuple[TimedWord, ...]:
    if not isinstance(raw, list):
        raise payload_error(provider, f'"words" is {type(raw).__name__}, not a list')
    words = []
    for item in raw:
        text = item.get("punctuated_word") or item.get("word")
        if not isinstance(text, str):
            raise payload_error(provider, f"a word without text: {str(item)[:80]}")
        start, end = float(item.get("start", 0.0)), float(item.get("end", 0.0))
        words.append(TimedWord(text, start, end, _number(item.get("confidence"))))
    return tuple(words)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _fatal(provider: str, body: dict[str, Any]) -> ProviderError:
    code = body.get("code") or body.get("variant") or ""
    detail = body.get("description") or body.get("message") or json.dumps(body)[:200]
    return ProviderError(
        provider, f"error message {code}: {detail}".replace(" :", ":"),
        kind=ProviderErrorKind.STATUS, retryable=True,
    )  # fmt: skip


class NovaWire:
    """``/v1/listen``: see the module docstring."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._interim = False  # the last result was interim with words
        self._speaking = False  # speech started that no speech_final / from_finalize ended

    def opening(self) -> list[str]:
        return []

    def audio(self, chunk: bytes) -> bytes:
        return chunk

    def keepalive(self) -> str:
        return _KEEPALIVE

    def finalize(self, unsent: bool) -> Finalizing:
        return Finalizing(json.dumps({"type": "Finalize"}), settled=False)

    def close_input(self) -> str:
        return _CLOSE

    def owes_words(self) -> bool:
        # Speech Deepgram heard and did not end (speech_final, from_finalize) may still have
        # words no interim showed yet; after its end, a Finalize may go unanswered.
        return self._interim or self._speaking

    def parse(self, message: str | bytes) -> list[SttStreamEvent]:
        body = parse_json(self.provider, message)
        kind = body.get("type")
        try:
            if kind == "Results":
                return self._results(body)
            if kind == "SpeechStarted":
                self._speaking = True
                return [TurnHint(TurnHintKind.SPEECH_STARTED, float(body["timestamp"]))]
            if kind == "UtteranceEnd":
                return [TurnHint(TurnHintKind.END_OF_TURN, float(body["last_word_end"]))]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise payload_error(self.provider, f"{kind}: {type(exc).__name__} {exc}") from exc
        if kind == "Error":
            raise _fatal(self.provider, body)
        return []  # Metadata, and kinds added after this was written

    def _results(self, body: dict[str, Any]) -> list[SttStreamEvent]:
        best = body["channel"]["alternatives"][0]
        text, words = str(best["transcript"]), _words(self.provider, best.get("words", []))
        end = float(body["start"]) + float(body["duration"])
        if not body.get("is_final"):
            self._interim = bool(text)
            self._speaking = self._speaking or bool(text)
            return [InterimWords(text, words)] if text else []
        self._interim = False
        if body.get("speech_final") or body.get("from_finalize"):
            self._speaking = False
        last = words[-1].confidence if words else None
        events: list[SttStreamEvent] = [
            FinalWords(text, words, last, audio_end=end, flushed=bool(body.get("from_finalize")))
        ]
        if body.get("speech_final") and text:
            events.append(TurnHint(TurnHintKind.END_OF_TURN, end))
        return events


class FluxWire:
    """``/v2/listen``: see the module docstring. Flux takes no ``KeepAlive``: the gateway
    pushes the line's audio continuously (silence included), which is what Flux wants."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._in_turn = False
        self._forced = False

    def opening(self) -> list[str]:
        return []

    def audio(self, chunk: bytes) -> bytes:
        return chunk

    def keepalive(self) -> None:
        return None

    def finalize(self, unsent: bool) -> Finalizing:
        if not self._in_turn and not unsent:
            return Finalizing(None, settled=True)
        self._forced = True
        return Finalizing(json.dumps({"type": "ForceEndTurn"}), settled=False)

    def close_input(self) -> str:
        return _CLOSE

    def owes_words(self) -> bool:
        return self._in_turn

    def parse(self, message: str | bytes) -> list[SttStreamEvent]:
        body = parse_json(self.provider, message)
        kind = body.get("type")
        if kind == "TurnInfo":
            try:
                return self._turn_info(body)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                detail = f"TurnInfo: {type(exc).__name__} {exc}"
                raise payload_error(self.provider, detail) from exc
        if kind == "Error":
            raise _fatal(self.provider, body)
        return []  # Connected, ConfigureSuccess / ConfigureFailure, later kinds

    def _turn_info(self, body: dict[str, Any]) -> list[SttStreamEvent]:
        event = body["event"]
        text, words = str(body.get("transcript", "")), _words(self.provider, body["words"])
        end = float(body["audio_window_end"])
        confidence = _number(body.get("end_of_turn_confidence"))
        interim: list[SttStreamEvent] = [InterimWords(text, words)] if text else []
        if event == "Update":
            return interim
        if event == "StartOfTurn":
            self._in_turn = True
            at = words[0].start if words else float(body["audio_window_start"])
            return [TurnHint(TurnHintKind.SPEECH_STARTED, at), *interim]
        if event == "EagerEndOfTurn":
            return [*interim, TurnHint(TurnHintKind.EAGER_END_OF_TURN, end, confidence)]
        if event == "TurnResumed":
            return [TurnHint(TurnHintKind.TURN_RESUMED, end, confidence), *interim]
        if event == "EndOfTurn":
            self._in_turn, forced, self._forced = False, self._forced, False
            last = words[-1].confidence if words else None
            final = FinalWords(text, words, last, audio_end=end, flushed=forced)
            return [final, TurnHint(TurnHintKind.END_OF_TURN, end, confidence)]
        return []
