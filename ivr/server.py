"""Run a gateway process: settings -> ``build_gateway`` -> app -> uvicorn.

SIGTERM (or SIGINT) drains instead of stopping: readiness goes false at once and live calls end
or move to other instances (``Gateway.drain``, ``IVR_DRAIN_SECONDS`` at most) while the server
keeps serving them; then uvicorn shuts down as usual. A second signal ends the drain at once
(streams still open are closed; Twilio resumes them elsewhere through the action URL); a third
exits without waiting for anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import FrameType

import structlog
import uvicorn
from fastapi import FastAPI

from ivr.app import create_app
from ivr.config import Settings
from ivr.gateway import Gateway, build_gateway
from ivr.obs.logging import configure_logging

log = structlog.get_logger("ivr.server")


@dataclass(slots=True)
class RunningServer:
    app: FastAPI
    gateway: Gateway
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def running_server(
    gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningServer]:
    """Run the gateway under uvicorn in this event loop until the block exits."""
    port = port or free_port(host)
    app = create_app(gateway)
    server = uvicorn.Server(uvicorn_config(app, host, port))
    task = asyncio.create_task(server.serve(), name="uvicorn")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the startup failure
                raise RuntimeError("uvicorn exited during startup")
            await asyncio.sleep(0.02)
        yield RunningServer(app=app, gateway=gateway, host=host, port=port)
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)


class DrainingServer(uvicorn.Server):
    """uvicorn whose exit signals drain the gateway first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            if self._drain is not None:
                self._drain.cancel()
                await asyncio.gather(self._drain, return_exceptions=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags and a thread-safe hand-off to the loop here.
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1 and self._loop is not None and self.started:
            log.info("server.drain_requested", signal=name)
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        log.warning("server.exit_now", signal=name, signals=self._signals)
        self.should_exit = True
        if self._signals >= 3:
            self.force_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit(), name="drain")

    async def _drain_then_exit(self) -> None:
        try:
            await self._gateway.drain()
        except Exception:  # never keep a process that was told to stop
            log.exception("server.drain_failed")
        self.should_exit = True


async def serve(host: str | None = None, port: int | None = None) -> int:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level, log_pii=settings.log_pii)
    gateway = build_gateway(settings)
    app = create_app(gateway)
    config = uvicorn_config(app, host or settings.host, port or settings.port)
    await DrainingServer(config, gateway).serve()
    return 0


def uvicorn_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # structlog owns logging
        access_log=False,
        lifespan="on",
        ws="websockets-sansio",
        ws_per_message_deflate=False,  # mu-law barely compresses; deflate would only cost CPU
    )
