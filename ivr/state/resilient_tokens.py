"""Stream tokens in a ``ResilientCallStore``: single use decided by the primary while it
answers, by this instance while it does not (``ivr.state.resilient``'s docstring)."""

from __future__ import annotations

import asyncio
import time

import structlog

from ivr.state.base import StoreUnavailable
from ivr.state.resilient_core import MintedToken, ResilientCore

_SWEEP_AT = 1024  # token maps are swept of expired entries past this size

log = structlog.get_logger(__name__)


class StreamTokens(ResilientCore):
    """Mints, spends and (once the primary is back) replays the spends of stream tokens."""

    async def put_stream_token(self, call_sid: str, token: str, ttl: float) -> None:
        self._sweep_tokens()
        in_primary = False
        if not self.degraded:
            try:
                work = self.primary.put_stream_token(call_sid, token, ttl)
                await self._within_budget("put_stream_token", work)
                in_primary = True
            except StoreUnavailable as exc:
                self._degrade("put_stream_token", exc)
        self._tokens[token] = MintedToken(call_sid, time.monotonic() + ttl, in_primary)

    async def redeem_stream_token(self, token: str) -> str | None:
        return await self._spend(token, None, 0.0)

    async def claim_stream_token(self, token: str, call_sid: str, ttl: float) -> bool:
        """Spend ``token``, which the caller verified belongs to ``call_sid`` and is good for
        ``ttl`` more seconds: True on its first use. While the primary is unreachable, first
        use means first on this instance."""
        return await self._spend(token, call_sid, ttl) == call_sid

    async def _spend(self, token: str, authentic: str | None, ttl: float) -> str | None:
        now = time.monotonic()
        if self._spent.get(token, 0.0) > now:
            return None  # used here already: a replay
        mine = self._tokens.pop(token, None)
        if mine is not None and mine.deadline <= now:
            mine = None
        if not self.degraded:
            try:
                sid = await self._redeem_on_primary(token)
            except StoreUnavailable as exc:
                self._degrade("redeem_stream_token", exc)
            else:
                if sid is None and mine is not None and not mine.in_primary:
                    sid = mine.call_sid  # minted here while degraded: the primary never had it
                if sid is not None:
                    self._spent[token] = now + max(ttl, mine.deadline - now if mine else 0.0)
                return sid  # the primary's answer wins over any local copy
        sid = authentic or (mine.call_sid if mine is not None else None)
        if sid is None:
            return None
        deadline = now + max(ttl, mine.deadline - now if mine else 0.0)
        self._spent[token] = deadline
        self._pending_spends[token] = deadline  # tell the primary when it is back
        self._wake.set()
        return sid

    async def _redeem_on_primary(self, token: str) -> str | None:
        """The primary's GETDEL, waited for within the budget. One that overruns it is left to
        finish, not cancelled: it may be queued for a pooled connection or between the link's
        retries, and Redis spending the token when it gets there is what refuses a replay on
        another instance before the reconciler could tell it (this one spends it locally)."""
        redeem = asyncio.ensure_future(self.primary.redeem_stream_token(token))
        try:
            return await self._within_budget("redeem_stream_token", asyncio.shield(redeem))
        finally:
            if not redeem.done():
                self._late_redeems.add(redeem)
                redeem.add_done_callback(self._late_redeem_done)

    def _late_redeem_done(self, redeem: asyncio.Future[str | None]) -> None:
        self._late_redeems.discard(redeem)
        if redeem.cancelled():
            return
        if (exc := redeem.exception()) is not None:  # spent here: the reconciler replays it
            log.info("call_store_late_redeem_failed", error=str(exc)[:200])

    async def _settle_late_redeems(self) -> None:
        """On close: give the redeems still on their way a budget to land, then cancel them."""
        if not self._late_redeems:
            return
        late = set(self._late_redeems)
        _, stuck = await asyncio.wait(late, timeout=self.budget)
        for redeem in stuck:
            redeem.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    def _sweep_tokens(self) -> None:
        now = time.monotonic()
        if len(self._tokens) >= _SWEEP_AT:
            self._tokens = {t: e for t, e in self._tokens.items() if e.deadline > now}
        if len(self._spent) >= _SWEEP_AT:
            self._spent = {t: d for t, d in self._spent.items() if d > now}

    async def _flush_tokens(self) -> None:
        """Spend on the primary what was spent here while it was unreachable, so a replay
        cannot use a token the primary still holds."""
        for token, deadline in list(self._pending_spends.items()):
            if deadline > time.monotonic():
                await self.primary.redeem_stream_token(token)
            self._pending_spends.pop(token, None)
