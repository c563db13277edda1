"""Run a flow on a call: execute the engine's actions against a ``CallIO``, feed results back.

    runner = FlowRunner(flow, io, llm, http, on_step=save_state)
    final = await runner.run()            # new call
    final = await runner.run(saved)       # resume a call whose instance died

``on_step`` is awaited after every engine step and before anything of that step is spoken, so a
crash loses at most the turn in progress.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
import structlog

from ivr.call.io import CallIO, Digits, HungUp, NoInput, Utterance
from ivr.errors import ProviderError
from ivr.flows.engine import FlowRuntimeError, new_state, step
from ivr.flows.events import (
    AgentTurn,
    CallerHungUp,
    CallerPressed,
    CallerSaid,
    CallerSilent,
    CallStarted,
    ClassifyIntent,
    FlowAction,
    FlowEvent,
    FlowState,
    Hangup,
    HttpRequest,
    HttpResult,
    IntentClassified,
    Listen,
    LlmReplied,
    Resumed,
    Say,
    ToolCallEvent,
    Transfer,
)
from ivr.flows.model import Flow
from ivr.llm.base import ChatMessage, LanguageModel, TextDelta, ToolCall

log = structlog.get_logger("ivr.flows")

OnStep = Callable[[FlowState], Awaitable[None]]


class FlowRunner:
    def __init__(
        self,
        flow: Flow,
        io: CallIO,
        llm: LanguageModel | None,
        http: httpx.AsyncClient,
        on_step: OnStep | None = None,
        *,
        call_vars: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.flow = flow
        self.io = io
        self.llm = llm
        self.http = http
        self.on_step = on_step
        self.call_vars = dict(call_vars or {})
        self.env = env

    async def run(self, state: FlowState | None = None) -> FlowState:
        """Run until the call ends (hang-up, transfer, caller gone); returns the final state."""
        event: FlowEvent
        if state is None or state.waiting == "start":
            state = state or new_state(self.flow, self.call_vars, self.env)
            event = CallStarted()
        else:
            event = Resumed()
        while True:
            state, actions = step(self.flow, state, event)
            log.debug("flow.step", flow=self.flow.name, node=state.node, waiting=state.waiting)
            if self.on_step is not None:
                await self.on_step(state)
            result = await self._execute(actions)
            if result is None:
                if not state.done:
                    raise FlowRuntimeError(
                        f"node '{state.node}' stopped without waiting for anything"
                    )
                log.info("flow.ended", flow=self.flow.name, node=state.node, outcome=state.outcome)
                return state
            event = result

    async def _execute(self, actions: list[FlowAction]) -> FlowEvent | None:
        for action in actions:
            if isinstance(action, Say):
                await self.io.say(action.text, interruptible=action.interruptible)
            elif isinstance(action, Transfer):
                await self.io.transfer(action.number)
            elif isinstance(action, Hangup):
                await self.io.hangup()
            else:
                return await self._wait_for(action)
        return None

    async def _wait_for(self, action: FlowAction) -> FlowEvent:
        if isinstance(action, Listen):
            return _caller_event(await self.io.listen(action.spec))
        if isinstance(action, AgentTurn):
            return await self._agent_turn(action)
        if isinstance(action, ClassifyIntent):
            return await self._classify(action)
        if isinstance(action, HttpRequest):
            return await self._http(action)
        raise FlowRuntimeError(f"unknown action {action!r}")

    # ------------------------------------------------------------ LLM

    async def _agent_turn(self, turn: AgentTurn) -> LlmReplied:
        if self.llm is None:
            return LlmReplied("", error="no language model is configured")
        llm = self.llm
        calls: list[ToolCall] = []
        errors: list[str] = []

        async def deltas() -> AsyncGenerator[str, None]:
            stream = llm.stream_chat(turn.messages, tools=turn.tools, max_tokens=turn.max_tokens)
            try:
                async for item in stream:
                    if isinstance(item, TextDelta):
                        yield item.text
                    else:
                        calls.append(item)
            except ProviderError as exc:
                errors.append(str(exc))
            finally:
                await _close(stream)

        chunks = deltas()
        try:
            spoken = await self.io.say_stream(chunks, interruptible=turn.interruptible)
        finally:
            await chunks.aclose()  # an interrupted reply stops generating on the server
        if errors:
            log.warning("flow.llm_failed", flow=self.flow.name, error=errors[0])
        return LlmReplied(
            text_heard=spoken.text_heard,
            interrupted=spoken.interrupted,
            tool_calls=tuple(ToolCallEvent(c.id, c.name, c.arguments) for c in calls),
            error=errors[0] if errors else None,
        )

    async def _classify(self, ask: ClassifyIntent) -> IntentClassified:
        if self.llm is None:
            return IntentClassified(None, error="no language model is configured")
        schema = classifier_schema(ask)
        text: list[str] = []
        stream = self.llm.stream_chat(_classifier_messages(ask), json_schema=schema)
        try:
            async for item in stream:
                if isinstance(item, TextDelta):
                    text.append(item.text)
            answer = json.loads("".join(text))
        except (ProviderError, ValueError) as exc:
            log.warning("flow.classify_failed", flow=self.flow.name, error=str(exc))
            return IntentClassified(None, error=str(exc))
        finally:
            await _close(stream)
        if not isinstance(answer, dict):
            return IntentClassified(None, error="the classifier did not answer a JSON object")
        intent = answer.pop("intent", None)
        slots = {k: v for k, v in answer.items() if v is not None}
        return IntentClassified(intent if intent not in (None, "none") else None, slots)

    # ------------------------------------------------------------ HTTP

    async def _http(self, request: HttpRequest) -> HttpResult:
        try:
            response = await self.http.request(
                request.method,
                request.url,
                headers=dict(request.headers),
                json=request.json,
                timeout=request.timeout,
            )
        except httpx.HTTPError as exc:
            log.warning("flow.http_failed", flow=self.flow.name, error=type(exc).__name__)
            return HttpResult(
                False, 0, None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        try:
            body = response.json() if response.content else None
        except ValueError:
            body = None
        if not response.is_success:
            return HttpResult(False, response.status_code, body, f"HTTP {response.status_code}")
        return HttpResult(True, response.status_code, body)


async def _close(stream: AsyncIterator[object]) -> None:
    """Close an LLM stream early: that closes the HTTP stream, so the server stops generating."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _caller_event(heard: Utterance | Digits | NoInput | HungUp) -> FlowEvent:
    if isinstance(heard, Utterance):
        return CallerSaid(heard.text)
    if isinstance(heard, Digits):
        return CallerPressed(heard.digits)
    if isinstance(heard, NoInput):
        return CallerSilent()
    return CallerHungUp()


def classifier_schema(ask: ClassifyIntent) -> dict[str, Any]:
    """Strict structured-output schema: the intent (or "none") plus any slots, all nullable."""
    props: dict[str, Any] = {}
    if ask.intents:
        props["intent"] = {"type": "string", "enum": [i.name for i in ask.intents] + ["none"]}
    if ask.extract_schema is not None:
        for name, prop in ask.extract_schema.get("properties", {}).items():
            kind = prop.get("type")
            nullable = [kind, "null"] if isinstance(kind, str) else kind
            props[name] = {**prop, "type": nullable} if kind else prop
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def _classifier_messages(ask: ClassifyIntent) -> list[ChatMessage]:
    lines = ["You read what a phone caller said and answer only with JSON."]
    if ask.intents:
        lines.append('Pick the caller\'s intent from this list, or "none" if none fits:')
        for intent in ask.intents:
            examples = "; ".join(intent.examples[:5])
            lines.append(f"- {intent.name}: {intent.description} (e.g. {examples})")
    if ask.extract_schema is not None:
        lines.append("Extract the fields of the schema from the answer; null when not said.")
    return [ChatMessage("system", "\n".join(lines)), ChatMessage("user", ask.text)]
