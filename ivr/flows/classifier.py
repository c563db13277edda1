"""The structured-output request that classifies what a caller said (a menu's spoken choice,
an intent with slots): built in one place, so a speculative request and the flow's own are the
same request."""

from __future__ import annotations

from typing import Any

from ivr.flows.events import ClassifyIntent
from ivr.llm.base import ChatMessage


def classifier_request(ask: ClassifyIntent) -> tuple[list[ChatMessage], dict[str, Any]]:
    """The messages and the JSON schema of the classification ``ask`` asks for."""
    return _classifier_messages(ask), classifier_schema(ask)


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
