"""The language-model seam: a chat history in, a stream of text and tool calls out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call, in OpenAI's JSON-schema form."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """Raw JSON text as the model produced it; the caller validates it."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


LlmEvent = TextDelta | ToolCall


class LanguageModel(Protocol):
    name: str
    model: str

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        first_output_limit: float | None = None,
    ) -> AsyncIterator[LlmEvent]:
        """Stream the reply: ``TextDelta``s as tokens arrive, then any ``ToolCall``s, complete.

        With ``json_schema`` the reply text is constrained to that schema (structured output).
        Raises ``ProviderError`` / ``ProviderTimeout``; the first token must arrive within the
        provider's first-token timeout, or ``first_output_limit`` seconds when given.
        """
        ...

    async def start(self) -> None:
        """Make the model reachable (launch a local server); no-op for a remote API."""
        ...

    async def aclose(self) -> None: ...
