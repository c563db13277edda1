"""The TwiML of a warm transfer: the caller held in a conference, the agent briefed, then joined.

Both legs join one conference named after the caller's CallSid (no personal data in the name,
as Twilio asks). The caller waits with ``startConferenceOnEnter=false`` (hold music from
``waitUrl``) until the agent, whose TwiML first ``<Say>``s the summary to the agent alone, enters
with ``startConferenceOnEnter=true``. Either leaving ends the conference: the caller hanging up
drops the agent, the agent hanging up ends the caller's ``<Dial>`` and so the call. Both legs
report ``join``/``leave``/``end`` to the same status callback (Twilio takes the conference's
callback from the participant that creates it, the caller; the agent's copy is the same URL).
"""

from __future__ import annotations

from twilio.twiml.voice_response import Dial, VoiceResponse

CONFERENCE_EVENTS = "join leave end"


def room_name(caller_sid: str) -> str:
    return f"warm-{caller_sid}"


def hold_twiml(room: str, *, wait_url: str | None, status_callback: str) -> str:
    """The caller's TwiML: wait in ``room`` (music from ``wait_url``; None is Twilio's default,
    "" silence) until the agent enters."""
    extra = {} if wait_url is None else {"wait_url": wait_url, "wait_method": "GET"}
    return _conference(None, room, start=False, status_callback=status_callback, **extra)


def agent_twiml(room: str, summary: str, *, status_callback: str) -> str:
    """The agent's TwiML: hear ``summary`` alone, then enter ``room`` and start it."""
    return _conference(summary, room, start=True, status_callback=status_callback)


def _conference(
    say: str | None, room: str, *, start: bool, status_callback: str, **extra: str
) -> str:
    response = VoiceResponse()
    if say:
        response.say(say)
    dial = Dial()
    dial.conference(
        room,
        start_conference_on_enter=start,
        end_conference_on_exit=True,
        beep=False,
        status_callback=status_callback,
        status_callback_event=CONFERENCE_EVENTS,
        status_callback_method="POST",
        **extra,
    )
    response.append(dial)
    return str(response.to_xml())
