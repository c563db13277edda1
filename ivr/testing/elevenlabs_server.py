"""A local stand-in for ElevenLabs' stream-input WebSocket
(``/v1/text-to-speech/{voice_id}/stream-input``), speaking its protocol: the BOS message
(``text: " "``, ``voice_settings``, ``generation_config``), text messages (``flush``,
``try_trigger_generation``), EOS (``text: ""``); ``{"audio", "isFinal", "alignment",
"normalizedAlignment"}`` messages (``ulaw_8000`` only; character times in ms from that
message's first audio), then ``{"isFinal": true}`` and a normal close. A bad ``xi-api-key`` is
accepted at the handshake, then answered with an error message and a 1008 close, as ElevenLabs
does. What it says follows ``ivr.testing.tts_script``; faults as ``ivr.testing.ws_server``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from websockets.datastructures import Headers

from ivr.testing.tts_script import Speaker, SpokenWord, TtsScript
from ivr.testing.ws_server import FakeWsServer, FaultyLink, JsonDict, WsFault


class FakeElevenLabsServer(FakeWsServer):
    """Attributes a test may set: ``script``, ``faults``, ``api_key``."""

    name = "elevenlabs"

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(api_key=api_key, host=host, port=port)
        self.script = TtsScript()

    def auth_ok(self, headers: Headers, query: dict[str, str]) -> bool:
        return True  # checked after the handshake, as ElevenLabs does

    def error_message(self, fault: WsFault) -> str:
        return json.dumps({"message": fault.reason or "Injected fault", "error": "injected"})

    async def serve_connection(self, link: FaultyLink) -> None:
        record = link.record
        key = record.headers.get("xi-api-key")
        if self.api_key is not None and key != self.api_key:
            refusal = {"message": "Invalid API key", "error": "invalid_api_key", "code": 1008}
            await link.ws.send(json.dumps(refusal))
            await link.ws.close(1008, "Invalid API key")
            return
        if record.query.get("output_format") != "ulaw_8000":
            await link.ws.close(1008, "this fake speaks ulaw_8000 only")
            return
        first = json.loads(await link.ws.recv())
        record.received.append(json.dumps(first))
        if first.get("text") != " ":
            await link.ws.close(1008, 'the first message must be {"text": " ", ...}')
            return
        await _Generation(self.script, link).run()


class _Generation:
    def __init__(self, script: TtsScript, link: FaultyLink) -> None:
        self.link = link
        self.speaker = Speaker(script)
        self.texts: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()

    async def run(self) -> None:
        speaking = asyncio.create_task(self._speak())
        try:
            async for message in self.link.ws:
                self.link.record.received.append(message)
                text = str(json.loads(message).get("text", ""))
                self.texts.put_nowait((text, text == ""))
                if text == "":
                    await speaking  # EOS: the rest of the audio, then the close
        finally:
            speaking.cancel()

    async def _speak(self) -> None:
        loop = asyncio.get_running_loop()
        texted_at = None
        while True:
            text, final = await self.texts.get()
            texted_at = texted_at or loop.time()
            base = self.speaker.seconds  # where this text's audio starts
            audio, words = self.speaker.add(text, final=final)
            for chunk in self.speaker.chunks(audio):
                start, end = base, base + len(chunk) / 8000
                base = end
                await self.speaker.pace(chunk, texted_at)
                alignment = _alignment([w for w in words if start <= w.start < end], start)
                body: dict[str, Any] = {"audio": base64.b64encode(chunk).decode(), "isFinal": None}
                body["alignment"] = body["normalizedAlignment"] = alignment
                await self.link.send_json(body)
            if final:
                await self.link.send_json({"isFinal": True})
                await self.link.ws.close(1000)
                return


def _alignment(words: list[SpokenWord], chunk_start: float) -> JsonDict | None:
    """Character times (ms from the chunk's first audio) for the words starting in it."""
    if not words:
        return None
    chars, starts, durations = [], [], []
    for word in words:
        step = (word.end - word.start) / len(word.text)
        for i, char in enumerate(word.text + " "):
            chars.append(char)
            starts.append(round((word.start + i * step - chunk_start) * 1000))
            durations.append(round(step * 1000))
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations}
