"""Warm transfers: hold the caller in a conference, brief the agent, join them; or bring the
caller back to the flow's ``fallback`` when the agent does not take the call.

1. ``hold`` (the stream that carried the call, after the transfer prompt played): store the
   decision and the conference leg in the record, then redirect the caller over REST into the
   conference (hold music). If that redirect fails the stream closes and the ``<Connect
   action>`` answers a cold ``<Dial>`` from the stored decision: the caller still reaches the
   agent, unbriefed.
2. A task owned here writes the summary (bounded), dials the agent over REST with TwiML that
   says it and then enters the conference, and watches a deadline.
3. Twilio's status callbacks, on any instance: the agent's ``participant-join`` ends the
   call's record (connected); the agent's ``busy``/``no-answer``/``failed``/``canceled``, or
   ``completed`` before it joined, brings the caller back: the record says ``failed`` with the
   reason, the caller is redirected to a new stream, and the flow resumes at its fallback. The
   caller leaving the hold (hung up) hangs up the agent's leg.

Every step is a compare-and-set on the record, so duplicate or racing callbacks act once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog

from ivr.control.connect import CallParams, StreamConnector
from ivr.control.endings import settle
from ivr.control.transfers import WarmTransfer
from ivr.control.warm_summary import SUMMARY_TIMEOUT, write_summary
from ivr.llm.base import LanguageModel
from ivr.obs import metrics
from ivr.state.base import CallRecord, CallStatus, CallStore, StoreError, WarmTransferLeg
from ivr.state.outcomes import Outcome
from ivr.telephony.conference import agent_twiml, hold_twiml, room_name
from ivr.telephony.rest import CallNotPlaced, NewCall, TwilioRest

log = structlog.get_logger("ivr.warm_transfer")

AGENT_STATUS_PATH = "/twilio/transfer/agent"
CONFERENCE_STATUS_PATH = "/twilio/transfer/conference"
AGENT_EVENTS = ("initiated", "ringing", "answered", "completed")
NOT_ANSWERED = frozenset({"busy", "no-answer", "failed", "canceled"})
REDIRECT_STOP_TIMEOUT = 5.0
"""Twilio ends the caller's stream with ``stop`` moments after the redirect."""
TWILIO_RING_BUFFER = 5
"""Twilio adds about this many seconds to a call's ``Timeout``."""
BRIEFING_ALLOWANCE = 45.0
"""Seconds from the agent answering to entering the conference (the summary being said)."""
WATCH_MARGIN = 15.0
AFTER_RING = TWILIO_RING_BUFFER + BRIEFING_ALLOWANCE + WATCH_MARGIN
"""A transfer no callback has settled this long after the agent's ring timeout is given up."""

_PENDING: frozenset[str] = frozenset({"holding", "dialling"})


