"""A local stand-in for OpenAI's Realtime API as a transcription session
(``/v1/realtime?intent=transcription``), speaking its events: ``session.created``, the
``session.update`` answered with ``session.updated`` (the GA shape, ``audio/pcmu``; the beta
``transcription_session.update`` with ``input_audio_format: g711_ulaw`` is accepted too),
``input_audio_buffer.append`` / ``commit``, the server VAD's ``speech_started`` /
``speech_stopped`` / ``committed``, and the words as
``conversation.item.input_audio_transcription.delta`` then ``.completed`` (with ``logprobs``);
``error`` events for what it cannot take (a commit of an empty buffer:
``input_audio_buffer_commit_empty``, a format other than mu-law). ``Authorization: Bearer``
checked at the handshake. What it hears is scripted (``ivr.testing.stt_script``); faults as
``ivr.testing.ws_server``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import uuid
from dataclasses import replace
from typing import Any

from websockets.datastructures import Headers

from ivr.testing.stt_script import Segment, SpeechTracker, SttScript
from ivr.testing.ws_server import FakeWsServer, FaultyLink, JsonDict, WsFault, later


class FakeOpenAIRealtimeServer(FakeWsServer):
    """Attributes a test may set: ``script``, ``faults``, ``api_key``."""

    name = "openai-realtime"

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(api_key=api_key, host=host, port=port)
        self.script = SttScript()

    def auth_ok(self, headers: Headers, query: dict[str, str]) -> bool:
        return self.api_key is None or headers.get("Authorization") == f"Bearer {self.api_key}"

    def refusal_body(self, status: int) -> JsonDict:
        if status == 401:
            message, code = "Incorrect API key provided.", "invalid_api_key"
        else:
            message, code = f"Injected fault: HTTP {status}", "injected"
        return {"error": {"message": message, "type": "invalid_request_error", "code": code}}

    def error_message(self, fault: WsFault) -> str:
        return json.dumps(_error("server_error", fault.reason or "server_error", "Injected fault"))

    async def serve_connection(self, link: FaultyLink) -> None:
        await _Transcription(self, link).run()


def _error(kind: str, code: str, message: str) -> JsonDict:
    return {
        "type": "error", "event_id": f"event_{uuid.uuid4().hex[:12]}",
        "error": {"type": kind, "code": code, "message": message, "param": None, "event_id": None},
    }  # fmt: skip


class _Transcription:
    def __init__(self, server: FakeOpenAIRealtimeServer, link: FaultyLink) -> None:
        self.server = server
        self.link = link
        self.tracker = SpeechTracker(server.script)
        self.tasks: set[asyncio.Task[None]] = set()
        self.items = 0
        self.configured = False

    async def run(self) -> None:
        send = self.link.send_json
        if self.link.record.query.get("intent") != "transcription":
            await send(_error("invalid_request_error", "bad_intent", "intent=transcription only"))
            await self.link.ws.close(1008, "intent")
            return
        await send({"type": "session.created", "session": {"type": "transcription"}})
        try:
            async for message in self.link.ws:
                self.link.record.received.append(message)
                body = json.loads(message)
                await self.event(str(body.get("type")), body)
        finally:
            for task in self.tasks:
                task.cancel()

    async def event(self, kind: str, body: JsonDict) -> None:
        if kind in ("session.update", "transcription_session.update"):
            await self.configure(kind, body.get("session") or {})
        elif kind == "input_audio_buffer.append":
            try:
                audio = base64.b64decode(body["audio"], validate=True)
            except (KeyError, binascii.Error):
                await self.link.send_json(_error("invalid_request_error", "bad_audio", "base64"))
                return
            await self.heard(audio)
        elif kind == "input_audio_buffer.commit":
            segment = self.tracker.cut()
            if segment is None:
                message = "Error committing input audio buffer: buffer is empty."
                await self.link.send_json(
                    _error("invalid_request_error", "input_audio_buffer_commit_empty", message)
                )
            else:
                await self.commit(segment)

    async def configure(self, kind: str, session: dict[str, Any]) -> None:
        if kind == "session.update":
            audio_in = (session.get("audio") or {}).get("input") or {}
            fmt = (audio_in.get("format") or {}).get("type")
            vad = audio_in.get("turn_detection") or {}
        else:
            fmt = {"g711_ulaw": "audio/pcmu"}.get(session.get("input_audio_format", ""), "?")
            vad = session.get("turn_detection") or {}
        if fmt != "audio/pcmu":
            message = f"this fake takes audio/pcmu (g711_ulaw) only, not {fmt}"
            await self.link.send_json(_error("invalid_request_error", "invalid_value", message))
            return
        if "silence_duration_ms" in vad:
            self.tracker.script = _with_silence(self.server.script, vad["silence_duration_ms"])
        self.configured = True
        answer = "session.updated" if kind == "session.update" else "transcription_session.updated"
        await self.link.send_json({"type": answer, "session": session})

    async def heard(self, audio: bytes) -> None:
        for what, segment in self.tracker.feed(audio):
            if what == "start":
                await self.link.send_json({
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": int(segment.start * 1000), "item_id": self.item_id(1),
                })  # fmt: skip
            elif what == "end":
                await self.link.send_json({
                    "type": "input_audio_buffer.speech_stopped",
                    "audio_end_ms": int(segment.voiced_end * 1000), "item_id": self.item_id(1),
                })  # fmt: skip
                await self.commit(segment)

    def item_id(self, ahead: int = 0) -> str:
        return f"item_{self.items + ahead:04d}"

    async def commit(self, segment: Segment) -> None:
        self.items += 1
        item = self.item_id()
        await self.link.send_json(
            {"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": None}
        )
        lag = self.tracker.clock - segment.voiced_end

        async def transcribe() -> None:
            words = segment.text.split()
            for index, word in enumerate(words):
                delta = word if index == 0 else " " + word
                await self.link.send_json({
                    "type": "conversation.item.input_audio_transcription.delta",
                    "item_id": item, "content_index": 0, "delta": delta,
                })  # fmt: skip
            await self.link.send_json({
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": item, "content_index": 0, "transcript": segment.text,
                "logprobs": [{"token": (" " if i else "") + w, "logprob": -0.05, "bytes": []}
                             for i, w in enumerate(words)],
                "usage": {"type": "duration", "seconds": round(segment.voiced_end, 2)},
            })  # fmt: skip

        later(self.tasks, self.server.script.final_delay - lag, transcribe)


def _with_silence(script: SttScript, silence_ms: int) -> SttScript:
    return replace(script, end_silence=silence_ms / 1000)
