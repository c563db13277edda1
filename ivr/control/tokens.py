"""Stream tokens: the one-call ticket in a ``<Stream url>`` path, checkable by any instance.

The webhook that answers a call mints a token; the media stream that Twilio opens for it must
present it. A token is HMAC-SHA256 signed with a key every instance shares (derived from
``IVR_STREAM_TOKEN_SECRET``, else from ``TWILIO_AUTH_TOKEN``), bound to the CallSid and an
expiry, and carries a random nonce, so an instance that never saw the webhook, with Redis
unreachable, can still tell a real token from a forged, altered or stale one.

Single use is the store's job (``admit``): through Redis while it answers (the first claim
wins on every instance, whichever instance minted the token), per instance while it does not
(``ResilientCallStore``).

Format (URL-path safe): ``base64url(payload) "." base64url(mac[:16])`` where the payload is
``"1|<call_sid>|<expires unix s>|<nonce>|<flags>"`` and flags is ``m`` for a planned move
(the drain's REST redirect: the call resumes without an apology) or empty.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ivr.state.base import CallStore

log = structlog.get_logger("ivr.stream")

DEFAULT_TTL = 120.0
"""Seconds a token is good for: Twilio connects within a second of fetching the TwiML."""
_VERSION = "1"
_MAC_BYTES = 16
_CALL_SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY_CONTEXT = b"ivr stream tokens v1"
MAX_TOKEN_CHARS = 512


@dataclass(frozen=True, slots=True)
class StreamClaims:
    """What a verified token says."""

    call_sid: str
    expires: float
    """Unix time."""
    nonce: str
    planned: bool = False
    """Minted for a planned move (drain): the call resumes without the resume prompt."""

    @property
    def store_key(self) -> str:
        """The name the token is spent under in the store (the nonce: short and unique)."""
        return self.nonce


class TokenRefused(ValueError):
    """The token is not one of ours, or no longer good; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"stream token refused ({reason}): {detail}")
        self.reason = reason


def valid_call_sid(call_sid: str) -> bool:
    """A CallSid we can put in a token (Twilio's are ``CA`` + 32 hex digits)."""
    return _CALL_SID.fullmatch(call_sid) is not None


def derive_key(secret: str) -> bytes:
    """The signing key for ``secret``; the auth token itself is never used as a key directly."""
    return hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


class StreamTokens:
    """Mints and verifies stream tokens (no I/O)."""

    def __init__(
        self, key: bytes, *, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.time
    ) -> None:
        if len(key) < 16:
            raise ValueError("stream token key must be at least 16 bytes")
        self._key = key
        self.ttl = ttl
        self._clock = clock

    @classmethod
    def from_secret(cls, secret: str, *, ttl: float = DEFAULT_TTL) -> StreamTokens:
        """Tokens keyed by ``secret``; an empty secret gets a random per-process key (then
        only this instance can check its tokens: fine for one instance, logged)."""
        if not secret:
            log.warning(
                "stream_tokens.random_key",
                detail="no IVR_STREAM_TOKEN_SECRET or TWILIO_AUTH_TOKEN: streams must reach "
                "the instance that answered the webhook",
            )
            return cls(secrets.token_bytes(32), ttl=ttl)
        return cls(derive_key(secret), ttl=ttl)

    def mint(self, call_sid: str, *, planned: bool = False) -> tuple[str, StreamClaims]:
        if not valid_call_sid(call_sid):
            raise ValueError(f"CallSid {call_sid[:80]!r} is not [A-Za-z0-9_-]{{1,64}}")
        claims = StreamClaims(
            call_sid=call_sid,
            expires=float(int(self._clock() + self.ttl)),
            nonce=secrets.token_urlsafe(12),
            planned=planned,
        )
        flags = "m" if planned else ""
        payload = f"{_VERSION}|{call_sid}|{int(claims.expires)}|{claims.nonce}|{flags}".encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}", claims

    def verify(self, token: str) -> StreamClaims:
        """The token's claims; ``TokenRefused`` saying why if it is malformed, forged,
        altered or expired."""
        if len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
            raise TokenRefused("bad_token", "not a stream token")
        body, mac = token.split(".")
        try:
            payload, given = _unb64(body), _unb64(mac)
        except (binascii.Error, ValueError) as exc:
            raise TokenRefused("bad_token", f"not base64url: {exc}") from exc
        if not hmac.compare_digest(given, self._mac(payload)):
            raise TokenRefused("bad_token_signature", "signature does not match")
        claims = _parse(payload)
        if claims.expires <= self._clock():
            raise TokenRefused("expired_token", f"expired at {claims.expires:.0f}")
        return claims

    def now(self) -> float:
        return self._clock()

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:_MAC_BYTES]


def _parse(payload: bytes) -> StreamClaims:
    # Signed by us, so well formed unless the key leaked; still never trust it blindly.
    try:
        version, call_sid, expires, nonce, flags = payload.decode().split("|")
        claims = StreamClaims(call_sid, float(int(expires)), nonce, planned=flags == "m")
    except ValueError as exc:
        raise TokenRefused("bad_token", f"payload: {exc}") from exc
    if version != _VERSION or not _CALL_SID.fullmatch(call_sid) or not nonce:
        raise TokenRefused("bad_token", "unknown version or fields")
    return claims


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("characters outside base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def issue(tokens: StreamTokens, store: CallStore, call_sid: str, planned: bool) -> str:
    """Mint a token for ``call_sid``; the store registers it for earlier releases' instances."""
    token, claims = tokens.mint(call_sid, planned=planned)
    await store.put_stream_token(call_sid, claims.store_key, tokens.ttl)
    return token


async def admit(tokens: StreamTokens, store: CallStore, token: str) -> StreamClaims:
    """The claims of a genuine token on its first use; ``TokenRefused`` otherwise."""
    claims = tokens.verify(token)
    ttl = max(0.001, claims.expires - tokens.now())
    if not await store.claim_stream_token(claims.store_key, claims.call_sid, ttl):
        raise TokenRefused("spent_token", "already used")
    return claims
