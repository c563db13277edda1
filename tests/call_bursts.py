"""Calls as Twilio places them, one step at a time, for what a scripted call cannot do: a stream
whose socket dies mid-call and is never resumed, a handshake forged so the call never connects,
Twilio's status callbacks sent in any order. And a burst of such calls mixed with ordinary ones
(``burst``), for the console checks and its screenshots (tests/console_screens.py).

Only the gateway's public surface is used (signed webhooks, the media stream, the callbacks),
so a burst runs against any version of the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.sim.script import script_from_data
from ivr.sim.webhook import CallIds, StreamTwiml, TwilioSide, parse_stream, rebase

FRAME = bytes([0xFF]) * 160  # 20 ms of mu-law silence


@dataclass(slots=True)
class RawCall:
    """One call, driven by hand: ``answer`` (the voice webhook), then a stream or a forgery."""

    tw: TwilioSide
    stream: StreamTwiml
    stream_sid: str = ""
    ws: ClientConnection | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _seq: int = 0

    @property
    def call_sid(self) -> str:
        return self.tw.ids.call_sid

    @classmethod
    async def answer(
        cls, http: httpx.AsyncClient, base_url: str, *, auth_token: str, public_url: str
    ) -> RawCall:
        tw, twiml = await ring(http, base_url, auth_token=auth_token, public_url=public_url)
        return cls(tw, _stream(twiml))

    def follow(self, twiml: str) -> RawCall:
        """The same call on the new stream ``twiml`` connects it to (a resume)."""
        return RawCall(self.tw, _stream(twiml))

    def _ws_url(self) -> tuple[str, str]:
        """(the URL Twilio signs: public wss://, the one it really connects to)."""
        public = self.stream.url
        real = rebase(public, self.tw.http_base.replace("http://", "ws://"))
        return public, real

    async def forge_handshake(self) -> int:
        """Open the stream with a forged signature, as an attacker would: the HTTP status it
        is refused with (the real stream never comes)."""
        _, real = self._ws_url()
        try:
            async with connect(real, additional_headers={"X-Twilio-Signature": "forged"}):
                pass
        except InvalidStatus as exc:
            return int(exc.response.status_code)
        raise AssertionError("a stream with a forged signature was accepted")

    async def connect(self) -> None:
        """The signed handshake, ``connected`` and ``start``; the bot's audio is read (and
        kept) in the background."""
        public, real = self._ws_url()
        signature = self.tw.validator.compute_signature(public, {})
        self.ws = await connect(
            real, additional_headers={"X-Twilio-Signature": signature}, compression=None
        )
        self.stream_sid = "MZ" + secrets.token_hex(16)
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1"}))
        start = {
            "accountSid": self.tw.ids.account_sid,
            "streamSid": self.stream_sid,
            "callSid": self.call_sid,
            "tracks": ["inbound"],
            "customParameters": self.stream.parameters,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        }
        await self._send({"event": "start", "start": start})
        self._tasks.append(asyncio.create_task(self._read()))

    async def _send(self, message: dict[str, Any]) -> None:
        assert self.ws is not None
        self._seq += 1
        await self.ws.send(
            json.dumps({**message, "sequenceNumber": str(self._seq), "streamSid": self.stream_sid})
        )

    async def _read(self) -> None:
        assert self.ws is not None
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                self.received.append(json.loads(raw))

    async def talk(self, seconds: float) -> None:
        """Caller silence in real time, 20 ms a frame (the line is live)."""
        payload = base64.b64encode(FRAME).decode()
        for chunk in range(round(seconds / 0.02)):
            media = {"track": "inbound", "chunk": str(chunk + 1), "timestamp": str(chunk * 20)}
            await self._send({"event": "media", "media": {**media, "payload": payload}})
            await asyncio.sleep(0.02)

    async def bot_spoke(self, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not any(m.get("event") == "media" for m in self.received):
            assert time.monotonic() < deadline, "the bot never spoke"
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """The socket dies mid-call: no ``stop``, no close frame (the TCP connection is
        aborted). Twilio would now ask the <Connect action> URL; this call never does."""
        assert self.ws is not None
        self.ws.transport.abort()
        await self._reap()

    async def hang_up(self) -> None:
        """The caller hangs up: ``stop``, then Twilio closes the socket."""
        assert self.ws is not None
        stop = {"accountSid": self.tw.ids.account_sid, "callSid": self.call_sid}
        with contextlib.suppress(ConnectionClosed):
            await self._send({"event": "stop", "stop": stop})
            await self.ws.close()
        await self._reap()

    async def _reap(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def action(self, status: str = "in-progress") -> str:
        """The <Connect action> request after the stream: the TwiML that comes back."""
        assert self.stream.action is not None
        return await self.tw.request(self.stream.action, self.tw.params(status))

    async def call_status(self, status: str, seconds: int | None = None, **extra: str) -> int:
        """Twilio's call-status callback (the number's), signed: the HTTP status answered."""
        params = self.tw.params(status) | {"CallbackSource": "call-progress-events", **extra}
        if seconds is not None:
            params["CallDuration"] = str(seconds)
        return await self.post("/twilio/status", params)

    async def stream_status(self, event: str, error: str = "") -> int:
        params = {
            "AccountSid": self.tw.ids.account_sid,
            "CallSid": self.call_sid,
            "StreamSid": self.stream_sid or "MZ" + "0" * 32,
            "StreamName": self.stream_sid,
            "StreamEvent": event,
            "Timestamp": "2026-01-01T00:00:00.000Z",
        }
        if error:
            params["StreamError"] = error
        return await self.post(self.stream.status_callback or "/twilio/stream-status", params)

    async def post(self, path: str, params: dict[str, str], *, signed: bool = True) -> int:
        public = path if path.startswith("http") else self.tw.public_base + path
        headers = {}
        if signed:
            headers["X-Twilio-Signature"] = self.tw.validator.compute_signature(public, params)
        response = await self.tw.http.post(
            rebase(public, self.tw.http_base), data=params, headers=headers
        )
        return response.status_code


async def ring(
    http: httpx.AsyncClient, base_url: str, *, auth_token: str, public_url: str
) -> tuple[TwilioSide, str]:
    """A new call's signed voice webhook: Twilio's side of it, and the TwiML answered."""
    ids = CallIds("CA" + secrets.token_hex(16), "AC" + "0" * 32, "+15550001111", "+15550002222")
    tw = TwilioSide(http, base_url, public_url, auth_token, ids)
    return tw, await tw.request("/twilio/voice", tw.params("ringing"))


def _stream(twiml: str) -> StreamTwiml:
    stream = parse_stream(twiml)
    assert stream is not None, twiml
    return stream


# -- a burst -------------------------------------------------------------------------------------

QUESTION = "Hello, what are your opening hours on weekdays and on weekends?"
GOODBYE = "Goodbye."


@dataclass(slots=True)
class Burst:
    """What a burst placed, by what should become of each call."""

    caller_hung_up: list[str] = field(default_factory=list)
    flow_hung_up: list[str] = field(default_factory=list)
    never_connected: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    reports: list[CallReport] = field(default_factory=list)

    def expected(self) -> dict[str, str]:
        """CallSid -> the outcome its call must end with."""
        kinds = ("caller_hung_up", "flow_hung_up", "never_connected", "dropped")
        return {sid: kind for kind in kinds for sid in getattr(self, kind)}


async def burst(
    base_url: str,
    *,
    auth_token: str,
    public_url: str,
    each: int = 2,
) -> Burst:
    """``each`` calls of every kind at once: callers who hang up, calls the flow hangs up (both
    with the number's status callback), handshakes forged while Twilio's own stream fails
    (never connected; Twilio's stream-error is sent), streams killed mid-call and never resumed
    (neither ever gets Twilio's call status: only the sweep can end them)."""
    done = Burst()
    async with httpx.AsyncClient(timeout=10.0) as http:

        async def scripted(script: list[Any], into: list[str]) -> None:
            report = await place_call(
                base_url,
                script=script_from_data(script, source="burst"),
                auth_token=auth_token,
                public_base_url=public_url,
                call_status_url=f"{public_url}/twilio/status",
            )
            into.append(report.call_sid)
            done.reports.append(report)

        async def forged() -> None:
            call = await RawCall.answer(
                http, base_url, auth_token=auth_token, public_url=public_url
            )
            assert await call.forge_handshake() == 403
            # Twilio never connected its own stream (say the TLS failed): it reports that.
            await call.stream_status("stream-error", "31910 TLS handshake failed")
            done.never_connected.append(call.call_sid)

        async def killed() -> None:
            call = await RawCall.answer(
                http, base_url, auth_token=auth_token, public_url=public_url
            )
            await call.connect()
            await call.bot_spoke()
            await call.talk(0.5)
            await call.kill()
            done.dropped.append(call.call_sid)

        async with asyncio.TaskGroup() as group:
            for _ in range(each):
                group.create_task(scripted([QUESTION, {"hangup": None}], done.caller_hung_up))
                group.create_task(scripted([QUESTION, GOODBYE], done.flow_hung_up))
                group.create_task(forged())
                group.create_task(killed())
    return done


async def call_in_progress(
    http: httpx.AsyncClient, base_url: str, *, auth_token: str, public_url: str
) -> RawCall:
    """A call whose stream is up and greeted (``hang_up`` it when done)."""
    call = await RawCall.answer(http, base_url, auth_token=auth_token, public_url=public_url)
    await call.connect()
    await call.bot_spoke()
    return call
