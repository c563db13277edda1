"""The call record every gateway instance shares, and the store protocol that keeps it.

A call must survive the loss of the instance carrying its media stream, so everything needed to
resume it (flow position, variables, what the caller has heard) lives in one ``CallRecord`` that
any instance can load.

    IvrError
    └── StoreError
        ├── StoreUnavailable   the backing store cannot be reached (retry later / degrade)
        ├── CallExists         create() for a call_sid that is already stored
        ├── CallNotFound       update()/end() for a call_sid that is not stored
        ├── UpdateConflict     update() lost the compare-and-set race too many times
        ├── StreamSuperseded   a newer stream carries the call (see ``fenced``)
        └── CorruptRecord      a stored value is not a valid CallRecord (names the key)
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ivr.errors import IvrError
from ivr.obs.pii import mask_deep, mask_speech
from ivr.state.outcomes import Outcome, outcome_of

DEFAULT_HISTORY_LIMIT = 50
DEFAULT_TURNS_LIMIT = 100
DEFAULT_TIMELINE_LIMIT = 200
DEFAULT_ENDED_TTL = 86_400.0

Mutator = Callable[["CallRecord"], None]


class StoreError(IvrError):
    """A call-state store operation failed."""


class StoreUnavailable(StoreError):
    """The store cannot be reached; the operation may or may not have been applied."""


class CallExists(StoreError):
    def __init__(self, call_sid: str) -> None:
        super().__init__(f"call {call_sid!r} already exists")
        self.call_sid = call_sid


class CallNotFound(StoreError):
    def __init__(self, call_sid: str) -> None:
        super().__init__(f"call {call_sid!r} not found (never created, or expired)")
        self.call_sid = call_sid


class UpdateConflict(StoreError):
    def __init__(self, call_sid: str, attempts: int) -> None:
        super().__init__(f"call {call_sid!r}: update lost the version race {attempts} times")
        self.call_sid = call_sid
        self.attempts = attempts


class StreamSuperseded(StoreError):
    """A newer stream carries this call: the old one must stop writing and end."""

    def __init__(self, call_sid: str, stream_sid: str, current: str | None) -> None:
        super().__init__(f"call {call_sid!r}: stream {stream_sid} was replaced by {current}")
        self.call_sid = call_sid


def fenced(stream_sid: str, mutate: Mutator) -> Mutator:
    """``mutate`` applied only while ``stream_sid`` still carries the call.

    A half-open old stream (its socket not yet dead) must not overwrite the live call's state.
    """

    def apply(record: CallRecord) -> None:
        if record.stream_sid != stream_sid:
            raise StreamSuperseded(record.call_sid, stream_sid, record.stream_sid)
        mutate(record)

    return apply


class CorruptRecord(StoreError):
    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: stored call record is invalid: {detail}")
        self.where = where


class CallStatus(enum.StrEnum):
    RINGING = "ringing"
    ACTIVE = "active"
    RECONNECTING = "reconnecting"
    TRANSFERRING = "transferring"
    ENDED = "ended"


class HistoryMessage(BaseModel):
    """One message as HEARD by the caller (assistant text is cut at barge-in)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class WarmTransferLeg(BaseModel):
    """A warm transfer under way: the caller holds in conference ``room`` while the agent is
    dialled. Every instance answers its status callbacks from this, so it lives in the record."""

    model_config = ConfigDict(extra="forbid")

    room: str
    status: Literal["holding", "dialling", "connected", "failed"] = "holding"
    agent_call_sid: str = ""
    result: str = ""
    """Why it failed: no-answer, busy, failed, canceled, not-joined, timeout, caller-left."""


def _now() -> datetime:
    return datetime.now(UTC)


def mask(value: str, keep: int = 2) -> str:
    """Mask every letter/digit except the last ``keep`` ones: '+14155550123' -> '+*********23'."""
    alnum_seen = 0
    out = []
    for ch in reversed(value):
        if ch.isalnum():
            alnum_seen += 1
            out.append(ch if alnum_seen <= keep else "*")
        else:
            out.append(ch)
    return "".join(reversed(out))


