"""Errors the gateway raises, mapped at each adapter from the library that failed.

IvrError
├── ConfigError             bad or missing settings; raised at startup
├── ProviderError           an STT / LLM / TTS provider failed (``retryable``: worth a retry)
│   ├── ProviderTimeout     no answer within the provider's timeout
│   └── ProviderStatusError the provider answered with an HTTP error status
├── ProtocolError           a message from Twilio (or the simulated caller) we cannot use
└── FlowError               a flow file is invalid (carries file, line, column)
"""

from __future__ import annotations


class IvrError(Exception):
    """Base of every error the gateway raises on purpose."""


class ConfigError(IvrError):
    """A setting is missing or invalid."""


class ProviderError(IvrError):
    """A speech or language provider failed."""

    def __init__(self, provider: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.retryable = retryable


class ProviderTimeout(ProviderError):
    def __init__(self, provider: str, seconds: float) -> None:
        super().__init__(provider, f"no answer within {seconds:g} s", retryable=True)
        self.seconds = seconds


class ProviderStatusError(ProviderError):
    def __init__(self, provider: str, status: int, body: str = "") -> None:
        # 4xx is the caller's fault and will fail again, except timeouts and rate limits.
        retryable = status >= 500 or status in (408, 429)
        detail = f"HTTP {status}" + (f": {body[:200]}" if body else "")
        super().__init__(provider, detail, retryable=retryable)
        self.status = status


class ProtocolError(IvrError):
    """A wire message could not be parsed; the call goes on without it."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class FlowError(IvrError):
    """A flow definition is invalid."""
