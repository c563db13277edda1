"""Retries and fallback providers for every provider kind, in one loop (``first_output``); each
kind's wrapper (``ivr.stt.resilient``, ``ivr.tts.resilient``, ``ivr.llm.resilient``) runs its
stage calls through it.

A stage call (one transcription, one reply, one sentence of speech) tries the primary provider,
retries it once on a retryable error, then tries each fallback, all before the first output
(STT: the answer; LLM: the first event; TTS: the first audio bytes) is handed to the caller and
within one budget, so the caller's wait stays bounded however many attempts it takes:

    budget (e.g. TTS 1.0 s) ------------------------------------------------->|
    primary: first try | retry (only if >= min_attempt left) |  fallback gets >= min_attempt

Once output has been handed over nothing is retried: the caller has already heard (or queued)
part of the answer, so the error goes to the caller as it is.

Every failure is counted once: the ones this loop recovers from here (when it starts the next
attempt), the one it gives up with by the caller that handles it (``count_provider_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import structlog

from ivr.errors import ConfigError, ProviderError, ProviderStatusError, ProviderTimeout
from ivr.obs.metrics import count_provider_error

log = structlog.get_logger("ivr.providers")

turn_deadline: ContextVar[float | None] = ContextVar("turn_deadline", default=None)
"""When (``time.monotonic()``) the caller must hear something of this turn: the call sets it
for the stages of a reply (ivr.call) so that a failing stage gives up in time for the cached
apology, whatever its own limit. Each attempt still gets at least ``min_attempt``."""

T = TypeVar("T")


class _Named(Protocol):
    @property
    def name(self) -> str: ...


P = TypeVar("P", bound=_Named)


class _Closable(_Named, Protocol):
    async def aclose(self) -> None: ...


class _Warmable(_Closable, Protocol):
    async def warm(self) -> None: ...


C = TypeVar("C", bound=_Closable)
W = TypeVar("W", bound=_Warmable)


class ProviderChain(Generic[C]):
    """A primary and its fallbacks under one retry policy: what every resilient wrapper holds
    (it takes its name from the primary) and closes."""

    def __init__(self, providers: Sequence[C], policy: RetryPolicy) -> None:
        self.providers = tuple(providers)
        self.policy = policy
        self.name = self.providers[0].name

    async def aclose(self) -> None:
        for provider in self.providers:
            await provider.aclose()


class WarmChain(ProviderChain[W]):
    """A ``ProviderChain`` of speech providers, which open their connections ahead of a call."""

    async def warm(self) -> None:
        for provider in self.providers:
            await provider.warm()


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    budget: float
    """Seconds the caller may wait for the first output, all attempts and fallbacks included."""
    min_attempt: float
    """No retry starts with less time than this (a fallback: half of it); while the budget
    allows, the primary leaves this much for each fallback."""
    retries: int = 1
    """Extra tries of one provider, for retryable errors only."""

    def __post_init__(self) -> None:
        if self.budget <= 0 or self.min_attempt <= 0 or self.retries < 0:
            raise ValueError(f"RetryPolicy needs positive times and retries >= 0: {self}")

    def limited(self, first_output_limit: float | None) -> RetryPolicy:
        """This policy with ``first_output_limit`` (when given) as its budget."""
        if first_output_limit is None:
            return self
        return replace(self, budget=first_output_limit)

    def reserve(self, later: int) -> float:
        """Time a provider leaves for the ``later`` fallbacks after it."""
        held = self.min_attempt * later
        return held if self.budget - held >= self.min_attempt else 0.0


async def first_output(
    stage: str,
    providers: Sequence[P],
    start: Callable[[P, float], AsyncIterator[T]],
    policy: RetryPolicy,
) -> AsyncIterator[T]:
    """What the first provider that gets going yields; ``start(provider, limit)`` begins one
    attempt whose first output must come within ``limit`` seconds (the adapter enforces it).

    Raises the last ProviderError when no attempt produced output (not counted here: the
    caller handles, and counts, it), or any error after the first output, as it is.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.budget
    if (turn := turn_deadline.get()) is not None:
        # loop.time() is time.monotonic() on every event loop asyncio ships.
        deadline = min(deadline, loop.time() + max(policy.min_attempt, turn - time.monotonic()))
    pending: ProviderError | None = None  # the failure the next attempt recovers from
    for index, provider in enumerate(providers):
        reserve = policy.reserve(len(providers) - 1 - index)
        tries = 0
        while True:
            wait = _retry_wait(pending, tries, policy) if tries else 0.0
            limit = deadline - reserve - loop.time() - wait
            # A retry needs min_attempt; a fallback gets what is left of the time reserved for
            # it (the primary's timeout and our own overhead ate a few ms of it).
            needed = policy.min_attempt if tries else policy.min_attempt / 2
            if pending is not None and (wait < 0 or limit < needed):
                break  # not retryable, or no time left for it: on to the next provider
            if pending is not None:
                _recovering(stage, pending, provider.name, deadline - policy.budget, loop.time())
                pending = None
                await asyncio.sleep(wait)
            attempt = start(provider, limit)
            try:
                first = await anext(attempt)
            except StopAsyncIteration:
                return  # done without output (nothing to say): not a failure
            except ProviderError as exc:
                await aclose_stream(attempt)
                pending, tries = exc, tries + 1
                continue
            try:
                yield first
                async for item in attempt:
                    yield item
            finally:
                await aclose_stream(attempt)
            return
    assert pending is not None, "first_output needs at least one provider"
    raise pending