class WarmTransfers:
    """One per gateway: starts warm transfers and answers their status callbacks."""

    def __init__(
        self,
        *,
        store: CallStore,
        rest: TwilioRest,
        connector: StreamConnector,
        llm: LanguageModel | None,
        public_url: str,
        summary_timeout: float = SUMMARY_TIMEOUT,
        after_ring: float = AFTER_RING,
    ) -> None:
        self._store = store
        self._rest = rest
        self._connector = connector
        self._llm = llm
        self._public_url = public_url.rstrip("/")
        self._summary_timeout = summary_timeout
        self.after_ring = after_ring
        """The deadline of a transfer is its ring timeout plus this (seconds)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        """Each transfer started here (by caller CallSid): dial the agent, then watch."""
        self._watching: set[str] = set()
        """Transfers past dialling, only waiting for their deadline (safe to cancel)."""

    # -- 1. the stream side ----------------------------------------------------------------

    async def hold(
        self, call_sid: str, number: str, warm: WarmTransfer, receive: asyncio.Task[Any]
    ) -> bool:
        """Put the caller on hold in the conference and start dialling the agent at
        ``number``. False: the caller could not be redirected (the ``<Connect action>`` then
        dials cold)."""
        room = room_name(call_sid)

        def decide(record: CallRecord) -> None:
            record.end_action, record.transfer_to = "transfer", number
            record.status = CallStatus.TRANSFERRING
            record.warm_transfer = WarmTransferLeg(room=room)

        try:
            record = await self._store.update(call_sid, decide)
        except StoreError as exc:  # without the leg no callback could act: a cold transfer
            log.error("warm_transfer.store_failed", error=repr(exc), fallback="cold")
            return False
        events_url = self._callback(CONFERENCE_STATUS_PATH, call_sid)
        twiml = hold_twiml(room, wait_url=warm.hold_music, status_callback=events_url)
        if not await self._rest.redirect(call_sid, twiml):
            log.warning("warm_transfer.hold_failed", fallback="cold")
            await self._forget_leg(call_sid)
            return False
        metrics.WARM_TRANSFERS.labels("held").inc()
        log.info("warm_transfer.holding", room=room)
        await asyncio.wait({receive}, timeout=REDIRECT_STOP_TIMEOUT)
        self._own(call_sid, self._dial_agent(record, number, warm))
        return True

    async def _forget_leg(self, call_sid: str) -> None:
        def forget(record: CallRecord) -> None:
            record.warm_transfer = None

        try:
            await self._store.update(call_sid, forget)
        except StoreError as exc:
            log.error("warm_transfer.store_failed", error=repr(exc))

    # -- 2. the agent leg ------------------------------------------------------------------

    async def _dial_agent(self, record: CallRecord, number: str, warm: WarmTransfer) -> None:
        call_sid = record.call_sid
        summary = await write_summary(warm, self._llm, limit=self._summary_timeout)
        log.info(
            "warm_transfer.summary",
            source=summary.source,
            seconds=round(summary.seconds, 3),
            pii_summary=summary.text,
        )
        leg = record.warm_transfer
        assert leg is not None
        events_url = self._callback(CONFERENCE_STATUS_PATH, call_sid)
        twiml = agent_twiml(leg.room, summary.text, status_callback=events_url)
        call = NewCall(
            to=number,
            from_=record.to_number,  # the number the caller dialled: ours, so Twilio allows it
            url="",
            twiml=twiml,
            timeout=warm.ring_timeout,
            status_callback=self._callback(AGENT_STATUS_PATH, call_sid),
            status_callback_events=AGENT_EVENTS,
        )
        try:
            agent_sid = await self._rest.create_call(call)
        except CallNotPlaced as exc:
            log.error("warm_transfer.dial_failed", error=str(exc), code=exc.code)
            await self.bring_back(call_sid, "failed")
            return
        if not await self._dialling(call_sid, agent_sid):
            await self._rest.hang_up(agent_sid)  # the caller left (or came back) meanwhile
            return
        self._watching.add(call_sid)
        try:
            await asyncio.sleep(warm.ring_timeout + self.after_ring)
        finally:
            self._watching.discard(call_sid)
        if await self.bring_back(call_sid, "timeout"):  # no callback said how it ended
            await self._rest.hang_up(agent_sid)

    async def _dialling(self, call_sid: str, agent_sid: str) -> bool:
        """Note the agent's leg; False when the transfer is no longer pending."""
        pending = False

        def note(record: CallRecord) -> None:
            nonlocal pending
            leg = record.warm_transfer
            pending = leg is not None and leg.status in _PENDING
            if leg is not None and pending:
                leg.agent_call_sid = agent_sid
                if leg.status == "holding":
                    leg.status = "dialling"

        try:
            await self._store.update(call_sid, note)
        except StoreError as exc:
            log.error("warm_transfer.store_failed", error=repr(exc))
            return True  # the callbacks still find the caller by the URL; keep dialling
        return pending

    # -- 3. status callbacks ---------------------------------------------------------------

    async def on_agent_status(self, caller_sid: str, form: Mapping[str, str]) -> None:
        """The agent leg's call progress (``StatusCallback`` of the call we placed)."""
        status = form.get("CallStatus", "")
        log.info("warm_transfer.agent_status", caller=caller_sid, status=status)
        if status in NOT_ANSWERED:
            await self.bring_back(caller_sid, status)
        elif status == "completed":
            record = await self._store.get(caller_sid)
            leg = record.warm_transfer if record is not None else None
            if leg is not None and leg.status in _PENDING:
                await self.bring_back(caller_sid, "not-joined")  # hung up during the summary

    async def on_conference_event(self, caller_sid: str, form: Mapping[str, str]) -> None:
        """The conference's ``join``/``leave``/``end`` events."""
        event = form.get("StatusCallbackEvent", "")
        participant = form.get("CallSid", "")
        log.info("warm_transfer.conference_event", caller=caller_sid, event_name=event)
        if event == "participant-join" and participant and participant != caller_sid:
            await self._connected(caller_sid, participant)
        elif event == "participant-leave" and participant == caller_sid:
            await self._caller_left(caller_sid)

    async def _connected(self, caller_sid: str, agent_sid: str) -> None:
        joined = False

        def join(record: CallRecord) -> None:
            nonlocal joined
            leg = record.warm_transfer
            joined = leg is not None and leg.status in _PENDING
            if leg is not None and joined:
                leg.status, leg.agent_call_sid = "connected", agent_sid

        record = await self._store.update(caller_sid, join)
        if joined:
            self._stop_watching(caller_sid)
            metrics.WARM_TRANSFERS.labels("connected").inc()
            log.info("warm_transfer.connected", room=_room(record))
            await settle(
                self._store,
                caller_sid,
                Outcome.TRANSFERRED_WARM,
                by="warm_transfer",
                status=CallStatus.TRANSFERRING,
            )

    async def _caller_left(self, caller_sid: str) -> None:
        """The caller hung up on hold: the agent must not be connected to nobody."""
        record = await self._fail(caller_sid, "caller-left")
        if record is None:
            return
        await settle(self._store, caller_sid, Outcome.CALLER_HUNG_UP, by="warm_transfer")
        leg = record.warm_transfer
        if leg is not None and leg.agent_call_sid:
            await self._rest.hang_up(leg.agent_call_sid)

    async def bring_back(self, caller_sid: str, result: str) -> bool:
        """Take the caller off hold onto a new stream: the flow goes on at the node's fallback.
        False when the transfer was no longer pending (another callback acted first)."""
        record = await self._fail(caller_sid, result)
        if record is None:
            return False
        twiml = await self._connector.twiml(CallParams.of(record))
        if not await self._rest.redirect(caller_sid, twiml):
            log.warning("warm_transfer.caller_gone", result=result)
            await settle(self._store, caller_sid, Outcome.CALLER_HUNG_UP, by="warm_transfer")
            return True
        log.info("warm_transfer.caller_back", result=result)
        return True

    async def _fail(self, caller_sid: str, result: str) -> CallRecord | None:
        """Mark the pending transfer failed (once); the record, or None if it was not pending."""
        failed = False

        def fail(record: CallRecord) -> None:
            nonlocal failed
            leg = record.warm_transfer
            failed = leg is not None and leg.status in _PENDING
            if leg is not None and failed:
                leg.status, leg.result = "failed", result
                # A drop of the stream that takes the caller back must resume, not dial.
                record.end_action, record.transfer_to = None, ""
                record.status = CallStatus.RECONNECTING

        record = await self._store.update(caller_sid, fail)
        if not failed:
            return None
        self._stop_watching(caller_sid)
        metrics.WARM_TRANSFERS.labels(_outcome_label(result)).inc()
        return record

    # -- housekeeping ----------------------------------------------------------------------

    def _callback(self, path: str, caller_sid: str) -> str:
        return f"{self._public_url}{path}?caller={caller_sid}"

    def _own(self, call_sid: str, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.create_task(work, name=f"warm-transfer-{call_sid}")
        self._tasks[call_sid] = task
        task.add_done_callback(lambda done: self._done(call_sid, done))

    def _done(self, call_sid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(call_sid) is task:
            del self._tasks[call_sid]
        if not task.cancelled() and task.exception() is not None:
            log.error("warm_transfer.task_failed", exc_info=task.exception())

    def _stop_watching(self, call_sid: str) -> None:
        """The transfer ended: its deadline no longer matters. Never while dialling: a call
        created but not yet noted would ring on with nobody to hang it up."""
        task = self._tasks.get(call_sid)
        if task is not None and call_sid in self._watching:
            task.cancel()

    async def aclose(self) -> None:
        """Stop watching (transfers in progress go on at Twilio; their callbacks still act)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _room(record: CallRecord) -> str:
    return record.warm_transfer.room if record.warm_transfer is not None else ""


def _outcome_label(result: str) -> str:
    known = NOT_ANSWERED | {"not-joined", "timeout", "caller-left"}
    return result if result in known else "other"
