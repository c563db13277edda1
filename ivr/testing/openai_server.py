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
The handlers and the fault plumbing are in ``ivr.testing.openai_endpoints``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.utils import get_remote_addr

from ivr.testing.hold import Hold
from ivr.testing.openai_endpoints import Connection, OpenAIEndpoints
from ivr.testing.openai_wire import (
    SECONDS_PER_CHAR,
    SPEECH_RATE,
    ChatScript,
    ChatSource,
    Fault,
    JsonDict,
    RecordedRequest,
    ScriptToolCall,
    continues_utterance,
    default_speak,
    echo_script,
    example_for_schema,
    last_user_text,
    openai_error,
    split_tokens,
    sse_body,
    wav_samples,
)


def _tracking_protocol(
    connections: dict[tuple[str, int], Connection], accepted: Callable[[], None]
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, registering each connection's transport by client address so a
    fault can reset the very socket a request came in on (ASGI does not expose it), and
    counting the connections it accepts."""
    base: Any = AutoHTTPProtocol

    class Tracking(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            accepted()
            self._ivr_client = get_remote_addr(transport)
            if self._ivr_client is not None:
                connections[self._ivr_client] = Connection(transport)

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
        self._connections: dict[tuple[str, int], Connection] = {}
        """Open connections by client address; touched only on the server's loop."""
        self._endpoints = OpenAIEndpoints(self, self._connections)

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
        self.connections_accepted = 0
        """TCP connections opened to the server since the reset (keep-alive reuse opens none)."""
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
            timeout_graceful_shutdown=2, http=_tracking_protocol(self._connections, self._accepted),
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
        self._endpoints.stopping = asyncio.Event()
        await self._server.serve(sockets=[sock])

    def stop(self) -> None:
        if self._thread is None or self._server is None:
            return
        stopping = self._endpoints.stopping
        if self._loop is not None and stopping is not None and not self._loop.is_closed():
            # Release handlers that hang on purpose, so graceful shutdown is quick.
            self._loop.call_soon_threadsafe(stopping.set)
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

    @property
    def open_connections(self) -> int:
        """Client connections open now (read from any thread: a dict's length is atomic)."""
        return len(self._connections)

    def _accepted(self) -> None:
        with self._lock:
            self.connections_accepted += 1

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

    def next_chat_script(self, request: JsonDict) -> ChatScript | str:
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

    def take_fault(self, endpoint: str) -> Fault | None:
        """The fault for this request to ``endpoint``, counting down its ``times``."""
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

    # ---- HTTP ------------------------------------------------------------------------

    def _app(self) -> Starlette:
        endpoints = self._endpoints
        return Starlette(
            routes=[
                Route("/v1/models", endpoints.models, methods=["GET"]),
                Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
                Route("/v1/audio/transcriptions", endpoints.transcriptions, methods=["POST"]),
                Route("/v1/audio/speech", endpoints.speech, methods=["POST"]),
            ]
        )


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
