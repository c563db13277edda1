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
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from types import TracebackType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

API_VERSION = "2010-04-01"
CALL_PATH = "/2010-04-01/Accounts/{account_sid}/Calls/{call_sid}.json"


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


@dataclass(slots=True)
class _Call:
    sid: str
    from_: str
    to: str
    control: CallControl | None
    status: str = "in-progress"
    created: float = field(default_factory=time.time)


class FakeTwilioRestApi:
    """``async with FakeTwilioRestApi(sid, token) as api:`` serves at ``api.url``."""

    def __init__(
        self, account_sid: str | None = None, auth_token: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.account_sid = account_sid or "AC" + secrets.token_hex(16)
        self.auth_token = auth_token or secrets.token_hex(16)
        self.host = host
        self.requests: list[RestRequest] = []
        self.updates: list[CallUpdate] = []
        self._calls: dict[str, _Call] = {}
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    # -- calls the simulated caller places ------------------------------------------------

    def add_call(self, call_sid: str, *, from_: str, to: str, control: CallControl) -> None:
        self._calls[call_sid] = _Call(call_sid, from_, to, control)

    def end_call(self, call_sid: str) -> None:
        """The call is over; like Twilio, it stays known (updates now get 21220)."""
        call = self._calls.get(call_sid)
        if call is not None:
            call.status, call.control = "completed", None

    # -- server lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        app = Starlette(routes=[Route(CALL_PATH, self._update, methods=["POST"])])
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
            "direction": "inbound",
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
