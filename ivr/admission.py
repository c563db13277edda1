"""Whether this instance takes new calls, what a call hears when it cannot, and the drain.

*Ready* (``/readyz``, ``ivr_ready``) means this instance can carry one more call: it is not
draining, carries fewer than ``IVR_MAX_CALLS`` streams and its event loop keeps time. Redis
health is not part of it: with Redis away every instance carries calls on in-memory state, and
a fleet that all went unready would leave the load balancer nowhere to send them.

A voice webhook that arrives while the instance cannot take a call (the load balancer has not
noticed yet, or every instance is full) is answered with the configured overflow instead of a
call that would stutter. While draining, webhooks are still answered when the store is shared
(the stream goes through the load balancer to a ready instance; this one refuses it with 503).

The drain (SIGTERM, ``ivr.server``): streams are refused at once; live calls are moved to other
instances at a turn boundary when Twilio REST credentials are set (``ivr.call.moves``), else
they finish here; after ``IVR_DRAIN_SECONDS`` the process exits anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import structlog
from twilio.twiml.voice_response import VoiceResponse

from ivr.call.live import LiveCall, LiveCalls
from ivr.call.moves import move_call
from ivr.call.services import CallServices
from ivr.obs.loop_lag import LoopLagMonitor
from ivr.state.base import CallStore
from ivr.state.resilient import statistics_of
from ivr.telephony import twilio

log = structlog.get_logger("ivr.admission")

RESERVATION_SECONDS = 10.0
"""How long a call answered by the webhook counts against IVR_MAX_CALLS before its stream
arrives. Twilio opens the stream within a second or two; a stream the load balancer sends to
another instance leaves the reservation here to lapse."""

OVERFLOW_APOLOGY = "Sorry, all our lines are busy right now. Please call again in a few minutes."
"""What IVR_OVERFLOW=apology says (Twilio's own voice, before hanging up)."""


@dataclass(frozen=True, slots=True)
class AdmissionStatus:
    ready: bool
    draining: bool
    calls: int
    capacity: int
    """IVR_MAX_CALLS; 0 = unlimited."""
    overloaded: bool
    loop_lag_ms: float
    inbound_backlog_ms: float
    """How late the process takes up its callers' audio (median of the last 2 s)."""
    store: str
    """``ok``, ``degraded`` (Redis unreachable: calls go on from memory) or ``memory``."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Admission:
    def __init__(
        self,
        *,
        live: LiveCalls,
        lag: LoopLagMonitor,
        store: CallStore,
        max_calls: int = 0,
        max_backlog: float = 0.0,
        overflow: str = "apology",
        overflow_number: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if overflow not in ("reject", "redirect", "apology"):
            raise ValueError(f"IVR_OVERFLOW must be reject, redirect or apology, got {overflow!r}")
        self.live = live
        self.lag = lag
        self.max_calls = max_calls
        self.max_backlog = max_backlog
        """Seconds behind its callers past which the instance takes no new call (0: never)."""
        self.overflow = overflow
        self.overflow_number = overflow_number
        self._store = store
        self._clock = clock
        self._reserved: dict[str, float] = {}  # call_sid -> when the reservation lapses

    @property
    def full(self) -> bool:
        return self.max_calls > 0 and self._calls() >= self.max_calls

    def reserve(self, call_sid: str) -> None:
        """Count a call the webhook just answered, so a burst of webhooks cannot all be
        admitted before their streams arrive (the live set only knows connected streams)."""
        if self.max_calls > 0:
            self._reserved[call_sid] = self._clock() + RESERVATION_SECONDS

    def _calls(self) -> int:
        """Live streams plus answered calls whose stream has not arrived (yet)."""
        now = self._clock()
        live = {call.call_sid for call in self.live.calls()}
        for sid in [s for s, until in self._reserved.items() if until <= now or s in live]:
            del self._reserved[sid]  # lapsed, or its stream is here and counted as live
        return len(live) + len(self._reserved)

    @property
    def overloaded(self) -> bool:
        """Its loop wakes late, or it hears its callers late: one more call makes it worse
        for every caller it carries."""
        behind = self.max_backlog > 0 and self.live.backlog.behind > self.max_backlog
        return behind or self.lag.overloaded

    @property
    def ready(self) -> bool:
        return not (self.live.draining or self.full or self.overloaded)

    def takes_new_call(self) -> bool:
        """Whether a voice webhook may start a call (see the module docstring)."""
        if self.full or self.overloaded:
            return False
        return not self.live.draining or self._store_state() != "memory"

    def status(self) -> AdmissionStatus:
        return AdmissionStatus(
            ready=self.ready,
            draining=self.live.draining,
            calls=self._calls(),
            capacity=self.max_calls,
            overloaded=self.overloaded,
            loop_lag_ms=round(self.lag.lag * 1000, 1),
            inbound_backlog_ms=round(self.live.backlog.behind * 1000, 1),
            store=self._store_state(),
        )

    def overflow_twiml(self) -> str:
        if self.overflow == "redirect":
            return twilio.dial_twiml(self.overflow_number)
        if self.overflow == "reject":
            response = VoiceResponse()
            response.reject(reason="busy")
            return str(response.to_xml())
        return twilio.reject_twiml(OVERFLOW_APOLOGY)

    def _store_state(self) -> str:
        statistics = statistics_of(self._store)
        if statistics is None:
            return "memory"
        return "degraded" if statistics.degraded else "ok"


@dataclass(slots=True)
class DrainResult:
    seconds: float
    moved: int
    left: int
    """Calls still live when the drain ran out (they are cut when the process exits)."""


ACTION_GRACE_SECONDS = 2.0
"""After the last call of a drain ends: time for Twilio's <Connect action> request to arrive."""


async def drain(services: CallServices, *, seconds: float) -> DrainResult:
    """Refuse new streams, then wait (up to ``seconds``) for every live call to end or, with
    REST credentials, to be moved to another instance at its next turn boundary."""
    live = services.live
    live.start_draining()
    began = time.monotonic()
    deadline = began + seconds
    log.info("drain.started", calls=len(live), seconds=seconds, moves=services.rest is not None)
    carried = len(live) > 0 or live.open_sockets > 0
    moves: dict[LiveCall, asyncio.Task[bool]] = {}
    try:
        while (len(live) or live.open_sockets) and (left := deadline - time.monotonic()) > 0:
            if services.rest is not None:
                for call in live.calls():
                    if call not in moves:
                        work = move_call(call, services.rest, services.connector, within=left)
                        moves[call] = asyncio.create_task(work, name=f"move-{call.call_sid}")
            await live.changed(at_most=min(0.5, left))
    finally:
        for task in moves.values():
            task.cancel()
        done = await asyncio.gather(*moves.values(), return_exceptions=True)
    for call, outcome in zip(moves, done, strict=True):
        if isinstance(outcome, Exception):
            log.error("drain.move_failed", call_sid=call.call_sid, error=repr(outcome))
    if carried and not len(live) and not live.open_sockets:
        # A call that just ended here makes Twilio ask its <Connect action> URL what next; if
        # no instance answers (a single instance, or the last one draining) the caller hears
        # Twilio's "application error" after the goodbye. Stay up a moment to answer it.
        await asyncio.sleep(max(0.0, min(ACTION_GRACE_SECONDS, deadline - time.monotonic())))
    result = DrainResult(
        seconds=round(time.monotonic() - began, 3),
        moved=sum(1 for d in done if d is True),
        left=len(live),
    )
    log.info("drain.finished", seconds=result.seconds, moved=result.moved, left=result.left)
    return result
