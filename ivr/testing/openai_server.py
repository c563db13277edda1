"""A real local HTTP server speaking OpenAI's wire formats, standing in for Cerebras,
the Hugging Face router, cloud STT and cloud TTS in tests, flow tests and benchmarks.

    with FakeOpenAIServer(api_key="sk-test") as srv:      # or: async with
        srv.chat = [ChatScript(text="Hello there."), ChatScript(tool_calls=[...])]
        client = OpenAI(base_url=srv.base_url, api_key="sk-test")

Endpoints: GET /v1/models, POST /v1/chat/completions (JSON and SSE),
POST /v1/audio/transcriptions (multipart), POST /v1/audio/speech (streamed raw PCM16 24 kHz).
``faults[endpoint] = Fault(...)`` breaks an endpoint the way production does, at the socket
(TCP reset before the status line or mid-answer, a stall before any byte or after N chunks) or
in the payload (HTTP 5xx, 429 with Retry-After, non-JSON, wrong shape, null fields).
The server runs uvicorn on its own event loop in a background thread, so sync and async
tests can both use it; handlers never block that loop (scripts run in worker threads).
Run ``python -m ivr.testing.openai_server --port N`` for an echo assistant on a fixed port.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import socket
import struct
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.utils import get_remote_addr

from ivr.audio.wav import wav_to_pcm16
from ivr.testing.hold import Hold
from ivr.testing.openai_wire import (
    SECONDS_PER_CHAR,
    SPEECH_RATE,
    ChatScript,
    ChatSource,
    ChunkMaker,
    Fault,
    JsonDict,
    RecordedRequest,
    ScriptToolCall,
    check_json_mode,
    completion_for,
    continues_utterance,
    default_speak,
    echo_script,
    example_for_schema,
    last_user_text,
    openai_error,
    script_tokens,
    split_tokens,
    sse_body,
    tool_call_deltas,
    unsupported_field,
    usage_for,
    wav_samples,
)

T = TypeVar("T")
JSON_CHUNK_BYTES = 8
"""A JSON answer broken by ``Fault.after_chunks`` goes out in pieces of this size."""

_CLIENT_LEFT = 499
"""nginx's "client closed request": recorded, never sent (the client is gone)."""


@dataclass(slots=True)
class _Connection:
    transport: asyncio.Transport
    closed: asyncio.Event = field(default_factory=asyncio.Event)


def _tracking_protocol(connections: dict[tuple[str, int], _Connection]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, registering each connection's transport by client address so a
    fault can reset the very socket a request came in on (ASGI does not expose it)."""
    base: Any = AutoHTTPProtocol

    class Tracking(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._ivr_client = get_remote_addr(transport)
            if self._ivr_client is not None:
                connections[self._ivr_client] = _Connection(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            if (conn := connections.pop(self._ivr_client, None)) is not None:  # type: ignore[arg-type]
                conn.closed.set()
            super().connection_lost(exc)

    return Tracking


class _Uvicorn(uvicorn.Server):
    """uvicorn server that signals a threading.Event once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready: threading.Event) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._ready.set()


