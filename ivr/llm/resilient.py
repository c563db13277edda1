"""``ResilientLlm``: an LLM primary and its fallbacks, with retries, until the first event
(``ivr.providers.resilience``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ivr.llm.base import ChatMessage, LanguageModel, LlmEvent, ToolSpec
from ivr.providers.resilience import ProviderChain, RetryPolicy, check_providers, first_output


class ResilientLlm(ProviderChain[LanguageModel]):
    """``LanguageModel``: the primary, then the fallbacks, with retries, until the first event;
    never a retry after it."""

    def __init__(self, providers: Sequence[LanguageModel], policy: RetryPolicy) -> None:
        check_providers("llm", providers)
        super().__init__(providers, policy)
        self.model = providers[0].model

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        first_output_limit: float | None = None,
    ) -> AsyncIterator[LlmEvent]:
        """``first_output_limit`` replaces the policy's budget for this call."""

        def attempt(llm: LanguageModel, limit: float) -> AsyncIterator[LlmEvent]:
            return llm.stream_chat(
                messages,
                tools=tools,
                json_schema=json_schema,
                max_tokens=max_tokens,
                first_output_limit=limit,
            )

        policy = self.policy.limited(first_output_limit)
        return first_output("llm", self.providers, attempt, policy)

    async def start(self) -> None:
        for provider in self.providers:
            await provider.start()