def _retry_wait(error: ProviderError | None, tries: int, policy: RetryPolicy) -> float:
    """Seconds to wait before retrying the same provider; negative means do not retry."""
    if error is None or not error.retryable or tries > policy.retries:
        return -1.0
    if isinstance(error, ProviderStatusError) and error.retry_after is not None:
        return error.retry_after
    return 0.0


def _recovering(
    stage: str, error: ProviderError, next_provider: str, started: float, now: float
) -> None:
    count_provider_error(stage, error.provider, error)
    event = "provider.retry" if next_provider == error.provider else "provider.fallback"
    log.warning(
        event,
        stage=stage,
        provider=error.provider,
        kind=error.kind.value,
        error=str(error),
        next_provider=next_provider,
        elapsed_s=round(now - started, 3),
    )


async def aclose_stream(stream: AsyncIterator[Any], *, quiet: bool = False) -> None:
    """Close ``stream`` if it can be closed (the seams promise only an AsyncIterator; an async
    generator closes its provider request). ``quiet``: a failure to close is no news, the
    request is over either way."""
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    if not quiet:
        await close()
        return
    with contextlib.suppress(Exception):
        await close()


async def first_within(
    provider: str, limit: float | None, stream: AsyncIterator[T]
) -> AsyncIterator[T]:
    """``stream``, whose first item must come within ``limit`` seconds (None: no limit), or
    ``ProviderTimeout``: the first-output limit of an engine that has none of its own."""
    try:
        timer = asyncio.timeout(limit)
        try:
            async with timer:
                first = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if limit is not None and timer.expired():
                raise ProviderTimeout(provider, limit, phase="first output") from None
            raise
        yield first
        async for item in stream:
            yield item
    finally:
        await aclose_stream(stream)


def check_providers(stage: str, providers: Sequence[Any], same: str | None = None) -> None:
    """A wrapper needs a provider, and ``same`` (an attribute) alike in all of them."""
    if not providers:
        raise ValueError(f"{stage}: at least one provider is needed")
    # The caller resamples by the wrapper's rate, so a fallback at another rate would be garbled.
    if same is not None and len(values := {getattr(p, same) for p in providers}) > 1:
        raise ValueError(f"{stage}: every provider must have the same {same}, got {values}")


def refuse_fallback(stage: str, fallback_url: str) -> None:
    """A fallback URL set for an offline engine is a mistake in the settings: say so."""
    if fallback_url:
        raise ConfigError(
            f"IVR_{stage}_FALLBACK_BASE_URL is set but IVR_{stage}_PROVIDER is an offline engine: "
            f"a fallback backs up an OpenAI-compatible provider (IVR_{stage}_PROVIDER=openai)"
        )
