"""The pieces of the call-flow file format that flows and their nodes share: names, the base
model, conditions, HTTP calls, routes, extraction, intents, interruptions, defaults, recording.

The format as a whole is described in ``ivr.flows.model``; the nodes are in ``ivr.flows.nodes``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from ivr.callio.interruption_policy import DEFAULT_BACKCHANNELS, InterruptionPolicy

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
