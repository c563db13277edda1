"""Placing one outbound call: check the request, create the call at Twilio, bind its flow.

The call's record is created here, right after Twilio gives the CallSid and long before the
callee can answer (phones ring for seconds): flow and version pinned, the dial's variables, the
direction. The answer webhook (``/twilio/outbound``) reads it on whichever instance Twilio asks,
and the stream runs the flow the dial chose, never the one routes.yaml gives the number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from ivr.control.status_callbacks import CALL_STATUS_PATH
from ivr.errors import IvrError
from ivr.flows.engine import CALL_VARIABLES
from ivr.flows.registry import FlowRegistry
from ivr.flows.validate import BUILTIN_VARIABLES
from ivr.state.base import CallRecord, CallStore, StoreError
from ivr.telephony.dialing import is_dialable
from ivr.telephony.rest import CallNotPlaced, NewCall, TwilioRest

log = structlog.get_logger("ivr.outbound")

ANSWER_PATH = "/twilio/outbound"
AMD_PATH = "/twilio/amd"
STATUS_PATH = CALL_STATUS_PATH  # Twilio's final word on the call, answered or not

Scalar = str | int | float | bool


class DialRequest(BaseModel):
    """``POST /calls`` body (and one campaign row)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    to: str = Field(description="The number to call, E.164 (+15550100998).")
    flow: str = Field(description="The flow the call runs (its file's name:).")
    vars: dict[str, Scalar] = Field(
        default_factory=dict, description="Call variables (declared by the flow)."
    )
    from_: str = Field(default="", alias="from", description="Caller ID; IVR_OUTBOUND_FROM.")
    machine_detection: str | None = Field(
        default=None, description="Twilio's async AMD: Enable, DetectMessageEnd, or '' (off)."
    )


class DialRefused(IvrError):
    """The call was not placed: ``status`` is the HTTP answer, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Dialled:
    call_sid: str
    flow: str
    flow_version: str


class Dialer:
    def __init__(
        self,
        rest: TwilioRest | None,
        store: CallStore,
        registry: FlowRegistry,
        *,
        public_url: str,
        from_number: str,
        machine_detection: str,
    ) -> None:
        self._rest = rest
        self._store = store
        self._registry = registry
        self._public_url = public_url.rstrip("/")
        self._from = from_number
        self._amd = machine_detection

    async def dial(self, request: DialRequest) -> Dialled:
        """Place the call; ``DialRefused`` (with the HTTP status to answer) when it is not."""
        from_ = request.from_ or self._from
        check(request, from_, self._registry)
        amd = self._amd if request.machine_detection is None else request.machine_detection
        if amd not in ("", "Enable", "DetectMessageEnd"):
            raise DialRefused(400, f"machine_detection must be Enable or DetectMessageEnd: {amd!r}")
        if self._rest is None:
            raise DialRefused(
                503, "outbound calls need TWILIO_ACCOUNT_SID and TWILIO_AUTH_TOKEN to be set"
            )
        flow = self._registry.get(request.flow)
        new = NewCall(
            to=request.to,
            from_=from_,
            url=self._public_url + ANSWER_PATH,
            machine_detection=amd,
            amd_callback_url=self._public_url + AMD_PATH if amd else "",
            status_callback=self._public_url + STATUS_PATH,
        )
        try:
            call_sid = await self._rest.create_call(new)
        except CallNotPlaced as exc:
            log.warning("outbound.not_placed", status=exc.status, code=exc.code, error=exc.reason)
            raise DialRefused(400 if exc.status == 400 else 502, str(exc)) from exc
        record = CallRecord(
            call_sid=call_sid,
            from_number=from_,
            to_number=request.to,
            flow_name=flow.name,
            flow_version=flow.version,
            variables=dict(request.vars),
            direction="outbound",
        )
        try:
            await self._store.create(record)
        except StoreError as exc:  # Twilio rings the callee anyway; the webhook will refuse
            log.error("outbound.record_failed", call_sid=call_sid, error=str(exc))
            raise DialRefused(503, f"call {call_sid} placed but not stored: {exc}") from exc
        log.info("outbound.placed", call_sid=call_sid, flow=flow.name, pii_to=request.to)
        return Dialled(call_sid, flow.name, flow.version)


def check(request: DialRequest, from_: str, registry: FlowRegistry) -> None:
    """What is wrong with a dial request, as ``DialRefused``: 400 for bad values, 404 for a
    flow that does not exist."""
    if not is_dialable(request.to):
        raise DialRefused(
            400, f"'to' must be an E.164 number such as +15550100998, got {request.to!r}"
        )
    if not from_:
        raise DialRefused(400, "no caller ID: give 'from' or set IVR_OUTBOUND_FROM")
    if not is_dialable(from_):
        raise DialRefused(400, f"'from' must be an E.164 number, got {from_!r}")
    flows = registry.flows
    if request.flow not in flows:
        known = ", ".join(sorted(flows)) or "none"
        raise DialRefused(404, f"flow {request.flow!r} does not exist (flows: {known})")
    declared = set(flows[request.flow].variables)
    reserved = sorted(set(request.vars) & (set(BUILTIN_VARIABLES) | set(CALL_VARIABLES)))
    if reserved:
        raise DialRefused(400, f"vars {reserved} are set by the gateway, not by a dial")
    unknown = sorted(set(request.vars) - declared)
    if unknown:
        raise DialRefused(
            400,
            f"flow {request.flow!r} has no variable {', '.join(map(repr, unknown))} "
            f"(declared: {', '.join(sorted(declared)) or 'none'})",
        )


def parse_vars(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs (``--var``); ``ValueError`` names a pair without ``=``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--var {pair!r}: expected NAME=VALUE")
        out[key.strip()] = value
    return out
