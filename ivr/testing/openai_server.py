"""A real local HTTP server speaking OpenAI's wire formats, standing in for Cerebras,
the Hugging Face router, cloud STT and cloud TTS in tests, flow tests and benchmarks.

    with FakeOpenAIServer(api_key="sk-test") as srv:      # or: async with
        srv.chat = [ChatScript(text="Hello there."), ChatScript(tool_calls=[...])]
        client = OpenAI(base_url=srv.base_url, api_key="sk-test")

Endpoints: GET /v1/models, POST /v1/chat/completions (JSON and SSE),
POST /v1/audio/transcriptions (multipart), POST /v1/audio/speech (streamed raw PCM16 24 kHz).
The server runs uvicorn on its own event loop in a background thread, so sync and async
tests can both use it; handlers never block that loop (scripts run in worker threads).
Run ``python -m ivr.testing.openai_server --port N`` for an echo assistant on a fixed port.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ivr.audio.wav import wav_to_pcm16

SPEECH_RATE = 24_000
"""OpenAI's ``pcm`` speech format: 24 kHz, mono, signed 16-bit little-endian."""
SECONDS_PER_CHAR = 0.065

JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ScriptToolCall:
    name: str
    arguments: str = "{}"
    """JSON text, streamed in several pieces."""
    id: str = ""
    """Empty means the server makes one up (``call_<hex>``)."""


@dataclass(frozen=True, slots=True)
class ChatScript:
    """What the fake model answers to one chat request."""

    text: str = ""
    tool_calls: Sequence[ScriptToolCall] = ()
    first_token_delay: float = 0.0
    """Seconds between the response headers and the first token."""
    token_delay: float = 0.0
    """Seconds between tokens."""
    status: int | None = None
    """Answer with this HTTP error status (OpenAI error JSON) instead of a reply."""
    error_body: JsonDict | None = None
    hang: bool = False
    """Send headers, then never a token (until the client leaves or the server stops)."""
    tokens: Sequence[str] | None = None
    """Exact token split of ``text``; default splits words and punctuation."""
    finish_reason: str = "stop"
    reasoning: str = ""
    """Thinking streamed before the answer in ``delta.reasoning`` (Cerebras' parsed format)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fault injected at one endpoint before it does its normal work."""

    status: int | None = None
    body: JsonDict | None = None
    delay: float = 0.0
    """Seconds before the first byte of the response."""
    hang: bool = False
    times: int | None = None
    """How many requests it applies to; None means every request."""


@dataclass(slots=True)
class RecordedRequest:
    endpoint: str
    """models | chat | transcriptions | speech"""
    path: str
    headers: dict[str, str]
    time: float
    """``time.monotonic()`` at arrival."""
    json: JsonDict | None = None
    form: dict[str, str] | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    outcome: str = "pending"
    """pending | completed | disconnected | error"""
    finished: threading.Event = field(default_factory=threading.Event)

    def wait_finished(self, timeout: float) -> bool:
        return self.finished.wait(timeout)


ChatSource = ChatScript | Sequence[ChatScript] | Callable[[JsonDict], ChatScript]


def openai_error(status: int, message: str, *, code: str | None = None) -> JSONResponse:
    """An error response in OpenAI's shape: ``{"error": {message, type, param, code}}``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        kind, code = "requests", code or "rate_limit_exceeded"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def split_tokens(text: str) -> list[str]:
    """Split like a tokenizer would, roughly: words with their leading space, punctuation alone."""
    return re.findall(r"\s*(?:\w+|[^\w\s])|\s+", text)


def last_user_text(request: Mapping[str, Any]) -> str:
    for message in reversed(request.get("messages") or []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):
            return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content or "")
    return ""


def example_for_schema(schema: Mapping[str, Any]) -> Any:
    """A minimal instance of a JSON schema, so the default script honours ``json_schema``."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: example_for_schema(sub) for name, sub in props.items()}
    defaults: dict[str, Any] = {"string": "", "integer": 0, "number": 0, "boolean": False}
    return defaults.get(str(kind), [] if kind == "array" else None)


def echo_script(request: Mapping[str, Any]) -> ChatScript:
    """Default assistant: ``You said: <last user text>.``, or a schema example for JSON mode."""
    fmt = request.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") or {}
        return ChatScript(text=json.dumps(example_for_schema(schema)))
    said = last_user_text(request).strip().rstrip(".!?")
    return ChatScript(text=f"You said: {said}.")


_tone_cache: dict[tuple[str, int], np.ndarray[Any, np.dtype[np.float64]]] = {}


