"""Stream tokens: signed so any instance can check them without Redis, spent once.

Single use goes through a real Redis (a private redis-server we stop, pause and restart):
while Redis answers, its claim (SET NX) decides for every instance, whichever minted the
token; while it does not, each instance admits a token once and tells Redis when it is back.
Instances of earlier releases (they register a token at mint and spend it by GETDEL) are
played by raw commands on the keys they use."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest
from redis_server import RedisServer

from ivr.control.tokens import StreamTokens, TokenRefused, admit, derive_key, issue
from ivr.state.memory import MemoryCallStore
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore

SECRET = "shared-by-every-instance"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_token_verifies_on_any_instance_with_the_same_secret_and_says_for_which_call() -> None:
    minted, claims = StreamTokens(derive_key(SECRET)).mint("CA123", planned=True)
    other_instance = StreamTokens(derive_key(SECRET))
    verified = other_instance.verify(minted)
    assert verified == claims
    assert verified.call_sid == "CA123" and verified.planned and verified.nonce
    assert StreamTokens(derive_key(SECRET)).mint("CA123")[1].nonce != claims.nonce


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"), "bad_token_signature"),
        (lambda t: ("B" if t[0] != "B" else "C") + t[1:], "bad_token_signature"),
        (lambda t: t.replace(".", ""), "bad_token"),
        (lambda t: t + ".x", "bad_token"),
        (lambda t: "%%%." + t.split(".")[1], "bad_token"),
        (lambda t: "A" * 600, "bad_token"),
        (lambda t: "", "bad_token"),
    ],
)
def test_an_altered_or_malformed_token_is_refused_with_its_reason(
    mangle: object, reason: str
) -> None:
    tokens = StreamTokens(derive_key(SECRET))
    token, _ = tokens.mint("CA123")
    assert callable(mangle)
    with pytest.raises(TokenRefused) as info:
        tokens.verify(mangle(token))
    assert info.value.reason == reason


def test_a_token_signed_with_another_secret_is_refused() -> None:
    forged, _ = StreamTokens(derive_key("someone else's")).mint("CA123")
    with pytest.raises(TokenRefused, match="signature"):
        StreamTokens(derive_key(SECRET)).verify(forged)


def test_a_token_expires_after_its_ttl() -> None:
    clock = Clock()
    tokens = StreamTokens(derive_key(SECRET), ttl=120, clock=clock)
    token, _ = tokens.mint("CA123")
    clock.now += 119
    assert tokens.verify(token).call_sid == "CA123"
    clock.now += 2
    with pytest.raises(TokenRefused) as info:
        tokens.verify(token)
    assert info.value.reason == "expired_token"


def test_a_callsid_that_cannot_be_put_in_a_token_is_refused_at_mint() -> None:
    with pytest.raises(ValueError, match="CallSid"):
        StreamTokens(derive_key(SECRET)).mint("CA1|forged")


async def test_with_the_memory_store_a_token_admits_one_stream() -> None:
    tokens, store = StreamTokens(derive_key(SECRET)), MemoryCallStore()
    token = await issue(tokens, store, "CA1", planned=False)
    assert (await admit(tokens, store, token)).call_sid == "CA1"
    with pytest.raises(TokenRefused, match="already used"):
        await admit(tokens, store, token)


# -- single use through Redis, two instances -----------------------------------------------------


def instance(redis_server: RedisServer, name: str) -> ResilientCallStore:
    primary = RedisCallStore(redis_server.url, prefix="ivr:", socket_timeout=1.0, pool_timeout=1.0)
    return ResilientCallStore(
        primary, instance_id=name, min_backoff=0.02, max_backoff=0.1, budget=0.15
    )


@pytest.fixture
async def pair(
    redis_server: RedisServer,
) -> AsyncIterator[tuple[ResilientCallStore, ResilientCallStore]]:
    a, b = instance(redis_server, "gw-a"), instance(redis_server, "gw-b")
    await a.start()
    await b.start()
    yield a, b
    await a.aclose()
    await b.aclose()


async def until(condition: object, within: float = 5.0) -> None:
    assert callable(condition)
    for _ in range(int(within / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not true within {within} s")


async def test_redis_decides_single_use_for_every_instance(
    pair: tuple[ResilientCallStore, ResilientCallStore],
) -> None:
    a, b = pair
    tokens = StreamTokens(derive_key(SECRET))
    token = await issue(tokens, a, "CA1", planned=False)  # the webhook on A
    assert (await admit(tokens, b, token)).call_sid == "CA1"  # the real stream lands on B
    for replay_on in (a, b):
        with pytest.raises(TokenRefused, match="already used"):
            await admit(tokens, replay_on, token)


async def test_while_redis_is_down_any_instance_admits_a_genuine_token_once(
    redis_server: RedisServer, pair: tuple[ResilientCallStore, ResilientCallStore]
) -> None:
    a, b = pair
    tokens = StreamTokens(derive_key(SECRET))
    token = await issue(tokens, a, "CA1", planned=False)  # written to Redis
    redis_server.stop()
    # B never saw the token; the signature is enough while Redis is away.
    assert (await admit(tokens, b, token)).call_sid == "CA1"
    assert b.degraded
    with pytest.raises(TokenRefused, match="already used"):
        await admit(tokens, b, token)
    redis_server.start()  # empty: a replacement Redis
    await until(lambda: not b.degraded)
    with pytest.raises(TokenRefused):
        await admit(tokens, a, token)


async def test_a_spend_made_during_an_outage_is_replayed_to_redis_when_it_returns(
    redis_server: RedisServer, pair: tuple[ResilientCallStore, ResilientCallStore]
) -> None:
    a, b = pair
    tokens = StreamTokens(derive_key(SECRET))
    token = await issue(tokens, a, "CA1", planned=False)
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)  # Redis keeps the token, but cannot answer
    try:
        assert (await admit(tokens, b, token)).call_sid == "CA1"
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    await until(lambda: not b.degraded and b.statistics().pending == 0)
    # Redis still held the token; B's recovery spent it there, so A (up all along) refuses it.
    with pytest.raises(TokenRefused, match="already used"):
        await admit(tokens, a, token)


async def test_a_token_minted_while_redis_was_down_is_good_once_on_any_instance(
    redis_server: RedisServer, pair: tuple[ResilientCallStore, ResilientCallStore]
) -> None:
    a, b = pair
    tokens = StreamTokens(derive_key(SECRET))
    redis_server.stop()
    token = await issue(tokens, a, "CA1", planned=False)  # registered nowhere
    assert a.degraded
    redis_server.start()
    await until(lambda: not a.degraded)
    # The stream reaches B: the signature says genuine, Redis says unused.
    assert (await admit(tokens, b, token)).call_sid == "CA1"
    for replay_on in (a, b):
        with pytest.raises(TokenRefused, match="already used"):
            await admit(tokens, replay_on, token)


# -- a fleet mid-upgrade: instances of the release before this one ---------------------------------


async def earlier_release_spends(redis_server: RedisServer, nonce: str) -> str | None:
    """What an instance of an earlier release does with a stream's token: GETDEL of the key
    its webhook registered (``<prefix>token:<nonce>``), admitted if it held the CallSid."""
    direct = RedisCallStore(redis_server.url, prefix="ivr:")
    try:
        raw = await direct.link.redis.execute_command("GETDEL", f"ivr:token:{nonce}")
    finally:
        await direct.aclose()
    return None if raw is None else raw.decode()


async def test_an_earlier_release_admits_a_stream_whose_token_this_one_minted_once(
    redis_server: RedisServer, pair: tuple[ResilientCallStore, ResilientCallStore]
) -> None:
    tokens = StreamTokens(derive_key(SECRET))
    nonces = []
    for call_sid in ("CA1", "CA2"):  # both webhooks answered by this release
        token = await issue(tokens, pair[0], call_sid, planned=False)
        nonces.append(tokens.verify(token).store_key)
    assert await earlier_release_spends(redis_server, nonces[0]) == "CA1"
    assert await earlier_release_spends(redis_server, nonces[0]) is None
    # The other way round: a token this release admitted is refused by the earlier one.
    assert (await admit(tokens, pair[1], token)).call_sid == "CA2"
    assert await earlier_release_spends(redis_server, nonces[1]) is None


async def test_a_token_an_earlier_release_minted_admits_its_stream_here_once(
    redis_server: RedisServer, pair: tuple[ResilientCallStore, ResilientCallStore]
) -> None:
    a, b = pair
    tokens = StreamTokens(derive_key(SECRET))
    token, claims = tokens.mint("CA1")  # the earlier release's webhook: SET, then the TwiML
    direct = RedisCallStore(redis_server.url, prefix="ivr:")
    try:
        await direct.link.redis.set(f"ivr:token:{claims.store_key}", "CA1", px=60_000)
    finally:
        await direct.aclose()
    assert (await admit(tokens, a, token)).call_sid == "CA1"
    with pytest.raises(TokenRefused, match="already used"):
        await admit(tokens, b, token)
    assert await earlier_release_spends(redis_server, claims.store_key) is None
