"""Run a flow on a call: execute the engine's actions against a ``CallIO``, feed results back.

    runner = FlowRunner(flow, io, llm, http, on_step=save_state)
    final = await runner.run()            # new call
    final = await runner.run(saved)       # resume a call whose instance died

``on_step`` is awaited after every engine step and before anything of that step is spoken, so a
crash loses at most the turn in progress. A request that is not idempotent is saved twice: in
flight with its idempotency key (the step that asks for it), then with its answer, before the
engine reads it; a resumed call re-sends it with the same key or reads the kept answer.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx
import structlog

from ivr.call.io import CallIO, Digits, HungUp, NoInput, Utterance
from ivr.errors import ProviderError
from ivr.flows.engine import FlowRuntimeError, call_env, new_state, step
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
from ivr.flows.waits import answered, kept_answer
from ivr.llm.base import ChatMessage, LanguageModel, TextDelta, ToolCall
from ivr.obs.metrics import count_provider_error

log = structlog.get_logger("ivr.flows")

OnStep = Callable[[FlowState], Awaitable[None]]

MAX_BODY = 1_000_000
"""Largest HTTP answer read from a backend, in bytes."""


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
        resume_prompt: str = "",
    ) -> None:
        """``resume_prompt`` is the gateway's apology when a call resumes, for flows that set
        none of their own (``IVR_RESUME_PROMPT``)."""
        self.flow = flow
        self.io = io
        self.llm = llm
        self.http = http
        self.on_step = on_step
        self.call_vars = dict(call_vars or {})
        self.env = env
        self.resume_prompt = resume_prompt

    async def run(self, state: FlowState | None = None) -> FlowState:
        """Run until the call ends (hang-up, transfer, caller gone); returns the final state."""
        event: FlowEvent
        if state is None or state.waiting == "start":
            state = state or new_state(self.flow, self.call_vars, self.env)
            event = CallStarted()
        else:
            state = state.model_copy(update={"env": call_env(self.flow, self.env)})
            event = Resumed(self.resume_prompt)
        if not state.call_id:  # a new call, or one saved before keys existed
            state = state.model_copy(update={"call_id": self._call_id()})
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
            if isinstance(result, HttpResult) and isinstance(actions[-1], HttpRequest):
                state, result = await self._keep_answer(state, actions[-1], result)
            event = result

    def _call_id(self) -> str:
        """The call in idempotency keys: its CallSid, else (tests, tools) a random id."""
        return str(self.call_vars.get("call_sid") or uuid.uuid4().hex)

    async def _keep_answer(
        self, state: FlowState, request: HttpRequest, result: HttpResult
    ) -> tuple[FlowState, HttpResult]:
        """Save the answer to a keyed request before the engine reads it: a call resumed from
        here on reads it instead of sending the request again. The engine reads the kept
        answer, so a resumed call and a live one go on alike."""
        if request.key is None:
            return state, result
        kept = await asyncio.to_thread(kept_answer, result, request.keep)
        state = answered(state, request.key, kept)
        if self.on_step is not None:
            await self.on_step(state)
        return state, kept

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
            except ProviderError as exc:  # given up on here: the flow's error path answers
                count_provider_error("llm", exc.provider, exc)
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
        except (ProviderError, ValueError, RecursionError) as exc:
            if isinstance(exc, ProviderError):
                count_provider_error("llm", exc.provider, exc)
            log.warning("flow.classify_failed", flow=self.flow.name, error=str(exc))
            return IntentClassified(None, error=str(exc))
        finally:
            await _close(stream)
        if not isinstance(answer, dict):
            return IntentClassified(None, error="the classifier did not answer a JSON object")
        intent = answer.pop("intent", None)
        offered = {i.name for i in ask.intents}
        slots = {k: v for k, v in answer.items() if v is not None}
        return IntentClassified(
            intent if isinstance(intent, str) and intent in offered else None, slots
        )

    # ------------------------------------------------------------ HTTP

    async def _http(self, request: HttpRequest) -> HttpResult:
        try:
            async with asyncio.timeout(request.timeout):  # total, not per read
                status, content = await self._fetch(request)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TimeoutError) as exc:
            # ValueError covers headers or URLs httpx cannot encode (e.g. non-ASCII headers).
            name = "TimeoutError" if isinstance(exc, TimeoutError) else type(exc).__name__
            log.warning("flow.http_failed", flow=self.flow.name, error=name)
            return HttpResult(False, 0, None, f"{name}: {exc}" if str(exc) else name)
        if content is None:
            return HttpResult(
                False, status, None, f"the answer is too large (over {MAX_BODY} bytes)"
            )
        body = await _parse_json(content)
        if not 200 <= status < 300:
            return HttpResult(False, status, body, f"HTTP {status}")
        return HttpResult(True, status, body)

    async def _fetch(self, request: HttpRequest) -> tuple[int, bytes | None]:
        """Status and body; the body is None when it is larger than ``MAX_BODY``."""
        async with self.http.stream(
            request.method,
            request.url,
            headers=dict(request.headers),
            json=request.json,
            timeout=request.timeout,
        ) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_BODY:
                    return response.status_code, None
                chunks.append(chunk)
            return response.status_code, b"".join(chunks)


async def _parse_json(content: bytes) -> Any:
    """The JSON answer, or None; a large one is parsed in a worker thread."""
    if not content:
        return None
    try:
        if len(content) > 64_000:
            return await asyncio.to_thread(json.loads, content)
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


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
