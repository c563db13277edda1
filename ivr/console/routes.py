"""The console's routes: the page and its static files, the JSON API and the event stream.

``GET /console`` and ``/console/static/*`` are the same for everyone (a login form and code, no
call data). Every ``/console/api/*`` route needs the admin bearer token (the event stream: a
ticket bought with it, see ``auth``) and answers 401 without it, 404 when no token is
configured. ``pii=true`` shows numbers and texts unmasked, only to the PII token, and is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import PurePosixPath
from typing import Annotated, Any, NoReturn

import structlog
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from ivr.console import views
from ivr.console.auth import TICKET_TTL, Access, ConsoleAuth
from ivr.console.ended import BadSearch, Search, search_ended
from ivr.console.feed import ActiveFeed, Snapshot
from ivr.recording.encode import MEDIA_TYPE
from ivr.recording.service import Recordings
from ivr.recording.sinks import RecordingError, RecordingNotFound
from ivr.state.admin import stored_call
from ivr.state.base import CallStore, StoreError
from ivr.state.resilient import statistics_of

log = structlog.get_logger("ivr.console")

STATIC = {"console.js": "text/javascript", "console.css": "text/css"}
STREAM_SECONDS = 30.0
"""An event stream ends after this long and the page opens a new one with a fresh ticket: a
stream never outlives its ticket by much, and a draining instance is not held open by consoles."""
HEARTBEAT_SECONDS = 10.0
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; media-src 'self' blob:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_OFF_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>ivr console: off</title></head><body>
<h1>The call console is off</h1>
<p>IVR_ADMIN_TOKEN is not set on this gateway. Set it (and IVR_ADMIN_PII_TOKEN to allow
unmasked numbers) and restart the gateway to use the console.</p>
</body></html>"""