# Fields carrying personal data; redacted() masks every field marked this way.
_PII: dict[str, Any] = {"pii": True}
TwilioStatus = Literal["", "completed", "busy", "no-answer", "failed", "canceled"]
# Fields added after records were first shared across versions, with their defaults: left out
# of the JSON while at their default, so a rolling upgrade's previous-version instances (whose
# model forbids unknown fields) still read every live call's record.
_OMITTED_AT_DEFAULT: dict[str, Any] = {"outcome": None, "twilio_status": "", "billed_seconds": None}


class CallRecord(BaseModel):
    """Everything needed to resume a call on any instance. Plain JSON data only."""

    model_config = ConfigDict(extra="forbid")

    call_sid: str = Field(min_length=1)
    stream_sid: str | None = None
    account_sid: str = ""
    from_number: str = Field(default="", json_schema_extra=_PII)
    to_number: str = Field(default="", json_schema_extra=_PII)
    flow_name: str = ""
    flow_version: str = ""  # content hash of the flow file the call started on
    node: str | None = None
    variables: dict[str, Any] = Field(default_factory=dict)
    flow_state: dict[str, Any] = Field(default_factory=dict)  # opaque, owned by the flow engine
    history: list[HistoryMessage] = Field(default_factory=list)
    turns: list[dict[str, Any]] = Field(default_factory=list)
    status: CallStatus = CallStatus.RINGING
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)
    ended_at: datetime | None = None
    version: int = 0  # set by the store: 1 after create, +1 on every write
    instance_id: str | None = None
    stream_count: int = 0
    # Recording: asked for this call by whoever created it (per call), then settled by its
    # flow when it is pinned (a flow may record every call, or never); the streams' files.
    record_call: bool = False
    recordings: list[str] = Field(default_factory=list)
    """Where each recorded stream of the call was saved (``local:KEY``, ``s3://B/KEY``)."""
    # How the flow decided to leave the stream; the <Connect action> handler turns it into TwiML
    # on whichever instance Twilio asks. None while the call is live (a dropped stream resumes).
    end_action: Literal["hangup", "transfer"] | None = None
    transfer_to: str = Field(default="", json_schema_extra=_PII)
    warm_transfer: WarmTransferLeg | None = None
    direction: Literal["inbound", "outbound"] = "inbound"
    """``outbound``: placed by ``POST /calls`` / ``ivr dial``; its flow was chosen at dial time."""
    answered_by: str = ""
    """Outbound: who answered as the flow saw it (human, machine, unknown)."""
    twilio_answered_by: str = ""
    """Outbound with Twilio's AMD: its ``AnsweredBy`` (human, machine_end_beep, fax, ...)."""
    history_limit: int = Field(default=DEFAULT_HISTORY_LIMIT, ge=1)
    turns_limit: int = Field(default=DEFAULT_TURNS_LIMIT, ge=1)
    timeline: list[dict[str, Any]] = Field(default_factory=list)
    """What happened on the call besides its words, oldest first: ``{"at": ISO time, "kind":
    "dtmf" | "barge_in" | "backchannel" | "node", ...}`` (see ``ivr.callio.timeline``); the newest
    ``timeline_limit`` are kept. Key presses are stored as the flow stores answers."""
    timeline_limit: int = Field(default=DEFAULT_TIMELINE_LIMIT, ge=1)
    outcome: Outcome | None = None
    """How the call ended, settled once by whoever ended it (``ivr.control.endings``); None while
    it goes on, and in records the previous version wrote (``outcome_of`` reads those)."""
    twilio_status: TwilioStatus = ""
    """Twilio's final word on the call (its call-status callback); empty until it comes."""
    billed_seconds: int | None = Field(default=None, ge=0)
    """The call's duration as Twilio billed it (``CallDuration``, seconds), same callback."""

    @model_validator(mode="after")
    def _bounded_on_load(self) -> CallRecord:
        self.enforce_bounds()
        return self

    @property
    def is_ended(self) -> bool:
        return self.ended_at is not None

    @property
    def resumed(self) -> bool:
        return self.stream_count > 1

    def add_message(self, role: str, content: str) -> None:
        self.history.append(HistoryMessage.model_validate({"role": role, "content": content}))
        self.enforce_bounds()

    def add_turn(self, latencies: dict[str, Any]) -> None:
        self.turns.append(dict(latencies))
        self.enforce_bounds()

    def add_events(self, events: list[dict[str, Any]]) -> None:
        self.timeline.extend(dict(event) for event in events)
        self.enforce_bounds()

    def enforce_bounds(self) -> None:
        """Keep only the newest messages/turns/events; stores call this before every write."""
        if len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]
        if len(self.turns) > self.turns_limit:
            del self.turns[: len(self.turns) - self.turns_limit]
        if len(self.timeline) > self.timeline_limit:
            del self.timeline[: len(self.timeline) - self.timeline_limit]

    def redacted(self) -> CallRecord:
        """A copy safe for listings and logs: personal-data fields masked."""
        masked: dict[str, Any] = {
            name: mask(getattr(self, name))
            for name, field in type(self).model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("pii")
        }
        # The same numbers also reach flow variables (`caller`, `called`): mask them there too.
        numbers = {getattr(self, name): value for name, value in masked.items() if value}
        if numbers:
            for name in ("variables", "flow_state"):
                raw = json.dumps(getattr(self, name))
                for number, hidden in numbers.items():
                    raw = raw.replace(json.dumps(number)[1:-1], hidden)
                masked[name] = json.loads(raw)
        return self.model_copy(update=masked, deep=True)

    def view(self, *, pii: bool = False) -> dict[str, Any]:
        """The record as JSON data for people (admin API, ``ivr calls``): unless ``pii``, its
        numbers masked, and phone- or card-like text anywhere in it too (history, variables)."""
        if pii:
            data: dict[str, Any] = self.model_dump(mode="json")
        else:
            data = mask_deep(self.redacted().model_dump(mode="json"), mask_speech)
            # Ids and digests, never a person's number (a digest may be all digits by chance).
            for name in ("call_sid", "stream_sid", "account_sid", "flow_version", "instance_id"):
                data[name] = getattr(self, name)
        ended = outcome_of(self)  # records of the previous version too
        data["outcome"] = ended.value if ended is not None else None
        data["twilio_status"], data["billed_seconds"] = self.twilio_status, self.billed_seconds
        return data

    def to_json(self) -> str:
        """The record as stored: the fields of ``_OMITTED_AT_DEFAULT`` left out while at their
        default. (A wrap serializer did this once, in Python on a dict of the whole record: each
        write dumped twice as slowly, a few writes every turn.)"""
        omit = {
            name for name, default in _OMITTED_AT_DEFAULT.items() if getattr(self, name) == default
        }
        return self.model_dump_json(exclude=omit, warnings=False)

    @classmethod
    def from_json(cls, raw: str | bytes, where: str) -> CallRecord:
        try:
            return cls.model_validate_json(raw)
        except ValueError as exc:
            raise CorruptRecord(where, str(exc).replace("\n", "; ")[:500]) from exc


