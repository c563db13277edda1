"""What goes into and out of the flow engine.

``FlowState`` is plain data that round-trips through JSON (the call session persists it between
steps). Events are what happened on the call; actions are what the runner must do next. Among the
actions of one step, at most one produces a result (``Listen``, ``AgentTurn``, ``ClassifyIntent``,
``HttpRequest``), and it is always the last one; its result is the next event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from ivr.callio.interruption_policy import InterruptionPolicy
from ivr.callio.io import ListenSpec
from ivr.control.transfers import WarmTransfer
from ivr.llm.base import ChatMessage, ToolSpec

# ---------------------------------------------------------------- state

Waiting = Literal["start", "input", "classify", "agent", "http", "tool_http", "transfer", "done"]
Outcome = Literal["hangup", "transfer", "caller_hangup"]


class ToolCallData(BaseModel):
    id: str
    name: str
    arguments: str


class HistoryItem(BaseModel):
    """One message of an agent conversation; assistant text is only what the caller heard."""

    role: Literal["user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCallData] = Field(default_factory=list)
    tool_call_id: str | None = None


class Frame(BaseModel):
    """A flow waiting for the sub-flow its subflow node ``node`` started to return."""

    flow: str
    version: str
    node: str
    vars: dict[str, Any]


class KeptAnswer(BaseModel):
    """A backend's answer as the call state keeps it (see ``waits.kept_answer``)."""

    ok: bool
    status: int = 0
    body: Any = None
    """The JSON answer: whole up to ``waits.MAX_KEPT_ANSWER``, else only the mapped fields."""
    error: str | None = None


class SentRequest(BaseModel):
    """A request that is not idempotent, from the node the call waits at. Saved with its key
    before it is sent (in flight) and again with its answer before the engine reads it, so a
    resumed call never sends it twice: it re-sends an in-flight one with the same key (the
    backend deduplicates) and reads a kept answer instead of asking again."""

    key: str
    """The ``Idempotency-Key`` header it is sent with."""
    flow: str
    node: str
    tool_call: str | None = None
    """The agent tool call it answers (None: an http node)."""
    answer: KeptAnswer | None = None
    """None while in flight."""


class FlowState(BaseModel):
    flow: str
    """The flow running now: the call's flow, or a sub-flow of it (then ``stack`` is not empty)."""
    version: str = ""
    node: str = ""
    waiting: Waiting = "start"
    vars: dict[str, Any] = Field(default_factory=dict)
    """The running flow's variables; a sub-flow has its own."""
    stack: list[Frame] = Field(default_factory=list)
    """The flows that started sub-flows, outermost first."""
    env: dict[str, str | None] = Field(default_factory=dict, exclude=True)
    """Environment values the call's flows read (the engine is pure). Never serialised, so
    secrets stay out of the call store; the runner reads them again when a call resumes."""
    attempts: int = 0
    """Failed answers (no match or no input) at the current input node."""
    agent_turns: int = 0
    tool_rounds: int = 0
    """Model calls since the caller last spoke (bounds tool-call loops)."""
    tool_errors: int = 0
    pending_tools: list[ToolCallData] = Field(default_factory=list)
    pending_answer: str | None = None
    history: list[HistoryItem] = Field(default_factory=list)
    reply_unheard: bool = False
    """The agent's last reply was cut before the caller heard a word of it: they had not
    finished (a pause mid-sentence taken for the end), so their next words join the caller
    message it answered instead of starting a new one."""
    outcome: Outcome | None = None
    transfer_to: str | None = None
    transfer_result: str | None = None
    """Why a warm transfer did not reach the agent (no-answer, busy, ...): set when the caller
    comes back from the hold, read once by the engine on resume (then ``transfer_status``)."""
    steps: int = 0
    call_id: str = ""
    """Identifies the call in idempotency keys (its CallSid; the runner sets it)."""
    http_seq: int = 0
    """Requests with an idempotency key sent so far: each key ends with its number."""
    request: SentRequest | None = None
    """The keyed request the call waits for, until the engine reads its answer."""

    @property
    def done(self) -> bool:
        return self.waiting == "done"


# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class CallStarted:
    pass


@dataclass(frozen=True, slots=True)
class Resumed:
    """The call continues from a saved state on another instance."""

    resume_prompt: str = ""
    """The gateway's apology, said when neither the flow nor the call's flow sets one. Given
    with the event, not kept in the state: it is configuration, not part of the call."""


@dataclass(frozen=True, slots=True)
class CallerSaid:
    text: str


@dataclass(frozen=True, slots=True)
class CallerPressed:
    digits: str


@dataclass(frozen=True, slots=True)
class CallerSilent:
    pass


@dataclass(frozen=True, slots=True)
class CallerHungUp:
    pass


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class LlmReplied:
    text_heard: str
    interrupted: bool = False
    tool_calls: tuple[ToolCallEvent, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class IntentClassified:
    intent: str | None
    slots: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class HttpResult:
    ok: bool
    status: int = 0
    json: Any = None
    error: str | None = None


FlowEvent = (
    CallStarted
    | Resumed
    | CallerSaid
    | CallerPressed
    | CallerSilent
    | CallerHungUp
    | LlmReplied
    | IntentClassified
    | HttpResult
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Say:
    text: str
    interruptible: bool = True
    after_beep: bool = False
    """Wait for a machine's greeting and beep to be over first (a voicemail)."""
    interruptions: InterruptionPolicy | None = None
    """What counts as the caller interrupting it (None: the defaults)."""


@dataclass(frozen=True, slots=True)
class Listen:
    spec: ListenSpec


@dataclass(frozen=True, slots=True)
class AgentTurn:
    messages: tuple[ChatMessage, ...]
    """System message first, then the conversation."""
    tools: tuple[ToolSpec, ...] = ()
    interruptible: bool = True
    max_tokens: int | None = None
    interruptions: InterruptionPolicy | None = None


@dataclass(frozen=True, slots=True)
class IntentOption:
    name: str
    description: str
    examples: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClassifyIntent:
    text: str
    intents: tuple[IntentOption, ...]
    extract_schema: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    timeout: float = 5.0
    key: str | None = None
    """Its idempotency key (already in ``headers``): the runner keeps the answer in the state
    and saves it before the engine reads it. None: idempotent, nothing is kept."""
    keep: tuple[str, ...] = ()
    """The answer's fields the flow maps, kept when the whole answer is too large to keep."""


@dataclass(frozen=True, slots=True)
class Transfer:
    number: str
    warm: WarmTransfer | None = None


@dataclass(frozen=True, slots=True)
class Hangup:
    pass


FlowAction = Say | Listen | AgentTurn | ClassifyIntent | HttpRequest | Transfer | Hangup
