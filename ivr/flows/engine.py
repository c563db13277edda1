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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ivr import phrases
from ivr.control.transfers import WarmTransfer
from ivr.errors import FlowError
from ivr.flows import matching
from ivr.flows.agent import AgentSteps
from ivr.flows.asking import AskSteps
from ivr.flows.events import (
    CallerHungUp,
    CallerPressed,
    CallerSaid,
    CallerSilent,
    CallStarted,
    FlowAction,
    FlowEvent,
    FlowState,
    Frame,
    Hangup,
    HttpResult,
    IntentClassified,
    LlmReplied,
    Resumed,
    Say,
    Transfer,
)
from ivr.flows.model import Flow
from ivr.flows.nodes import (
    AgentNode,
    AskNode,
    BranchNode,
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
from ivr.flows.spec import EnvVar
from ivr.flows.template import lookup, render, render_value
from ivr.flows.waits import as_result, read_answer, resend, send, waiting_request
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


def copy_state(state: FlowState) -> FlowState:
    """A copy the step may change without touching ``state`` (a speculative step is thrown
    away). Dumped and validated again, not ``model_copy(deep=True)``: pydantic-core copies the
    containers ~4x faster than ``copy.deepcopy`` (three steps a turn with speculation); the
    variables are JSON data, so the copy is as deep. ``env`` is never dumped: copied apart."""
    copy = FlowState.model_validate(state.model_dump())
    copy.env = dict(state.env)
    return copy


# Built-in variables a sub-flow starts with, copied from the flow that starts it.
CALL_VARIABLES = ("caller", "called", "call_sid")


def step(flow: Flow, state: FlowState, event: FlowEvent) -> tuple[FlowState, list[FlowAction]]:
    run = _Step(flow, copy_state(state))
    try:
        run.state.steps += 1
        run.handle(event)
        return run.state, run.actions
    finally:
        # The kinds' steps point back at the step: without this, every step (one per caller
        # pause with speculation) leaves its copy of the state for the cyclic GC to find.
        del run.agent, run.asking


class _Step:
    """One step of a call; it is the ``StepContext`` of the agent steps it hands agent nodes to."""

    def __init__(self, flow: Flow, state: FlowState) -> None:
        self.root = flow
        self.state = state
        self.actions: list[FlowAction] = []
        self.agent: AgentSteps = AgentSteps(self)
        self.asking: AskSteps = AskSteps(self)
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
            self.finish("caller_hangup")
        elif isinstance(event, HttpResult) and self.state.waiting == "http":
            _http_result(self, event)
        elif isinstance(event, HttpResult) and self.state.waiting == "tool_http":
            self.agent.tool_http_result(event)
        elif isinstance(event, IntentClassified) and self.state.waiting == "classify":
            self.asking.classified(event)
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
        listen = STEPS[node.kind].listen
        if listen is not None:
            listen(self, node, event)

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
            self.finish("hangup")
            return None
        node = self.flow.nodes[target]
        self.state.node = target
        self.state.attempts = 0
        self.state.waiting = "start"
        return STEPS[node.kind].enter(self, target, node)

    def finish(self, outcome: Any) -> None:
        self.state.outcome = outcome
        self.state.waiting = "done"

    # ------------------------------------------------------------ sub-flows

    def call(self, name: str, node: SubflowNode) -> str:
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

    def return_(self) -> str | None:
        """Go back to the flow that started this one, after its subflow node."""
        if not self.state.stack:  # a flow with return nodes answered a call itself
            self.actions.append(Hangup())
            self.finish("hangup")
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
        if node is not None and STEPS[node.kind].came_back(self, node):
            return  # it left the stream on purpose (a warm transfer's hold): no apology is due
        self.say(self.flow.resume_prompt or self.root.resume_prompt or event.resume_prompt)
        if self.lost:
            self._restart()
            return
        node = self.flow.nodes.get(self.state.node)
        if node is None:  # the flow changed under a resumed call: start over
            self.goto(self.flow.start)
        else:
            STEPS[node.kind].resume(self, node)


# ---------------------------------------------------------------- each kind's steps

N = TypeVar("N")


def _enter_again(run: _Step, node: Any) -> None:
    run.goto(run.state.node)


def _not_away(run: _Step, node: Any) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Steps(Generic[N]):
    """What the engine does at a node of one kind."""

    enter: Callable[[_Step, str, N], str | None]
    """Entering the node (named): the node to go on to when it waits for nothing, else None
    (it waits: for the caller, an answer, or the call is over)."""
    listen: Callable[[_Step, N, CallerInput], None] | None = None
    """What the caller said or pressed, or their silence, while it waits for input."""
    resume: Callable[[_Step, N], None] = _enter_again
    """The call resumed on a new stream while at the node (after the resume prompt)."""
    came_back: Callable[[_Step, N], bool] = _not_away
    """Whether the call resumed because it came back from where the node sent it (a warm
    transfer not taken); it then goes on without the resume prompt."""


CallerInput = CallerSaid | CallerPressed | CallerSilent


def _enter_say(run: _Step, name: str, node: SayNode) -> str | None:
    run.say(node.text, node.interruptible, node.after_beep)
    return node.next


def _enter_set(run: _Step, name: str, node: SetNode) -> str | None:
    run.state.vars.update(render_value(node.values, run.scope()))
    return node.next


def _enter_branch(run: _Step, name: str, node: BranchNode) -> str | None:
    return next(
        (c.next for c in node.cases if matching.all_hold(c.conditions, run.scope())),
        node.default,
    )


def _enter_asking(run: _Step, name: str, node: AskNode | MenuNode) -> None:
    run.asking.prompt(node)


def _answer(run: _Step, node: AskNode | MenuNode, event: CallerInput) -> None:
    run.asking.answer(node, event)


def _prompt_again(run: _Step, node: AskNode | MenuNode) -> None:
    run.asking.prompt(node)


def _enter_agent(run: _Step, name: str, node: AgentNode) -> None:
    run.agent.enter(node)


def _agent_input(run: _Step, node: AgentNode, event: CallerInput) -> None:
    run.agent.caller_input(node, event)


def _agent_resume(run: _Step, node: AgentNode) -> None:
    run.agent.resume(node)


def _enter_goto(run: _Step, name: str, node: GotoNode) -> str | None:
    return node.next


def _enter_subflow(run: _Step, name: str, node: SubflowNode) -> str | None:
    return run.call(name, node)


def _enter_return(run: _Step, name: str, node: ReturnNode) -> str | None:
    return run.return_()


def _enter_http(run: _Step, name: str, node: HttpNode) -> None:
    run.actions.append(send(run.state, node.request, run.scope()))
    run.state.waiting = "http"


def _resume_http(run: _Step, node: HttpNode) -> None:
    """The call waited for a keyed request: take its kept answer, or (in flight, maybe
    received) send it again with its key; never a second request under a new key."""
    sent = waiting_request(run.state) if run.state.waiting == "http" else None
    if sent is None:
        run.goto(run.state.node)
    elif sent.answer is not None:
        _http_result(run, as_result(sent.answer))
    else:
        run.actions.append(resend(run.state, node.request, run.scope()))


def _http_result(run: _Step, event: HttpResult) -> None:
    node = run.flow.nodes[run.state.node]
    assert isinstance(node, HttpNode)
    run.state.request = None  # answered: its outcome goes into the variables now
    run.state.vars["http_status"] = event.status
    error = read_answer(node.request, event, run.state.vars)
    run.state.vars["http_error"] = error
    target = node.on_error if error else node.next
    assert target is not None  # the validator requires both edges
    run.goto(target)


def _enter_transfer(run: _Step, name: str, node: TransferNode) -> None:
    run.say(node.say, interruptible=False)
    number = run.render(node.number).strip()
    if not is_dialable(number):  # a variable held something that cannot be dialled
        run.say(phrases.TRANSFER_FAILED, interruptible=False)
        run.actions.append(Hangup())
        run.finish("hangup")
        return
    run.state.transfer_to = number
    if node.warm:
        _warm_transfer(run, node, number)
        return
    run.actions.append(Transfer(number))
    run.finish("transfer")


def _warm_transfer(run: _Step, node: TransferNode, number: str) -> None:
    """The call leaves the stream but the flow waits: the agent may not take it, and then
    the call comes back here (``transfer_result`` set) and goes on at ``fallback``."""
    conversation = tuple(
        (item.role, item.content)
        for item in run.state.history
        if item.role in ("user", "assistant") and item.content
    )
    warm = WarmTransfer(
        summary=run.render(node.summary or phrases.WARM_TRANSFER_SUMMARY).strip(),
        summarize=node.summarize,
        conversation=conversation,
        hold_music=node.hold_music,
        ring_timeout=node.ring_timeout,
    )
    run.actions.append(Transfer(number, warm))
    run.state.outcome = "transfer"
    run.state.transfer_result = None
    run.state.waiting = "transfer"


def _transfer_not_taken(run: _Step, node: TransferNode, result: str) -> None:
    run.state.vars["transfer_status"] = result
    run.state.outcome = run.state.transfer_to = run.state.transfer_result = None
    assert node.fallback is not None  # the model requires it with warm: true
    run.goto(node.fallback)


def _transfer_came_back(run: _Step, node: TransferNode) -> bool:
    result = run.state.transfer_result
    if run.state.waiting == "transfer" and result:
        _transfer_not_taken(run, node, result)  # back from the hold
        return True
    return False


def _enter_hangup(run: _Step, name: str, node: HangupNode) -> None:
    run.say(node.say, interruptible=False)
    run.actions.append(Hangup())
    run.finish("hangup")


STEPS: dict[str, Steps[Any]] = {
    "say": Steps(_enter_say),
    "ask": Steps(_enter_asking, _answer, _prompt_again),
    "menu": Steps(_enter_asking, _answer, _prompt_again),
    "agent": Steps(_enter_agent, _agent_input, _agent_resume),
    "branch": Steps(_enter_branch),
    "set": Steps(_enter_set),
    "http": Steps(_enter_http, resume=_resume_http),
    "transfer": Steps(_enter_transfer, came_back=_transfer_came_back),
    "hangup": Steps(_enter_hangup),
    "goto": Steps(_enter_goto),
    "subflow": Steps(_enter_subflow),
    "return": Steps(_enter_return),
}
"""The engine's steps for each node kind, by ``kind``."""
