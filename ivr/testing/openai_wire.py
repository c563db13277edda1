"""What the fake OpenAI server says, kept apart from how it serves it: the scripts a test hands
it (``ChatScript``, ``Fault``), the requests it records, and builders for OpenAI's exact wire
formats (chat completion JSON and ``chat.completion.chunk`` SSE, error bodies, PCM speech)."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from starlette.responses import JSONResponse

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
    """What goes wrong at one endpoint, at the socket or the payload level. Faults act after the
    API-key check, in this order: ``delay``, then the first of ``drop`` / ``hang`` / ``status`` /
    ``raw`` that is set; ``after_chunks`` instead lets the real answer start, then breaks it.

    A "chunk" is one SSE event (chat streams), one audio chunk (speech), or 8 bytes of a JSON
    answer (transcriptions, chat without streaming), which is then sent chunked.
    """

    status: int | None = None
    """Answer with this HTTP error status (OpenAI error JSON unless ``body``)."""
    body: JsonDict | None = None
    headers: Mapping[str, str] | None = None
    """Extra headers on the ``status`` / ``raw`` response, e.g. ``{"Retry-After": "1"}``."""
    delay: float = 0.0
    """Seconds before anything else happens (nothing is sent meanwhile)."""
    hang: bool = False
    """Never send a byte, not even the status line (until the client leaves or the server stops)."""
    drop: bool = False
    """Reset the connection (TCP RST) before the status line."""
    raw: bytes | None = None
    """Answer HTTP 200 with exactly these bytes instead of the real answer (garbage payloads)."""
    content_type: str = "application/json"
    """Content type of ``raw``."""
    after_chunks: int | None = None
    """Send this many chunks of the real answer, then do ``then``."""
    then: Literal["reset", "stall"] = "reset"
    """``reset``: TCP RST mid-answer. ``stall``: keep the connection open and send nothing more."""
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
    method: str = "POST"
    peer: tuple[str, int] | None = None
    """The client's address: requests from one port came over one connection."""
    json: JsonDict | None = None
    form: dict[str, str] | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    outcome: str = "pending"
    """pending | completed | disconnected | error"""
    fault: Fault | None = None
    """The fault this request got, if any."""
    finished: threading.Event = field(default_factory=threading.Event)
    finished_at: float | None = None
    """``time.monotonic()`` when the answer was over (sent, broken or abandoned)."""

    def finish(self) -> None:
        self.finished_at = time.monotonic()
        self.finished.set()

    def wait_finished(self, timeout: float) -> bool:
        return self.finished.wait(timeout)


ChatSource = ChatScript | Sequence[ChatScript] | Callable[[JsonDict], ChatScript]


def openai_error(
    status: int, message: str, *, code: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error response in OpenAI's shape: ``{"error": {message, type, param, code}}``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        kind, code = "requests", code or "rate_limit_exceeded"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_body(*events: JsonDict | str, done: bool = True) -> bytes:
    """A raw ``text/event-stream`` body: each event as one ``data:`` line (dicts as JSON, strings
    as they are), then ``data: [DONE]``. For ``Fault(raw=...)`` streams the real server would
    never send, e.g. a chunk with ``"choices": null``."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join([*lines, "data: [DONE]\n\n" if done else ""]).encode()


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


class ChunkMaker:
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


def script_tokens(script: ChatScript) -> list[str]:
    return list(script.tokens) if script.tokens is not None else split_tokens(script.text)


def call_id(call: ScriptToolCall, index: int) -> str:
    return call.id or f"call_{uuid.uuid5(uuid.NAMESPACE_OID, f'{call.name}{index}').hex[:24]}"


def tool_call_deltas(index: int, call: ScriptToolCall) -> list[JsonDict]:
    """First delta names the call (empty arguments), later ones carry argument pieces."""
    head = {
        "index": index,
        "id": call_id(call, index),
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    args, n = call.arguments, 3
    size = max(1, -(-len(args) // n))
    pieces = [args[i : i + size] for i in range(0, len(args), size)]
    return [head] + [{"index": index, "function": {"arguments": p}} for p in pieces]


def usage_for(body: Mapping[str, Any], script: ChatScript) -> JsonDict:
    prompt = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
    completion = len(script_tokens(script)) + sum(len(c.arguments) // 4 for c in script.tool_calls)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_for(body: Mapping[str, Any], script: ChatScript) -> JsonDict:
    message: JsonDict = {"role": "assistant", "content": script.text or None, "refusal": None}
    if script.tool_calls:
        message["tool_calls"] = [
            {
                "id": call_id(call, i),
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
        "usage": usage_for(body, script),
    }


def unsupported_field(name: str) -> JSONResponse:
    """Cerebras' answer to a body field it does not know (its error object is not nested)."""
    body = {
        "message": f"body.{name}: property 'body.{name}' is unsupported",
        "type": "invalid_request_error",
        "param": "validation_error",
        "code": "wrong_api_format",
    }
    return JSONResponse(body, status_code=422)


def check_json_mode(body: Mapping[str, Any], script: ChatScript) -> str | None:
    """With ``json_schema`` a real model can only emit JSON; a script that does not is a bug."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") != "json_schema" or script.status is not None or script.tool_calls:
        return None
    try:
        json.loads(script.text)
    except ValueError:
        return f"script text is not JSON but response_format is json_schema: {script.text!r}"
    return None


def wav_samples(wav: bytes) -> bytes:
    """The PCM of a WAV upload (the whole upload when it is not one)."""
    try:
        return wav_to_pcm16(wav).pcm16
    except Exception:
        return wav


def continues_utterance(audio: bytes, previous: bytes) -> bool:
    """``audio`` is the same utterance as ``previous``, further on: it starts with the first
    half of it (the tail differs by the resampler's edge and the trailing silence)."""
    half = len(previous) // 2 & ~1
    return half >= 3200 and len(audio) >= len(previous) and audio[:half] == previous[:half]
