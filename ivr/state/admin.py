"""Read-only admin API over the call store: who is on the line right now, and one call's state.

Disabled (404 everywhere) unless a token is configured; phone numbers are always redacted.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request

from ivr.state.base import CallStore, StoreUnavailable


def admin_router(store: CallStore, token: str | None) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    def authorised(request: Request) -> None:
        if not token:
            raise HTTPException(status_code=404, detail="admin API is disabled (no token set)")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status_code=403, detail="missing or wrong bearer token")

    guard = [Depends(authorised)]

    @router.get("/calls", dependencies=guard)
    async def list_calls(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        try:
            calls = await store.list_active(limit)
        except StoreUnavailable as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        return {"calls": [c.redacted().model_dump(mode="json") for c in calls]}

    @router.get("/calls/{call_sid}", dependencies=guard)
    async def show_call(call_sid: str) -> dict[str, Any]:
        try:
            record = await store.get(call_sid)
        except StoreUnavailable as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        if record is None:
            raise HTTPException(status_code=404, detail=f"call {call_sid!r} not found")
        return record.redacted().model_dump(mode="json")

    return router
