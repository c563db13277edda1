"""The pure flow engine: ``step(flow, state, event) -> (state, actions)``. No I/O, no clocks.

Entering a node runs the nodes that need nothing from the outside (set, branch, goto, say,
subflow, return) until one must wait: for the caller (ask, menu, agent), for the LLM, or for an
HTTP answer. The input state is never modified; the returned state is a new object.

``flow`` is the call's flow with its sub-flows attached (``Flow.subflows``); a subflow node
pushes a ``Frame`` onto ``state.stack`` and runs the sub-flow with its own variables until a
return node pops it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ivr import phrases
from ivr.control.transfers import WarmTransfer
from ivr.errors import FlowError
from ivr.flows import argcheck, matching
from ivr.flows.agent import AgentSteps
from ivr.flows.events import (
    CallerHungUp,
    CallerPressed,
    CallerSaid,
    CallerSilent,
    CallStarted,
    ClassifyIntent,
    FlowAction,
    FlowEvent,
    FlowState,
    Frame,
    Hangup,
    HttpResult,
    IntentClassified,
    IntentOption,
    Listen,
    LlmReplied,
    Resumed,
    Say,
    Transfer,
)
from ivr.flows.model import (
    AgentNode,
    AskNode,
    BranchNode,
    EnvVar,
    Flow,
    GotoNode,
    HangupNode,
    HttpNode,
    MenuNode,
    ReturnNode,
    SayNode,
    SetNode,
    SubflowNode,
    TransferNode,
)
from ivr.flows.template import lookup, render, render_value
from ivr.flows.waits import as_result, listen_spec, read_answer, resend, send, waiting_request
from ivr.telephony.dialing import is_dialable

MAX_HOPS = 64
"""Nodes entered without waiting for anything; the validator rejects such loops, this is a guard."""


class FlowRuntimeError(FlowError):
    """The engine got an event it cannot handle in the current state."""


def new_state(
    flow: Flow, call_vars: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> FlowState:
    """A fresh state: flow variables, then ``call_vars``. ``{env: NAME}`` variables are not
    stored in ``vars``: they are read from ``state.env``, which is never persisted."""
    values = start_values(flow)
    values.update(call_vars or {})
    return FlowState(
        flow=flow.name,
        version=flow.version,
        node=flow.start,
        vars=values,
        env=call_env(flow, env),
    )


def call_env(flow: Flow, env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The environment values a call's flows read (``os.environ`` when ``env`` is None);
    names that are not set are left out (their variables take the default)."""
    environ = os.environ if env is None else env
    names = {
        default.env
        for one in (flow, *flow.subflows.values())
        for default in one.variables.values()
        if isinstance(default, EnvVar)
    }
    return {name: environ[name] for name in sorted(names) if name in environ}


def start_values(flow: Flow) -> dict[str, Any]:
    """A flow's variables at its start, without the ``{env: NAME}`` ones."""
    return {k: v for k, v in flow.variables.items() if not isinstance(v, EnvVar)}


def env_values(flow: Flow, env: Mapping[str, str | None]) -> dict[str, Any]:
    """A flow's ``{env: NAME}`` variables (their default when the name is not set)."""
    values: dict[str, Any] = {}
    for name, default in flow.variables.items():
        if isinstance(default, EnvVar):
            found = env.get(default.env)
            values[name] = default.default if found is None else found
    return values


# Built-in variables a sub-flow starts with, copied from the flow that starts it.
CALL_VARIABLES = ("caller", "called", "call_sid")


def step(flow: Flow, state: FlowState, event: FlowEvent) -> tuple[FlowState, list[FlowAction]]:
    run = _Step(flow, state.model_copy(deep=True))
    try:
        run.state.steps += 1
        run.handle(event)
        return run.state, run.actions
    finally:
        # The agent steps point back at the step: without this, every step (one per caller
        # pause with speculation) leaves its copy of the state for the cyclic GC to find.
        del run.agent


