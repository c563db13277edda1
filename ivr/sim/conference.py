"""Twilio's side of a warm transfer, for the REST stand-in: conference rooms and agents' phones.

``ConferenceDesk`` plays two parts of Twilio's:

* the ``<Dial><Conference>`` noun: a call whose TwiML enters a room joins it, waits there (the
  caller on hold until a ``startConferenceOnEnter`` participant comes), and leaves when its call
  is redirected over REST, hangs up, or the room ends (a participant with
  ``endConferenceOnExit`` left). The room reports ``participant-join``, ``conference-start``,
  ``participant-leave`` and ``conference-end`` to the status callback of the participant that
  created it, signed like every Twilio request;
* the phones of the numbers it is given (``AgentPhone``): a call the gateway creates to one of
  them rings, then answers or not (``busy``, ``no-answer``), runs its TwiML (``<Say>`` is
  recorded as what the agent heard, ``<Dial><Conference>`` enters the room) and reports its
  progress to the call's ``StatusCallback`` (``initiated``, ``ringing``, ``answered``,
  ``completed`` as asked for).

Ringing is compressed: an agent that does not answer reports ``no-answer`` after its
``ring_seconds``, not after the call's ``Timeout``. Speech takes ``SAY_SECONDS_PER_CHAR``.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Literal

import httpx
from twilio.request_validator import RequestValidator

from ivr.sim.rest_api import CallCreate, CallUpdate, FakeTwilioRestApi
from ivr.sim.webhook import rebase

SAY_SECONDS_PER_CHAR = 0.004
"""How long ``<Say>`` takes in the stand-in (fast: about a second for a long summary)."""
EVENT_NAMES = {
    "join": ("participant-join",),
    "leave": ("participant-leave",),
    "start": ("conference-start",),
    "end": ("conference-end",),
}


@dataclass(frozen=True, slots=True)
class AgentPhone:
    """How the phone at one number behaves."""

    answers: bool = True
    ring_seconds: float = 0.3
    """Rings this long, then answers (or, if it does not, reports ``unanswered``)."""
    unanswered: Literal["no-answer", "busy", "failed"] = "no-answer"
    hang_up_after_summary: bool = False
    """Answers, hears the summary, then hangs up instead of entering the room."""


@dataclass(frozen=True, slots=True)
class ConferenceEntry:
    """One ``<Dial><Conference>`` as TwiML gives it."""

    room: str
    start_on_enter: bool
    end_on_exit: bool
    wait_url: str | None
    status_callback: str
    events: tuple[str, ...]


@dataclass(slots=True)
class AgentCall:
    """One call to an agent, as the agent and Twilio saw it."""

    create: CallCreate
    statuses: list[str] = field(default_factory=list)
    heard: list[str] = field(default_factory=list)
    """The text of each ``<Say>`` the agent heard."""
    rooms: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) on every status change."""


@dataclass(frozen=True, slots=True)
class RoomEvent:
    t: float
    event: str
    call_sid: str
    """The participant ("" for conference-start/end)."""


@dataclass(frozen=True, slots=True)
class Callback:
    """One signed request the stand-in sent the gateway."""

    t: float
    """``time.monotonic()`` when it was sent."""
    url: str
    """As Twilio addresses it (the public URL)."""
    params: dict[str, str]
    status_code: int
    """The gateway's answer (0: unreachable)."""


@dataclass(slots=True)
class _Room:
    name: str
    sid: str
    callback: str = ""
    events: tuple[str, ...] = ()
    started: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    members: dict[str, ConferenceEntry] = field(default_factory=dict)
    log: list[RoomEvent] = field(default_factory=list)


