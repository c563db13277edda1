"""HTTP and WebSocket routes, mounted here and decided where the work is owned: what Twilio asks
of a call in ``ivr.control``, the media stream in ``ivr.call.stream``, the operators' routes in
``ivr.console``, ``ivr.state.admin`` and ``ivr.outbound``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Response, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ivr.call.stream import handle_stream
from ivr.console import console_router
from ivr.control.status_callbacks import status_callbacks_router
from ivr.control.warm_routes import warm_transfer_router
from ivr.control.webhooks import CallWebhooks, call_webhooks_router
from ivr.gateway import Gateway
from ivr.outbound.routes import outbound_router
from ivr.state.admin import admin_router
from ivr.telephony.media_socket import StarletteMediaSocket


def create_app(gateway: Gateway, *, manage_lifecycle: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await gateway.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await gateway.aclose()

    # No /docs, /redoc or /openapi.json: the routes are Twilio's and the operators', and a
    # public schema only maps the attack surface.
    app = FastAPI(title="ivr", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    services = gateway.services
    hooks = CallWebhooks(
        store=gateway.store,
        auth=services.auth,
        connector=services.connector,
        admission=gateway.admission,
        flows=gateway.flows,
    )
    app.include_router(call_webhooks_router(hooks))
    app.include_router(_media_stream_route(gateway))
    settings = gateway.settings
    app.include_router(
        admin_router(gateway.store, settings.admin_token or None, settings.admin_pii_token or None)
    )
    app.include_router(
        console_router(
            gateway.store,
            settings.admin_token or None,
            settings.admin_pii_token or None,
            recordings=services.recordings,
        )
    )
    app.include_router(outbound_router(gateway))
    app.include_router(warm_transfer_router(services.auth, services.warm))
    app.include_router(status_callbacks_router(services.store, services.auth))
    app.include_router(_ops_routes(gateway))
    return app


def _media_stream_route(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.websocket("/twilio/stream/{token}")
    async def stream(ws: WebSocket, token: str) -> None:
        await handle_stream(StarletteMediaSocket(ws), token, gateway.services)

    return router


def _ops_routes(gateway: Gateway) -> APIRouter:
    """Liveness, readiness and metrics for the orchestrator and Prometheus."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz(verbose: bool = False) -> dict[str, object]:
        # Alive: the process answers. No host name or pid: this answer is public.
        if not verbose:
            return {"status": "ok"}
        return {"status": "ok", **gateway.admission.status().as_dict()}

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        # Whether THIS instance takes calls (not draining, not full, loop keeping time).
        # Redis is reported, not required: without it calls go on from memory.
        status = gateway.admission.status()
        return JSONResponse(status.as_dict(), status_code=200 if status.ready else 503)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return router
