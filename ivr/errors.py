"""Errors the gateway raises, mapped at each adapter from the library that failed.

IvrError
├── ConfigError             bad or missing settings; raised at startup
├── ProviderError           an STT / LLM / TTS provider failed: ``kind`` says how, ``retryable``
│   │                       whether the same request may succeed if sent again
│   ├── ProviderTimeout     kind TIMEOUT: no first byte, no next chunk, or not done in time
│   └── ProviderStatusError kind STATUS: the provider answered with an HTTP error status
├── ProtocolError           a message from Twilio (or the simulated caller) we cannot use
└── FlowError               a flow file is invalid (carries file, line, column)

``ProviderError.kind`` (call sites branch and count on it, never on the class):

    TIMEOUT  no answer within a first-byte, stall or total limit         retryable
    CONNECT  no connection (refused, DNS, TLS): the request never left   retryable
    RESET    the connection broke after the request went out             retryable
    STATUS   an HTTP error status (or an error event inside a stream)    5xx, 408, 429 retryable
    PAYLOAD  an answer we cannot use: not JSON, wrong shape, null fields not retryable
    ENGINE   an offline engine failed: missing package, crash            not retryable

The OpenAI-compatible adapters translate every httpx / openai-SDK / JSON / attribute error into
one of these (``ivr.providers.openai_http.provider_error``), chained with ``raise ... from exc``.
"""

from __future__ import annotations

import enum


class IvrError(Exception):
    """Base of every error the gateway raises on purpose."""


class ConfigError(IvrError):
    """A setting is missing or invalid."""


class ProviderErrorKind(enum.StrEnum):
    """How a provider failed; the value is the ``kind`` metric label."""

    TIMEOUT = "timeout"
    CONNECT = "connect"
    RESET = "reset"
    STATUS = "status"
    PAYLOAD = "payload"
    ENGINE = "engine"


_RETRYABLE_KINDS = frozenset(
    {ProviderErrorKind.TIMEOUT, ProviderErrorKind.CONNECT, ProviderErrorKind.RESET}
)


class ProviderError(IvrError):
    """A speech or language provider failed.

    ``retryable`` defaults by kind (see the module docstring); ``kind`` defaults to ENGINE,
    which is what the offline engines raise.
    """

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        kind: ProviderErrorKind = ProviderErrorKind.ENGINE,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.kind = kind
        self.retryable = kind in _RETRYABLE_KINDS if retryable is None else retryable


class ProviderTimeout(ProviderError):
    def __init__(self, provider: str, seconds: float, *, phase: str = "answer") -> None:
        super().__init__(
            provider, f"no {phase} within {seconds:g} s", kind=ProviderErrorKind.TIMEOUT
        )
        self.seconds = seconds
        """The limit that ran out, as configured."""
        self.phase = phase
        """Which limit ran out: "answer", "first token", "next chunk", "end of stream" ..."""


class ProviderStatusError(ProviderError):
    def __init__(
        self, provider: str, status: int, body: str = "", *, retry_after: float | None = None
    ) -> None:
        # 4xx is the caller's fault and will fail again, except timeouts and rate limits.
        retryable = status >= 500 or status in (408, 429)
        detail = f"HTTP {status}" + (f": {body[:200]}" if body else "")
        super().__init__(provider, detail, kind=ProviderErrorKind.STATUS, retryable=retryable)
        self.status = status
        self.retry_after = retry_after
        """Seconds the server asked us to wait (``Retry-After``), when it said."""


class ProtocolError(IvrError):
    """A wire message could not be parsed; the call goes on without it."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class FlowError(IvrError):
    """A flow definition is invalid."""
