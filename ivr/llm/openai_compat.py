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

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from typing import Any

from ivr.errors import ProviderError
from ivr.llm.base import ChatMessage, LlmEvent, TextDelta, ToolCall, ToolSpec
from ivr.providers.openai_http import (
    OpenAIEndpoint,
    StageLimits,
    WaitClock,
    payload_error,
    sse_event_batches,
)

REASONING_OFF: Mapping[str, Any] = {"reasoning_effort": "none"}
"""Thinking off on Cerebras and the Hugging Face router (Gemma 4, GPT-OSS: minimum effort)."""
CHAT_TEMPLATE_NO_THINKING: Mapping[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
"""Thinking off on self-hosted vLLM / SGLang / llama.cpp serving Gemma 4 or Qwen 3."""

JsonDict = dict[str, Any]
_SCHEMA_NAME = re.compile(r"[^a-zA-Z0-9_-]")
_NOT_SSE = ("application/json", "text/html", "text/plain")


@dataclass(slots=True)
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class OpenAICompatLlm:
    """``LanguageModel`` over ``/v1/chat/completions`` with streaming.

    Iterate ``stream_chat`` inside ``contextlib.aclosing`` (or to the end): closing the
    generator closes the HTTP stream, which stops generation on the server. Every failure is a
    ``ProviderError``; no retries here (they are ``the kind's resilient wrapper's decision).
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
        # Lenient defaults for tools and tests on a busy machine; the gateway passes the
        # IVR_LLM_* settings (ivr/providers.py), which keep dead air under 2 s.
        first_token_timeout: float = 3.0,
        total_timeout: float = 20.0,
        stall_timeout: float = 5.0,
        connect_timeout: float = 3.0,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.limits = StageLimits(first_token_timeout, stall_timeout, total_timeout)
        """Seconds from the request to the first text or tool-call delta; between later chunks;
        waiting on the server for one reply in all."""
        self.extra_body = dict(extra_body) if extra_body else None
        """Provider-specific top-level fields merged into every request body."""
        self._http = OpenAIEndpoint(
            base_url,
            api_key,
            provider=name,
            read_timeout=total_timeout + 1.0,
            connect_timeout=connect_timeout,
        )

    async def start(self) -> None:
        """Nothing to launch: the model runs at the provider."""

    @property
    def first_token_timeout(self) -> float:
        return self.limits.first

    async def aclose(self) -> None:
        await self._http.aclose()

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
        first_output_limit: float | None = None,
    ) -> AsyncIterator[LlmEvent]:
        """See ``LanguageModel.stream_chat``; ``first_output_limit`` replaces the first-token
        timeout for this call."""
        params = self.request_params(
            messages, tools=tools, json_schema=json_schema, max_tokens=max_tokens
        )
        limits = self.limits
        if first_output_limit is not None:
            limits = StageLimits(first_output_limit, limits.stall, limits.total)
        clock = WaitClock(
            self.name, limits, first_phase="first token", transport_timeout=limits.total + 1.0
        )
        calls: dict[int, _ToolCallParts] = {}
        body = {k: v for k, v in params.items() if k != "extra_body"} | (self.extra_body or {})
        received = 0
        async with AsyncExitStack() as stack:
            response = await clock.wait(
                stack.enter_async_context(self._http.post("/chat/completions", json_body=body))
            )
            kind = response.headers.get("content-type", "")
            if kind.startswith(_NOT_SSE):  # an error page or a JSON body served with status 200
                raise payload_error(self.name, f"{kind} instead of an event stream")
            batches = sse_event_batches(response.content)
            batches = await stack.enter_async_context(aclosing(batches))
            while (batch := await clock.wait(anext(batches, None))) is not None:
                # The text of the events one read found goes on as one delta: every delta
                # is a trip through each layer above (flow, prefetch, sentence splitter).
                merged: list[str] = []
                try:
                    for chunk in batch:
                        received += 1
                        texts, progressed = _absorb(self.name, chunk, calls)
                        if progressed:
                            clock.output_started()
                        merged.extend(t.text for t in texts)
                except ProviderError:
                    if merged:  # what came before a malformed chunk is still handed over
                        yield TextDelta("".join(merged))
                    raise
                if merged:
                    yield TextDelta("".join(merged))
        if not received:
            raise payload_error(self.name, "the stream ended without a single chunk")
        for call in _finish_tool_calls(self.name, calls):
            yield call


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


def _absorb(
    provider: str, chunk: object, calls: dict[int, _ToolCallParts]
) -> tuple[list[TextDelta], bool]:
    """Text deltas of one chunk, and whether it carried any token (text or tool call).

    Tool-call pieces are collected into ``calls``. Reasoning deltas (``reasoning`` /
    ``reasoning_content`` fields) are dropped: they must never be spoken. Chunks are the JSON
    as sent, so a wrong shape (``"choices": null``, no ``delta``) is caught here.
    """
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        raise payload_error(provider, 'stream chunk without a "choices" list')
    try:
        return _absorb_choices(chunk, calls)
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        raise payload_error(provider, f"malformed stream chunk ({exc})") from exc


def _absorb_choices(
    chunk: JsonDict, calls: dict[int, _ToolCallParts]
) -> tuple[list[TextDelta], bool]:
    texts: list[TextDelta] = []
    progressed = False
    for choice in chunk["choices"]:
        if choice.get("index", 0) != 0:
            continue
        delta = choice["delta"]
        if not isinstance(delta, dict):
            raise TypeError(f"delta is {type(delta).__name__}, not an object")
        if (content := delta.get("content")) is not None and not isinstance(content, str):
            raise TypeError(f"delta.content is {type(content).__name__}, not a string")
        if content:
            texts.append(TextDelta(content))
        for piece in delta.get("tool_calls") or ():
            progressed = True
            parts = calls.setdefault(int(piece.get("index", 0)), _ToolCallParts())
            parts.id = piece.get("id") or parts.id
            if (function := piece.get("function")) is not None:
                parts.name = function.get("name") or parts.name
                if arguments := function.get("arguments"):
                    parts.arguments.append(arguments)
    return texts, progressed or bool(texts)


def _finish_tool_calls(provider: str, calls: dict[int, _ToolCallParts]) -> list[ToolCall]:
    done: list[ToolCall] = []
    for index in sorted(calls):
        parts = calls[index]
        if not parts.name:
            raise payload_error(provider, f"tool call #{index} arrived without a function name")
        arguments = "".join(parts.arguments) or "{}"  # some servers send "" for no arguments
        done.append(ToolCall(id=parts.id or f"call_{index}", name=parts.name, arguments=arguments))
    return done
