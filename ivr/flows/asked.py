"""Which value an agent just asked the caller for, so their answer can end when it is whole.

An agent's tools declare their arguments' shapes (``ivr.flows.schema_shape``, or a tool's
``expects:``). When the agent's question names one argument ("What is your account
number?"), the caller's next turn listens for that argument's shape: eight digits end the
turn at the shortest pause, four of them wait. A question that names none, or several with
different shapes, changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from ivr.flows import matching
from ivr.flows.nodes import AgentNode, AgentTool
from ivr.flows.schema_shape import AnswerShape, schema_shape

_SENTENCE = re.compile(r"[^.!?]+[.!?]*")


def asked_shape(node: AgentNode, reply: str | None) -> AnswerShape | None:
    """The shape of the argument the agent's ``reply`` asks for, if it asks for one."""
    question = _question(reply or "")
    if not question:
        return None
    said = matching.words(question)
    found = {
        shape
        for tool in node.tools
        for shape, phrases in _expected_arguments(tool)
        if any(matching.phrase_in(said, phrase) for phrase in phrases)
    }
    return found.pop() if len(found) == 1 else None


def _question(reply: str) -> str:
    """The reply's last question, else its last sentence: what the caller answers."""
    sentences = [s.strip() for s in _SENTENCE.findall(reply) if s.strip()]
    questions = [s for s in sentences if s.endswith("?")]
    last: str = (questions or sentences or [""])[-1]
    return last


def _expected_arguments(tool: AgentTool) -> Iterator[tuple[AnswerShape, list[str]]]:
    """Each argument of ``tool`` with a shape, and the phrases that ask for it."""
    properties: dict[str, Any] = tool.parameters.get("properties") or {}
    for name, schema in properties.items():
        declared = tool.expects.get(name)
        shape: AnswerShape | None
        if declared is not None and declared.expect is not None:
            shape = AnswerShape(declared.expect, declared.digits, declared.max_digits)
        else:
            shape = schema_shape(schema) if isinstance(schema, dict) else None
        if shape is None:
            continue
        phrases = [name.replace("_", " ")]
        if isinstance(schema, dict) and isinstance(schema.get("title"), str):
            phrases.append(schema["title"])
        if declared is not None:
            phrases.extend(declared.asked_as)
        yield shape, phrases
