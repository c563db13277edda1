"""What a waiting node asks the runner for, and what it takes from the answer (pure functions).

Shared by the engine (ask, menu and http nodes) and the agent steps (agent nodes, HTTP tools).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ivr.callio.io import ListenSpec
from ivr.callio.turn_policy import TurnPolicy, policy_for
from ivr.flows.asked import asked_shape
from ivr.flows.events import FlowState, HttpRequest, HttpResult, KeptAnswer, SentRequest
from ivr.flows.model import Flow
from ivr.flows.nodes import AgentNode, AskNode, MenuNode
from ivr.flows.schema_shape import AnswerShape
from ivr.flows.spec import HttpCall
from ivr.flows.template import lookup, render, render_url, render_value
from ivr.flows.turn_spec import TurnSpec


def listen_spec(
    flow: Flow, node: AskNode | MenuNode | AgentNode, last_reply: str | None = None
) -> ListenSpec:
    """How to listen at ``node`` of ``flow`` (the flow gives the default no-input timeout).
    At an agent, ``last_reply`` is what it just said: a question for one of its tools'
    arguments listens for that argument's shape."""
    timeout = node.no_input_timeout or flow.defaults.no_input_timeout
    if isinstance(node, AgentNode):
        turn = turn_policy(node.turn, shape=asked_shape(node, last_reply))
        return ListenSpec(speech=True, dtmf=True, no_input_timeout=timeout, turn=turn)
    return ListenSpec(
        speech=node.speech,
        dtmf=node.dtmf,
        no_input_timeout=timeout,
        num_digits=_num_digits(node),
        finish_on_key=node.digits.finish_on_key,
        inter_digit_timeout=node.digits.inter_digit_timeout,
        turn=turn_policy(node.turn, node.digits.num_digits, answers=_answers(flow, node)),
    )


def turn_policy(
    spec: TurnSpec,
    dtmf_digits: int | None = None,
    *,
    shape: AnswerShape | None = None,
    answers: tuple[str, ...] = (),
) -> TurnPolicy:
    """The node's ``turn:`` block as the call's policy; an answer of digits has as many as the
    node's DTMF ``num_digits`` unless the block says otherwise. ``shape``: the value asked
    for now, in place of the block's ``expect``; ``answers``: phrases that are whole answers."""
    if shape is None:
        shape = AnswerShape(spec.expect, spec.digits, spec.max_digits)
        if spec.expect == "digits" and spec.digits is None and spec.max_digits is None:
            shape = AnswerShape("digits", dtmf_digits)
    return policy_for(
        shape.expect,
        digits=shape.digits,
        max_digits=shape.max_digits,
        min_silence_ms=spec.min_silence_ms,
        max_silence_ms=spec.max_silence_ms,
        fallback_silence_ms=spec.fallback_silence_ms,
        number_silence_ms=spec.number_silence_ms,
        answers=answers,
    )


def _answers(flow: Flow, node: AskNode | MenuNode) -> tuple[str, ...]:
    """What a caller may say that is a whole answer here: the phrases that pick a route."""
    if isinstance(node, MenuNode):
        return tuple(phrase for option in node.options for phrase in option.say)
    intents = [flow.intents[r.intent] for r in node.routes if r.intent in flow.intents]
    return tuple(phrase for intent in intents for phrase in intent.examples)


def _num_digits(node: AskNode | MenuNode) -> int | None:
    """A menu of single keys answers on the first key, not after the inter-digit timeout."""
    if node.digits.num_digits is not None or "digits" in node.model_fields_set:
        return node.digits.num_digits
    if isinstance(node, MenuNode):
        return 1
    keys = [route.key for route in node.routes if route.key]
    if keys and node.store is None and node.pattern is None and all(len(k) == 1 for k in keys):
        return 1
    return None


def http_request(
    call: HttpCall, variables: Mapping[str, Any], key: str | None = None
) -> HttpRequest:
    """``call`` with its templates rendered from ``variables``, and ``key`` in its
    idempotency header when given."""
    headers = {k: render(v, variables) for k, v in call.headers.items()}
    if key is not None:
        headers[call.idempotency_header] = key
    return HttpRequest(
        method=call.method,
        url=render_url(call.url, variables),
        headers=headers,
        json=render_value(call.json_body, variables),
        timeout=call.timeout,
        key=key,
        keep=tuple(call.map.values()) if key is not None else (),
    )