def _char_tone(ch: str, rate: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    key = (ch, rate)
    if key not in _tone_cache:
        n = int(rate * SECONDS_PER_CHAR)
        t = np.arange(n) / rate
        ramp = min(n // 2, int(rate * 0.008))
        env = np.ones(n)
        env[:ramp] = env[-ramp:][::-1] = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, ramp))
        if ch.isalnum():  # a voiced, vowel-like buzz whose pitch depends on the letter
            f0 = 110.0 + (ord(ch.lower()) % 26) * 6.0
            wave = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in (1, 2, 3)) / 1.84
            _tone_cache[key] = 0.3 * wave * env
        else:  # spaces and punctuation: a quiet gap, like the pause between words
            _tone_cache[key] = 0.01 * np.sin(2 * np.pi * 150.0 * t) * env
    return _tone_cache[key]


def default_speak(text: str, sample_rate: int = SPEECH_RATE) -> bytes:
    """Deterministic speech-like PCM16: about 65 ms per character, nonzero energy."""
    if not text:
        return b""
    samples = np.concatenate([_char_tone(ch, sample_rate) for ch in text])
    return (samples * 32767).astype("<i2").tobytes()


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

    def reset(self) -> None:
        """Back to the default scripts with no faults and no recorded requests (the key and
        the port stay), so one server can serve many tests."""
        self.chat: ChatSource = echo_script
        self.transcripts: collections.deque[str] = collections.deque()
        self.transcribe: Callable[[bytes, dict[str, str]], str] = self._next_transcript
        self.speak: Callable[[str], bytes] = default_speak
        self.speech_chunk_bytes = 4800
        """Bytes per streamed speech chunk (4800 = 100 ms); odd sizes test sample alignment."""
        self.speech_chunk_delay = 0.0
        self.faults: dict[str, Fault] = {}
        """Per endpoint: ``models``, ``chat``, ``transcriptions``, ``speech``."""
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
            timeout_graceful_shutdown=2,
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
        try:
            return self.transcripts.popleft()
        except IndexError:
            return ""

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

    async def _precheck(self, endpoint: str, request: Request) -> Response | None:
        """Auth, then any injected fault; a response here ends the request."""
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                shown = auth.removeprefix("Bearer ")[:6] or "(none)"
                message = f"Incorrect API key provided: {shown}***."
                return openai_error(401, message, code="invalid_api_key")
        fault = self._take_fault(endpoint)
        if fault is None:
            return None
        await self._sleep(fault.delay)
        if fault.hang:
            await self._hang()
            return openai_error(503, "FakeOpenAIServer is shutting down")
        if fault.status is not None:
            if fault.body is not None:
                return JSONResponse(fault.body, status_code=fault.status)
            return openai_error(fault.status, f"Injected fault: HTTP {fault.status}")
        return None

    @staticmethod
    def _finish(rec: RecordedRequest, response: Response, outcome: str = "completed") -> Response:
        rec.outcome = "error" if response.status_code >= 400 else outcome
        rec.finished.set()
        return response

    # ---- GET /v1/models --------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        rec = self._record("models", request)
        if (early := await self._precheck("models", request)) is not None:
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
        return await self._precheck(endpoint, request)

    # ---- POST /v1/chat/completions ---------------------------------------------------

    async def _chat_completions(self, request: Request) -> Response:
        rec = self._record("chat", request)
        if (early := await self._read_json(rec, "chat", request)) is not None:
            return self._finish(rec, early)
        body = rec.json or {}
        if self.chat_fields is not None and (unknown := sorted(set(body) - self.chat_fields)):
            return self._finish(rec, _unsupported_field(unknown[0]))
        if not isinstance(body.get("messages"), list) or not body.get("model"):
            return self._finish(rec, openai_error(400, "'model' and 'messages' are required"))
        script = await asyncio.to_thread(self._next_chat_script, body)
        if isinstance(script, str):
            return self._finish(rec, openai_error(500, script))
        if (problem := _check_json_mode(body, script)) is not None:
            return self._finish(rec, openai_error(500, problem))
        if script.status is not None:
            if script.error_body is not None:
                return self._finish(rec, JSONResponse(script.error_body, script.status))
            return self._finish(rec, openai_error(script.status, f"Scripted HTTP {script.status}"))
        if body.get("stream"):
            stream = self._chat_stream(body, script, rec)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self._sleep(script.first_token_delay)
        if script.hang:
            await self._hang()
        return self._finish(rec, JSONResponse(_completion(body, script)))

    async def _chat_stream(
        self, body: JsonDict, script: ChatScript, rec: RecordedRequest
    ) -> AsyncIterator[str]:
        chunks = _ChunkMaker(body)
        try:
            await self._sleep(script.first_token_delay)
            if script.hang:
                await self._hang()
            yield chunks.sse({"role": "assistant", "content": "", "refusal": None})
            for token in split_tokens(script.reasoning):
                yield chunks.sse({"reasoning": token})
            for i, token in enumerate(_tokens(script)):
                if i:
                    await self._sleep(script.token_delay)
                yield chunks.sse({"content": token})
            for index, call in enumerate(script.tool_calls):
                for delta in _tool_call_deltas(index, call):
                    await self._sleep(script.token_delay)
                    yield chunks.sse({"tool_calls": [delta]})
            finish = "tool_calls" if script.tool_calls else script.finish_reason
            yield chunks.sse({}, finish)
            if chunks.include_usage:
                yield chunks.usage_sse(_usage(body, script))
            yield "data: [DONE]\n\n"
            rec.outcome = "completed"
        except BaseException:  # the client left: Starlette cancels the stream
            rec.outcome = "disconnected"
            raise
        finally:
            rec.finished.set()

    # ---- POST /v1/audio/transcriptions -----------------------------------------------

    async def _transcriptions(self, request: Request) -> Response:
        rec = self._record("transcriptions", request)
        async with request.form() as form:
            rec.form = {k: v for k, v in form.items() if isinstance(v, str)}
            upload = form.get("file")
            if isinstance(upload, UploadFile):
                rec.files["file"] = await upload.read()
                rec.form["file.filename"] = upload.filename or ""
        if (early := await self._precheck("transcriptions", request)) is not None:
            return self._finish(rec, early)
        if "file" not in rec.files or not rec.form.get("model"):
            return self._finish(rec, openai_error(400, "'file' and 'model' are required"))
        text = await asyncio.to_thread(self.transcribe, rec.files["file"], dict(rec.form))
        fmt = rec.form.get("response_format", "json")
        if fmt == "text":
            return self._finish(rec, PlainTextResponse(text + "\n"))
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
            return self._finish(rec, JSONResponse(verbose))
        return self._finish(rec, JSONResponse({"text": text}))

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
        return StreamingResponse(self._speech_stream(pcm, rec), media_type="audio/pcm")

    async def _speech_stream(self, pcm: bytes, rec: RecordedRequest) -> AsyncIterator[bytes]:
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
            rec.finished.set()


