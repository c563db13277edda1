"""The flow side of speculative turns: start the reply to words the caller may not have finished.

While the caller pauses, the call hands the runner a tentative transcript. The speculator asks
the pure engine what the flow *would* do with it (``step`` on a copy of the state: nothing is
saved, nothing happens) and, when that is an LLM request, starts it now (``PrefetchingModel``)
and has the call synthesise the reply's first sentence as soon as the stream holds it. The flow
itself only ever runs committed input: when the turn ends with the same words, its LLM request
is identical and adopts the prefetched stream; different words, or the caller going on, throw
the prefetch away (the HTTP stream is cancelled; nothing was heard, nothing is in the history).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ivr.callio.prefetch import Prefetch
from ivr.callio.speculation import Speculation
from ivr.flows.classifier import classifier_request
from ivr.flows.engine import step
from ivr.flows.events import AgentTurn, CallerSaid, ClassifyIntent, FlowState, Say
from ivr.flows.model import Flow
from ivr.llm.base import ChatMessage, LanguageModel, LlmEvent, TextDelta, ToolSpec

log = structlog.get_logger("ivr.flows")


@dataclass(frozen=True, slots=True)
class _Request:
    """What makes two LLM requests the same request."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...]
    json_schema: dict[str, Any] | None
    max_tokens: int | None


class PrefetchingModel:
    """A ``LanguageModel`` for one call that can start a request before the flow sends it."""

    def __init__(self, inner: LanguageModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.model = inner.model
        self._pending: tuple[_Request, Prefetch[LlmEvent]] | None = None

    def prefetch(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> Prefetch[LlmEvent]:
        self.discard()
        request = _Request(tuple(messages), tuple(tools), json_schema, max_tokens)
        prefetch: Prefetch[LlmEvent] = Prefetch(
            "llm",
            lambda: self.inner.stream_chat(
                messages, tools=tools, json_schema=json_schema, max_tokens=max_tokens
            ),
            join=join_text,
        )
        self._pending = (request, prefetch)
        return prefetch

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[ToolSpec] = (),
        json_schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        first_output_limit: float | None = None,
    ) -> AsyncIterator[LlmEvent]:
        """The prefetched reply if it was asked for exactly this (it keeps the limits it
        started with), else a new request."""
        pending, self._pending = self._pending, None

        def live() -> AsyncIterator[LlmEvent]:
            return self.inner.stream_chat(
                messages,
                tools=tools,
                json_schema=json_schema,
                max_tokens=max_tokens,
                first_output_limit=first_output_limit,
            )

        if pending is not None:
            request, prefetch = pending
            same = request == _Request(tuple(messages), tuple(tools), json_schema, max_tokens)
            if same and not prefetch.failed_early:
                return prefetch.adopt(live)
            prefetch.discard()
        return live()

    def discard(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].discard()

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        """Drop this call's prefetch; the model itself is shared and stays open."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending[1].aclose()


class TurnSpeculator:
    """Owned by a ``FlowRunner``: reacts to the call's tentative transcripts."""

    def __init__(self, flow: Flow, llm: PrefetchingModel | None, io: Speculation) -> None:
        self._flow = flow
        self._llm = llm
        self._io = io
        self._state: FlowState | None = None
        self._text: str | None = None
        """The words the prefetch in flight answers."""
        self._voicing: asyncio.Task[None] | None = None

    def listening(self, state: FlowState | None) -> None:
        """The flow waits for the caller in ``state`` (None: it does not wait any more). A
        new wait makes whatever the last one prefetched and did not use stale."""
        if state is not None:
            self.retract()
        self._state = state

    def on_tentative(self, text: str | None) -> None:
        """``text``: the caller's words at a pause; None: they went on talking. What was
        started stays until the next pause says whether the words changed: the same words
        need no second request (a breath, a cough), and adoption is by exact request anyway."""
        if text is None or text == self._text:
            return
        self.retract()
        if self._state is None:
            return
        self._text = text
        try:
            _, actions = step(self._flow, self._state, CallerSaid(text))
        except Exception as exc:  # the real step will meet (and report) the same problem
            log.debug("flow.speculation_skipped", error=repr(exc))
            return
        first = actions[0] if actions else None
        if isinstance(first, Say):
            self._io.prefetch_speech(first.text)
        elif isinstance(first, AgentTurn) and self._llm is not None:
            prefetch = self._llm.prefetch(
                first.messages, tools=first.tools, max_tokens=first.max_tokens
            )
            self._voicing = asyncio.create_task(self._voice_first_sentence(prefetch))
        elif isinstance(first, ClassifyIntent) and self._llm is not None:
            messages, schema = classifier_request(first)
            self._llm.prefetch(messages, json_schema=schema)

    async def _voice_first_sentence(self, prefetch: Prefetch[LlmEvent]) -> None:
        """Have the call synthesise the reply's first sentence as soon as it is complete, cut
        exactly as the reply will cut it (the same chunker over the same deltas)."""
        chunker = self._io.reply_chunker()
        seen = 0
        while True:
            items = prefetch.items_so_far()
            for item in items[seen:]:
                if isinstance(item, TextDelta):
                    pieces = chunker.push(item.text)
                    if pieces:
                        self._io.prefetch_speech(pieces[0])
                        return
            seen = len(items)
            if prefetch.adopted:  # the turn's reply reads it now, and voices it as it comes
                return
            if prefetch.done:
                pieces = chunker.flush()
                if pieces and not prefetch.failed_early:
                    self._io.prefetch_speech(pieces[0])
                return
            await prefetch.wait_changed()

    def retract(self) -> None:
        """What was started on stale words is thrown away."""
        self._text = None
        if self._voicing is not None:
            self._voicing.cancel()
            self._voicing = None
        if self._llm is not None:
            self._llm.discard()

    async def aclose(self) -> None:
        voicing, self._voicing = self._voicing, None
        if voicing is not None:
            voicing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await voicing
        if self._llm is not None:
            await self._llm.aclose()


def join_text(events: Sequence[LlmEvent]) -> list[LlmEvent]:
    """``events`` with each run of text deltas as one delta (tool calls stay where they are)."""
    joined: list[LlmEvent] = []
    run: list[str] = []
    for event in events:
        if isinstance(event, TextDelta):
            run.append(event.text)
            continue
        if run:
            joined.append(TextDelta("".join(run)))
            run = []
        joined.append(event)
    if run:
        joined.append(TextDelta("".join(run)))
    return joined
