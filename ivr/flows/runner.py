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

from ivr.callio.interruption_policy import InterruptionPolicy
from ivr.callio.io import CallIO, Digits, HungUp, NoInput, Spoken, Utterance
from ivr.callio.timeline import CallTimeline
from ivr.errors import ProviderError
from ivr.flows.classifier import classifier_request
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
from ivr.flows.privacy import stored_digits
from ivr.flows.speculation import PrefetchingModel, TurnSpeculator
from ivr.flows.waits import answered, kept_answer
from ivr.llm.base import LanguageModel, TextDelta, ToolCall
from ivr.obs.metrics import count_provider_error
from ivr.obs.pii import mask_speech

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
        wait_for_beep: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``resume_prompt`` is the gateway's apology when a call resumes, for flows that set
        none of their own (``IVR_RESUME_PROMPT``). ``wait_for_beep`` returns once a machine's
        greeting is over (outbound calls); a ``say`` with ``after_beep`` waits for it."""
        self.flow = flow
        self.io = io
        # Per call: a reply may be requested while the caller pauses, and adopted if the
        # turn ends on the same words (see ivr.flows.speculation).
        self.llm: LanguageModel | None = PrefetchingModel(llm) if llm is not None else None
        self._speculator = (
            TurnSpeculator(flow, self.llm, io.capabilities.speculation)
            if io.capabilities.speculation is not None and isinstance(self.llm, PrefetchingModel)
            else None
        )
        self._state: FlowState | None = None
        self.http = http
        self.on_step = on_step
        self.call_vars = dict(call_vars or {})
        self.env = env
        self.resume_prompt = resume_prompt
        self.wait_for_beep = wait_for_beep
        # Key presses, barge-ins and node changes, for the call record (saved with each step).
        self.timeline: CallTimeline | None = io.capabilities.timeline

    async def run(self, state: FlowState | None = None) -> FlowState:
        """Run until the call ends (hang-up, transfer, caller gone); returns the final state."""
        speculator = self._speculator
        speculation = self.io.capabilities.speculation
        if speculator is None or speculation is None:
            return await self._run(state)
        speculation.on_tentative_input(speculator.on_tentative)
        try:
            return await self._run(state)
        finally:
            speculation.on_tentative_input(None)
            await speculator.aclose()

    async def _run(self, state: FlowState | None) -> FlowState:
        event: FlowEvent
        if state is None or state.waiting == "start":
            state = state or new_state(self.flow, self.call_vars, self.env)
            event = CallStarted()
        else:
            state = state.model_copy(update={"env": call_env(self.flow, self.env)})
            event = Resumed(self.resume_prompt)
        if not state.call_id:  # a new call, or one saved before keys existed
            state = state.model_copy(update={"call_id": self._call_id()})
        # A new call's first landing is a node change too; a resumed one's is not.
        at = ("", "") if isinstance(event, CallStarted) else (state.flow, state.node)
        while True:
            state, actions = step(self.flow, state, event)
            self._state = state
            at = self._note_node(at, state)
            log.debug("flow.step", flow=self.flow.name, node=state.node, waiting=state.waiting)
            if self.on_step is not None:
                await self.on_step(state)
            result = await self._execute(actions)
            if result is None:
                if not state.done and state.waiting != "transfer":  # warm: the call may return
                    raise FlowRuntimeError(
                        f"node '{state.node}' stopped without waiting for anything"
                    )
                log.info("flow.ended", flow=self.flow.name, node=state.node, outcome=state.outcome)
                return state
            if isinstance(result, HttpResult) and isinstance(actions[-1], HttpRequest):
                state, result = await self._keep_answer(state, actions[-1], result)
            event = result

    def _note_node(self, at: tuple[str, str], state: FlowState) -> tuple[str, str]:
        """Where the step landed; a node change is noted on the timeline."""
        now = (state.flow, state.node)
        if self.timeline is not None and state.node and now != at:
            self.timeline.add("node", flow=state.flow, to=state.node, **{"from": at[1]})
        return now

    def _note_spoken(self, spoken: Spoken) -> None:
        if self.timeline is not None and spoken.interrupted:
            node = self._state.node if self._state is not None else ""
            heard = mask_speech(spoken.text_heard)  # stored like the history it ends
            unheard = mask_speech(spoken.text_unheard)  # the console shows where it was cut
            self.timeline.add("barge_in", node=node, heard=heard, unheard=unheard)

    def _note_keys(self, heard: Utterance | Digits | NoInput | HungUp) -> None:
        if self.timeline is not None and isinstance(heard, Digits) and self._state is not None:
            digits = stored_digits(self.flow, self._state, heard.digits)
            self.timeline.add("dtmf", node=self._state.node, digits=digits)

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

    def _interruptions(self, policy: InterruptionPolicy | None) -> None:
        control = self.io.capabilities.interruptions
        if control is not None:
            control.set_interruption_policy(policy)

    async def _execute(self, actions: list[FlowAction]) -> FlowEvent | None:
        for action in actions:
            if isinstance(action, Say):
                if action.after_beep and self.wait_for_beep is not None:
                    await self.wait_for_beep()
                self._interruptions(action.interruptions)
                spoken = await self.io.say(action.text, interruptible=action.interruptible)
                self._note_spoken(spoken)
            elif isinstance(action, Transfer):
                await self.io.transfer(action.number, action.warm)
            elif isinstance(action, Hangup):
                await self.io.hangup()
            else:
                return await self._wait_for(action)
        return None

    async def _wait_for(self, action: FlowAction) -> FlowEvent:
        if isinstance(action, Listen):
            if self._speculator is None:
                heard = await self.io.listen(action.spec)
            else:
                self._speculator.listening(self._state)
                try:
                    heard = await self.io.listen(action.spec)
                finally:
                    self._speculator.listening(None)
            self._note_keys(heard)
            return _caller_event(heard)
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
            self._interruptions(turn.interruptions)
            spoken = await self.io.say_stream(chunks, interruptible=turn.interruptible)
        finally:
            await chunks.aclose()  # an interrupted reply stops generating on the server
        self._note_spoken(spoken)
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
        messages, schema = classifier_request(ask)
        text: list[str] = []
        stream = self.llm.stream_chat(messages, json_schema=schema)
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