# ---- wire-format builders -----------------------------------------------------------


class _ChunkMaker:
    """Builds ``chat.completion.chunk`` SSE lines sharing one id, as OpenAI does."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = str(body.get("model"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def _base(self) -> JsonDict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_fake",
        }

    def sse(self, delta: JsonDict, finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = self._base() | {"choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # every chunk but the last carries usage: null
        return f"data: {json.dumps(chunk)}\n\n"

    def usage_sse(self, usage: JsonDict) -> str:
        return f"data: {json.dumps(self._base() | {'choices': [], 'usage': usage})}\n\n"


def _tokens(script: ChatScript) -> list[str]:
    return list(script.tokens) if script.tokens is not None else split_tokens(script.text)


def _call_id(call: ScriptToolCall, index: int) -> str:
    return call.id or f"call_{uuid.uuid5(uuid.NAMESPACE_OID, f'{call.name}{index}').hex[:24]}"


def _tool_call_deltas(index: int, call: ScriptToolCall) -> list[JsonDict]:
    """First delta names the call (empty arguments), later ones carry argument pieces."""
    head = {
        "index": index,
        "id": _call_id(call, index),
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    args, n = call.arguments, 3
    size = max(1, -(-len(args) // n))
    pieces = [args[i : i + size] for i in range(0, len(args), size)]
    return [head] + [{"index": index, "function": {"arguments": p}} for p in pieces]


def _usage(body: Mapping[str, Any], script: ChatScript) -> JsonDict:
    prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
    completion = len(_tokens(script)) + sum(len(c.arguments) // 4 for c in script.tool_calls)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _completion(body: Mapping[str, Any], script: ChatScript) -> JsonDict:
    message: JsonDict = {"role": "assistant", "content": script.text or None, "refusal": None}
    if script.tool_calls:
        message["tool_calls"] = [
            {
                "id": _call_id(call, i),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for i, call in enumerate(script.tool_calls)
        ]
    finish = "tool_calls" if script.tool_calls else script.finish_reason
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model")),
        "system_fingerprint": "fp_fake",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": _usage(body, script),
    }


def _unsupported_field(name: str) -> JSONResponse:
    """Cerebras' answer to a body field it does not know (its error object is not nested)."""
    body = {
        "message": f"body.{name}: property 'body.{name}' is unsupported",
        "type": "invalid_request_error",
        "param": "validation_error",
        "code": "wrong_api_format",
    }
    return JSONResponse(body, status_code=422)


def _check_json_mode(body: Mapping[str, Any], script: ChatScript) -> str | None:
    """With ``json_schema`` a real model can only emit JSON; a script that does not is a bug."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") != "json_schema" or script.status is not None or script.tool_calls:
        return None
    try:
        json.loads(script.text)
    except ValueError:
        return f"script text is not JSON but response_format is json_schema: {script.text!r}"
    return None


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
