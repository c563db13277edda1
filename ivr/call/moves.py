"""Planned moves: a draining instance hands a live call to another one between turns.

At a turn boundary (the flow listens, nobody is talking) the call is redirected over Twilio's
REST API to TwiML that connects a fresh stream through the public URL, so the load balancer
picks a ready instance. That stream's token is marked *planned*: the new instance resumes the
call from the store without the resume apology and without counting the stream toward the
resume limit. The caller, who was being listened to, is listened to again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from ivr.call.live import LiveCall
from ivr.call.session import CallSession
from ivr.callio.io import CallerInput, ListenSpec, Spoken
from ivr.control.connect import StreamConnector
from ivr.control.transfers import WarmTransfer
from ivr.telephony.rest import TwilioRest

log = structlog.get_logger("ivr.call")

STOP_AFTER_REDIRECT = 5.0
"""Twilio ends the old stream with ``stop`` moments after a redirect; past this we close it."""


class MovedCallSession(CallSession):
    """The session of a call that arrived by a planned move, at a turn boundary: the caller
    heard everything and was being listened to. What the flow says before it listens again
    (the resume apology, the question it already asked) is skipped; a streamed reply (the
    model answering words the old instance heard) still plays."""

    _quiet = True

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        if self._quiet:
            log.info("call.move_prompt_skipped", pii_text=text)
            return Spoken(text_heard="", interrupted=False)
        return await super().say(text, interruptible=interruptible)

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        self._quiet = False
        return await super().say_stream(chunks, interruptible=interruptible)

    async def listen(self, spec: ListenSpec) -> CallerInput:
        self._quiet = False
        return await super().listen(spec)

    async def transfer(self, number: str, warm: WarmTransfer | None = None) -> None:
        self._quiet = False
        await super().transfer(number, warm)

    async def hangup(self) -> None:
        self._quiet = False
        await super().hangup()


async def move_call(
    call: LiveCall, rest: TwilioRest, connector: StreamConnector, *, within: float
) -> bool:
    """Move ``call`` at its next turn boundary (within ``within`` s); True once Twilio took the
    redirect. False (logged) if no boundary came, the call ended, or the REST update failed:
    the call then stays here until it ends or the drain runs out."""
    try:
        async with asyncio.timeout(within):
            await call.session.wait_for_turn_boundary()
    except TimeoutError:
        log.warning("call.move_no_boundary", call_sid=call.call_sid, waited=within)
        return False
    if call.ended.is_set():
        return False
    twiml = await connector.twiml(call.params, planned=True)
    call.moving = True
    if not await rest.redirect(call.call_sid, twiml):
        call.moving = False
        log.warning("call.move_failed", call_sid=call.call_sid)
        return False
    log.info("call.moved", call_sid=call.call_sid)
    try:
        async with asyncio.timeout(STOP_AFTER_REDIRECT):
            await call.ended.wait()
    except TimeoutError:
        log.warning("call.move_no_stop", call_sid=call.call_sid)
        await call.close_stream()
    return True