def flow_sources_from_json(raw: str | bytes, where: str) -> dict[str, str]:
    """Stored flow sources back from JSON; ``CorruptRecord`` (naming ``where``) if malformed."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise CorruptRecord(where, f"flow sources are not JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise CorruptRecord(where, "flow sources must be a JSON object of path -> text")
    return data


def clone(record: CallRecord) -> CallRecord:
    """A deep copy; a JSON round trip is about 3x faster than ``model_copy(deep=True)``."""
    return CallRecord.model_validate_json(record.model_dump_json(warnings=False))


def apply_mutation(
    current: CallRecord, mutate: Mutator, *, owned: bool = False
) -> tuple[CallRecord, str]:
    """Run ``mutate`` on a copy and stamp the store-owned fields; returns the new record and
    its JSON. ``current`` is untouched unless ``owned`` (the caller just loaded it and will
    discard it), which skips the copy."""
    sid, version = current.call_sid, current.version
    draft = current if owned else clone(current)
    mutate(draft)
    if draft.call_sid != sid:
        raise ValueError(f"update of {sid!r} tried to change call_sid")
    draft.version = version + 1
    draft.updated_at = _now()
    draft.enforce_bounds()
    # Validate what the mutator wrote (bad types, non-JSON values) before anything is stored;
    # plain dicts appended to ``history`` are accepted here and become HistoryMessage.
    raw = draft.to_json()
    return CallRecord.model_validate_json(raw), raw


def prepare_new(record: CallRecord) -> tuple[CallRecord, str]:
    """The record as ``create`` stores it: version 1, fresh timestamps, validated JSON."""
    draft = clone(record)
    draft.version = 1
    draft.updated_at = _now()
    draft.enforce_bounds()
    raw = draft.to_json()
    return CallRecord.model_validate_json(raw), raw


def ending(status: CallStatus) -> Mutator:
    def mark(record: CallRecord) -> None:
        record.status = status
        if record.ended_at is None:
            record.ended_at = _now()

    return mark


@runtime_checkable
class CallStore(Protocol):
    """Where call records live. Every method may raise ``StoreUnavailable``."""

    async def create(self, record: CallRecord) -> CallRecord:
        """Store a new call (version 1). Raises ``CallExists`` if the sid is taken."""
        ...

    async def get(self, call_sid: str) -> CallRecord | None: ...

    async def update(self, call_sid: str, mutate: Mutator) -> CallRecord:
        """Atomic read-modify-write. ``mutate`` edits the record in place and may run more
        than once (it is re-run on a version conflict), so it must depend only on its input."""
        ...

    async def end(self, call_sid: str, status: CallStatus = CallStatus.ENDED) -> None:
        """Mark the call finished: sets ``ended_at``, drops it from the active list, expires it
        after ``ended_ttl`` seconds."""
        ...

    async def list_active(self, limit: int = 100) -> list[CallRecord]:
        """Calls not ended, most recently updated first."""
        ...

    async def list_ended(
        self, limit: int = 100, before: datetime | None = None
    ) -> list[CallRecord]:
        """Ended calls still stored (``ended_ttl``), whichever instance ended them: newest
        ``ended_at`` first, only those that ended strictly before ``before`` (the previous
        page's last ``ended_at``: the next page). An empty page is the end of the list."""
        ...

    async def list_stale(self, written_before: datetime, limit: int = 100) -> list[CallRecord]:
        """Calls not ended whose record was last written before ``written_before``, oldest
        first: the candidates for an ending nobody wrote (``ivr.control.sweeper``)."""
        ...

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        """Register a token just minted for ``call_sid`` where instances of earlier releases
        look for it (they spend a token by deleting it: a fleet mid-upgrade admits streams
        either way). Single use no longer depends on it: ``claim_stream_token`` does not read
        it, so a registration that failed or came late costs nothing."""
        ...

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        """Spend ``token``, which the caller verified is genuine (signed, ``ivr.control.
        tokens``), belongs to ``call_sid`` and is good for ``ttl`` more seconds: True on its
        first use, False for a replayed or duplicate handshake. The spend is kept ``ttl``
        seconds, as long as the token could be presented again."""
        ...

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        """Keep the files flow ``version`` was loaded from ({relative path: text}) for ``ttl``
        seconds, so any instance can run calls pinned to it. Stored only if absent (a version
        names its content); the TTL is renewed either way."""
        ...

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        """The sources saved for ``version``; None if never saved or expired."""
        ...

    async def ping(self) -> bool: ...

    async def start(self) -> None:
        """Begin background work (reconnects, reconciliation); before the first call."""
        ...

    async def aclose(self) -> None: ...
