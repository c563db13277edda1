"""The nodes of a call flow, one pydantic model per ``kind``, and what each answers about itself
(its edges, the variables it sets, its prompts, ...). The format as a whole is described in
``ivr.flows.model``; the pieces nodes share are in ``ivr.flows.spec``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ivr.flows.problems import Path_
from ivr.flows.schema_shape import schema_shape
from ivr.flows.spec import Case, DtmfSpec, Extract, HttpCall, Interruptions, Route, Spec, VarName
from ivr.flows.turn_spec import ExpectedArgument, TurnSpec
from ivr.telephony.dialing import is_dialable


class Edge(NamedTuple):
    """A node another node can go to, and the field that names it."""

    path: Path_
    """Of the field, within the node: ``("next",)``, ``("routes", 0, "next")``, ..."""
    target: str
    label: str | None = None
    """What the choice is, for drawings (None: the field says it)."""


class NodeBase(Spec):
    """What every kind of node answers about itself; a kind overrides what applies to it.
    (The engine's steps per kind are in ``ivr.flows.engine``, the checks in
    ``ivr.flows.validate``.)"""

    description: str = ""

    def targets(self) -> Iterator[Edge]:
        """Every node this one can go to."""
        return iter(())

    def variables_set(self) -> Iterator[str]:
        """The variables this node may set."""
        return iter(())

    def answer_variables(self, answers_of: Callable[[str], set[str]]) -> Iterator[str]:
        """Of ``variables_set``, those that can hold what the caller said or pressed.
        ``answers_of(flow)``: those of another flow of the call (for a sub-flow's returns)."""
        return iter(())

    def answer_store(self) -> str | None:
        """The variable the caller's answer at this node goes into, if any."""
        return None

    def assigned_values(self) -> Mapping[str, Any]:
        """Values (or templates) the flow file itself gives variables here."""
        return {}

    def spoken_texts(self) -> Iterator[str]:
        """Prompt templates this node may say ("" for one that is not set)."""
        return iter(())

    def condition_lists(self) -> Iterator[tuple[str, list[Case]]]:
        """(field, cases) of the conditions this node checks."""
        return iter(())

    def knowledge_files(self) -> list[str]:
        """Files (relative to the flow file) read into the node's context at load."""
        return []

    def uses_llm(self) -> bool:
        """Whether running this node may ask the LLM."""
        return False


def _next(node: SayNode | SetNode | GotoNode | SubflowNode) -> Iterator[Edge]:
    if node.next is not None:
        yield Edge(("next",), node.next)


class SayNode(NodeBase):
    kind: Literal["say"]
    text: str
    interruptible: bool = True
    interruptions: Interruptions | None = None
    after_beep: bool = Field(
        default=False,
        description="Voicemail: on an outbound call answered by a machine, wait until its "
        "greeting and beep are over, then say the text whole (never interrupted).",
    )
    next: str | None = None

    def targets(self) -> Iterator[Edge]:
        return _next(self)

    def spoken_texts(self) -> Iterator[str]:
        yield self.text


class _InputNode(NodeBase):
    prompt: str
    interruptible: bool = True
    interruptions: Interruptions | None = None
    speech: bool = True
    dtmf: bool = True
    digits: DtmfSpec = Field(default_factory=DtmfSpec)
    no_input_timeout: float | None = Field(default=None, gt=0, le=60)
    no_input_prompt: str | None = None
    no_match_prompt: str | None = None
    max_retries: int | None = Field(default=None, ge=0, le=10)
    fallback: str = Field(default="hangup", description="Where to go after the retries run out.")
    store: VarName | None = Field(default=None, description="Variable that receives the answer.")
    turn: TurnSpec = Field(
        default_factory=TurnSpec, description="When a spoken answer is over (pause lengths)."
    )

    def targets(self) -> Iterator[Edge]:
        yield Edge(("fallback",), self.fallback)

    def variables_set(self) -> Iterator[str]:
        if self.store:
            yield self.store

    def answer_variables(self, answers_of: Callable[[str], set[str]]) -> Iterator[str]:
        return self.variables_set()

    def answer_store(self) -> str | None:
        return self.store

    def spoken_texts(self) -> Iterator[str]:
        yield from (self.prompt, self.no_input_prompt or "", self.no_match_prompt or "")


class AskNode(_InputNode):
    kind: Literal["ask"]
    routes: list[Route] = Field(default_factory=list)
    classify: bool = Field(
        default=False, description="Ask the LLM for the intent when no example phrase matches."
    )
    extract: Extract | None = None
    pattern: str | None = Field(default=None, description="Regex the raw answer must fully match.")
    next: str | None = Field(default=None, description="Where to go when no route applies.")

    @field_validator("pattern")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"bad regular expression {value!r}: {exc}") from exc
        return value

    def targets(self) -> Iterator[Edge]:
        yield from super().targets()
        for i, route in enumerate(self.routes):
            label = " / ".join(x for x in (route.intent, route.key) if x)
            yield Edge(("routes", i, "next"), route.next, label)
        if self.next is not None:
            yield Edge(("next",), self.next)

    def variables_set(self) -> Iterator[str]:
        yield from super().variables_set()
        if self.extract is not None:
            yield from self.extract.fields

    def uses_llm(self) -> bool:
        return self.classify or self.extract is not None


