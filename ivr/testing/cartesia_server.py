"""A local stand-in for Cartesia's TTS WebSocket (``/tts/websocket``), speaking its protocol:
generation requests with ``context_id``, ``continue`` (continuations of one context) and
``cancel``; ``chunk`` (base64 audio, ``pcm_mulaw`` at 8000 Hz only), ``timestamps``
(``word_timestamps``, seconds from the context's first audio), ``done`` and ``error``
(``status_code``, ``title``, ``message``, ``error_code``) messages; many contexts at once on
one socket. ``X-API-Key`` and ``Cartesia-Version`` checked at the handshake. What it says
follows ``ivr.testing.tts_script``; faults as ``ivr.testing.ws_server``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from websockets.datastructures import Headers

from ivr.testing.tts_script import Speaker, TtsScript
from ivr.testing.ws_server import FakeWsServer, FaultyLink, JsonDict, WsFault

_REQUIRED = ("model_id", "voice", "output_format", "transcript", "context_id")


class FakeCartesiaServer(FakeWsServer):
    """Attributes a test may set: ``script``, ``faults``, ``api_key``."""

    name = "cartesia"

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(api_key=api_key, host=host, port=port)
        self.script = TtsScript()
        self.cancelled: list[str] = []
        """Context ids cancelled by the client."""

    def auth_ok(self, headers: Headers, query: dict[str, str]) -> bool:
        key = headers.get("X-API-Key") or query.get("api_key")
        version = headers.get("Cartesia-Version") or query.get("cartesia_version")
        return bool(version) and (self.api_key is None or key == self.api_key)

    def refusal_body(self, status: int) -> JsonDict:
        return {"error": "Invalid API key" if status == 401 else f"Injected fault: HTTP {status}"}

    def error_message(self, fault: WsFault) -> str:
        return json.dumps(_error("", 500, "Internal error", fault.reason or "Injected fault"))

    async def serve_connection(self, link: FaultyLink) -> None:
        contexts: dict[str, _Context] = {}
        try:
            async for message in link.ws:
                link.record.received.append(message)
                request = json.loads(message)
                context_id = str(request.get("context_id", ""))
                if request.get("cancel"):
                    if (context := contexts.pop(context_id, None)) is not None:
                        context.task.cancel()
                    self.cancelled.append(context_id)
                    continue
                if (problem := _problem(request)) is not None:
                    await link.send_json(_error(context_id, 400, "Invalid request", problem))
                    continue
                context = contexts.get(context_id)
                if context is None or context.task.done():
                    context = contexts[context_id] = _Context(self, link, context_id)
                context.texts.put_nowait((request["transcript"], not request.get("continue")))
        finally:
            for context in contexts.values():
                context.task.cancel()


def _problem(request: dict[str, Any]) -> str | None:
    if missing := [k for k in _REQUIRED if k not in request]:
        return f"missing {', '.join(missing)}"
    fmt = request["output_format"]
    if fmt.get("encoding") != "pcm_mulaw" or fmt.get("sample_rate") != 8000:
        return f"this fake speaks pcm_mulaw at 8000 Hz only, not {fmt}"
    return None


def _error(context_id: str, status: int, title: str, message: str) -> JsonDict:
    return {
        "type": "error", "done": True, "status_code": status, "title": title,
        "message": message, "error_code": "injected" if status >= 500 else "invalid_request",
        "context_id": context_id,
    }  # fmt: skip


class _Context:
    """One context: text pieces in order, audio out as they come."""

    def __init__(self, server: FakeCartesiaServer, link: FaultyLink, context_id: str) -> None:
        self.link = link
        self.context_id = context_id
        self.speaker = Speaker(server.script)
        self.texts: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self.task = asyncio.create_task(self._speak())

    def _message(self, kind: str, **fields: Any) -> JsonDict:
        done = kind == "done"
        return {
            "type": kind,
            "done": done,
            "status_code": 206,
            "context_id": self.context_id,
            **fields,
        }

    async def _speak(self) -> None:
        loop = asyncio.get_running_loop()
        texted_at = None
        while True:
            text, final = await self.texts.get()
            texted_at = texted_at or loop.time()
            audio, words = self.speaker.add(text, final=final)
            if words:
                stamps = {
                    "words": [w.text for w in words],
                    "start": [w.start for w in words],
                    "end": [w.end for w in words],
                }
                await self.speaker.pace(b"", texted_at)
                await self.link.send_json(self._message("timestamps", word_timestamps=stamps))
            for chunk in self.speaker.chunks(audio):
                await self.speaker.pace(chunk, texted_at)
                data = base64.b64encode(chunk).decode()
                await self.link.send_json(self._message("chunk", data=data, step_time=12.5))
            if final:
                await self.link.send_json(self._message("done"))
                return
