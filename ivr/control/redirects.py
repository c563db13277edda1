"""A call taken off its stream over Twilio's REST API: a cold transfer (the caller is dialled
through at once, not after the stream closes), and a hang-up that no other instance could read
from the store. After a redirect Twilio ends the stream with ``stop``: that is the redirect
completing, not the caller hanging up, so it is waited for (bounded) and not acted on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from ivr.state.base import CallRecord, CallStatus, CallStore
from ivr.state.resilient import statistics_of
from ivr.telephony import twilio
from ivr.telephony.rest import TwilioRest

log = structlog.get_logger("ivr.stream")

# After a REST redirect Twilio sends `stop` within moments; past this we close the WS ourselves.
REDIRECT_STOP_TIMEOUT = 5.0
# A call this instance carried without the shared store (Redis away, record rebuilt from
# `start`) ends by keeping the line open until the caller hangs up, for at most this long: the
# <Connect action> request may land on an instance that cannot know the flow hung up.
HANGUP_HOLD_SECONDS = 20.0


async def transfer_by_rest(
    rest: TwilioRest | None,
    store: CallStore,
    call_sid: str,
    number: str,
    receive: asyncio.Task[Any],
) -> bool:
    """Redirect the call to ``<Dial>`` over REST; on failure the WS is closed as before.

    The decision is stored first, so a ``<Connect action>`` request (REST failed, or raced it)
    answers ``<Dial>`` too. After a redirect Twilio ends the stream with ``stop``: that is the
    transfer completing, not the caller hanging up, so wait for it (bounded) without acting on it.
    """
    if rest is None:
        return False

    def decide(record: CallRecord) -> None:
        record.end_action, record.transfer_to = "transfer", number
        record.status = CallStatus.TRANSFERRING

    try:
        await store.update(call_sid, decide)
    except Exception as exc:  # without the stored decision the action path can't Dial either
        log.error("call.transfer_store_failed", error=repr(exc))
    redirected = await rest.redirect(call_sid, twilio.dial_twiml(number))
    if redirected:
        log.info("call.transfer_redirected", pii_number=number)
        await asyncio.wait({receive}, timeout=REDIRECT_STOP_TIMEOUT)
    else:
        log.warning("call.transfer_rest_failed", fallback="connect_action")
    return redirected


def store_degraded(store: object) -> bool:
    """Whether the store is carrying calls from memory (Redis away): another instance then
    cannot read that this call ended. A plain store has no such state."""
    statistics = statistics_of(store)
    return statistics is not None and statistics.degraded


async def hang_up_without_store(
    rest: TwilioRest | None, call_sid: str, receive: asyncio.Task[Any]
) -> None:
    """End a call whose end no other instance can read (its record was rebuilt here, or the
    store is carrying calls from memory).

    Closing the stream would make Twilio ask the <Connect action> URL what next, and the
    instance that answers holds at best the webhook's copy of the call: it would resume the
    call after its goodbye. So hang up over REST when we can; otherwise keep the line open,
    silent, until the caller hangs up (they have heard the goodbye), bounded.
    """
    if rest is not None and await rest.redirect(call_sid, twilio.hangup_twiml()):
        log.info("call.hangup_redirected", reason="record_not_shared")
        await asyncio.wait({receive}, timeout=REDIRECT_STOP_TIMEOUT)
        return
    log.info("call.hangup_held", reason="record_not_shared", seconds=HANGUP_HOLD_SECONDS)
    await asyncio.wait({receive}, timeout=HANGUP_HOLD_SECONDS)