def send(
    state: FlowState,
    call: HttpCall,
    variables: Mapping[str, Any],
    tool_call: str | None = None,
) -> HttpRequest:
    """The request of ``call`` from the node ``state`` is at. One that is not idempotent gets
    the call's next key, recorded in ``state.request`` as in flight: the runner saves that
    before it sends, so a resumed call re-sends it with the same key (``resend``)."""
    if not call.keyed:
        state.request = None
        return http_request(call, variables)
    state.http_seq += 1
    key = idempotency_key(state, tool_call)
    state.request = SentRequest(key=key, flow=state.flow, node=state.node, tool_call=tool_call)
    return http_request(call, variables, key)


def idempotency_key(state: FlowState, tool_call: str | None) -> str:
    """``CALL:FLOW:NODE[:TOOL_CALL]:N``: the call (its CallSid), where the request is sent
    from, and the call's request number. The number alone makes it unique within the call;
    the rest tells a backend's operator which call and node it came from."""
    parts = [state.call_id or "call", state.flow, state.node]
    if tool_call is not None:
        parts.append(tool_call)
    return ":".join([*(_KEY_UNSAFE.sub("_", p)[:64] for p in parts), str(state.http_seq)])


_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def resend(state: FlowState, call: HttpCall, variables: Mapping[str, Any]) -> HttpRequest:
    """The in-flight request of a resumed call again, with the key it was first sent with."""
    assert state.request is not None
    return http_request(call, variables, state.request.key)


def waiting_request(state: FlowState, tool_call: str | None = None) -> SentRequest | None:
    """The keyed request the call waits for at its node (for ``tool_call``), if any."""
    sent = state.request
    if sent is None:
        return None
    here = (sent.flow, sent.node, sent.tool_call) == (state.flow, state.node, tool_call)
    return sent if here else None


def kept_answer(result: HttpResult, fields: tuple[str, ...]) -> HttpResult:
    """``result`` as the call state keeps it: its JSON whole when it is small, else only the
    mapped ``fields`` (the call state is saved at every step)."""
    body = result.json
    if body is None or len(json.dumps(body, ensure_ascii=False)) <= MAX_KEPT_ANSWER:
        return result
    return replace(result, json=_pick(body, fields))


MAX_KEPT_ANSWER = 16_000
"""Largest answer (JSON characters) kept whole in the call state."""


def _pick(body: Any, fields: tuple[str, ...]) -> Any:
    """A copy of ``body`` with only the dotted paths ``fields`` (``lookup`` finds them in it)."""
    kept: dict[str, Any] = {}
    # Deepest first: a shorter path that contains a longer one replaces what it built.
    for path in sorted(fields, key=lambda p: p.count("."), reverse=True):
        value = lookup(body, path)
        if value is None:
            continue
        parts = path.split(".")
        node = kept
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _as_lists(kept, body)


def _as_lists(kept: Any, original: Any) -> Any:
    """Turn the dicts ``_pick`` built where the original has lists back into lists."""
    if not isinstance(kept, dict):
        return kept
    if isinstance(original, list):
        out: list[Any] = [None] * (max((int(k) for k in kept), default=-1) + 1)
        for k, v in kept.items():
            out[int(k)] = _as_lists(v, original[int(k)])
        return out
    return {k: _as_lists(v, original.get(k)) for k, v in kept.items()}


def answered(state: FlowState, key: str, result: HttpResult) -> FlowState:
    """``state`` with the answer to its request ``key`` kept (the runner saves it next)."""
    if state.request is None or state.request.key != key:
        return state
    answer = KeptAnswer(ok=result.ok, status=result.status, body=result.json, error=result.error)
    return state.model_copy(update={"request": state.request.model_copy(update={"answer": answer})})


def as_result(answer: KeptAnswer) -> HttpResult:
    return HttpResult(answer.ok, answer.status, answer.body, answer.error)


def read_answer(call: HttpCall, result: HttpResult, variables: dict[str, Any]) -> str | None:
    """Copy the fields ``call.map`` names from a successful answer into ``variables``, in order;
    returns why the request failed (its error, or the first field missing), else None."""
    if not result.ok:
        return result.error
    for var, path in call.map.items():
        value = lookup(result.json, path) if isinstance(result.json, dict | list) else None
        if value is None:
            return f"the answer has no field '{path}'"
        variables[var] = value
    return None
