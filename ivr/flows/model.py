"""The call-flow file format: what operators write in ``flows/*.yaml``, as pydantic models.

A flow is a graph of named nodes. Each node has a ``kind``; edges are node names in fields such
as ``next``, ``fallback``, ``on_error`` and per-option ``next``. Text fields are templates
(see ``ivr.flows.template``). ``Flow.model_json_schema()`` is what ``ivr flows schema`` prints.

References (targets, intents, variables, knowledge files) are checked by ``ivr.flows.validate``,
not here: pydantic only checks the shape, so every error can name its file, line and column.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from ivr.callio.interruption_policy import DEFAULT_BACKCHANNELS, InterruptionPolicy
from ivr.flows.problems import Path_
from ivr.flows.schema_shape import schema_shape
from ivr.flows.turn_spec import ExpectedArgument, TurnSpec
from ivr.telephony.dialing import is_dialable

NodeName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")]
VarName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]

# Targets every flow may use without declaring them: end the call.
BUILTIN_TARGETS = ("hangup",)
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- conditions


class Condition(Spec):
    """A test on one variable. Exactly one operator besides ``var`` must be given.

    No expressions are evaluated: the operators are fixed and compare plain values.
    """

    var: str = Field(description="Variable name (dotted path allowed: account.status).")
    equals: Any = None
    not_equals: Any = None
    in_: list[Any] | None = Field(default=None, alias="in")
    exists: bool | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    contains: str | None = Field(default=None, description="Case-insensitive substring test.")
    matches: str | None = Field(default=None, description="Regular expression, full match.")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one_operator(self) -> Condition:
        ops = [op for op in OPERATORS if op in self.model_fields_set or _alias_set(self, op)]
        if len(ops) != 1:
            raise ValueError(
                f"a condition needs exactly one operator of {', '.join(OPERATORS)}; "
                f"got {ops or 'none'}"
            )
        if self.matches is not None:
            try:
                re.compile(self.matches)
            except re.error as exc:
                raise ValueError(f"bad regular expression {self.matches!r}: {exc}") from exc
        return self

    @property
    def operator(self) -> str:
        return next(op for op in OPERATORS if op in self.model_fields_set or _alias_set(self, op))


OPERATORS = ("equals", "not_equals", "in", "exists", "gt", "ge", "lt", "le", "contains", "matches")


def _alias_set(cond: Condition, op: str) -> bool:
    return op == "in" and "in_" in cond.model_fields_set


class Case(Spec):
    when: Condition | list[Condition] = Field(
        description="One condition, or a list that must all hold."
    )
    next: str

    @property
    def conditions(self) -> list[Condition]:
        return self.when if isinstance(self.when, list) else [self.when]


# ---------------------------------------------------------------- shared pieces


class DtmfSpec(Spec):
    num_digits: int | None = Field(default=None, ge=1, le=32)
    finish_on_key: Literal["#", "*", ""] = "#"
    inter_digit_timeout: float = Field(default=3.0, gt=0, le=30)


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


class HttpCall(Spec):
    """An HTTP request; string values anywhere in it are templates."""

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    json_body: Any = Field(default=None, alias="json")
    timeout: float = Field(default=5.0, gt=0, le=60)
    map: dict[VarName, str] = Field(
        default_factory=dict,
        description="variable -> dotted path in the JSON answer (e.g. data.items.0.name).",
    )
    idempotent: bool | None = Field(
        default=None,
        description="Safe to send twice (default: true for GET, false otherwise). A request "
        "that is not carries an idempotency key, and a resumed call never sends it twice.",
    )
    idempotency_header: str = Field(
        default="Idempotency-Key",
        description="Header that carries the key of a request that is not idempotent.",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("idempotency_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        if not _HEADER_NAME.fullmatch(value):
            raise ValueError(
                f"'{value}' is not an HTTP header name (letters, digits and !#$%&'*+.^_`|~- only)"
            )
        return value

    @property
    def keyed(self) -> bool:
        """Sent with an idempotency key, its answer kept in the call state."""
        safe = self.method == "GET" if self.idempotent is None else self.idempotent
        return not safe


class Route(Spec):
    """One way out of an ``ask`` node: an intent (by phrases / LLM) and/or a DTMF key."""

    intent: str | None = None
    key: str | None = Field(default=None, pattern=r"^[0-9*#]+$")
    next: str

    @model_validator(mode="after")
    def _intent_or_key(self) -> Route:
        if self.intent is None and self.key is None:
            raise ValueError("a route needs an 'intent', a 'key', or both")
        return self


class Extract(Spec):
    """Slots the LLM extracts from the answer (structured output); each field is a variable."""

    schema_: dict[str, Any] = Field(alias="schema", description="JSON Schema of an object.")
    required: bool = Field(
        default=True, description="If the schema's required fields are missing, treat as no match."
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object" or not isinstance(value.get("properties"), dict):
            raise ValueError("extract.schema must be {type: object, properties: {...}}")
        for name, prop in value["properties"].items():
            if not isinstance(name, str) or not VARIABLE_NAME.fullmatch(name):
                raise ValueError(f"extract property '{name}' is not a valid variable name")
            if not isinstance(prop, dict):
                raise ValueError(
                    f"extract property '{name}' must be a schema like {{type: string}}, "
                    f"not {prop!r}"
                )
        return value

    @property
    def fields(self) -> list[str]:
        return list(self.schema_["properties"])


class Intent(Spec):
    description: str = ""
    examples: list[str] = Field(default_factory=list, description="Phrases that select it.")


class EnvVar(Spec):
    env: str
    default: Any = None


class Interruptions(Spec):
    """What counts as the caller interrupting a prompt (the prompt must be interruptible).
    Echo of the bot and unvoiced noise never do; other speech pauses the prompt at once, and
    its transcript decides: a real turn interrupts it, anything else resumes it."""

    min_speech_ms: int = Field(
        default=100, ge=20, le=2000, description="Caller sound before the prompt pauses."
    )
    min_words: int = Field(
        default=1, ge=0, le=20, description="Words, backchannel not counted, that interrupt."
    )
    backchannels: list[str] | None = Field(
        default=None,
        description="Phrases that show the caller is listening (default: uh-huh, mm-hmm, "
        "okay, yeah, right, ...); [] makes every word count.",
    )
    backchannel_hold_ms: int = Field(
        default=900,
        ge=0,
        le=2000,
        description="Once the caller has backchanneled in the call, caller sound before the "
        "prompt pauses is raised past their longest backchannel, up to this; 0: never.",
    )

    def policy(self) -> InterruptionPolicy:
        words = DEFAULT_BACKCHANNELS if self.backchannels is None else tuple(self.backchannels)
        return InterruptionPolicy(
            min_speech_ms=self.min_speech_ms,
            min_words=self.min_words,
            backchannels=words,
            backchannel_hold_ms=self.backchannel_hold_ms,
        )


class Defaults(Spec):
    no_input_timeout: float = Field(default=6.0, gt=0, le=60)
    max_retries: int = Field(default=2, ge=0, le=10)
    no_input_prompt: str = "Sorry, I didn't hear anything."
    no_match_prompt: str = "Sorry, I didn't get that."
    error_prompt: str = "Sorry, something went wrong on our side."
    interruptions: Interruptions = Field(default_factory=Interruptions)


class RecordingSpec(Spec):
    """Whether the gateway records this flow's calls (caller left, bot right as heard)."""

    enabled: bool | Literal["never"] = Field(
        default=False,
        description="true: record every call; false: only a call that asks for it (per call); "
        "never: no call of this flow is recorded, whatever it asks.",
    )
    consent_prompt: str | None = Field(
        default=None,
        description="Said first, uninterruptible, on every recorded call (plain text, not a "
        "template), e.g. 'This call may be recorded for quality purposes.'",
    )

    @field_validator("enabled", mode="before")
    @classmethod
    def _true_false_or_never(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "never":
            return value
        raise ValueError(f"recording.enabled must be true, false or never, got {value!r}")

    def records(self, asked: bool) -> bool:
        """Whether a call of this flow is recorded, given what the call itself asked."""
        if self.enabled == "never":
            return False
        return self.enabled is True or asked


# ---------------------------------------------------------------- nodes


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


Node = Annotated[
    SayNode
    | AskNode
    | MenuNode
    | AgentNode
    | BranchNode
    | SetNode
    | HttpNode
    | TransferNode
    | HangupNode
    | GotoNode
    | SubflowNode
    | ReturnNode,
    Field(discriminator="kind"),
]

INPUT_KINDS = frozenset({"ask", "menu", "agent"})
TERMINAL_KINDS = frozenset({"transfer", "hangup"})


class Flow(Spec):
    """One call flow file."""

    name: VarName
    description: str = ""
    numbers: list[str] = Field(default_factory=list, description="Called numbers it answers.")
    start: str
    variables: dict[VarName, Annotated[EnvVar | Any, Field(union_mode="left_to_right")]] = Field(
        default_factory=dict,
        description="Call variables and their start values; {env: NAME, default: x} reads the "
        "environment when the call starts.",
    )
    variables_in_clear: list[VarName] = Field(
        default_factory=list,
        description="Variables the call record keeps unmasked (the caller's answers and phone "
        "or card numbers are masked there otherwise), e.g. an account number a later http node "
        "needs after the call resumes on another instance.",
    )
    intents: dict[VarName, Intent] = Field(default_factory=dict)
    defaults: Defaults = Field(default_factory=Defaults)
    resume_prompt: str | None = Field(
        default=None, description="Said first when a call resumes on another instance."
    )
    recording: RecordingSpec = Field(default_factory=RecordingSpec)
    nodes: dict[NodeName, Node] = Field(min_length=1)

    # Filled by the loader, not written by operators.
    source: SkipJsonSchema[str] = Field(default="", exclude=True)
    version: SkipJsonSchema[str] = Field(default="", exclude=True)
    """This file's digest, combined with the file digests of every sub-flow it includes."""
    file_version: SkipJsonSchema[str] = Field(default="", exclude=True)
    """This file's digest alone."""
    subflows: SkipJsonSchema[dict[str, Flow]] = Field(default_factory=dict, exclude=True)
    """Every flow it includes, directly or not, by name: the versions a pinned call runs."""
    ref_positions: SkipJsonSchema[dict[str, tuple[int, int]]] = Field(
        default_factory=dict, exclude=True
    )
    """(line, column) of sub-flow references ("nodes.N.flow", "nodes.N.pass.K", ...)."""

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def subflow_nodes(self) -> dict[str, SubflowNode]:
        return {n: node for n, node in self.nodes.items() if isinstance(node, SubflowNode)}

    def flow_named(self, name: str) -> Flow | None:
        """This flow or one it includes."""
        return self if name == self.name else self.subflows.get(name)

    def interruptions(self, node_name: str) -> InterruptionPolicy:
        """What interrupts the prompts of ``node_name``: its own block, else the defaults'."""
        node = self.nodes.get(node_name)
        own = getattr(node, "interruptions", None)
        return (own if isinstance(own, Interruptions) else self.defaults.interruptions).policy()
