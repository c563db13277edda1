"""Stream tokens in a ``ResilientCallStore``: single use decided by the primary while it
answers, by this instance while it does not (``ivr.state.resilient``'s docstring)."""

from __future__ import annotations

import asyncio
import time

import structlog

from ivr.state.base import StoreUnavailable
from ivr.state.resilient_core import PendingSpend, ResilientCore

log = structlog.get_logger(__name__)


class StreamTokens(ResilientCore):
    """Registers and spends stream tokens, and (once the primary is back) replays the spends
    made without it."""

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        # Only for instances of earlier releases (``CallStore.put_stream_token``): single use
        # does not read it, so while degraded there is nothing to keep or write back.
        if self.degraded:
            return
        try:
            work = self.primary.put_stream_token(call_sid, token, ttl)
            await self._within_budget("put_stream_token", work)
        except StoreUnavailable as exc:
            self._degrade("put_stream_token", exc)

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        """Spend ``token`` (genuine, for ``call_sid``, good ``ttl`` more seconds): True on its
        first use. While the primary is unreachable, first use means first on this instance,
        and the spend is replayed to the primary when it is back."""
        now = time.monotonic()
        if self._spent.holds(token, now):
            return False  # used here already: a replay
        expires = now + ttl
        if not self.degraded:
            try:
                first = await self._claim_on_primary(token, call_sid, ttl)
            except StoreUnavailable as exc:
                self._degrade("claim_stream_token", exc)
            else:
                if first:
                    self._spent.put(token, call_sid, expires, now)
                return first  # the primary's answer decides for every instance
        self._spent.put(token, call_sid, expires, now)
        self._pending_spends[token] = PendingSpend(call_sid, expires)
        self._wake.set()
        return True

    async def _claim_on_primary(self, token: str, call_sid: str, ttl: float) -> bool:
        """The primary's claim, waited for within the budget. One that overruns it is left to
        finish, not cancelled: it may be queued for a pooled connection or between the link's
        retries, and Redis spending the token when it gets there is what refuses a replay on
        another instance before the reconciler could tell it (this one spends it locally)."""
        claim = asyncio.ensure_future(self.primary.claim_stream_token(token, call_sid, ttl))
        try:
            return await self._within_budget("claim_stream_token", asyncio.shield(claim))
        finally:
            if not claim.done():
                self._late_claims.add(claim)
                claim.add_done_callback(self._late_claim_done)

    def _late_claim_done(self, claim: asyncio.Future[bool]) -> None:
        self._late_claims.discard(claim)
        if claim.cancelled():
            return
        if (exc := claim.exception()) is not None:  # spent here: the reconciler replays it
            log.info("call_store_late_claim_failed", error=str(exc)[:200])

    async def _settle_late_claims(self) -> None:
        """On close: give the claims still on their way a budget to land, then cancel them."""
        if not self._late_claims:
            return
        late = set(self._late_claims)
        _, stuck = await asyncio.wait(late, timeout=self.budget)
        for claim in stuck:
            claim.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _flush_tokens(self) -> None:
        """Spend on the primary what was spent here while it was unreachable, so another
        instance refuses a replay. A token spent elsewhere meanwhile stays spent: the
        primary's claim only ever adds a spend."""
        for token, spend in list(self._pending_spends.items()):
            left = spend.deadline - time.monotonic()
            if left > 0:
                await self.primary.claim_stream_token(token, spend.call_sid, left)
            self._pending_spends.pop(token, None)
