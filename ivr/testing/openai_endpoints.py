"""The endpoints of ``ivr.testing.openai_server``: each request recorded, checked (key, holds,
injected faults), then answered in OpenAI's wire format, in pieces and broken where a fault says.

The handlers read what a test scripted from the server itself (``Scripted``), at each request,
so a test may change it at any time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ivr.audio.wav import wav_to_pcm16
from ivr.testing.hold import Hold
from ivr.testing.openai_wire import (
    ChatScript,
    ChunkMaker,
    Fault,
    JsonDict,
    RecordedRequest,
    check_json_mode,
    completion_for,
    openai_error,
    script_tokens,
    split_tokens,
    tool_call_deltas,
    unsupported_field,
    usage_for,
)

T = TypeVar("T")
JSON_CHUNK_BYTES = 8
"""A JSON answer broken by ``Fault.after_chunks`` goes out in pieces of this size."""

_CLIENT_LEFT = 499
"""nginx's "client closed request": recorded, never sent (the client is gone)."""


@dataclass(slots=True)
class Connection:
    transport: asyncio.Transport
    closed: asyncio.Event = field(default_factory=asyncio.Event)


class Scripted(Protocol):
    """What the handlers read from the server a test scripts (``FakeOpenAIServer``)."""

    api_key: str | None
    requests: list[RecordedRequest]
    holds: dict[str, Hold]
    chat_fields: frozenset[str] | None
    transcribe: Callable[[bytes, dict[str, str]], str]
    speak: Callable[[str], bytes]
    speech_chunk_bytes: int
    speech_chunk_delay: float

    def next_chat_script(self, request: JsonDict) -> ChatScript | str: ...

    def take_fault(self, endpoint: str) -> Fault | None: ...


