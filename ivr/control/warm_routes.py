"""The status callbacks of warm transfers: the agent leg's call progress and the conference's
events. Signed by Twilio like every webhook (403 otherwise); answered by any instance."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import structlog
from fastapi import APIRouter, Request, Response

from ivr.control.tokens import valid_call_sid
from ivr.control.warm import AGENT_STATUS_PATH, CONFERENCE_STATUS_PATH, WarmTransfers
from ivr.control.webhook_auth import StreamAuth, signed_form
from ivr.state.base import CallNotFound, StoreError

log = structlog.get_logger("ivr.warm_transfer")

Handler = Callable[[WarmTransfers, str, Mapping[str, str]], Awaitable[None]]


def warm_transfer_router(auth: StreamAuth, warm: WarmTransfers | None) -> APIRouter:
    """``warm``: None on an instance without REST credentials (it starts no warm transfers)."""
    router = APIRouter()

    @router.post(AGENT_STATUS_PATH)
    async def agent_status(request: Request) -> Response:
        return await _callback(request, auth, warm, WarmTransfers.on_agent_status)

    @router.post(CONFERENCE_STATUS_PATH)
    async def conference_event(request: Request) -> Response:
        return await _callback(request, auth, warm, WarmTransfers.on_conference_event)

    return router


async def _callback(
    request: Request, auth: StreamAuth, warm: WarmTransfers | None, handle: Handler
) -> Response:
    form = await signed_form(request, auth)
    if form is None:
        return Response("invalid signature", status_code=403)
    caller = request.query_params.get("caller", "")
    if not valid_call_sid(caller):
        return Response("the callback URL names no caller CallSid", status_code=400)
    if warm is None:  # only an instance with REST credentials starts warm transfers
        return Response("warm transfers need TWILIO_ACCOUNT_SID", status_code=404)
    try:
        await handle(warm, caller, form)
    except CallNotFound:
        return Response("no such call", status_code=404)
    except StoreError as exc:  # the transfer's own deadline brings the caller back
        log.error("warm_transfer.callback_failed", caller=caller, error=repr(exc))
        return Response("call state unavailable", status_code=503)
    return Response(status_code=204)
