"""Constants shared by the gateway fixtures (conftest.py) and the tests that use them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from ivr.server import RunningServer

AUTH_TOKEN = "test-auth-token"
PUBLIC_URL = "https://gw.example.com"

GatewayFactory = Callable[..., AbstractAsyncContextManager[RunningServer]]