class MenuOption(Spec):
    key: str = Field(pattern=r"^[0-9*#]$")
    say: list[str] = Field(default_factory=list, description="Phrases that pick this option.")
    next: str


class MenuNode(_InputNode):
    kind: Literal["menu"]
    options: list[MenuOption] = Field(min_length=1)

    def targets(self) -> Iterator[Edge]:
        yield from super().targets()
        for i, option in enumerate(self.options):
            yield Edge(("options", i, "next"), option.next, f"key {option.key}")


class AgentTool(Spec):
    """A function the agent may call. Its effect is declared, never code."""

    name: VarName
    description: str
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the arguments; arguments are validated before use.",
    )
    set: dict[VarName, Any] = Field(
        default_factory=dict, description="Variables to set; templates may use {{ args.NAME }}."
    )
    http: HttpCall | None = Field(default=None, description="Request whose JSON goes to the model.")
    next: str | None = Field(default=None, description="Leave the agent for this node (handoff).")
    result: str = Field(default="done", description="Tool result text given to the model.")
    expects: dict[VarName, ExpectedArgument] = Field(
        default_factory=dict,
        description="Arguments the agent asks the caller for, and how their answers look (by "
        "default every argument whose schema declares a shape: a digits pattern, a date).",
    )

    @field_validator("expects")
    @classmethod
    def _expects_arguments(
        cls, value: dict[str, ExpectedArgument], info: ValidationInfo
    ) -> dict[str, ExpectedArgument]:
        properties = (info.data.get("parameters") or {}).get("properties") or {}
        for name, expected in value.items():
            if name not in properties:
                known = ", ".join(properties) or "none"
                raise ValueError(f"'{name}' is not one of its parameters ({known})")
            if expected.expect is None and schema_shape(properties[name]) is None:
                raise ValueError(
                    f"'{name}': its schema declares no shape (a pattern like ^\\d{{8}}$, "
                    "format: date, an integer's minimum and maximum); give 'expect:'"
                )
        return value


class AgentNode(NodeBase):
    kind: Literal["agent"]
    system: str
    knowledge: list[str] = Field(
        default_factory=list, description="Files (relative to the flow file) put into context."
    )
    knowledge_text: str = ""
    greeting: str | None = Field(default=None, description="Said when the node is entered.")
    tools: list[AgentTool] = Field(default_factory=list)
    respond_immediately: bool = Field(
        default=False,
        description="On entry, answer the conversation so far without waiting (for handoffs).",
    )
    history: Literal["keep", "reset"] = Field(
        default="keep", description="keep: the conversation so far carries over (handoff)."
    )
    exit_when: list[Case] = Field(
        default_factory=list, description="Checked after every agent turn; first match leaves."
    )
    max_turns: int | None = Field(default=None, ge=1, le=200)
    on_max_turns: str | None = None
    no_input_timeout: float | None = Field(default=None, gt=0, le=60)
    no_input_prompt: str | None = None
    max_no_input: int = Field(default=2, ge=0, le=10)
    on_no_input: str = "hangup"
    on_error: str | None = Field(default=None, description="Where to go if the LLM fails.")
    interruptible: bool = True
    interruptions: Interruptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    turn: TurnSpec = Field(
        default_factory=TurnSpec, description="When the caller's turn is over (pause lengths)."
    )

    @model_validator(mode="after")
    def _max_turns_target(self) -> AgentNode:
        if self.max_turns is not None and self.on_max_turns is None:
            raise ValueError("max_turns needs on_max_turns: the node to go to when it is reached")
        return self

    def targets(self) -> Iterator[Edge]:
        for i, tool in enumerate(self.tools):
            if tool.next is not None:
                yield Edge(("tools", i, "next"), tool.next, tool.name)
        for i, case in enumerate(self.exit_when):
            yield Edge(("exit_when", i, "next"), case.next)
        for name in ("on_max_turns", "on_no_input", "on_error"):
            if (target := getattr(self, name)) is not None:
                yield Edge((name,), target)

    def variables_set(self) -> Iterator[str]:
        for tool in self.tools:
            yield from tool.set
            if tool.http is not None:
                yield from tool.http.map

    def answer_variables(self, answers_of: Callable[[str], set[str]]) -> Iterator[str]:
        return (name for tool in self.tools for name in tool.set)

    def spoken_texts(self) -> Iterator[str]:
        yield from (self.greeting or "", self.no_input_prompt or "")

    def condition_lists(self) -> Iterator[tuple[str, list[Case]]]:
        yield "exit_when", self.exit_when

    def knowledge_files(self) -> list[str]:
        return self.knowledge

    def uses_llm(self) -> bool:
        return True


