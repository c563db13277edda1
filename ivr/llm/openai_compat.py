"""Chat completions from any OpenAI-compatible server: Cerebras, the Hugging Face router,
vLLM, llama.cpp, OpenAI itself. Only the base URL, key and model change between them:

    Cerebras:   base_url="https://api.cerebras.ai/v1",     model="gemma-4-31b"
    HF router:  base_url="https://router.huggingface.co/v1", model="google/gemma-4-31B-it:cerebras"

Reasoning ("thinking") must stay off for voice. Gemma 4 on Cerebras thinks only when asked
(``reasoning_effort`` low/medium/high), so the default sends no extra field at all, which is
safe on every server. To turn thinking off explicitly pass ``extra_body=REASONING_OFF``
(``reasoning_effort: "none"``, accepted by Cerebras and the HF router). Servers that switch
thinking through the chat template (vLLM, llama.cpp, SGLang) take ``CHAT_TEMPLATE_NO_THINKING``
instead. Cerebras rejects fields it does not know (HTTP 422), so never send both blindly.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai
from openai.types.chat import ChatCompletionChunk

from ivr.errors import ProviderError, ProviderStatusError, ProviderTimeout
from ivr.llm.base import ChatMessage, LlmEvent, TextDelta, ToolCall, ToolSpec

REASONING_OFF: Mapping[str, Any] = {"reasoning_effort": "none"}
"""Thinking off on Cerebras and the Hugging Face router (Gemma 4, GPT-OSS: minimum effort)."""
CHAT_TEMPLATE_NO_THINKING: Mapping[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
"""Thinking off on self-hosted vLLM / SGLang / llama.cpp serving Gemma 4 or Qwen 3."""

T = TypeVar("T")
_SCHEMA_NAME = re.compile(r"[^a-zA-Z0-9_-]")


@dataclass(slots=True)
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAICompatLlm:
    """``LanguageModel`` over ``/v1/chat/completions`` with streaming.

    Iterate ``stream_chat`` inside ``contextlib.aclosing`` (or to the end): closing the
    generator closes the HTTP stream, which stops generation on the server.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        model: str,
        name: str = "openai_compat",
        temperature: float | None = 0.3,
        max_tokens: int | None = 256,
        first_token_timeout: float = 3.0,
        total_timeout: float = 20.0,
        connect_timeout: float = 3.0,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.first_token_timeout = first_token_timeout
        """Seconds from sending the request to the first text or tool-call delta."""
        self.total_timeout = total_timeout
        """Seconds spent waiting on the server for one reply, in all."""
        self.extra_body = dict(extra_body) if extra_body else None
        """Provider-specific top-level fields merged into every request body."""
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,  # retries are the caller's decision (ProviderError.retryable)
            timeout=openai.Timeout(total_timeout, connect=connect_timeout),
        )
        # The SDK imports its resource modules on first attribute access (~50 ms): do it now,
        # not inside the first caller turn on the event loop.
        _ = self._client.chat.completions

    async def aclose(self) -> None:
        await self._client.close()

    def request_params(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments for ``chat.completions.create`` (also used by tests and logs)."""
        params: dict[str, Any] = {
            "model": self.model,
            "messages": [_message_json(m) for m in messages],
            "stream": True,
        }
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if (limit := max_tokens if max_tokens is not None else self.max_tokens) is not None:
            params["max_tokens"] = limit
        if tools:
            params["tools"] = [_tool_json(t) for t in tools]
        if json_schema is not None:
            params["response_format"] = response_format_for(json_schema)
        if self.extra_body:
            params["extra_body"] = self.extra_body
        return params

    async def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[LlmEvent]:
        params = self.request_params(
            messages, tools=tools, json_schema=json_schema, max_tokens=max_tokens
        )
        clock = _WaitBudget(self.total_timeout)
        calls: dict[int, _ToolCallParts] = {}
        stream = await self._call(clock.first(self.first_token_timeout), self._open(params))
        try:
            got_first = False
            while True:
                budget = clock.next() if got_first else clock.first(self.first_token_timeout)
                chunk = await self._call(budget, _next_chunk(stream))
                if chunk is None:
                    break
                texts, progressed = _absorb(chunk, calls)
                got_first = got_first or progressed
                for text in texts:
                    yield text
        finally:
            await stream.close()
        for call in _finish_tool_calls(self.name, calls):
            yield call

    async def _open(self, params: dict[str, Any]) -> openai.AsyncStream[ChatCompletionChunk]:
        stream: openai.AsyncStream[
            ChatCompletionChunk
        ] = await self._client.chat.completions.create(**params)
        return stream

    async def _call(self, budget: _Budget, step: Awaitable[T]) -> T:
        """Await ``step`` within ``budget``, mapping every failure to a ProviderError."""
        try:
            async with budget:
                return await step
        except TimeoutError as exc:
            raise ProviderTimeout(self.name, budget.limit) from exc
        except openai.APITimeoutError as exc:
            raise ProviderTimeout(self.name, budget.limit) from exc
        except openai.APIStatusError as exc:
            raise ProviderStatusError(self.name, exc.status_code, _error_text(exc)) from exc
        except openai.APIConnectionError as exc:
            raise ProviderError(self.name, f"connection failed: {exc}", retryable=True) from exc
        except (openai.APIError, ValueError) as exc:  # stream error event, malformed chunk
            raise ProviderError(self.name, f"bad response: {exc}") from exc


# ---- timing -----------------------------------------------------------------------------


class _Budget:
    """``asyncio.timeout`` for one await, charging the time it took to a shared clock."""

    def __init__(self, clock: _WaitBudget, limit: float, seconds: float) -> None:
        self._clock, self.limit, self._seconds = clock, limit, seconds

    async def __aenter__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._timeout = asyncio.timeout(self._seconds)
        await self._timeout.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        self._clock.spent += self._loop.time() - self._started
        await self._timeout.__aexit__(*exc)


class _WaitBudget:
    """Time spent waiting on the server. Time the consumer spends between events (speaking,
    say) is not charged, and no timeout is armed while the generator is suspended."""

    def __init__(self, total: float) -> None:
        self.total = total
        self.spent = 0.0

    def first(self, first_token: float) -> _Budget:
        left = self.total - self.spent
        remaining_first = first_token - self.spent
        if remaining_first <= left:
            return _Budget(self, first_token, max(0.0, remaining_first))
        return _Budget(self, self.total, max(0.0, left))

    def next(self) -> _Budget:
        return _Budget(self, self.total, max(0.0, self.total - self.spent))


# ---- wire mapping -----------------------------------------------------------------------


def response_format_for(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI structured output: ``{"type": "json_schema", "json_schema": {...}}``, strict."""
    name = _SCHEMA_NAME.sub("_", str(schema.get("title") or "reply"))[:64]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _message_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["content"] = message.content or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


async def _next_chunk(
    stream: openai.AsyncStream[ChatCompletionChunk],
) -> ChatCompletionChunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _absorb(
    chunk: ChatCompletionChunk, calls: dict[int, _ToolCallParts]
) -> tuple[list[TextDelta], bool]:
    """Text deltas of one chunk, and whether it carried any token (text or tool call).

    Tool-call pieces are collected into ``calls``. Reasoning deltas (``reasoning`` /
    ``reasoning_content`` fields) are dropped: they must never be spoken.
    """
    texts: list[TextDelta] = []
    progressed = False
    for choice in chunk.choices:
        if choice.index != 0:
            continue
        if choice.delta.content:
            texts.append(TextDelta(choice.delta.content))
        for piece in choice.delta.tool_calls or ():
            progressed = True
            parts = calls.setdefault(piece.index, _ToolCallParts())
            parts.id = piece.id or parts.id
            if piece.function is not None:
                parts.name = piece.function.name or parts.name
                if piece.function.arguments:
                    parts.arguments.append(piece.function.arguments)
    return texts, progressed or bool(texts)


def _finish_tool_calls(provider: str, calls: dict[int, _ToolCallParts]) -> list[ToolCall]:
    done: list[ToolCall] = []
    for index in sorted(calls):
        parts = calls[index]
        if not parts.name:
            raise ProviderError(provider, f"tool call #{index} arrived without a function name")
        arguments = "".join(parts.arguments) or "{}"  # some servers send "" for no arguments
        done.append(ToolCall(id=parts.id or f"call_{index}", name=parts.name, arguments=arguments))
    return done


def _error_text(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        message = body.get("message") or body.get("error")
        if message:
            return str(message)
        return json.dumps(body)[:500]
    return exc.response.text[:500] if exc.response is not None else str(exc)
