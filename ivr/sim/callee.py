"""The far end of the calls the gateway places: picks up what the REST stand-in creates.

``FakeTwilioRestApi(answer=callees.answer)``: when the gateway creates a call, the callee whose
number it dialled picks up like Twilio would connect it: the call's ``Url`` is requested
(signed), the ``<Connect><Stream>`` is opened and the callee's script plays (the simulated
caller does all of that: ``place_call(outbound=...)``). With async AMD asked for, Twilio's
verdict is POSTed (signed) to ``AsyncAmdStatusCallback`` when the callee says it would come.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import structlog

from ivr.sim.caller import OutboundAnswer, place_call
from ivr.sim.report import CallReport
from ivr.sim.rest_api import CallCreate, FakeTwilioRestApi
from ivr.sim.script import Script
from ivr.sim.webhook import CallFailed, CallIds, TwilioSide

log = structlog.get_logger("ivr.sim.callee")


@dataclass(frozen=True, slots=True)
class Callee:
    """Who answers one number: what they play, and what Twilio's AMD would say of them."""

    script: Script
    answered_by: str = ""
    """Twilio's ``AnsweredBy`` for this callee (human, machine_end_beep, ...); "" = none."""
    amd_after_s: float = 3.0
    """Seconds after the callee starts talking (its audio starts reaching the gateway) at
    which Twilio's verdict arrives: Twilio's AMD judges that same audio."""


@dataclass(slots=True)
class AmdCallback:
    call_sid: str
    answered_by: str
    status_code: int


@dataclass(slots=True)
class SimulatedCallees:
    """Numbers and who answers them; ``reports`` and ``amd_callbacks`` for the tests."""

    http_base: str
    auth_token: str
    public_base_url: str
    callees: dict[str, Callee]
    rest_api: FakeTwilioRestApi | None = None
    """Set once the stand-in runs: the calls are its account's, redirects reach them."""
    reports: dict[str, CallReport] = field(default_factory=dict)
    amd_callbacks: list[AmdCallback] = field(default_factory=list)
    failures: dict[str, Exception] = field(default_factory=dict)
    statuses: list[tuple[str, str]] = field(default_factory=list)
    no_answer_after_s: float | None = 0.3
    """How long a number nobody answers rings before Twilio reports ``no-answer`` (None:
    it rings on)."""
    """(CallSid, CallStatus) of each status callback sent."""
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set each time a call is over (its report is in ``reports``)."""

    async def answer(self, create: CallCreate) -> None:
        callee = self.callees.get(create.to)
        if callee is None:  # rings out: Twilio reports the end of the call that never began
            log.info("callee.no_answer", to=create.to)
            if self.no_answer_after_s is not None:
                await asyncio.sleep(self.no_answer_after_s)
                await self._post_status(create, "no-answer")
            return
        amd = None
        answer = OutboundAnswer(create.call_sid, create.url, create.method)
        if create.async_amd and create.amd_callback and callee.answered_by:
            amd = asyncio.create_task(self._amd_verdict(create, callee, answer.streaming))
        try:
            report = await self._pick_up(create, callee, answer)
        except Exception as exc:  # a broken callee script: the test waiting on it must see it
            log.error("callee.failed", call_sid=create.call_sid, error=repr(exc))
            self.failures[create.call_sid] = exc
            self.answered.set()
            return
        finally:
            if amd is not None:
                amd.cancel()
                await asyncio.gather(amd, return_exceptions=True)
        await self._post_status(create, "completed")
        self.reports[create.call_sid] = report
        self.answered.set()

    async def _pick_up(
        self, create: CallCreate, callee: Callee, answer: OutboundAnswer
    ) -> CallReport:
        return await place_call(
            self.http_base,
            script=callee.script,
            auth_token=self.auth_token,
            public_base_url=self.public_base_url,
            from_=create.from_,
            to=create.to,
            rest_api=self.rest_api,
            outbound=answer,
        )

    async def wait_for(self, call_sid: str, within: float) -> CallReport:
        """The call's report once it is over; raises what broke its callee."""
        async with asyncio.timeout(within):
            while call_sid not in self.reports and call_sid not in self.failures:
                self.answered.clear()
                await self.answered.wait()
        if call_sid in self.failures:
            raise self.failures[call_sid]
        return self.reports[call_sid]

    async def _amd_verdict(
        self, create: CallCreate, callee: Callee, streaming: asyncio.Event
    ) -> None:
        await streaming.wait()
        await asyncio.sleep(callee.amd_after_s)
        params = {
            "AnsweredBy": callee.answered_by,
            "MachineDetectionDuration": str(round(callee.amd_after_s * 1000)),
        }
        status = await self._callback(create, create.amd_callback, params)
        self.amd_callbacks.append(AmdCallback(create.call_sid, callee.answered_by, status))

    async def _post_status(self, create: CallCreate, call_status: str) -> None:
        """The ``completed`` event (Twilio's default) with the call's final status."""
        if create.status_callback and "completed" in create.status_callback_events:
            await self._callback(create, create.status_callback, {"CallStatus": call_status})
            self.statuses.append((create.call_sid, call_status))

    async def _callback(self, create: CallCreate, url: str, params: dict[str, str]) -> int:
        """A signed POST to one of the call's callback URLs; its HTTP status (0: failed)."""
        account = self.rest_api.account_sid if self.rest_api else ""
        ids = CallIds(create.call_sid, account, create.from_, create.to, "outbound-api")
        body = {"AccountSid": account, "CallSid": create.call_sid, **params}
        async with httpx.AsyncClient(timeout=5.0) as http:
            tw = TwilioSide(http, self.http_base, self.public_base_url, self.auth_token, ids)
            try:
                await tw.request(url, body)
            except (CallFailed, httpx.HTTPError) as exc:  # Twilio logs it and goes on
                log.warning("callee.callback_failed", url=url, error=str(exc))
                return 0
        return 200
