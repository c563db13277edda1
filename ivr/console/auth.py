"""Who may use the console: the admin bearer token, and short-lived stream tickets for SSE.

The page keeps the token the operator typed (``sessionStorage``: gone with the tab) and sends it
as ``Authorization: Bearer`` to every JSON endpoint. A browser's ``EventSource`` cannot set
headers, so the page first trades its bearer token for a ticket (``POST /console/api/ticket``)
and opens the event stream with it in the query string. A ticket is HMAC-signed with a key
derived from the admin token (so every instance accepts every other's, with no shared state and
no cookie to guard against cross-site requests), names what it allows (numbers masked or not)
and expires after ``TICKET_TTL`` seconds: a URL that leaks into a proxy log is worthless a minute
later. Rotating the admin token invalidates every ticket.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

TICKET_TTL = 60.0
_KEY_LABEL = b"ivr-console-stream-ticket-v1"


@dataclass(frozen=True, slots=True)
class Access:
    """What an authenticated request may see."""

    pii_allowed: bool
    """Signed in with IVR_ADMIN_PII_TOKEN: may ask for numbers and texts unmasked."""


class ConsoleAuth:
    """Checks bearer tokens and stream tickets; off (``enabled`` False) without an admin token."""

    def __init__(
        self,
        token: str | None,
        pii_token: str | None = None,
        *,
        ticket_ttl: float = TICKET_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._token = token or ""
        self._pii_token = pii_token or ""
        self._ttl = ticket_ttl
        self._clock = clock
        self._key = hmac.new(self._token.encode(), _KEY_LABEL, hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        return bool(self._token)

    def bearer(self, authorization: str) -> Access | None:
        """The access an ``Authorization`` header grants; None if missing or wrong."""
        if not self.enabled:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        if self._pii_token and _same(given, self._pii_token):
            return Access(pii_allowed=True)
        if _same(given, self._token):
            return Access(pii_allowed=False)
        return None

    def mint(self, *, pii: bool) -> str:
        """A ticket for one event stream: ``expiry.pii.nonce.signature``."""
        body = f"{int(self._clock() + self._ttl)}.{int(pii)}.{secrets.token_hex(8)}"
        return f"{body}.{self._sign(body)}"

    def redeem(self, ticket: str) -> bool | None:
        """Whether the ticket shows numbers unmasked; None if forged, malformed or expired."""
        if not self.enabled:
            return None
        body, _, signature = ticket.rpartition(".")
        if not body or not _same(signature, self._sign(body)):
            return None
        expiry, pii, _nonce = [*body.split("."), "", ""][:3]
        if not expiry.isdigit() or int(expiry) < self._clock() or pii not in ("0", "1"):
            return None
        return pii == "1"

    def _sign(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
