"""What of a flow's state the call record keeps: the caller's answers and phone or card numbers
masked, unless the flow lists the variable under ``variables_in_clear``.

Only the stored copy is masked. The live state keeps the real values, so the call uses what the
caller said (an http node sends the real digits). A call resumed on another instance continues
from the stored copy: there a masked variable holds its mask (``*****45``), which is why a flow
lists the variables it still needs after a resume.

* The caller's answers (``store:`` of ask and menu nodes, ``last_input``, ``extract:`` fields,
  agent tool ``set:``, and what ``set`` or ``return`` copies from those) keep only their last
  digits when they carry 3 or more (pressed, or said as digits or digit words): ``*****45``, a
  4-digit PIN ``****``.
* Every other string (other variables, the conversation history, tool arguments) has its phone
  and card numbers masked (``ivr.obs.pii.mask_speech``).
* Never masked: ``caller``, ``called`` and ``call_sid`` (the record holds those numbers to route
  and resume the call anyway), and a value the flow file itself gives the variable (under
  ``variables:`` or in a ``set`` node), such as a transfer number: it is no caller's data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ivr.flows import matching, template
from ivr.flows.events import FlowState, HistoryItem
from ivr.flows.model import Flow
from ivr.flows.spec import EnvVar
from ivr.obs.pii import kept_digits, mask_deep, mask_speech

ALWAYS_CLEAR = frozenset({"caller", "called", "call_sid"})
MIN_ANSWER_DIGITS = 3
"""From 3 digits (a CVV) an answer is masked."""


@dataclass(frozen=True, slots=True)
class _Policy:
    clear: frozenset[str] = ALWAYS_CLEAR
    answers: frozenset[str] = frozenset()
    literals: dict[str, list[Any]] = field(default_factory=dict)


def stored_state(flow: Flow, state: FlowState) -> FlowState:
    """``state`` as the call record keeps it; ``state`` itself is left as it is."""
    stack = [f.model_copy(update={"vars": _vars(flow, f.flow, f.vars)}) for f in state.stack]
    pending = state.pending_answer
    return state.model_copy(
        update={
            "vars": _vars(flow, state.flow, state.vars),
            "stack": stack,
            "history": [_item(item) for item in state.history],
            "pending_answer": None if pending is None else mask_answer(pending),
        }
    )


def stored_digits(flow: Flow, state: FlowState, digits: str) -> str:
    """Keys pressed at ``state``'s node as the call record keeps them (its timeline): like the
    answer they are, in clear only if the node stores them in a ``variables_in_clear`` one."""
    running = flow.flow_named(state.flow)
    node = running.nodes.get(state.node) if running is not None else None
    store = node.answer_store() if node is not None else None
    if store and store in _policy(flow, state.flow).clear:
        return digits
    return mask_answer(digits)


def mask_answer(text: str) -> str:
    """A caller's answer with 3 or more digits: those digits alone, all but the last masked."""
    digits = matching.spoken_digits(text)
    if len(digits) < MIN_ANSWER_DIGITS:
        return mask_speech(text)
    keep = kept_digits(len(digits))
    return "*" * (len(digits) - keep) + digits[len(digits) - keep :]


def answer_variables(flow: Flow, call_flow: Flow | None = None) -> set[str]:
    """The variables of ``flow`` that can hold what the caller said or pressed. ``call_flow``:
    the flow of the call, which knows every sub-flow (``flow`` itself when None)."""
    top = call_flow or flow

    def answers_of(name: str) -> set[str]:
        sub = top.flow_named(name)
        return answer_variables(sub, top) if sub is not None else set()

    names = {"last_input"}
    for node in flow.nodes.values():
        names.update(node.answer_variables(answers_of))
    return names | _copies(flow, names)


def _copies(flow: Flow, answers: set[str]) -> set[str]:
    """``set`` values that are templates reading an answer, until no new one turns up."""
    assigned = [node.assigned_values() for node in flow.nodes.values()]
    found: set[str] = set()
    while True:
        new = {
            name
            for values in assigned
            for name, value in values.items()
            if name not in answers | found and _reads(value, answers | found)
        }
        if not new:
            return found
        found |= new


def _reads(value: Any, names: set[str]) -> bool:
    try:
        return any(
            ref.split(".")[0] in names
            for _, text in template.strings_in(value)
            for ref in template.references(text)
        )
    except template.TemplateSyntaxError:  # refused at load; be safe if it ever is not
        return True


def _is_template(value: Any) -> bool:
    return any(template.has_references(text) for _, text in template.strings_in(value))


def _policy(flow: Flow, name: str) -> _Policy:
    one = flow.flow_named(name)
    if one is None:  # not a flow of this call: keep only the call's own numbers in clear
        return _Policy()
    literals: dict[str, list[Any]] = {
        k: [v] for k, v in one.variables.items() if not isinstance(v, EnvVar)
    }
    for node in one.nodes.values():
        for k, v in node.assigned_values().items():
            if not _is_template(v):
                literals.setdefault(k, []).append(v)
    return _Policy(
        clear=ALWAYS_CLEAR | set(one.variables_in_clear),
        answers=frozenset(answer_variables(one, flow)),
        literals=literals,
    )


def _vars(flow: Flow, name: str, values: dict[str, Any]) -> dict[str, Any]:
    policy = _policy(flow, name)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in policy.clear or value in policy.literals.get(key, ()):
            out[key] = value
        elif key in policy.answers:
            out[key] = _answer_value(value)
        else:
            out[key] = mask_deep(value, mask_speech)
    return out


def _answer_value(value: Any) -> Any:
    # An extracted number (``type: integer``) is an answer too; other values are masked as text.
    if isinstance(value, int) and not isinstance(value, bool):
        return mask_answer(str(value)) if abs(value) >= 10 ** (MIN_ANSWER_DIGITS - 1) else value
    return mask_deep(value, mask_answer)


def _item(item: HistoryItem) -> HistoryItem:
    calls = [c.model_copy(update={"arguments": mask_speech(c.arguments)}) for c in item.tool_calls]
    return item.model_copy(update={"content": mask_speech(item.content), "tool_calls": calls})