class OpenAIEndpoints:
    """``/v1/models``, ``/v1/chat/completions``, ``/v1/audio/transcriptions``,
    ``/v1/audio/speech``, answered from what ``server`` scripts."""

    def __init__(self, server: Scripted, connections: dict[tuple[str, int], Connection]) -> None:
        self.server = server
        self.connections = connections
        """Open connections by client address (to reset one); touched only on the server's loop."""
        self.stopping: asyncio.Event | None = None
        """Set when the server stops: releases handlers that hang or wait on purpose."""

    def _record(self, endpoint: str, request: Request) -> RecordedRequest:
        rec = RecordedRequest(
            endpoint=endpoint,
            path=request.url.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            time=time.monotonic(),
            method=request.method,
            peer=(request.client.host, request.client.port) if request.client else None,
        )
        self.server.requests.append(rec)
        return rec

    async def _hang(self) -> None:
        assert self.stopping is not None
        await self.stopping.wait()

    async def _sleep(self, seconds: float) -> None:
        """A scripted delay that ends early when the server stops. Even a zero delay yields to
        the loop, so a client that left is noticed before more chunks are written."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        assert self.stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _precheck(
        self, endpoint: str, request: Request, rec: RecordedRequest
    ) -> Response | None:
        """Auth, then any injected fault; a response here ends the request. A fault that breaks
        the answer midway (``after_chunks``) is left on ``rec`` for the handler."""
        if self.server.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.server.api_key}":
                shown = auth.removeprefix("Bearer ")[:6] or "(none)"
                message = f"Incorrect API key provided: {shown}***."
                return openai_error(401, message, code="invalid_api_key")
        if (hold := self.server.holds.get(endpoint)) is not None:
            assert self.stopping is not None
            await hold.wait(self.stopping)
        fault = rec.fault = self.server.take_fault(endpoint)
        if fault is None:
            return None
        await self._sleep(fault.delay)
        if fault.drop:
            await self._reset(request)
            return Response(status_code=500)  # never sent: the connection is gone
        if fault.hang:
            await self._hang()
            return openai_error(503, "FakeOpenAIServer is shutting down")
        if fault.status is not None:
            if fault.body is not None:
                return JSONResponse(fault.body, status_code=fault.status, headers=fault.headers)
            message = f"Injected fault: HTTP {fault.status}"
            return openai_error(fault.status, message, headers=fault.headers)
        if fault.raw is not None:
            return Response(fault.raw, headers=fault.headers, media_type=fault.content_type)
        return None

    async def _reset(self, request: Request) -> None:
        """Abort the request's TCP connection with an RST (SO_LINGER 0), as a crashed server or
        proxy does, and wait until uvicorn has seen it go."""
        client = request.scope.get("client")
        conn = self.connections.get(tuple(client)) if client else None
        if conn is None:
            raise RuntimeError(f"FakeOpenAIServer: no open connection from {client}")
        sock = conn.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.transport.abort()
        await conn.closed.wait()

    async def _broken(
        self, request: Request, rec: RecordedRequest, chunks: AsyncGenerator[T, None]
    ) -> AsyncIterator[T]:
        """``chunks``, cut after ``rec.fault.after_chunks`` by a reset or a stall."""
        fault = rec.fault
        limit = fault.after_chunks if fault is not None else None
        async with contextlib.aclosing(chunks) as source:
            sent = 0
            async for chunk in source:
                if sent == limit:
                    break
                yield chunk
                sent += 1
        if fault is None or limit is None:
            return
        # Chunks already written sit in the client's receive queue: it reads them before the RST.
        if fault.then == "reset":
            await self._reset(request)
        else:
            await self._hang()

    def _answer(self, request: Request, rec: RecordedRequest, response: Response) -> Response:
        """A complete JSON answer, sent in pieces and broken when ``rec.fault`` says so."""
        fault = rec.fault
        if fault is None or fault.after_chunks is None or response.status_code >= 400:
            return self._finish(rec, response)
        body = bytes(response.body)
        pieces = [body[i : i + JSON_CHUNK_BYTES] for i in range(0, len(body), JSON_CHUNK_BYTES)]

        async def send() -> AsyncGenerator[bytes, None]:
            try:
                for piece in pieces:
                    yield piece
            finally:
                rec.outcome = "disconnected"
                rec.finish()

        stream = self._broken(request, rec, send())
        return StreamingResponse(stream, response.status_code, media_type=response.media_type)

    @staticmethod
    def _finish(rec: RecordedRequest, response: Response, outcome: str = "completed") -> Response:
        if response.status_code == _CLIENT_LEFT:
            outcome = "disconnected"
        elif response.status_code >= 400:
            outcome = "error"
        rec.outcome = outcome
        rec.finish()
        return response

    # ---- GET /v1/models --------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        rec = self._record("models", request)
        if (early := await self._precheck("models", request, rec)) is not None:
            return self._finish(rec, early)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "fake"}
            for m in ("gemma-4-31b", "google/gemma-4-31B-it:cerebras", "whisper-1", "tts-1")
        ]
        return self._finish(rec, JSONResponse({"object": "list", "data": data}))

    async def _read_json(
        self, rec: RecordedRequest, endpoint: str, request: Request
    ) -> Response | None:
        """Parse the JSON body into ``rec``; an error response if it is not JSON or a fault hits."""
        try:
            rec.json = await request.json()
        except ValueError as exc:
            return openai_error(400, f"Request body is not JSON: {exc}")
        except ClientDisconnect:  # the client cancelled while sending (a dropped speculation)
            return Response(status_code=_CLIENT_LEFT)
        return await self._precheck(endpoint, request, rec)

    # ---- POST /v1/chat/completions ---------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        rec = self._record("chat", request)
        if (early := await self._read_json(rec, "chat", request)) is not None:
            return self._finish(rec, early)
        body = rec.json or {}
        if self.server.chat_fields is not None and (
            unknown := sorted(set(body) - self.server.chat_fields)
        ):
            return self._finish(rec, unsupported_field(unknown[0]))
        if not isinstance(body.get("messages"), list) or not body.get("model"):
            return self._finish(rec, openai_error(400, "'model' and 'messages' are required"))
        script = await asyncio.to_thread(self.server.next_chat_script, body)
        if isinstance(script, str):
            return self._finish(rec, openai_error(500, script))
        if (problem := check_json_mode(body, script)) is not None:
            return self._finish(rec, openai_error(500, problem))
        if script.status is not None:
            if script.error_body is not None:
                return self._finish(rec, JSONResponse(script.error_body, script.status))
            return self._finish(rec, openai_error(script.status, f"Scripted HTTP {script.status}"))
        if body.get("stream"):
            stream = self._broken(request, rec, self._chat_stream(body, script, rec))
            return StreamingResponse(stream, media_type="text/event-stream")
        await self._sleep(script.first_token_delay)
        if script.hang:
            await self._hang()
        return self._answer(request, rec, JSONResponse(completion_for(body, script)))

    async def _chat_stream(
        self, body: JsonDict, script: ChatScript, rec: RecordedRequest
    ) -> AsyncGenerator[str, None]:
        chunks = ChunkMaker(body)
        try:
            await self._sleep(script.first_token_delay)
            if script.hang:
                await self._hang()
            yield chunks.sse({"role": "assistant", "content": "", "refusal": None})
            for token in split_tokens(script.reasoning):
                yield chunks.sse({"reasoning": token})
            for i, token in enumerate(script_tokens(script)):
                if i:
                    await self._sleep(script.token_delay)
                yield chunks.sse({"content": token})
            for index, call in enumerate(script.tool_calls):
                for delta in tool_call_deltas(index, call):
                    await self._sleep(script.token_delay)
                    yield chunks.sse({"tool_calls": [delta]})
            finish = "tool_calls" if script.tool_calls else script.finish_reason
            yield chunks.sse({}, finish)
            if chunks.include_usage:
                yield chunks.usage_sse(usage_for(body, script))
            yield "data: [DONE]\n\n"
            rec.outcome = "completed"
        except BaseException:  # the client left: Starlette cancels the stream
            rec.outcome = "disconnected"
            raise
        finally:
            rec.finish()

    # ---- POST /v1/audio/transcriptions -----------------------------------------------

    async def transcriptions(self, request: Request) -> Response:
        rec = self._record("transcriptions", request)
        try:
            async with request.form() as form:
                rec.form = {k: v for k, v in form.items() if isinstance(v, str)}
                upload = form.get("file")
                if isinstance(upload, UploadFile):
                    rec.files["file"] = await upload.read()
                    rec.form["file.filename"] = upload.filename or ""
        except ClientDisconnect:  # the client cancelled while uploading (a dropped speculation)
            return self._finish(rec, Response(status_code=_CLIENT_LEFT))
        if (early := await self._precheck("transcriptions", request, rec)) is not None:
            return self._finish(rec, early)
        if "file" not in rec.files or not rec.form.get("model"):
            return self._finish(rec, openai_error(400, "'file' and 'model' are required"))
        text = await asyncio.to_thread(self.server.transcribe, rec.files["file"], dict(rec.form))
        fmt = rec.form.get("response_format", "json")
        if fmt == "text":
            return self._answer(request, rec, PlainTextResponse(text + "\n"))
        if fmt == "verbose_json":
            try:
                duration = wav_to_pcm16(rec.files["file"]).seconds
            except ValueError:
                duration = 0.0
            verbose: JsonDict = {
                "task": "transcribe",
                "language": rec.form.get("language", "english"),
            }
            verbose |= {"duration": duration, "text": text, "segments": []}
            return self._answer(request, rec, JSONResponse(verbose))
        return self._answer(request, rec, JSONResponse({"text": text}))

    # ---- POST /v1/audio/speech -------------------------------------------------------

    async def speech(self, request: Request) -> Response:
        rec = self._record("speech", request)
        if (early := await self._read_json(rec, "speech", request)) is not None:
            return self._finish(rec, early)
        body = rec.json or {}
        text, fmt = body.get("input"), body.get("response_format", "mp3")
        if not isinstance(text, str) or not text or not body.get("model") or not body.get("voice"):
            return self._finish(rec, openai_error(400, "'model', 'input' and 'voice' are required"))
        if fmt != "pcm":
            return self._finish(rec, openai_error(400, f"fake speaks only pcm, not {fmt!r}"))
        pcm = await asyncio.to_thread(self.server.speak, text)
        stream = self._broken(request, rec, self._speech_stream(pcm, rec))
        return StreamingResponse(stream, media_type="audio/pcm")

    async def _speech_stream(self, pcm: bytes, rec: RecordedRequest) -> AsyncGenerator[bytes, None]:
        step = max(1, self.server.speech_chunk_bytes)
        try:
            for offset in range(0, len(pcm), step):
                if offset:
                    await self._sleep(self.server.speech_chunk_delay)
                yield pcm[offset : offset + step]
            rec.outcome = "completed"
        except BaseException:  # the client left: Starlette cancels the stream
            rec.outcome = "disconnected"
            raise
        finally:
            rec.finish()