class FakeOpenAIServer:
    """See the module docstring. Attributes a test may set at any time:

    ``chat``, ``transcribe``, ``speak``, ``transcripts``, ``faults``, ``api_key``,
    ``speech_chunk_bytes``, ``speech_chunk_delay``.
    """

    def __init__(self, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.api_key = api_key
        """When set, requests must carry ``Authorization: Bearer <api_key>`` (else 401)."""
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self.reset()
        self._thread: threading.Thread | None = None
        self._server: _Uvicorn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._connections: dict[tuple[str, int], _Connection] = {}
        """Open connections by client address; touched only on the server's loop."""

    def reset(self) -> None:
        """Back to the default scripts with no faults and no recorded requests (the key and
        the port stay), so one server can serve many tests."""
        self.chat: ChatSource = echo_script
        self.transcripts: collections.deque[str] = collections.deque()
        self.transcripts_per_utterance = True
        """``transcripts`` script what each *utterance* says: a request whose audio goes on
        from the previous request's (a speculative transcription at a pause, then the whole
        turn once the caller went on) gets that request's transcript again instead of the
        next one. False: one transcript per request."""
        self._last_audio = b""
        self._last_transcript = ""
        self.transcribe: Callable[[bytes, dict[str, str]], str] = self._next_transcript
        self.speak: Callable[[str], bytes] = default_speak
        self.speech_chunk_bytes = 4800
        """Bytes per streamed speech chunk (4800 = 100 ms); odd sizes test sample alignment."""
        self.speech_chunk_delay = 0.0
        self.faults: dict[str, Fault] = {}
        """Per endpoint: ``models``, ``chat``, ``transcriptions``, ``speech``."""
        self.holds: dict[str, Hold] = {}
        """Per endpoint: requests wait until that many wait at once (``ivr.testing.hold``)."""
        self.chat_fields: frozenset[str] | None = None
        """When set, chat requests with other top-level fields get HTTP 422, the way Cerebras
        validates bodies (most servers, and the default here, ignore unknown fields)."""
        self.requests: list[RecordedRequest] = []
        with self._lock:
            self._script_queue: collections.deque[ChatScript] | None = None
            self._script_source: object = None

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> FakeOpenAIServer:
        if self._thread is not None:
            raise RuntimeError("FakeOpenAIServer already started")
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it every keep-alive response stalls ~40 ms on Nagle + delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=2, http=_tracking_protocol(self._connections),
        )  # fmt: skip
        ready = threading.Event()
        self._server = _Uvicorn(config, ready)
        self._thread = threading.Thread(
            target=self._run, args=(sock, ready), name=f"fake-openai-{self.port}", daemon=True
        )
        self._thread.start()
        if not ready.wait(10) or not self._server.started:
            raise RuntimeError(f"FakeOpenAIServer did not start on {self.base_url}")
        return self

    def _run(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock))
        finally:
            ready.set()  # unblock start() if serving failed early
            loop.close()
            sock.close()

    async def _serve(self, sock: socket.socket) -> None:
        assert self._server is not None
        self._stopping = asyncio.Event()
        await self._server.serve(sockets=[sock])

    def stop(self) -> None:
        if self._thread is None or self._server is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            # Release handlers that hang on purpose, so graceful shutdown is quick.
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._server.should_exit = True
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("FakeOpenAIServer thread did not stop within 10 s")
        self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeOpenAIServer:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def requests_for(self, endpoint: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.endpoint == endpoint]

    # ---- scripting helpers -----------------------------------------------------------

    def _next_transcript(self, wav: bytes, form: dict[str, str]) -> str:
        audio = wav_samples(wav)
        with self._lock:
            previous, self._last_audio = self._last_audio, audio
            if self.transcripts_per_utterance and continues_utterance(audio, previous):
                return self._last_transcript
            try:
                self._last_transcript = self.transcripts.popleft()
            except IndexError:
                self._last_transcript = ""
            return self._last_transcript

    def _next_chat_script(self, request: JsonDict) -> ChatScript | str:
        """The script for this request, or an explanation why there is none."""
        source = self.chat
        if isinstance(source, ChatScript):
            return source
        if callable(source):
            return source(request)
        with self._lock:
            if self._script_source is not source:  # a new list was assigned
                self._script_source, self._script_queue = source, collections.deque(source)
            assert self._script_queue is not None
            if not self._script_queue:
                return f"FakeOpenAIServer: all {len(source)} chat scripts were used up"
            return self._script_queue.popleft()

    # ---- HTTP plumbing ---------------------------------------------------------------

    def _app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/v1/audio/transcriptions", self._transcriptions, methods=["POST"]),
                Route("/v1/audio/speech", self._speech, methods=["POST"]),
            ]
        )

    def _record(self, endpoint: str, request: Request) -> RecordedRequest:
        rec = RecordedRequest(
            endpoint=endpoint,
            path=request.url.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            time=time.monotonic(),
        )
        self.requests.append(rec)
        return rec

    async def _hang(self) -> None:
        assert self._stopping is not None
        await self._stopping.wait()

    async def _sleep(self, seconds: float) -> None:
        """A scripted delay that ends early when the server stops. Even a zero delay yields to
        the loop, so a client that left is noticed before more chunks are written."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        assert self._stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _take_fault(self, endpoint: str) -> Fault | None:
        with self._lock:
            fault = self.faults.get(endpoint)
            if fault is None:
                return None
            if fault.times is not None:
                if fault.times <= 1:
                    del self.faults[endpoint]
                else:
                    self.faults[endpoint] = replace(fault, times=fault.times - 1)
            return fault

    async def _precheck(
        self, endpoint: str, request: Request, rec: RecordedRequest
    ) -> Response | None:
        """Auth, then any injected fault; a response here ends the request. A fault that breaks
        the answer midway (``after_chunks``) is left on ``rec`` for the handler."""
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                shown = auth.removeprefix("Bearer ")[:6] or "(none)"
                message = f"Incorrect API key provided: {shown}***."
                return openai_error(401, message, code="invalid_api_key")
        if (hold := self.holds.get(endpoint)) is not None:
            assert self._stopping is not None
            await hold.wait(self._stopping)
        fault = rec.fault = self._take_fault(endpoint)
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
        conn = self._connections.get(tuple(client)) if client else None
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

    async def _models(self, request: Request) -> Response:
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

    async def _chat_completions(self, request: Request) -> Response:
        rec = self._record("chat", request)
        if (early := await self._read_json(rec, "chat", request)) is not None:
            return self._finish(rec, early)
        body = rec.json or {}
        if self.chat_fields is not None and (unknown := sorted(set(body) - self.chat_fields)):
            return self._finish(rec, unsupported_field(unknown[0]))
        if not isinstance(body.get("messages"), list) or not body.get("model"):
            return self._finish(rec, openai_error(400, "'model' and 'messages' are required"))
        script = await asyncio.to_thread(self._next_chat_script, body)
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

    async def _transcriptions(self, request: Request) -> Response:
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
        text = await asyncio.to_thread(self.transcribe, rec.files["file"], dict(rec.form))
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

    async def _speech(self, request: Request) -> Response:
        rec = self._record("speech", request)
        if (early := await self._read_json(rec, "speech", request)) is not None:
            return self._finish(rec, early)
        body = rec.json or {}
        text, fmt = body.get("input"), body.get("response_format", "mp3")
        if not isinstance(text, str) or not text or not body.get("model") or not body.get("voice"):
            return self._finish(rec, openai_error(400, "'model', 'input' and 'voice' are required"))
        if fmt != "pcm":
            return self._finish(rec, openai_error(400, f"fake speaks only pcm, not {fmt!r}"))
        pcm = await asyncio.to_thread(self.speak, text)
        stream = self._broken(request, rec, self._speech_stream(pcm, rec))
        return StreamingResponse(stream, media_type="audio/pcm")

    async def _speech_stream(self, pcm: bytes, rec: RecordedRequest) -> AsyncGenerator[bytes, None]:
        step = max(1, self.speech_chunk_bytes)
        try:
            for offset in range(0, len(pcm), step):
                if offset:
                    await self._sleep(self.speech_chunk_delay)
                yield pcm[offset : offset + step]
            rec.outcome = "completed"
        except BaseException:  # the client left: Starlette cancels the stream
            rec.outcome = "disconnected"
            raise
        finally:
            rec.finish()


# ---- CLI ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible server (echo assistant)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8088)
    parser.add_argument("--api-key", default=None, help="require this bearer token")
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    args = parser.parse_args(argv)
    server = FakeOpenAIServer(api_key=args.api_key, host=args.host, port=args.port)
    delays = {"first_token_delay": args.first_token_delay, "token_delay": args.token_delay}
    server.chat = lambda request: replace(echo_script(request), **delays)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with server:
        print(f"fake OpenAI server on {server.base_url} (Ctrl-C to stop)", flush=True)
        done.wait()


if __name__ == "__main__":
    main()


__all__ = [
    "SECONDS_PER_CHAR",
    "SPEECH_RATE",
    "ChatScript",
    "FakeOpenAIServer",
    "Fault",
    "RecordedRequest",
    "ScriptToolCall",
    "default_speak",
    "echo_script",
    "example_for_schema",
    "last_user_text",
    "openai_error",
    "split_tokens",
    "sse_body",
]
