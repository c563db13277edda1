"""Constants shared by the gateway fixtures (conftest.py) and the tests that use them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from ivr.server import RunningServer
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.state.base import CallRecord

AUTH_TOKEN = "test-auth-token"
PUBLIC_URL = "https://gw.example.com"

GatewayFactory = Callable[..., AbstractAsyncContextManager[RunningServer]]


async def record_of(server: RunningServer, report: CallReport) -> CallRecord:
    """The gateway's stored record of a simulated call."""
    record = await server.gateway.store.get(report.call_sid)
    assert record is not None
    return record


async def dial(server: RunningServer, script: list[Any]) -> CallReport:
    """One simulated Twilio call at ``server`` speaking ``script``, signed as Twilio signs."""
    return await place_call(
        server.base_url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
    )