def console_router(
    store: CallStore,
    token: str | None,
    pii_token: str | None = None,
    *,
    feed: ActiveFeed | None = None,
    stream_seconds: float = STREAM_SECONDS,
    recordings: Recordings | None = None,
) -> APIRouter:
    """The console under ``/console``; its feed runs for the app's lifetime when enabled."""
    auth = ConsoleAuth(token, pii_token)
    feed = feed or ActiveFeed(store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(feed.run(), name="console-feed") if auth.enabled else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    router = APIRouter(prefix="/console", lifespan=lifespan, include_in_schema=False)
    _page_routes(router, auth)
    _api_routes(router, auth, store, feed)
    _stream_route(router, auth, feed, stream_seconds)
    _recording_route(router, auth, store, recordings)
    return router


def _page_routes(router: APIRouter, auth: ConsoleAuth) -> None:
    @router.get("")
    async def page() -> HTMLResponse:
        if not auth.enabled:
            return HTMLResponse(_OFF_PAGE, status_code=404, headers=_HEADERS)
        return HTMLResponse(_static_text("index.html"), headers=_HEADERS)

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        if not auth.enabled or name not in STATIC:
            raise HTTPException(status_code=404)
        return Response(_static_text(name), media_type=STATIC[name], headers=_HEADERS)


def _api_routes(router: APIRouter, auth: ConsoleAuth, store: CallStore, feed: ActiveFeed) -> None:
    # Dependencies as defaults (see ivr.state.admin: string annotations hide local names).
    access_to = Depends(_Guard(auth))
    pii_shown = Depends(_PiiGuard(auth))

    @router.post("/api/session")
    async def session(access: Access = access_to) -> dict[str, Any]:
        """The login form's check: the token works, and whether it may unmask."""
        return {"pii_allowed": access.pii_allowed, "ticket_ttl": TICKET_TTL}

    @router.post("/api/ticket")
    async def ticket(pii: bool = pii_shown) -> dict[str, Any]:
        return {"ticket": auth.mint(pii=pii), "expires_in": TICKET_TTL}

    @router.get("/api/calls/{call_sid}")
    async def show_call(call_sid: str, pii: bool = pii_shown) -> dict[str, Any]:
        record = await stored_call(store, call_sid)
        if pii:
            log.info("console.pii_shown", call_sid=call_sid)
        return views.detail(record, pii=pii, events=feed.events_of(call_sid))

    @router.get("/api/ended")
    async def ended(
        q: str = "",
        flow: str = "",
        outcome: str = "",
        date: str = "",
        before: str = "",
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        pii: bool = pii_shown,
    ) -> dict[str, Any]:
        """Ended calls of every instance (the store's ended index), newest first; ``next``
        is the ``before`` of the following page (None: no more)."""
        try:
            search = Search.parse(q, flow, outcome, date, before)
        except BadSearch as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        try:
            found = await search_ended(store, search, limit=limit, pii=pii)
        except StoreError as exc:
            log.warning("console.store_read_failed", error=str(exc))
            raise HTTPException(status_code=503, detail=f"call store: {exc}") from exc
        stats = statistics_of(store)
        # Degraded: the list holds only what this instance ended or saw end (see the store).
        found["partial"] = bool(stats and stats.degraded)
        found["matched"] = len(found["calls"])
        if pii:
            log.info("console.pii_shown", calls=len(found["calls"]))
        return found


def _recording_route(
    router: APIRouter, auth: ConsoleAuth, store: CallStore, recordings: Recordings | None
) -> None:
    access_to = Depends(_Guard(auth))

    @router.get("/api/calls/{call_sid}/recording")
    async def recording(
        call_sid: str, part: Annotated[int, Query(ge=0)] = 0, access: Access = access_to
    ) -> StreamingResponse:
        """One recorded stream of a call (``part``: 0 for the first), streamed from the sink."""
        record = await stored_call(store, call_sid)
        if part >= len(record.recordings):
            raise HTTPException(status_code=404, detail=f"call {call_sid} has no recording {part}")
        if recordings is None:
            raise HTTPException(status_code=404, detail="recordings are off on this instance")
        location = record.recordings[part]
        try:
            body = await recordings.open(location)
        except RecordingNotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except RecordingError as exc:
            log.error("console.recording_unreadable", call_sid=call_sid, reason=exc.reason)
            raise HTTPException(status_code=502, detail=f"recording sink: {exc.reason}") from exc
        log.info("console.recording_played", call_sid=call_sid, part=part)
        media_type = MEDIA_TYPE.get(PurePosixPath(location).suffix, "application/octet-stream")
        headers = {**_HEADERS, "Content-Length": str(body.size)}
        # A plain iterator: Starlette reads it on a worker thread (file or S3 reads block).
        return StreamingResponse(body.chunks, media_type=media_type, headers=headers)


def _stream_route(router: APIRouter, auth: ConsoleAuth, feed: ActiveFeed, seconds: float) -> None:
    @router.get("/api/events")
    async def events(ticket: str = "", call: str = "") -> StreamingResponse:
        pii = auth.redeem(ticket)
        if pii is None:
            _refuse(auth)
        if pii:
            log.info("console.pii_shown", stream=True, call_sid=call or None)
        body = _event_stream(feed, pii=bool(pii), call_sid=call, seconds=seconds)
        headers = {**_HEADERS, "X-Accel-Buffering": "no"}
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _event_stream(
    feed: ActiveFeed, *, pii: bool, call_sid: str, seconds: float
) -> AsyncIterator[str]:
    """``active`` (the list) and ``call`` (the watched call) when they change; ``ended`` when
    the watched call leaves the active list; ``bye`` before the stream closes itself."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    sent: tuple[Any, ...] | None = None
    watched: int | None = None
    with feed.subscribe() as queue:
        yield f"retry: 2000\nevent: hello\ndata: {json.dumps({'pii': pii})}\n\n"
        while (left := deadline - loop.time()) > 0:
            try:
                snapshot = await asyncio.wait_for(queue.get(), min(left, HEARTBEAT_SECONDS))
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if snapshot.versions != sent or snapshot.error:
                sent = snapshot.versions
                yield _sse("active", _active_event(snapshot, pii))
            if call_sid:
                for chunk in _watched_events(snapshot, call_sid, watched, pii):
                    yield chunk
                watched = snapshot.version_of(call_sid)
    yield _sse("bye", {"reconnect": True})


def _watched_events(snapshot: Snapshot, call_sid: str, watched: int | None, pii: bool) -> list[str]:
    version = snapshot.version_of(call_sid)
    if version is None:
        return [_sse("ended", {"call_sid": call_sid})] if watched is not None else []
    if version == watched:
        return []
    return [_sse("call", snapshot.detail(call_sid, pii=pii))]


def _active_event(snapshot: Snapshot, pii: bool) -> dict[str, Any]:
    return {
        "seq": snapshot.seq,
        "taken_at": snapshot.taken_at.isoformat(),
        "error": snapshot.error,
        "calls": snapshot.summaries(pii=pii),
    }


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class _Guard:
    """The bearer token's access; 404 when the console is off, 401 when it is missing/wrong."""

    def __init__(self, auth: ConsoleAuth) -> None:
        self.auth = auth

    def __call__(self, request: Request) -> Access:
        return _access(self.auth, request)


class _PiiGuard:
    """Whether this request shows numbers unmasked: ``pii=true`` with the PII token (else 403)."""

    def __init__(self, auth: ConsoleAuth) -> None:
        self.auth = auth

    def __call__(self, request: Request, pii: bool = False) -> bool:
        access = _access(self.auth, request)
        if pii and not access.pii_allowed:
            raise HTTPException(status_code=403, detail="pii=true needs the PII token")
        return pii


def _access(auth: ConsoleAuth, request: Request) -> Access:
    access = auth.bearer(request.headers.get("authorization", ""))
    if access is None:
        _refuse(auth)
    return access


def _refuse(auth: ConsoleAuth) -> NoReturn:
    if not auth.enabled:
        raise HTTPException(status_code=404, detail="console is off: IVR_ADMIN_TOKEN is not set")
    raise HTTPException(
        status_code=401,
        detail="missing or wrong admin token",
        headers={"WWW-Authenticate": "Bearer"},
    )


@functools.cache
def _static_text(name: str) -> str:
    return resources.files("ivr.console").joinpath("static", name).read_text("utf-8")
