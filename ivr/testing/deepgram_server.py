"""A local stand-in for Deepgram's streaming STT, speaking its wire protocol: ``/v1/listen``
(Nova: ``Results`` interim and final with ``speech_final`` and ``from_finalize``,
``SpeechStarted``, ``UtteranceEnd``, ``Metadata``; ``KeepAlive``, ``Finalize``,
``CloseStream``) and ``/v2/listen`` (Flux: ``Connected``, ``TurnInfo`` with ``Update``,
``StartOfTurn``, ``EagerEndOfTurn``, ``TurnResumed``, ``EndOfTurn``; ``ForceEndTurn``,
``CloseStream``). Raw mu-law in; ``Authorization: Token <key>`` checked at the handshake (401
with ``err_code``/``err_msg`` otherwise); a socket without audio or a message for
``idle_close`` seconds is closed ``1011 NET-0001`` as Deepgram does. What it hears is
scripted (``ivr.testing.stt_script``); faults as ``ivr.testing.ws_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from websockets.datastructures import Headers

from ivr.testing.stt_script import Segment, SpeechTracker, SttScript, Word
from ivr.testing.ws_server import FakeWsServer, FaultyLink, JsonDict, WsFault, later


class FakeDeepgramServer(FakeWsServer):
    """Attributes a test may set: ``script``, ``faults``, ``idle_close``, ``api_key``."""

    name = "deepgram"

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        super().__init__(api_key=api_key, host=host, port=port)
        self.script = SttScript()
        self.idle_close = 10.0
        """Seconds without audio or a message before the server gives up (NET-0001)."""
        self.eager_delay = 0.05
        """Flux: wall seconds from the end of speech to ``EagerEndOfTurn`` (when asked for)."""
        self.eager_silence: float | None = None
        """Flux: audio seconds of silence inside a stretch of speech after which
        ``EagerEndOfTurn`` goes out at once, and ``TurnResumed`` if the caller goes on (None:
        the eager end only comes ``eager_delay`` after the stretch ends)."""
        self.finalize_silent = False
        """Nova: a ``Finalize`` while no speech is held gets no answer at all (Deepgram answers
        it "typically when there is a noticeable amount of audio buffered")."""

    def auth_ok(self, headers: Headers, query: dict[str, str]) -> bool:
        return self.api_key is None or headers.get("Authorization") == f"Token {self.api_key}"

    def refusal_body(self, status: int) -> JsonDict:
        if status == 401:
            code, message = "INVALID_AUTH", "Invalid credentials."
        else:
            code, message = "INJECTED", f"Injected fault: HTTP {status}"
        return {"err_code": code, "err_msg": message, "request_id": str(uuid.uuid4())}

    def error_message(self, fault: WsFault) -> str:
        return json.dumps(
            {"type": "Error", "code": fault.reason or "INTERNAL", "description": "Injected fault"}
        )

    async def serve_connection(self, link: FaultyLink) -> None:
        flux = link.record.path == "/v2/listen"
        if link.record.query.get("encoding") != "mulaw":
            await link.ws.close(1008, "DATA-0000: this fake takes encoding=mulaw only")
            return
        session = (_Flux if flux else _Nova)(self, link)
        await session.run()


class _Listen:
    """One connection: audio in, scripted results out."""

    def __init__(self, server: FakeDeepgramServer, link: FaultyLink) -> None:
        self.server = server
        self.link = link
        self.tracker = SpeechTracker(server.script)
        self.tasks: set[asyncio.Task[None]] = set()
        self.request_id = str(uuid.uuid4())

    async def run(self) -> None:
        await self.opened()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.server.idle_close):
                        message = await self.link.ws.recv()
                except TimeoutError:
                    reason = "NET-0001: no audio or message within the timeout window"
                    await self.link.ws.close(1011, reason)
                    return
                self.link.record.received.append(message)
                if isinstance(message, bytes):
                    await self.heard(message)
                elif await self.control(json.loads(message)):
                    return
        finally:
            for task in self.tasks:
                task.cancel()

    async def heard(self, audio: bytes) -> None:
        for what, segment in self.tracker.feed(audio):
            if what == "start":
                await self.started(segment)
            elif what == "interim":
                await self.interim(segment)
            else:
                lag = self.tracker.clock - segment.voiced_end  # ~ wall time since it ended
                await self.ended(segment, self.server.script.final_delay - lag)

    async def close_stream(self) -> None:
        """Everything heard goes out (now, not at its scripted time) before the close."""
        if (segment := self.tracker.cut()) is not None:
            await self.ended(segment, 0.0)
        while self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await next(iter(self.tasks))

    async def opened(self) -> None: ...
    async def started(self, segment: Segment) -> None: ...
    async def interim(self, segment: Segment) -> None: ...
    async def ended(self, segment: Segment, delay: float) -> None: ...
    async def control(self, body: JsonDict) -> bool:
        """Handle a JSON message; True when the connection is done."""
        raise NotImplementedError


def _nova_words(words: list[Word]) -> list[JsonDict]:
    return [
        {"word": w.text.lower().strip(".,?!"), "start": w.start, "end": w.end,
         "confidence": 0.98, "punctuated_word": w.text}
        for w in words
    ]  # fmt: skip


class _Nova(_Listen):
    async def started(self, segment: Segment) -> None:
        if self.link.record.query.get("vad_events") == "true":
            await self.link.send_json(
                {"type": "SpeechStarted", "channel": [0], "timestamp": segment.start}
            )

    async def interim(self, segment: Segment) -> None:
        if self.link.record.query.get("interim_results") == "true":
            words = segment.words_by(self.tracker.clock, self.server.script.word_seconds)
            await self.link.send_json(self.results(segment, words, final=False))

    async def ended(self, segment: Segment, delay: float, *, finalize: bool = False) -> None:
        async def send() -> None:
            words = segment.all_words(self.server.script.word_tail)
            body = self.results(segment, words, final=True)
            body["from_finalize"] = finalize
            await self.link.send_json(body)
            if "utterance_end_ms" in self.link.record.query and segment.text:
                last = segment.voiced_end - self.server.script.word_tail
                await self.link.send_json(
                    {"type": "UtteranceEnd", "channel": [0, 1], "last_word_end": last}
                )

        later(self.tasks, delay, send)

    def results(self, segment: Segment, words: list[Word], *, final: bool) -> JsonDict:
        end = segment.voiced_end if final else self.tracker.clock
        transcript = " ".join(w.text for w in words)
        return {
            "type": "Results", "channel_index": [0, 1], "start": segment.start,
            "duration": round(end - segment.start, 3), "is_final": final,
            "speech_final": final, "from_finalize": False,
            "channel": {"alternatives": [
                {"transcript": transcript, "confidence": 0.98, "words": _nova_words(words)}
            ]},
            "metadata": {"request_id": self.request_id, "model_info": {"name": "fake-nova"}},
        }  # fmt: skip

    async def control(self, body: JsonDict) -> bool:
        kind = body.get("type")
        if kind == "Finalize":
            segment = self.tracker.cut()
            if segment is None and self.server.finalize_silent:
                return False
            segment = segment or Segment("", self.tracker.clock, self.tracker.clock)
            await self.ended(segment, 0.0, finalize=True)
        elif kind == "CloseStream":
            await self.close_stream()
            await self.link.send_json(
                {"type": "Metadata", "request_id": self.request_id, "duration": self.tracker.clock}
            )
            await self.link.ws.close(1000)
            return True
        return False  # KeepAlive: recorded, nothing to answer


class _Flux(_Listen):
    async def opened(self) -> None:
        await self.link.send_json(
            {"type": "Connected", "request_id": self.request_id, "sequence_id": 0}
        )
        self.turn_index = 0
        self.sequence = 0
        self.eager_at: float | None = None
        """Audio time of the voiced end an ``EagerEndOfTurn`` was sent for, in this turn."""

    async def heard(self, audio: bytes) -> None:
        await super().heard(audio)
        segment = self.tracker.segment
        limit = self.server.eager_silence
        if segment is None or limit is None or "eager_eot_threshold" not in self.link.record.query:
            return
        words = segment.words_by(self.tracker.clock, self.server.script.word_seconds)
        if self.eager_at is None and self.tracker.clock - segment.voiced_end >= limit:
            self.eager_at = segment.voiced_end
            await self.turn_info("EagerEndOfTurn", segment, words, 0.6)
        elif self.eager_at is not None and segment.voiced_end > self.eager_at:
            self.eager_at = None  # the caller went on after the eager end
            await self.turn_info("TurnResumed", segment, words, 0.2)

    async def turn_info(self, event: str, segment: Segment, words: list[Word], eot: float) -> None:
        self.sequence += 1
        end = segment.voiced_end if event in ("EndOfTurn", "EagerEndOfTurn") else self.tracker.clock
        await self.link.send_json({
            "type": "TurnInfo", "request_id": self.request_id, "sequence_id": self.sequence,
            "event": event, "turn_index": self.turn_index, "audio_window_start": segment.start,
            "audio_window_end": round(end, 3), "transcript": " ".join(w.text for w in words),
            "words": [{"word": w.text, "confidence": 0.97, "start": w.start, "end": w.end}
                      for w in words],
            "end_of_turn_confidence": eot,
        })  # fmt: skip
        if event == "EndOfTurn":
            self.turn_index += 1

    async def started(self, segment: Segment) -> None:
        await self.turn_info("StartOfTurn", segment, [], 0.01)

    async def interim(self, segment: Segment) -> None:
        words = segment.words_by(self.tracker.clock, self.server.script.word_seconds)
        await self.turn_info("Update", segment, words, 0.05)

    async def ended(self, segment: Segment, delay: float) -> None:
        words = segment.all_words()
        eager_sent, self.eager_at = self.eager_at is not None, None
        if "eager_eot_threshold" in self.link.record.query and words and not eager_sent:
            eager = self.server.eager_delay - (self.server.script.final_delay - delay)

            async def eager_end() -> None:
                await self.turn_info("EagerEndOfTurn", segment, words, 0.6)

            later(self.tasks, eager, eager_end)

        async def end() -> None:
            await self.turn_info("EndOfTurn", segment, words, 0.9)

        later(self.tasks, delay, end)

    async def control(self, body: JsonDict) -> bool:
        kind = body.get("type")
        if kind == "ForceEndTurn" and (segment := self.tracker.cut()) is not None:
            await self.ended(segment, 0.0)
        elif kind == "CloseStream":
            await self.close_stream()
            await self.link.ws.close(1000)
            return True
        return False
