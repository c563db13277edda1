"""Twilio's REST API, for the two call updates the gateway makes: redirect and hang up.

Uses the official ``twilio`` library with its aiohttp client, so nothing blocks the event loop.
Every failure becomes one log line and ``False``: callers fall back to the ``<Connect action>``
path and the call teardown never sees an exception. Bounded by ``timeout`` end to end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import structlog
from twilio.base.exceptions import TwilioException, TwilioRestException
from twilio.http.async_http_client import AsyncTwilioHttpClient
from twilio.rest import Client

from ivr.config import Settings
from ivr.errors import IvrError

log = structlog.get_logger("ivr.twilio_rest")

# The call no longer exists: 20404 (not found) or 21220 (not in progress, cannot redirect).
CALL_GONE_CODES = frozenset({20404, 21220})


@dataclass(frozen=True, slots=True)
class NewCall:
    """An outbound call to place."""

    to: str
    from_: str
    url: str
    """Our webhook Twilio requests when the callee answers."""
    machine_detection: str = ""
    """Twilio's async AMD: ``Enable`` or ``DetectMessageEnd``; "" = off."""
    amd_callback_url: str = ""
    twiml: str = ""
    """TwiML to run when answered, instead of requesting ``url`` (a warm transfer's agent)."""
    timeout: int | None = None
    """Seconds to let it ring (Twilio: 5-600, default 60)."""
    status_callback: str = ""
    status_callback_events: tuple[str, ...] = ()
    """``initiated``, ``ringing``, ``answered``, ``completed`` (Twilio's default: completed)."""


class CallNotPlaced(IvrError):
    """Twilio did not create the call: its HTTP status, error code and message."""

    def __init__(self, status: int, code: int | None, message: str) -> None:
        super().__init__(f"Twilio refused the call: {message}" + (f" ({code})" if code else ""))
        self.status, self.code, self.reason = status, code, message


class TwilioRest:
    """Updates live calls (``POST .../Calls/{CallSid}.json``). Use as ``async with``."""

    def __init__(
        self,
        account_sid: str,
        auth_token: str,
        *,
        api_base_url: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        self._timeout = timeout
        self._http = AsyncTwilioHttpClient()
        self._client = Client(account_sid, auth_token, http_client=self._http)
        if api_base_url:
            # Domain.base_url is what the generated resources join their paths to. Edge/region
            # (also read from TWILIO_EDGE/TWILIO_REGION) would rewrite that host, so drop them.
            self._client.api.base_url = api_base_url.rstrip("/")
            self._client.edge = None
            self._client.region = None

    async def redirect(self, call_sid: str, twiml: str) -> bool:
        """Replace the call's running TwiML at once (its Media Stream then gets ``stop``).

        ``False`` when the update failed or the call is already gone (nothing to redirect).
        """
        return await self._update(call_sid, "redirect", twiml=twiml)

    async def _update(self, call_sid: str, op: str, **params: Any) -> bool:
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.calls(call_sid).update_async(**params)
        except TwilioRestException as exc:
            if exc.code in CALL_GONE_CODES:
                log.info("twilio_rest.call_gone", op=op, call_sid=call_sid, code=exc.code)
                return False
            log.error(
                "twilio_rest.failed",
                op=op,
                call_sid=call_sid,
                status=exc.status,
                code=exc.code,
                error=exc.msg,
                hint=_hint(exc.status),
            )
            return False
        except TimeoutError:
            log.error("twilio_rest.timeout", op=op, call_sid=call_sid, seconds=self._timeout)
            return False
        except (TwilioException, aiohttp.ClientError, OSError, ValueError) as exc:
            log.error("twilio_rest.unreachable", op=op, call_sid=call_sid, error=repr(exc))
            return False
        log.info("twilio_rest.updated", op=op, call_sid=call_sid)
        return True

    async def create_call(self, call: NewCall) -> str:
        """Place an outbound call (``POST .../Calls.json``); its CallSid. Raises
        ``CallNotPlaced`` with Twilio's reason when Twilio refuses or cannot be reached."""
        amd: dict[str, Any] = {}
        if call.machine_detection:
            amd = {
                "machine_detection": call.machine_detection,
                "async_amd": "true",
                "async_amd_status_callback": call.amd_callback_url,
                "async_amd_status_callback_method": "POST",
            }
        extra = _twiml_and_progress(call)
        try:
            async with asyncio.timeout(self._timeout):
                created = await self._client.calls.create_async(
                    to=call.to, from_=call.from_, **extra, **amd
                )
        except TwilioRestException as exc:
            raise CallNotPlaced(exc.status, exc.code, exc.msg) from exc
        except TimeoutError as exc:
            raise CallNotPlaced(504, None, f"no answer from Twilio in {self._timeout} s") from exc
        except (TwilioException, aiohttp.ClientError, OSError, ValueError) as exc:
            raise CallNotPlaced(502, None, f"Twilio unreachable: {exc!r}") from exc
        sid = str(created.sid or "")
        if not sid:
            raise CallNotPlaced(502, None, "Twilio answered without a CallSid")
        log.info("twilio_rest.call_created", call_sid=sid, amd=call.machine_detection)
        return sid

    async def hang_up(self, call_sid: str) -> bool:
        """End the call whether it rings or is answered (``Status=completed``)."""
        return await self._update(call_sid, "hang_up", status="completed")

    async def aclose(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> TwilioRest:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def rest_from_settings(settings: Settings) -> TwilioRest | None:
    """A client when both TWILIO_ACCOUNT_SID and TWILIO_AUTH_TOKEN are set, else None."""
    if not (settings.twilio_account_sid and settings.twilio_auth_token):
        return None
    return TwilioRest(
        settings.twilio_account_sid,
        settings.twilio_auth_token,
        api_base_url=settings.twilio_api_base_url or None,
    )


def _twiml_and_progress(call: NewCall) -> dict[str, Any]:
    """What the call runs (its TwiML, or our webhook) and how it reports its progress."""
    params: dict[str, Any] = (
        {"twiml": call.twiml} if call.twiml else {"url": call.url, "method": "POST"}
    )
    if call.timeout is not None:
        params["timeout"] = call.timeout
    if call.status_callback:
        params["status_callback"] = call.status_callback
        params["status_callback_method"] = "POST"
        if call.status_callback_events:
            params["status_callback_event"] = list(call.status_callback_events)
    return params


def _hint(status: int) -> str:
    if status == 401:
        return "TWILIO_ACCOUNT_SID / TWILIO_AUTH_TOKEN are not valid credentials for the REST API"
    if status == 404:
        return "the call is not under TWILIO_ACCOUNT_SID"
    return ""
