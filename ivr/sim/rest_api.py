"""A stand-in for Twilio's REST API (the Calls update), served by uvicorn on a free port.

``POST /2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json`` with ``Twiml``, ``Url`` (+
``Method``) or ``Status=completed``, HTTP Basic auth ``AccountSid:AuthToken``, answered with
Twilio's call JSON or its error JSON (401/20003, 404/20404, 400/21220). A live call registered
by the simulated caller (``place_call(rest_api=...)``) reacts like Twilio: its stream gets
``stop`` and is closed, and the new TwiML takes over the call.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from email.utils import formatdate
from types import TracebackType
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ivr.telephony.dialing import E164

API_VERSION = "2010-04-01"
CALL_PATH = "/2010-04-01/Accounts/{account_sid}/Calls/{call_sid}.json"
CALLS_PATH = "/2010-04-01/Accounts/{account_sid}/Calls.json"


@dataclass(frozen=True, slots=True)
class CallUpdate:
    """One accepted update of a live call."""

    t: float
    """``time.monotonic()`` when the request arrived."""
    call_sid: str
    twiml: str | None = None
    url: str | None = None
    method: str = "POST"
    status: str | None = None
    """``completed`` ends the call."""


@dataclass(frozen=True, slots=True)
class RestRequest:
    """Every request, accepted or not, for tests to inspect."""

    t: float
    method: str
    path: str
    form: dict[str, str]
    status_code: int


CallControl = Callable[[CallUpdate], None]
"""How the simulated call applies an update (must not block: it only signals the call)."""


@dataclass(frozen=True, slots=True)
class CallCreate:
    """One accepted ``POST .../Calls.json``: an outbound call, as its callee will see it."""

    t: float
    call_sid: str
    to: str
    from_: str
    url: str
    method: str = "POST"
    machine_detection: str = ""
    async_amd: bool = False
    amd_callback: str = ""
    """``AsyncAmdStatusCallback``: where Twilio POSTs ``AnsweredBy``."""
    twiml: str = ""
    """``Twiml``: what the call runs when answered, instead of requesting ``url``."""
    timeout: int = 60
    status_callback: str = ""
    status_callback_events: tuple[str, ...] = ("completed",)
    """``StatusCallbackEvent`` (repeated): initiated, ringing, answered, completed."""


class ConferenceHost(Protocol):
    """Twilio's ``<Dial><Conference>`` for a simulated caller (``ivr.sim.conference``)."""

    async def hold(
        self, call_sid: str, twiml: str, redirected: asyncio.Event, hangup: asyncio.Event
    ) -> Literal["rest", "caller", "ended"]:
        """In the room until redirected over REST, hung up, or the room ended."""
        ...


Answerer = Callable[[CallCreate], Coroutine[Any, Any, None]]
"""Picks up a created call (``ivr.sim.callee``): runs as a task of the stand-in."""


@dataclass(slots=True)
class _Call:
    sid: str
    from_: str
    to: str
    control: CallControl | None
    status: str = "in-progress"
    direction: str = "inbound"
    created: float = field(default_factory=time.time)


