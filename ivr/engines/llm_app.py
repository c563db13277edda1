"""A minimal OpenAI-compatible HTTP server over `LlamaEngine` (runs in its own process).

Implements what the gateway's LLM client uses: `GET /v1/models` and
`POST /v1/chat/completions` (streamed as SSE or not), with temperature, top_p,
max_tokens, seed and `response_format` (JSON schema -> grammar). Tools are ignored:
a 135M model cannot call them reliably.

Run: python -m ivr.engines.llm_app --model FILE.gguf [--port 0]
It prints `LISTENING http://127.0.0.1:PORT` on stdout once the model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ivr.engines.llama import (
    ChatTurn,
    EngineError,
    GenerationStats,
    LlamaEngine,
    SamplingParams,
)

_QUEUE_CREDITS = 64
_END = object()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def turn(self) -> ChatTurn:
        text = self.content if isinstance(self.content, str) else ""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        role = {"developer": "system", "tool": "user"}.get(self.role, self.role)
        return ChatTurn(role=role, content=text)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    seed: int | None = None
    response_format: dict[str, Any] | None = None


def sampling_params(req: ChatRequest, default_max: int) -> SamplingParams:
    grammar = None
    if req.response_format is not None:
        from llama_cpp_py_sync.constraints import response_format_to_grammar

        try:
            grammar = response_format_to_grammar(req.response_format)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, f"unsupported response_format: {exc}") from exc
    return SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens or default_max,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        grammar=grammar,
    )


async def stream_pieces(
    engine: LlamaEngine, turns: list[ChatTurn], params: SamplingParams, stats: GenerationStats
) -> AsyncIterator[str]:
    """Run generation in a worker thread and yield its pieces without blocking the loop.

    The worker may run at most _QUEUE_CREDITS pieces ahead of the consumer. Closing
    this iterator early (client gone) cancels the worker and waits for it.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    credits = threading.Semaphore(_QUEUE_CREDITS)
    cancel = threading.Event()

    def push(item: object) -> bool:
        while not credits.acquire(timeout=0.1):
            if cancel.is_set():
                return False
        loop.call_soon_threadsafe(queue.put_nowait, item)
        return True

    def work() -> None:
        try:
            for piece in engine.stream_chat(turns, params, cancel, stats):
                if not push(piece):
                    return
            push(_END)
        except Exception as exc:  # handed to the consumer, which re-raises it
            push(exc)

    worker = loop.run_in_executor(None, work)
    try:
        while True:
            item = await queue.get()
            credits.release()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, str)
            yield item
    finally:
        cancel.set()
        await asyncio.shield(worker)


def _chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None) -> str:
    body = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


def _usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's field for prompt caching: how much of the prompt was not evaluated again.
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


async def _sse(
    pieces: AsyncIterator[str], stats: GenerationStats, model: str, usage: bool
) -> AsyncIterator[str]:
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    yield _chunk(cid, model, {"role": "assistant", "content": ""}, None)
    try:
        async for piece in pieces:
            yield _chunk(cid, model, {"content": piece}, None)
    except EngineError as exc:
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'engine_error'}})}\n\n"
        return
    yield _chunk(cid, model, {}, stats.finish_reason)
    if usage:
        body = {"id": cid, "object": "chat.completion.chunk", "model": model, "choices": []}
        yield f"data: {json.dumps({**body, 'usage': _usage(stats)})}\n\n"
    yield "data: [DONE]\n\n"


def build_app(engine: LlamaEngine, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="ivr local LLM", docs_url=None, redoc_url=None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "local"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest) -> StreamingResponse | JSONResponse:
        params = sampling_params(req, default_max_tokens)
        stats = GenerationStats()
        pieces = stream_pieces(engine, [m.turn() for m in req.messages], params, stats)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(pieces, stats, model_name, usage), media_type="text/event-stream"
            )
        try:
            text = "".join([p async for p in pieces])
        except EngineError as exc:
            raise HTTPException(400, str(exc)) from exc
        return JSONResponse(_completion(text, stats, model_name))

    return app


def _completion(text: str, stats: GenerationStats, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": stats.finish_reason,
            }
        ],
        "usage": _usage(stats),
    }


def warm_up(engine: LlamaEngine) -> None:
    # The first decode allocates compute buffers; pay that before the first call.
    turns = [ChatTurn("user", "Hello")]
    for _ in engine.stream_chat(turns, SamplingParams(max_tokens=2), threading.Event()):
        pass


def serve(args: argparse.Namespace, announce: Callable[[str], None] = print) -> None:
    engine = LlamaEngine(Path(args.model), n_ctx=args.ctx, n_threads=args.threads)
    warm_up(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    app = build_app(engine, args.alias, args.max_tokens)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    announce(f"LISTENING http://{host}:{port}")
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="path to a GGUF file")
    parser.add_argument("--alias", default="local", help="model id reported by /v1/models")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256, help="default max_tokens")
    return parser.parse_args(argv)


if __name__ == "__main__":
    serve(parse_args(), announce=lambda line: print(line, flush=True))
