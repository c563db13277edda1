"""Read-only admin API over the call store: who is on the line right now, and one call's state.

Disabled (404 everywhere) unless a token is configured. Answers mask phone numbers, and phone-
or card-like text anywhere in a record (``CallRecord.view``). ``?pii=true`` shows them unmasked,
only to the second token (IVR_ADMIN_PII_TOKEN), and every such answer is logged.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, HTTPException, Query, Request

from ivr.state.base import CallRecord, CallStore, StoreUnavailable

log = structlog.get_logger("ivr.admin")


def admin_router(store: CallStore, token: str | None, pii_token: str | None = None) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])
    # Dependencies as defaults, not in Annotated: these annotations are strings (postponed
    # evaluation), and FastAPI cannot resolve a name local to this function from a string.
    pii_allowed = Depends(_PiiGuard(token, pii_token))

    @router.get("/calls")
    async def list_calls(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100, pii: bool = pii_allowed
    ) -> dict[str, Any]:
        try:
            calls = await store.list_active(limit)
        except StoreUnavailable as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        if pii:
            log.info("admin.pii_shown", calls=len(calls))
        return {"calls": [c.view(pii=pii) for c in calls]}

    @router.get("/calls/{call_sid}")
    async def show_call(call_sid: str, pii: bool = pii_allowed) -> dict[str, Any]:
        record = await stored_call(store, call_sid)
        if pii:
            log.info("admin.pii_shown", call_sid=call_sid)
        return record.view(pii=pii)

    return router


async def stored_call(store: CallStore, call_sid: str) -> CallRecord:
    """A call's record for an HTTP answer: 404 when there is none, 503 when the store is away."""
    try:
        record = await store.get(call_sid)
    except StoreUnavailable as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from exc
    if record is None:
        raise HTTPException(status_code=404, detail=f"call {call_sid!r} not found")
    return record


class _PiiGuard:
    """Checks the bearer token; answers whether this request may see numbers unmasked."""

    def __init__(self, token: str | None, pii_token: str | None) -> None:
        self.token, self.pii_token = token, pii_token

    def __call__(
        self,
        request: Request,
        pii: Annotated[bool, Query(description="unmasked numbers (IVR_ADMIN_PII_TOKEN)")] = False,
    ) -> bool:
        if not self.token:
            raise HTTPException(status_code=404, detail="admin API is disabled (no token set)")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer"
        is_pii_token = bearer and bool(self.pii_token) and _same(given, self.pii_token or "")
        if not is_pii_token and not (bearer and _same(given, self.token)):
            raise HTTPException(status_code=403, detail="missing or wrong bearer token")
        if pii and not self.pii_token:
            raise HTTPException(status_code=403, detail="pii=true is disabled: no PII token set")
        if pii and not is_pii_token:
            raise HTTPException(status_code=403, detail="pii=true needs the PII bearer token")
        return pii


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
