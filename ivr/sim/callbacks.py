"""Twilio's status callbacks for one simulated call, sent as Twilio sends them: signed, in the
background (the call never waits for them), each an HTTP POST of its own.

- ``<Stream statusCallback>`` (when the TwiML asks for it): ``stream-started`` after the stream's
  ``start``, ``stream-stopped`` when it ends, ``stream-error`` with a ``StreamError`` when its
  handshake fails.
- The number's call-status callback (when the simulated number has one): ``completed`` with
  ``CallDuration`` once the call is over.

An answer other than 2xx is what Twilio's debugger reports as warning 15003: it goes into the
call's report as a violation.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import httpx

from ivr.sim.playout import Violation
from ivr.sim.report import CallReport
from ivr.sim.webhook import CallFailed, StreamTwiml, TwilioSide


class TwilioCallbacks:
    def __init__(
        self, tw: TwilioSide, report: CallReport, t0: float, call_status_url: str | None
    ) -> None:
        self._tw = tw
        self._report = report
        self._t0 = t0
        self._call_status_url = call_status_url
        self._tasks: set[asyncio.Task[None]] = set()

    def stream_event(
        self, stream: StreamTwiml, stream_sid: str, event: str, error: str = ""
    ) -> None:
        if not stream.status_callback:
            return
        ids = self._tw.ids
        params = {
            "AccountSid": ids.account_sid,
            "CallSid": ids.call_sid,
            "StreamSid": stream_sid,
            "StreamName": stream_sid,
            "StreamEvent": event,
            "Timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        if error:
            params["StreamError"] = error
        self._post(stream.status_callback, params)

    def call_over(self, status: str, seconds: int | None) -> None:
        if not self._call_status_url:
            return
        params = self._tw.params(status) | {"CallbackSource": "call-progress-events"}
        if seconds is not None:
            params["CallDuration"] = str(seconds)
        self._post(self._call_status_url, params)

    def _post(self, url: str, params: dict[str, str]) -> None:
        task = asyncio.create_task(self._send(url, params), name="twilio-callback")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, url: str, params: dict[str, str]) -> None:
        try:
            await self._tw.request(url, params, expect=(200, 204))
        except (CallFailed, httpx.HTTPError, OSError) as exc:
            t = time.monotonic() - self._t0
            self._report.violations.append(Violation(t, "15003", str(exc)[:200], url))

    async def aclose(self) -> None:
        """Wait for every callback still being sent."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
