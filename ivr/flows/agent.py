"""Engine steps of an ``agent`` node: caller turns, model replies, tool calls, exits.

The history keeps only what the caller heard of each reply. Tool arguments are checked against
the declared schema; a bad call goes back to the model as a tool error once, then the agent
apologises and listens instead of looping.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from ivr.flows import argcheck, matching
from ivr.flows.events import (
    AgentTurn,
    CallerPressed,
    CallerSaid,
    CallerSilent,
    FlowAction,
    FlowState,
    HistoryItem,
    HttpResult,
    Listen,
    LlmReplied,
    ToolCallData,
)
from ivr.flows.model import Flow
from ivr.flows.nodes import AgentNode, AgentTool
from ivr.flows.template import render_value
from ivr.flows.waits import as_result, listen_spec, read_answer, resend, send, waiting_request
from ivr.llm.base import ChatMessage, ToolCall, ToolSpec

MAX_TOOL_ROUNDS = 4
"""Model calls per caller turn; stops a model that keeps calling tools."""
MAX_HISTORY = 60
"""Messages kept in the state (it is persisted after every step); older turns are dropped."""
MAX_TOOL_ERRORS = 1
"""Invalid tool calls sent back to the model for a retry before giving up on the turn."""
MAX_CALLS_PER_REPLY = 8
"""Tool calls run from one reply; the rest are answered "not run"."""


class StepContext(Protocol):
    """What the agent steps use of the engine step they run in."""

    @property
    def flow(self) -> Flow:
        """The flow running now (a sub-flow call or return changes it within a step)."""

    @property
    def state(self) -> FlowState: ...

    @property
    def actions(self) -> list[FlowAction]:
        """The step's actions so far; the agent appends its own."""

    def say(self, text: str | None, interruptible: bool = True) -> None: ...

    def goto(self, target: str) -> None: ...

    def render(self, text: str) -> str: ...

    def scope(self) -> dict[str, Any]: ...