class _Step:
    """One step of a call; it is the ``StepContext`` of the agent steps it hands agent nodes to."""

    def __init__(self, flow: Flow, state: FlowState) -> None:
        self.root = flow
        self.state = state
        self.actions: list[FlowAction] = []
        self.agent = AgentSteps(self)
        # Without a stack the call's own flow runs (whatever name the state has, as before).
        current = flow.subflows.get(state.flow) if state.stack else flow
        self.lost = current is None or not self._frames_known()
        self.flow = current or flow

    def _frames_known(self) -> bool:
        """Every waiting flow is known and waits at a subflow node (false after a version
        change under a resumed call)."""
        for frame in self.state.stack:
            flow = self.root.flow_named(frame.flow)
            if flow is None or not isinstance(flow.nodes.get(frame.node), SubflowNode):
                return False
        return True

    # ------------------------------------------------------------ dispatch

    def handle(self, event: FlowEvent) -> None:
        if self.state.done:
            return
        if self.lost and not isinstance(event, Resumed | CallerHungUp):
            raise FlowRuntimeError(
                f"flow '{self.state.flow}' of this call is not part of flow '{self.root.name}'"
            )
        if isinstance(event, CallStarted):
            self.goto(self.flow.start)
        elif isinstance(event, Resumed):
            self._resume(event)
        elif isinstance(event, CallerHungUp):
            self._finish("caller_hangup")
        elif isinstance(event, HttpResult) and self.state.waiting == "http":
            self._http_result(event)
        elif isinstance(event, HttpResult) and self.state.waiting == "tool_http":
            self.agent.tool_http_result(event)
        elif isinstance(event, IntentClassified) and self.state.waiting == "classify":
            self._classified(event)
        elif isinstance(event, LlmReplied) and self.state.waiting == "agent":
            self.agent.replied(event)
        elif isinstance(event, CallerSaid | CallerPressed | CallerSilent):
            self._caller_input(event)
        else:
            raise FlowRuntimeError(
                f"event {type(event).__name__} while waiting for {self.state.waiting} "
                f"at node '{self.state.node}'"
            )

    def _caller_input(self, event: CallerSaid | CallerPressed | CallerSilent) -> None:
        if self.state.waiting != "input":
            raise FlowRuntimeError(f"caller input while waiting for {self.state.waiting}")
        node = self.flow.nodes[self.state.node]
        if isinstance(node, AgentNode):
            self.agent.caller_input(node, event)
        elif isinstance(node, AskNode | MenuNode):
            self._answer(node, event)

    # ------------------------------------------------------------ moving between nodes

    def scope(self) -> dict[str, Any]:
        """What templates and conditions see: the environment values, then the variables."""
        return {**env_values(self.flow, self.state.env), **self.state.vars}

    def render(self, text: str) -> str:
        return render(text, self.scope())

    def say(self, text: str | None, interruptible: bool = True, after_beep: bool = False) -> None:
        if text:
            rendered = self.render(text)
            if rendered.strip():
                policy = self.flow.interruptions(self.state.node)
                self.actions.append(
                    Say(rendered, interruptible and not after_beep, after_beep, policy)
                )

    def goto(self, target: str) -> None:
        for _ in range(MAX_HOPS):
            next_target = self._enter(target)
            if next_target is None:
                return
            target = next_target
        raise FlowRuntimeError(f"more than {MAX_HOPS} nodes without waiting, last '{target}'")

    def _enter(self, target: str) -> str | None:
        """Enter ``target``; return the next node if it does not wait for anything."""
        if target == "hangup":
            self.actions.append(Hangup())
            self._finish("hangup")
            return None
        node = self.flow.nodes[target]
        self.state.node = target
        self.state.attempts = 0
        self.state.waiting = "start"
        if isinstance(node, SayNode):
            self.say(node.text, node.interruptible, node.after_beep)
            return node.next
        if isinstance(node, SetNode):
            self.state.vars.update(render_value(node.values, self.scope()))
            return node.next
        if isinstance(node, GotoNode):
            return node.next
        if isinstance(node, SubflowNode):
            return self._call(target, node)
        if isinstance(node, ReturnNode):
            return self._return()
        if isinstance(node, BranchNode):
            return next(
                (c.next for c in node.cases if matching.all_hold(c.conditions, self.scope())),
                node.default,
            )
        self._enter_waiting(node)
        return None

    def _enter_waiting(self, node: Any) -> None:
        if isinstance(node, AskNode | MenuNode):
            self._prompt(node, None)
        elif isinstance(node, AgentNode):
            self.agent.enter(node)
        elif isinstance(node, HttpNode):
            self.actions.append(send(self.state, node.request, self.scope()))
            self.state.waiting = "http"
        elif isinstance(node, TransferNode):
            self.say(node.say, interruptible=False)
            number = self.render(node.number).strip()
            if not is_dialable(number):  # a variable held something that cannot be dialled
                self.say(phrases.TRANSFER_FAILED, interruptible=False)
                self.actions.append(Hangup())
                self._finish("hangup")
                return
            self.state.transfer_to = number
            if node.warm:
                self._warm_transfer(node, number)
                return
            self.actions.append(Transfer(number))
            self._finish("transfer")
        elif isinstance(node, HangupNode):
            self.say(node.say, interruptible=False)
            self.actions.append(Hangup())
            self._finish("hangup")

    def _warm_transfer(self, node: TransferNode, number: str) -> None:
        """The call leaves the stream but the flow waits: the agent may not take it, and then
        the call comes back here (``transfer_result`` set) and goes on at ``fallback``."""
        conversation = tuple(
            (item.role, item.content)
            for item in self.state.history
            if item.role in ("user", "assistant") and item.content
        )
        warm = WarmTransfer(
            summary=self.render(node.summary or phrases.WARM_TRANSFER_SUMMARY).strip(),
            summarize=node.summarize,
            conversation=conversation,
            hold_music=node.hold_music,
            ring_timeout=node.ring_timeout,
        )
        self.actions.append(Transfer(number, warm))
        self.state.outcome = "transfer"
        self.state.transfer_result = None
        self.state.waiting = "transfer"

    def _transfer_not_taken(self, node: TransferNode, result: str) -> None:
        self.state.vars["transfer_status"] = result
        self.state.outcome = self.state.transfer_to = self.state.transfer_result = None
        assert node.fallback is not None  # the model requires it with warm: true
        self.goto(node.fallback)

    def _finish(self, outcome: Any) -> None:
        self.state.outcome = outcome
        self.state.waiting = "done"

    # ------------------------------------------------------------ sub-flows

    def _call(self, name: str, node: SubflowNode) -> str:
        """Start the sub-flow of subflow node ``name``; returns the sub-flow's start node."""
        sub = self.root.subflows.get(node.flow)
        if sub is None:  # the loader attaches every sub-flow; a Flow built by hand may not
            raise FlowRuntimeError(f"sub-flow '{node.flow}' is not attached to '{self.root.name}'")
        parent = self.state.vars
        values = start_values(sub)
        values.update({k: parent[k] for k in CALL_VARIABLES if k in parent})
        values.update(render_value(node.pass_, self.scope()))
        frame = Frame(flow=self.flow.name, version=self.flow.version, node=name, vars=parent)
        self.state.stack.append(frame)
        self._switch(sub, values)
        return sub.start

    def _return(self) -> str | None:
        """Go back to the flow that started this one, after its subflow node."""
        if not self.state.stack:  # a flow with return nodes answered a call itself
            self.actions.append(Hangup())
            self._finish("hangup")
            return None
        frame = self.state.stack.pop()
        parent = self.root.flow_named(frame.flow)
        node = parent.nodes.get(frame.node) if parent else None
        if parent is None or not isinstance(node, SubflowNode):
            raise FlowRuntimeError(f"cannot return to node '{frame.node}' of '{frame.flow}'")
        values = frame.vars
        child = self.scope()
        values.update({var: lookup(child, path) for var, path in node.return_.items()})
        self._switch(parent, values)
        self.state.node = frame.node
        return node.next

    def _switch(self, flow: Flow, values: dict[str, Any]) -> None:
        self.flow = flow
        self.state.flow, self.state.version, self.state.vars = flow.name, flow.version, values

    def _restart(self) -> None:
        """The call's flow changed under a resumed call so much that its place is gone."""
        values = self.state.stack[0].vars if self.state.stack else self.state.vars
        self.state.stack = []
        self._switch(self.root, values)
        self.goto(self.root.start)

    def _resume(self, event: Resumed) -> None:
        node = None if self.lost else self.flow.nodes.get(self.state.node)
        result = self.state.transfer_result
        if isinstance(node, TransferNode) and self.state.waiting == "transfer" and result:
            self._transfer_not_taken(node, result)  # back from the hold: no apology is due
            return
        self.say(self.flow.resume_prompt or self.root.resume_prompt or event.resume_prompt)
        if self.lost:
            self._restart()
            return
        node = self.flow.nodes.get(self.state.node)
        if node is None:  # the flow changed under a resumed call: start over
            self.goto(self.flow.start)
        elif isinstance(node, AskNode | MenuNode):
            self._prompt(node, None)
        elif isinstance(node, AgentNode):
            self.agent.resume(node)
        elif not (isinstance(node, HttpNode) and self._resume_http(node)):
            self.goto(self.state.node)

    def _resume_http(self, node: HttpNode) -> bool:
        """The call waited for a keyed request: take its kept answer, or (in flight, maybe
        received) send it again with its key; never a second request under a new key."""
        sent = waiting_request(self.state) if self.state.waiting == "http" else None
        if sent is None:
            return False
        if sent.answer is not None:
            self._http_result(as_result(sent.answer))
        else:
            self.actions.append(resend(self.state, node.request, self.scope()))
        return True

    # ------------------------------------------------------------ ask / menu

    def _prompt(self, node: AskNode | MenuNode, before: str | None) -> None:
        self.say(before)
        self.say(node.prompt, node.interruptible)
        self.actions.append(Listen(listen_spec(self.flow, node)))
        self.state.waiting = "input"

    def _retry(self, node: AskNode | MenuNode, silent: bool) -> None:
        self.state.attempts += 1
        limit = node.max_retries if node.max_retries is not None else self.flow.defaults.max_retries
        if self.state.attempts > limit:
            self.goto(node.fallback)
            return
        d = self.flow.defaults
        if silent:
            self._prompt(node, node.no_input_prompt or d.no_input_prompt)
        else:
            self._prompt(node, node.no_match_prompt or d.no_match_prompt)

    def _answer(
        self, node: AskNode | MenuNode, event: CallerSaid | CallerPressed | CallerSilent
    ) -> None:
        if isinstance(event, CallerSilent):
            self._retry(node, silent=True)
            return
        answer = event.text.strip() if isinstance(event, CallerSaid) else event.digits
        if not answer:
            self._retry(node, silent=isinstance(event, CallerSaid))
            return
        self.state.vars["last_input"] = answer
        spoken = isinstance(event, CallerSaid)
        target = _match_route(self.flow, node, answer, spoken)
        if target is not None:
            self._accept(node, answer, target)
        elif isinstance(node, AskNode) and spoken and (node.extract or node.classify):
            self._classify(node, answer)
        elif (
            isinstance(node, AskNode)
            and node.next is not None
            and _pattern_ok(node, answer, spoken)
        ):
            self._accept(node, _clean(node, answer, spoken), node.next)
        else:
            self._retry(node, silent=False)

    def _accept(self, node: AskNode | MenuNode, answer: str, target: str) -> None:
        if node.store:
            self.state.vars[node.store] = answer
        self.goto(target)

    def _classify(self, node: AskNode, answer: str) -> None:
        intents = tuple(
            IntentOption(r.intent, self.flow.intents[r.intent].description,
                         tuple(self.flow.intents[r.intent].examples))
            for r in node.routes if r.intent
        )  # fmt: skip
        schema = node.extract.schema_ if node.extract else None
        self.actions.append(ClassifyIntent(answer, intents, schema))
        self.state.pending_answer = answer
        self.state.waiting = "classify"

    def _classified(self, event: IntentClassified) -> None:
        node = self.flow.nodes[self.state.node]
        assert isinstance(node, AskNode)
        answer = self.state.pending_answer or ""
        self.state.pending_answer = None
        if event.error is None and node.extract is not None:
            slots = _valid_slots(node.extract.schema_, event.slots)
            required = node.extract.schema_.get("required", [])
            missing = [f for f in required if slots.get(f) in (None, "")]
            if missing and node.extract.required:
                self._retry(node, silent=False)
                return
            self.state.vars.update(slots)
        routes = {r.intent: r.next for r in node.routes if r.intent}
        intent = event.intent if isinstance(event.intent, str) else None
        if event.error is None and intent in routes:
            self.state.vars["last_intent"] = intent
            self._accept(node, answer, routes[intent])
        elif event.error is None and node.next is not None and _pattern_ok(node, answer, True):
            self._accept(node, _clean(node, answer, True), node.next)
        else:
            self._retry(node, silent=False)

    # ------------------------------------------------------------ http

    def _http_result(self, event: HttpResult) -> None:
        node = self.flow.nodes[self.state.node]
        assert isinstance(node, HttpNode)
        self.state.request = None  # answered: its outcome goes into the variables now
        self.state.vars["http_status"] = event.status
        error = read_answer(node.request, event, self.state.vars)
        self.state.vars["http_error"] = error
        target = node.on_error if error else node.next
        assert target is not None  # the validator requires both edges
        self.goto(target)