class BranchNode(NodeBase):
    kind: Literal["branch"]
    cases: list[Case] = Field(min_length=1)
    default: str | None = None

    def targets(self) -> Iterator[Edge]:
        for i, case in enumerate(self.cases):
            yield Edge(("cases", i, "next"), case.next)
        if self.default is not None:
            yield Edge(("default",), self.default)

    def condition_lists(self) -> Iterator[tuple[str, list[Case]]]:
        yield "cases", self.cases


class SetNode(NodeBase):
    kind: Literal["set"]
    values: dict[VarName, Any]
    next: str | None = None

    def targets(self) -> Iterator[Edge]:
        return _next(self)

    def variables_set(self) -> Iterator[str]:
        return iter(self.values)

    def assigned_values(self) -> Mapping[str, Any]:
        return self.values


class HttpNode(NodeBase):
    kind: Literal["http"]
    request: HttpCall
    next: str | None = None
    on_error: str | None = None

    def targets(self) -> Iterator[Edge]:
        for name in ("next", "on_error"):
            if (target := getattr(self, name)) is not None:
                yield Edge((name,), target)

    def variables_set(self) -> Iterator[str]:
        return iter(self.request.map)


class TransferNode(NodeBase):
    kind: Literal["transfer"]
    number: str
    say: str | None = None
    warm: bool = Field(
        default=False,
        description="Hold the caller in a conference, dial the number, let the agent hear "
        "'summary', then join them; 'fallback' when the agent does not answer.",
    )
    fallback: str | None = Field(
        default=None, description="Warm only: where the call goes on if the agent is not joined."
    )
    summary: str | None = Field(
        default=None, description="Warm only: what the agent hears before joining (template)."
    )
    summarize: bool = Field(
        default=False,
        description="Warm only: the LLM writes the summary from the conversation ('summary' "
        "is its fallback and its facts).",
    )
    hold_music: str | None = Field(
        default=None,
        description="Warm only: the conference waitUrl (audio or TwiML URL); '' is silence, "
        "unset is Twilio's default music.",
    )
    ring_timeout: int = Field(
        default=20, ge=5, le=120, description="Warm only: seconds the agent's phone rings."
    )

    @field_validator("number")
    @classmethod
    def _e164(cls, value: str) -> str:
        # A templated number is checked once rendered, at run time.
        if "{{" not in value and not is_dialable(value):
            raise ValueError(f"transfer number '{value}' must be in E.164 form, e.g. +15550100998")
        return value

    @model_validator(mode="after")
    def _warm_options(self) -> TransferNode:
        if self.warm and self.fallback is None:
            raise ValueError(
                "a warm transfer needs 'fallback:': the node the call goes on at when the "
                "agent does not answer"
            )
        if not self.warm:
            given = [k for k in _WARM_ONLY if k in self.model_fields_set]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with 'warm: true'")
        if self.hold_music and not self.hold_music.startswith(("https://", "http://")):
            raise ValueError(f"hold_music '{self.hold_music}' must be an http(s) URL (or '')")
        return self

    def targets(self) -> Iterator[Edge]:
        if self.fallback is not None:  # a warm transfer the agent did not take
            yield Edge(("fallback",), self.fallback)

    def spoken_texts(self) -> Iterator[str]:
        yield self.say or ""


_WARM_ONLY = ("fallback", "summary", "summarize", "hold_music", "ring_timeout")


class HangupNode(NodeBase):
    kind: Literal["hangup"]
    say: str | None = None

    def spoken_texts(self) -> Iterator[str]:
        yield self.say or ""


class GotoNode(NodeBase):
    kind: Literal["goto"]
    next: str | None = None

    def targets(self) -> Iterator[Edge]:
        return _next(self)


class SubflowNode(NodeBase):
    """Run another flow (by name) as a sub-routine; continue at ``next`` when it returns."""

    kind: Literal["subflow"]
    flow: VarName = Field(description="Name of the flow to run (its file's 'name:').")
    next: str | None = Field(default=None, description="Where to go when the sub-flow returns.")
    pass_: dict[VarName, Any] = Field(
        default_factory=dict,
        alias="pass",
        description="Sub-flow variable -> value or template (in this flow's variables).",
    )
    return_: dict[VarName, str] = Field(
        default_factory=dict,
        alias="return",
        description="Variable here -> sub-flow variable (dotted path allowed), copied at return.",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def targets(self) -> Iterator[Edge]:
        return _next(self)

    def variables_set(self) -> Iterator[str]:
        return iter(self.return_)

    def answer_variables(self, answers_of: Callable[[str], set[str]]) -> Iterator[str]:
        inner = answers_of(self.flow)
        return (k for k, v in self.return_.items() if v.split(".")[0] in inner)


class ReturnNode(NodeBase):
    """End a sub-flow: the calling flow continues after its subflow node."""

    kind: Literal["return"]