class NodeSteps:
    """The steps of one kind of node within one engine step (``ctx``)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    @property
    def flow(self) -> Flow:
        return self.ctx.flow

    @property
    def state(self) -> FlowState:
        return self.ctx.state


class AgentSteps(NodeSteps):
    """The steps of an agent node within one engine step (``ctx``)."""

    # ------------------------------------------------------------ entering and listening

    def _node(self) -> AgentNode:
        node = self.flow.nodes[self.state.node]
        assert isinstance(node, AgentNode)
        return node

    def enter(self, node: AgentNode) -> None:
        self.state.agent_turns = 0
        if node.history == "reset":
            self.state.history = []
        if node.greeting:
            greeting = self.ctx.render(node.greeting)
            self.ctx.say(greeting, node.interruptible)
            self.state.history.append(HistoryItem(role="assistant", content=greeting))
        if node.respond_immediately and any(m.role == "user" for m in self.state.history):
            # The round count carries over handoffs: agents that hand off to each other
            # without the caller speaking must not call the model forever.
            if self.state.tool_rounds < MAX_TOOL_ROUNDS:
                self._ask_model(node)
            else:
                self.ctx.say(self.flow.defaults.error_prompt)
                self._listen(node)
        else:
            self._listen(node)

    def _listen(self, node: AgentNode) -> None:
        history = self.state.history
        said = history[-1].content if history and history[-1].role == "assistant" else None
        self.ctx.actions.append(Listen(listen_spec(self.flow, node, said)))
        self.state.waiting = "input"

    def caller_input(
        self, node: AgentNode, event: CallerSaid | CallerPressed | CallerSilent
    ) -> None:
        history = self.state.history
        goes_on = self.state.reply_unheard and bool(history) and history[-1].role == "user"
        self.state.reply_unheard = False
        if isinstance(event, CallerPressed):
            text = f"(the caller pressed {event.digits})"
        elif isinstance(event, CallerSaid) and event.text.strip():
            text = event.text.strip()
            if goes_on:  # the rest of the sentence the unheard reply was asked for
                text = f"{history.pop().content} {text}"
        else:
            self._no_input(node)
            return
        self.state.attempts = 0
        self.state.vars["last_input"] = text
        history.append(HistoryItem(role="user", content=text))
        self._trim_history()
        self.state.tool_rounds = 0
        self.state.tool_errors = 0
        self._ask_model(node)

    def _trim_history(self) -> None:
        """Keep the newest messages, starting at a caller turn so no tool result is orphaned."""
        history = self.state.history
        if len(history) > MAX_HISTORY:
            del history[: len(history) - MAX_HISTORY]
            while history and history[0].role != "user":
                del history[0]

    def _no_input(self, node: AgentNode) -> None:
        self.state.attempts += 1
        if self.state.attempts > node.max_no_input:
            self.ctx.goto(node.on_no_input)
            return
        self.ctx.say(node.no_input_prompt or self.flow.defaults.no_input_prompt)
        self._listen(node)

    def _ask_model(self, node: AgentNode) -> None:
        system = self.ctx.render(node.system)
        if node.knowledge_text:
            system += "\n\n# Reference information\n\n" + node.knowledge_text
        messages = (ChatMessage("system", system), *(_chat(m) for m in self.state.history))
        tools = tuple(ToolSpec(t.name, t.description, t.parameters) for t in node.tools)
        policy = self.flow.interruptions(self.state.node)
        turn = AgentTurn(messages, tools, node.interruptible, node.max_tokens, policy)
        self.ctx.actions.append(turn)
        self.state.tool_rounds += 1
        self.state.waiting = "agent"

    # ------------------------------------------------------------ model replies

    def replied(self, event: LlmReplied) -> None:
        node = self._node()
        if event.error is not None:
            if event.text_heard:  # the caller heard part of the reply; the model must know
                self.state.history.append(HistoryItem(role="assistant", content=event.text_heard))
            self.ctx.say(self.flow.defaults.error_prompt)
            if node.on_error is not None:
                self.ctx.goto(node.on_error)
            else:
                self._listen(node)
            return
        # An interrupted reply keeps only what was heard and drops its tool calls: the caller
        # cut in, so the next turn starts from what they say.
        calls = (
            []
            if event.interrupted
            else [
                ToolCallData(id=c.id, name=c.name, arguments=c.arguments) for c in event.tool_calls
            ]
        )
        if event.text_heard or calls:
            self.state.history.append(
                HistoryItem(role="assistant", content=event.text_heard, tool_calls=calls)
            )
        if calls:
            for extra in calls[MAX_CALLS_PER_REPLY:]:
                self._tool_result(extra.id, "not run: too many tool calls in one reply")
            self.state.pending_tools = calls[:MAX_CALLS_PER_REPLY]
            self._run_pending_tools(node)
        else:
            at = self.state.node
            self._turn_done(node)
            # Joined to the caller's next words only if they answer this node's listen.
            self.state.reply_unheard = (
                event.interrupted
                and not event.text_heard
                and self.state.node == at
                and self.state.waiting == "input"
            )

    def _turn_done(self, node: AgentNode) -> None:
        self.state.agent_turns += 1
        for case in node.exit_when:
            if matching.all_hold(case.conditions, self.ctx.scope()):
                self.ctx.goto(case.next)
                return
        if node.max_turns is not None and self.state.agent_turns >= node.max_turns:
            assert node.on_max_turns is not None
            self.ctx.goto(node.on_max_turns)
            return
        self._listen(node)

    def _run_pending_tools(self, node: AgentNode) -> None:
        tools = {t.name: t for t in node.tools}
        while self.state.pending_tools:
            call = self.state.pending_tools.pop(0)
            tool = tools.get(call.name)
            if tool is None:
                self._tool_error(
                    call, f"unknown tool '{call.name}'; available: {', '.join(tools) or 'none'}"
                )
                continue
            args, problems = argcheck.parse_arguments(call.arguments, tool.parameters)
            if problems:
                self._tool_error(call, "invalid arguments: " + "; ".join(problems))
                continue
            scope = {**self.ctx.scope(), "args": args}
            self.state.vars.update(render_value(tool.set, scope))
            if tool.http is not None:
                self.ctx.actions.append(send(self.state, tool.http, scope, call.id))
                self.state.pending_answer = call.id
                self.state.waiting = "tool_http"
                return
            self._tool_result(call.id, tool.result)
            if tool.next is not None:
                self._handoff(tool)
                return
        self._after_tools(node)

    def _tool_error(self, call: ToolCallData, message: str) -> None:
        self.state.tool_errors += 1
        self._tool_result(
            call.id, f"ERROR: {message}. Call the tool again with corrected arguments."
        )

    def _tool_result(self, call_id: str, content: str) -> None:
        self.state.history.append(HistoryItem(role="tool", content=content, tool_call_id=call_id))

    def _handoff(self, tool: AgentTool) -> None:
        for rest in self.state.pending_tools:  # every call needs an answer in the history
            self._tool_result(rest.id, "not run: the conversation moved on")
        self.state.pending_tools = []
        assert tool.next is not None
        self.ctx.goto(tool.next)

    def _after_tools(self, node: AgentNode) -> None:
        gave_up = self.state.tool_errors > MAX_TOOL_ERRORS
        if gave_up or self.state.tool_rounds >= MAX_TOOL_ROUNDS:
            self.ctx.say(self.flow.defaults.error_prompt)
            self._turn_done(node)
        else:
            self._ask_model(node)

    def tool_http_result(self, event: HttpResult) -> None:
        node = self._node()
        call_id = self.state.pending_answer or ""
        self.state.pending_answer = None
        self.state.request = None  # answered: its outcome goes into the history now
        tool = self._pending_http_tool(node, call_id)
        if tool is None or tool.http is None:  # e.g. the flow changed under a resumed call
            self._tool_result(call_id, "ERROR: the tool is no longer available")
            self._run_pending_tools(node)
            return
        error = read_answer(tool.http, event, self.state.vars)
        if error:
            self._tool_result(call_id, f"ERROR: the request failed ({error})")
        else:
            self._tool_result(call_id, _json_text(event.json))
        if tool.next is not None and not error:
            self._handoff(tool)
            return
        self._run_pending_tools(node)

    def _pending_http_tool(self, node: AgentNode, call_id: str) -> AgentTool | None:
        """The HTTP tool of the newest call with this id (models may repeat ids)."""
        http_tools = {t.name: t for t in node.tools if t.http is not None}
        for item in reversed(self.state.history):
            for call in item.tool_calls:
                if call.id == call_id and call.name in http_tools:
                    return http_tools[call.name]
        return None

    def resume(self, node: AgentNode) -> None:
        """After a lost instance: finish a keyed tool request the call waited for; else answer
        the caller's last words if the reply was lost too."""
        if self._resume_tool_http(node):
            return
        self._repair_history()
        if self.state.history and self.state.history[-1].role == "user":
            self.state.tool_rounds = 0
            self.state.tool_errors = 0
            self._ask_model(node)
        else:
            self._listen(node)

    def _resume_tool_http(self, node: AgentNode) -> bool:
        """Take the kept answer of the tool request the call waited for, or send it again with
        its key. Asking the model again instead would make a new tool call: a new key."""
        sent = self.state.request
        if self.state.waiting != "tool_http" or sent is None or sent.tool_call is None:
            return False
        call_id = sent.tool_call
        if waiting_request(self.state, call_id) is None:
            return False
        # The record's copy of ``pending_answer`` may be masked; the request's id is not.
        self.state.pending_answer = call_id
        if sent.answer is not None:
            self.tool_http_result(as_result(sent.answer))
            return True
        tool = self._pending_http_tool(node, call_id)
        call = self._call_in_history(call_id, tool.name) if tool else None
        if tool is None or tool.http is None or call is None:
            return False  # the flow changed under the resumed call
        args, problems = argcheck.parse_arguments(call.arguments, tool.parameters)
        if problems:
            return False
        scope = {**self.ctx.scope(), "args": args}
        self.ctx.actions.append(resend(self.state, tool.http, scope))
        return True

    def _call_in_history(self, call_id: str, name: str) -> ToolCallData | None:
        """The newest call of tool ``name`` with this id."""
        for item in reversed(self.state.history):
            for call in item.tool_calls:
                if call.id == call_id and call.name == name:
                    return call
        return None

    def _repair_history(self) -> None:
        """Drop a trailing tool-call message whose results were lost when the instance died."""
        answered = {m.tool_call_id for m in self.state.history if m.role == "tool"}
        for i in range(len(self.state.history) - 1, -1, -1):
            item = self.state.history[i]
            if item.tool_calls and any(c.id not in answered for c in item.tool_calls):
                del self.state.history[i:]
                break
        self.state.pending_tools = []
        self.state.pending_answer = None


def _chat(item: HistoryItem) -> ChatMessage:
    calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in item.tool_calls)
    return ChatMessage(item.role, item.content, tool_calls=calls, tool_call_id=item.tool_call_id)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)[:4000]
