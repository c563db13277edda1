"""Engine steps of ``ask`` and ``menu`` nodes: the prompt, the caller's answer matched to a
route (a key, example phrases, the LLM's intent and slots), retries, and where the answer goes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ivr.flows import argcheck, matching
from ivr.flows.agent import NodeSteps
from ivr.flows.events import (
    CallerPressed,
    CallerSaid,
    CallerSilent,
    ClassifyIntent,
    IntentClassified,
    IntentOption,
    Listen,
)
from ivr.flows.model import Flow
from ivr.flows.nodes import AskNode, MenuNode
from ivr.flows.waits import listen_spec


class AskSteps(NodeSteps):
    """The steps of an ask or menu node within one engine step (``ctx``)."""

    def prompt(self, node: AskNode | MenuNode, before: str | None = None) -> None:
        self.ctx.say(before)
        self.ctx.say(node.prompt, node.interruptible)
        self.ctx.actions.append(Listen(listen_spec(self.flow, node)))
        self.state.waiting = "input"

    def _retry(self, node: AskNode | MenuNode, silent: bool) -> None:
        self.state.attempts += 1
        limit = node.max_retries if node.max_retries is not None else self.flow.defaults.max_retries
        if self.state.attempts > limit:
            self.ctx.goto(node.fallback)
            return
        d = self.flow.defaults
        if silent:
            self.prompt(node, node.no_input_prompt or d.no_input_prompt)
        else:
            self.prompt(node, node.no_match_prompt or d.no_match_prompt)

    def answer(
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
        self.ctx.goto(target)

    def _classify(self, node: AskNode, answer: str) -> None:
        intents = tuple(
            IntentOption(r.intent, self.flow.intents[r.intent].description,
                         tuple(self.flow.intents[r.intent].examples))
            for r in node.routes if r.intent
        )  # fmt: skip
        schema = node.extract.schema_ if node.extract else None
        self.ctx.actions.append(ClassifyIntent(answer, intents, schema))
        self.state.pending_answer = answer
        self.state.waiting = "classify"

    def classified(self, event: IntentClassified) -> None:
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