class ConferenceDesk:
    """Attach with ``ConferenceDesk(api, phones={...})``; set ``gateway_base`` before calls."""

    def __init__(
        self, api: FakeTwilioRestApi, *, phones: dict[str, AgentPhone], public_base: str
    ) -> None:
        self.api = api
        self.phones = phones
        self.public_base = public_base.rstrip("/")
        self.gateway_base = ""
        """Where signed callbacks really go (the public URL's path, on this base)."""
        self.calls: list[AgentCall] = []
        self.rooms: dict[str, _Room] = {}
        self.callbacks: list[Callback] = []
        self._validator = RequestValidator(api.auth_token)
        self._sequence = itertools.count(1)
        self._http = httpx.AsyncClient(timeout=5.0)
        api.answer_with(self.ring)
        api.conference_host = self

    async def aclose(self) -> None:
        await self._http.aclose()

    async def wait_for_status(self, call: AgentCall, status: str, within: float = 5.0) -> None:
        """Until ``call`` reached ``status`` (TimeoutError past ``within``: it never did)."""
        async with asyncio.timeout(within):
            while status not in call.statuses:
                changed = call.changed
                await changed.wait()

    def room_log(self, room: str) -> list[RoomEvent]:
        return list(self.rooms[room].log) if room in self.rooms else []

    # -- the caller's side: hold in a room until redirected, hung up or the room ends ----------

    async def hold(
        self, call_sid: str, twiml: str, redirected: asyncio.Event, hangup: asyncio.Event
    ) -> Literal["rest", "caller", "ended"]:
        entry = conference_of(twiml)
        assert entry is not None
        room = await self._enter(call_sid, entry)
        waits = {
            "rest": asyncio.ensure_future(redirected.wait()),
            "caller": asyncio.ensure_future(hangup.wait()),
            "ended": asyncio.ensure_future(room.ended.wait()),
        }
        try:
            await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits.values():
                wait.cancel()
        how = next(k for k, w in waits.items() if w.done() and not w.cancelled())
        if how != "ended":
            reason = "participant_updated_via_api" if how == "rest" else "participant_hung_up"
            await self._leave(room, call_sid, reason)
        return how  # type: ignore[return-value]

    # -- the agent's side: a created call rings a phone --------------------------------------

    async def ring(self, create: CallCreate) -> None:
        """The ``Answerer`` of the stand-in: runs for the life of the agent's call."""
        call = AgentCall(create)
        self.calls.append(call)
        hung_up = asyncio.Event()

        def on_update(update: CallUpdate) -> None:
            if update.status == "completed":
                hung_up.set()

        self.api.add_call(create.call_sid, from_=create.from_, to=create.to, control=on_update)
        phone = self.phones.get(create.to, AgentPhone(answers=False, unanswered="failed"))
        await self._progress(call, "initiated")
        await self._progress(call, "ringing")
        if await _wait(hung_up, phone.ring_seconds):
            await self._progress(call, "canceled", final=True)
            return
        if not phone.answers:
            await self._progress(call, phone.unanswered, final=True)
            return
        answered = time.monotonic()
        await self._progress(call, "in-progress")
        await self._run_agent_twiml(call, phone, hung_up)
        duration = str(round(time.monotonic() - answered))
        await self._progress(call, "completed", final=True, duration=duration)

    async def _run_agent_twiml(
        self, call: AgentCall, phone: AgentPhone, hung: asyncio.Event
    ) -> None:
        root = ET.fromstring(call.create.twiml)
        for verb in root:
            if verb.tag == "Say":
                text = verb.text or ""
                call.heard.append(text)
                if await _wait(hung, len(text) * SAY_SECONDS_PER_CHAR):
                    return
                if phone.hang_up_after_summary:
                    return
            elif verb.tag == "Dial" and (entry := _entry(verb)) is not None:
                room = await self._enter(call.create.call_sid, entry)
                call.rooms.append(entry.room)
                ended = asyncio.ensure_future(room.ended.wait())
                hung_wait = asyncio.ensure_future(hung.wait())
                await asyncio.wait({ended, hung_wait}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                hung_wait.cancel()
                if not room.ended.is_set():
                    await self._leave(room, call.create.call_sid, "participant_updated_via_api")
                return

    # -- rooms -----------------------------------------------------------------------------

    async def _enter(self, call_sid: str, entry: ConferenceEntry) -> _Room:
        room = self.rooms.get(entry.room)
        if room is None or room.ended.is_set():
            room = _Room(entry.room, "CF" + secrets.token_hex(16))
            self.rooms[entry.room] = room
        if not room.callback and entry.status_callback:  # the creator's callback is the room's
            room.callback, room.events = entry.status_callback, entry.events
        room.members[call_sid] = entry
        await self._event(room, "join", call_sid, entry)
        if not room.started and entry.start_on_enter and len(room.members) >= 2:
            room.started = True
            await self._event(room, "start", "", None)
        return room

    async def _leave(self, room: _Room, call_sid: str, reason: str) -> None:
        entry = room.members.pop(call_sid, None)
        if entry is None:
            return
        await self._event(room, "leave", call_sid, entry, ReasonParticipantLeft=reason)
        if entry.end_on_exit or not room.members:
            why = (
                "participant-with-end-conference-on-exit-left"
                if entry.end_on_exit
                else ("last-participant-left")
            )
            await self._event(
                room, "end", "", None, ReasonConferenceEnded=why, CallSidEndingConference=call_sid
            )
            room.members.clear()
            room.ended.set()

    async def _event(
        self,
        room: _Room,
        kind: str,
        call_sid: str,
        entry: ConferenceEntry | None,
        **extra: str,
    ) -> None:
        name = EVENT_NAMES[kind][0]
        room.log.append(RoomEvent(time.monotonic(), name, call_sid))
        if not room.callback or kind not in room.events:
            return
        params = {
            "AccountSid": self.api.account_sid,
            "ConferenceSid": room.sid,
            "FriendlyName": room.name,
            "StatusCallbackEvent": name,
            "SequenceNumber": str(next(self._sequence)),
            "Timestamp": formatdate(time.time(), usegmt=True),
            **extra,
        }
        if call_sid and entry is not None:
            params |= {
                "CallSid": call_sid,
                "Muted": "false",
                "Hold": "false",
                "Coaching": "false",
                "StartConferenceOnEnter": str(entry.start_on_enter).lower(),
                "EndConferenceOnExit": str(entry.end_on_exit).lower(),
            }
        await self._post(room.callback, params)

    # -- signed callbacks ------------------------------------------------------------------

    async def _progress(
        self, call: AgentCall, status: str, *, final: bool = False, duration: str = ""
    ) -> None:
        """Report ``status`` (if the call asked for that event), then note it: a status seen
        in ``statuses`` has been answered by the gateway."""
        await self._report(call, status, final, duration)
        call.statuses.append(status)
        call.changed.set()
        call.changed = asyncio.Event()

    async def _report(self, call: AgentCall, status: str, final: bool, duration: str) -> None:
        create = call.create
        event = {"in-progress": "answered"}.get(status, status)
        if final:
            event = "completed"
            self.api.end_call(create.call_sid)
        if not create.status_callback or event not in create.status_callback_events:
            return
        params = {
            "AccountSid": self.api.account_sid,
            "ApiVersion": "2010-04-01",
            "CallSid": create.call_sid,
            "CallStatus": status,
            "Called": create.to,
            "Caller": create.from_,
            "Direction": "outbound-api",
            "From": create.from_,
            "To": create.to,
            "CallbackSource": "call-progress-events",
            "SequenceNumber": str(next(self._sequence)),
            "Timestamp": formatdate(time.time(), usegmt=True),
        }
        if duration:
            params |= {"CallDuration": duration, "Duration": duration}
        await self._post(create.status_callback, params)

    async def _post(self, url: str, params: dict[str, str]) -> None:
        sent = time.monotonic()
        signature = self._validator.compute_signature(url, params)
        target = rebase(url, self.gateway_base or self.public_base)
        try:
            answer = await self._http.post(
                target, data=params, headers={"X-Twilio-Signature": signature}
            )
            status = answer.status_code
        except httpx.HTTPError:
            status = 0  # Twilio logs a warning (11200) and goes on
        self.callbacks.append(Callback(sent, url, params, status))


def conference_of(twiml: str) -> ConferenceEntry | None:
    """The ``<Dial><Conference>`` a TwiML document enters, if any."""
    try:
        root = ET.fromstring(twiml)
    except ET.ParseError:
        return None
    for dial in root.iter("Dial"):
        entry = _entry(dial)
        if entry is not None:
            return entry
    return None


def _entry(dial: ET.Element) -> ConferenceEntry | None:
    noun = dial.find("Conference")
    if noun is None or not (noun.text or "").strip():
        return None
    return ConferenceEntry(
        room=(noun.text or "").strip(),
        start_on_enter=noun.get("startConferenceOnEnter", "true") == "true",
        end_on_exit=noun.get("endConferenceOnExit", "false") == "true",
        wait_url=noun.get("waitUrl"),
        status_callback=noun.get("statusCallback", ""),
        events=tuple(noun.get("statusCallbackEvent", "").split()),
    )


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``event`` is set first; whether it was."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True
