"""The offline LLM as a provider: SmolLM2 on llama.cpp, in a server process of its own
(``ivr.engines.llm_server``), talked to by the ordinary OpenAI-compatible client."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ivr.engines.llm_server import LocalLlmError, LocalLlmServer
from ivr.llm.base import ChatMessage, LanguageModel, LlmEvent, ToolSpec

log = logging.getLogger("ivr.engines.llm_server")  # the name its log lines have always had

ClientFactory = Callable[[str, str, str], LanguageModel]
"""(base_url, api_key, model) -> the OpenAI-compatible client that talks to the server."""


class OfflineLlm:
    """A ``LanguageModel`` served by a ``LocalLlmServer`` that ``start()`` launches.

    Built before the gateway starts (so every part of it can hold the model from the first
    moment); ``stream_chat`` raises ``LocalLlmError`` until ``start()`` has run.
    """

    name = "local"

    def __init__(self, connect: ClientFactory, server: LocalLlmServer | None = None) -> None:
        self._connect = connect
        self._server = server or LocalLlmServer()
        self._client: LanguageModel | None = None
        self.model = self._server.model

    async def start(self) -> None:
        log.info("llm.offline: starting the offline model server (no LLM API key set)")
        await self._server.start()
        server = self._server
        self._client = self._connect(server.base_url, server.api_key, server.model)

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        first_output_limit: float | None = None,
    ) -> AsyncIterator[LlmEvent]:
        if self._client is None:
            raise LocalLlmError("the offline model server has not been started")
        return self._client.stream_chat(
            messages,
            tools=tools,
            json_schema=json_schema,
            max_tokens=max_tokens,
            first_output_limit=first_output_limit,
        )

    async def aclose(self) -> None:
        try:
            if self._client is not None:
                await self._client.aclose()
        finally:
            self._client = None
            await self._server.stop()
