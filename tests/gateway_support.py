"""Constants shared by the gateway fixtures (conftest.py) and the tests that use them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from ivr.server import RunningServer
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