class FakeTwilioRestApi:
    """``async with FakeTwilioRestApi(sid, token) as api:`` serves at ``api.url``."""

    def __init__(
        self,
        account_sid: str | None = None,
        auth_token: str | None = None,
        host: str = "127.0.0.1",
        *,
        answer: Answerer | None = None,
    ) -> None:
        """``answer`` picks up the calls created here (none: they ring unanswered)."""
        self.account_sid = account_sid or "AC" + secrets.token_hex(16)
        self.auth_token = auth_token or secrets.token_hex(16)
        self.host = host
        self.requests: list[RestRequest] = []
        self.updates: list[CallUpdate] = []
        self.creates: list[CallCreate] = []
        self._pick_up = answer
        self.conference_host: ConferenceHost | None = None
        """Set by ``ivr.sim.conference.ConferenceDesk``: callers enter its rooms."""
        self._ringing: set[asyncio.Task[None]] = set()
        self._calls: dict[str, _Call] = {}
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def answer_with(self, answer: Answerer) -> None:
        """Pick up the calls created from now on with ``answer``."""
        self._pick_up = answer

    # -- calls the simulated caller places ------------------------------------------------

    def add_call(self, call_sid: str, *, from_: str, to: str, control: CallControl) -> None:
        known = self._calls.get(call_sid)  # an outbound call created here, now answered
        direction = known.direction if known is not None else "inbound"
        self._calls[call_sid] = _Call(call_sid, from_, to, control, direction=direction)

    def end_call(self, call_sid: str) -> None:
        """The call is over; like Twilio, it stays known (updates now get 21220)."""
        call = self._calls.get(call_sid)
        if call is not None:
            call.status, call.control = "completed", None

    # -- server lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        app = Starlette(
            routes=[
                Route(CALL_PATH, self._update, methods=["POST"]),
                Route(CALLS_PATH, self._create, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, host=self.host, port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(), name="fake-twilio-rest")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("fake Twilio REST API exited during startup")
            await asyncio.sleep(0.01)
        self._port = self._server.servers[0].sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        for ringing in self._ringing:
            ringing.cancel()
        await asyncio.gather(*self._ringing, return_exceptions=True)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> FakeTwilioRestApi:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the endpoint ----------------------------------------------------------------------

    async def _update(self, request: Request) -> JSONResponse:
        t = time.monotonic()
        form = {k: str(v) for k, v in (await request.form()).items()}
        response = self._answer(request, form, t)
        self.requests.append(
            RestRequest(t, request.method, request.url.path, form, response.status_code)
        )
        return response

    def _answer(self, request: Request, form: dict[str, str], t: float) -> JSONResponse:
        path = request.url.path
        if not self._authorised(request.headers.get("authorization", "")):
            return _error(401, 20003, "Authenticate", "Your AccountSid or AuthToken was incorrect.")
        call = self._calls.get(request.path_params["call_sid"])
        if request.path_params["account_sid"] != self.account_sid or call is None:
            return _error(404, 20404, f"The requested resource {path} was not found")
        problem = _check_form(form)
        if problem:
            return _error(400, None, problem)  # Twilio's code varies by parameter; not modelled
        update = CallUpdate(
            t,
            call.sid,
            twiml=form.get("Twiml"),
            url=form.get("Url"),
            method=form.get("Method", "POST").upper(),
            status=form.get("Status"),
        )
        if call.status == "completed" or call.control is None:
            if update.status == "completed":
                return JSONResponse(self._call_json(call))
            return _error(400, 21220, "Call is not in-progress. Cannot redirect.")
        if update.status == "canceled":  # only cancels queued/ringing calls: no effect here
            return JSONResponse(self._call_json(call))
        self.updates.append(update)
        call.control(update)
        if update.status == "completed":
            call.status, call.control = "completed", None
        return JSONResponse(self._call_json(call))

    # -- outbound calls: Calls.json create ------------------------------------------------

    async def _create(self, request: Request) -> JSONResponse:
        t = time.monotonic()
        raw = await request.form()
        form = {k: str(v) for k, v in raw.items()}
        if "StatusCallbackEvent" in raw:  # repeated, one value per event
            events = raw.getlist("StatusCallbackEvent")
            form["StatusCallbackEvent"] = " ".join(str(v) for v in events)
        response = self._answer_create(request, form, t)
        self.requests.append(
            RestRequest(t, request.method, request.url.path, form, response.status_code)
        )
        return response

    def _answer_create(self, request: Request, form: dict[str, str], t: float) -> JSONResponse:
        if not self._authorised(request.headers.get("authorization", "")):
            return _error(401, 20003, "Authenticate", "Your AccountSid or AuthToken was incorrect.")
        if request.path_params["account_sid"] != self.account_sid:
            return _error(404, 20404, f"The requested resource {request.url.path} was not found")
        problem = _check_create(form)
        if problem is not None:
            return _error(400, *problem)
        create = CallCreate(
            t,
            "CA" + secrets.token_hex(16),
            to=form["To"],
            from_=form["From"],
            url=form.get("Url", ""),
            method=form.get("Method", "POST").upper(),
            machine_detection=form.get("MachineDetection", ""),
            async_amd=form.get("AsyncAmd", "false") == "true",
            amd_callback=form.get("AsyncAmdStatusCallback", ""),
            twiml=form.get("Twiml", ""),
            timeout=int(form.get("Timeout", "60")),
            status_callback=form.get("StatusCallback", ""),
            status_callback_events=tuple(form.get("StatusCallbackEvent", "completed").split()),
        )
        self.creates.append(create)
        call = _Call(create.call_sid, create.from_, create.to, None, "queued", "outbound-api")
        self._calls[call.sid] = call
        if self._pick_up is not None:  # ring the callee once this answer is on its way
            ringing = asyncio.create_task(self._pick_up(create), name=f"ring-{call.sid}")
            self._ringing.add(ringing)
            ringing.add_done_callback(self._ringing.discard)
        return JSONResponse(self._call_json(call), status_code=201)

    def _authorised(self, header: str) -> bool:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return secrets.compare_digest(f"{user}:{password}", f"{self.account_sid}:{self.auth_token}")

    def _call_json(self, call: _Call) -> dict[str, Any]:
        uri = f"/{API_VERSION}/Accounts/{self.account_sid}/Calls/{call.sid}"
        created = formatdate(call.created, usegmt=False)
        return {
            "sid": call.sid,
            "account_sid": self.account_sid,
            "api_version": API_VERSION,
            "status": call.status,
            "direction": call.direction,
            "from": call.from_,
            "from_formatted": call.from_,
            "to": call.to,
            "to_formatted": call.to,
            "date_created": created,
            "date_updated": formatdate(time.time()),
            "start_time": created,
            "end_time": None,
            "duration": None,
            "parent_call_sid": None,
            "price": None,
            "price_unit": "USD",
            "answered_by": None,
            "caller_name": None,
            "forwarded_from": None,
            "group_sid": None,
            "phone_number_sid": None,
            "queue_time": "0",
            "trunk_sid": None,
            "annotation": None,
            "uri": f"{uri}.json",
            "subresource_uris": {
                "notifications": f"{uri}/Notifications.json",
                "recordings": f"{uri}/Recordings.json",
                "payments": f"{uri}/Payments.json",
                "events": f"{uri}/Events.json",
                "siprec": f"{uri}/Siprec.json",
                "streams": f"{uri}/Streams.json",
                "transcriptions": f"{uri}/Transcriptions.json",
                "user_defined_message_subscriptions": f"{uri}/UserDefinedMessageSubscriptions.json",
                "user_defined_messages": f"{uri}/UserDefinedMessages.json",
            },
        }


def _check_create(form: dict[str, str]) -> tuple[int | None, str] | None:
    """Twilio's error (code, message) for a create request, or None when it is acceptable.
    Only ``Url`` is modelled for the call's instructions (not ``Twiml``/``ApplicationSid``)."""
    to, from_ = form.get("To", ""), form.get("From", "")
    if not to:
        return 21201, "No 'To' number is specified"
    if not from_:
        return 21603, "A 'From' phone number is required."
    if not E164.fullmatch(to):
        return 21211, f"Invalid 'To' Phone Number: {to}"
    if not E164.fullmatch(from_):
        return 21212, f"Invalid 'From' Phone Number: {from_}"
    url, twiml = form.get("Url", ""), form.get("Twiml", "")
    if twiml:
        return _check_create_twiml(form)
    if not url:
        return 21205, "Url parameter is required."
    if urlsplit(url).scheme not in ("http", "https"):
        return 21205, f"Url is not a valid URL: {url}"
    if form.get("Method", "POST").upper() not in ("GET", "POST"):
        return None, "Method must be GET or POST"
    detection = form.get("MachineDetection")
    if detection is not None and detection not in ("Enable", "DetectMessageEnd"):
        return None, f"MachineDetection must be Enable or DetectMessageEnd, got {detection!r}"
    if form.get("AsyncAmd", "false") not in ("true", "false"):
        return None, "AsyncAmd must be true or false"
    return None


def _check_create_twiml(form: dict[str, str]) -> tuple[int | None, str] | None:
    """A create that runs ``Twiml`` (a warm transfer's agent leg): its TwiML, ring timeout and
    progress events."""
    if form.get("Url"):
        return None, "Twiml and Url are mutually exclusive"
    try:
        root = ET.fromstring(form["Twiml"])
    except ET.ParseError as exc:
        return 12100, f"Twiml is not valid XML: {exc}"
    if root.tag != "Response":
        return 12100, f"Twiml root must be <Response>, got <{root.tag}>"
    timeout = form.get("Timeout", "60")
    if not timeout.isdigit() or not 5 <= int(timeout) <= 600:
        return None, f"Timeout must be an integer from 5 to 600, got {timeout!r}"
    events = form.get("StatusCallbackEvent", "").split()
    unknown = [e for e in events if e not in ("initiated", "ringing", "answered", "completed")]
    if unknown:
        return None, f"StatusCallbackEvent has unknown values {unknown}"
    return None


def _check_form(form: dict[str, str]) -> str:
    """What is wrong with an update request, or '' when it is acceptable."""
    given = [k for k in ("Twiml", "Url", "Status") if form.get(k)]
    if not given:
        return "One of Twiml, Url or Status is required"
    if "Twiml" in given and "Url" in given:
        return "Twiml and Url are mutually exclusive"
    status = form.get("Status")
    if status and status not in ("completed", "canceled"):
        return f"Status must be completed or canceled, got {status!r}"
    twiml = form.get("Twiml")
    if twiml is not None:
        try:
            root = ET.fromstring(twiml)
        except ET.ParseError as exc:
            return f"Twiml is not valid XML: {exc}"
        if root.tag != "Response":
            return f"Twiml root must be <Response>, got <{root.tag}>"
    return ""


def _error(status: int, code: int | None, message: str, detail: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message, "more_info": None, "status": status}
    if code is not None:
        body["more_info"] = f"https://www.twilio.com/docs/errors/{code}"
    headers = {}
    if detail is not None:
        body["detail"] = detail
    if status == 401:
        headers["WWW-Authenticate"] = 'Basic realm="Twilio API"'
    return JSONResponse(body, status_code=status, headers=headers)