def _match_route(flow: Flow, node: AskNode | MenuNode, answer: str, spoken: bool) -> str | None:
    key = matching.spoken_key(answer) if spoken else answer
    if isinstance(node, MenuNode):
        for option in node.options:
            if key == option.key or (spoken and matching.any_phrase(answer, option.say)):
                return option.next
        return None
    for route in node.routes:
        if route.key is not None and key == route.key:
            return route.next
        if (
            spoken
            and route.intent
            and matching.any_phrase(answer, flow.intents[route.intent].examples)
        ):
            return route.next
    return None


def _valid_slots(schema: Mapping[str, Any], slots: Mapping[str, Any]) -> dict[str, Any]:
    """The extracted values that are declared, not null, and match their property schema."""
    props: Mapping[str, Any] = schema.get("properties", {})
    return {
        k: v
        for k, v in slots.items()
        if isinstance(props.get(k), dict) and v is not None and not argcheck.check(v, props[k], k)
    }


def _clean(node: AskNode, answer: str, spoken: bool) -> str:
    """A spoken answer to a digits question ("one two three") is stored as digits."""
    if spoken and node.pattern and node.dtmf:
        digits = matching.spoken_digits(answer)
        if digits and node.pattern and _full(node.pattern, digits):
            return digits
    return answer


def _pattern_ok(node: AskNode, answer: str, spoken: bool) -> bool:
    return node.pattern is None or _full(node.pattern, _clean(node, answer, spoken))


def _full(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None
