"""Run a gateway process: settings -> ``build_gateway`` -> app -> uvicorn.

SIGTERM (or SIGINT) drains instead of stopping: readiness goes false at once and live calls end
or move to other instances (``Gateway.drain``, ``IVR_DRAIN_SECONDS`` at most) while the server
keeps serving them; then uvicorn shuts down as usual. A second signal ends the drain at once
(streams still open are closed; Twilio resumes them elsewhere through the action URL); a third
exits without waiting for anything.

``serve_workers`` runs N such processes on one port: each binds it with ``SO_REUSEPORT`` and the
kernel spreads new connections over them, so each is a full gateway (its own instance id, event
loop and core) and the shared call store lets a call's webhook and stream land on different
ones. The parent only supervises: it forwards signals (so each worker drains on SIGTERM),
restarts a worker that dies (killed while starting, or after it started serving), and stops
everything if one exits by itself before serving (it cannot start).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from ivr.app import create_app
from ivr.config import Settings
from ivr.errors import ConfigError, IvrError
from ivr.gateway import Gateway, build_gateway
from ivr.media_server import MediaServer
from ivr.obs.logging import configure_logging

log = structlog.get_logger("ivr.server")


@dataclass(slots=True)
class RunningServer:
    app: FastAPI
    gateway: Gateway
    host: str
    port: int
    media: MediaServer | None = None
    """What carries the media streams (None: uvicorn + Starlette, ``IVR_MEDIA_SERVER=asgi``)."""

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
    media = media_server_for(gateway)
    server = GatewayServer(uvicorn_config(app, host, port, gateway, media), media)
    task = asyncio.create_task(server.serve(), name="uvicorn")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the startup failure
                raise RuntimeError("uvicorn exited during startup")
            await asyncio.sleep(0.02)
        yield RunningServer(app=app, gateway=gateway, host=host, port=port, media=media)
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)


class GatewayServer(uvicorn.Server):
    """uvicorn, and the media streams it handed to ``ivr.media_server`` closed at shutdown
    before the gateway's own (uvicorn knows only the connections it serves itself)."""

    def __init__(self, config: uvicorn.Config, media: MediaServer | None) -> None:
        super().__init__(config)
        self._media = media

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._media is not None:
            await self._media.aclose()
        await super().shutdown(sockets)


class DrainingServer(GatewayServer):
    """uvicorn whose exit signals drain the gateway first (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        media: MediaServer | None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config, media)
        self._gateway = gateway
        self._on_started = on_started
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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            freeze_startup_heap()
            self._gateway.admission.lag.restart()  # the collection's stall is not load
        if self.started and self._on_started is not None:
            self._on_started()

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


def run_serving(main: Coroutine[Any, Any, int]) -> int:
    """Run a gateway process's ``main`` on the event loop ``IVR_EVENT_LOOP`` names."""
    if Settings().event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


async def serve(
    host: str | None = None,
    port: int | None = None,
    *,
    sock: socket.socket | None = None,
    worker: int | None = None,
    on_started: Callable[[], None] | None = None,
) -> int:
    """One gateway process. ``sock``: a bound socket to listen on (a worker's); ``worker``: its
    number (a configured ``IVR_INSTANCE_ID`` gets ``-w<number>-<pid>`` appended, so each worker
    process has its own); ``on_started``: called once the server accepts connections."""
    settings = Settings()
    if worker is not None and settings.instance_id:
        # Unique per process, a restarted worker included: the id owns calls in the store.
        unique = f"{settings.instance_id}-w{worker}-{os.getpid()}"
        settings = settings.model_copy(update={"instance_id": unique})
    configure_logging(settings.log_format, settings.log_level, log_pii=settings.log_pii)
    gateway = build_gateway(settings)
    app = create_app(gateway)
    media = media_server_for(gateway)
    config = uvicorn_config(app, host or settings.host, port or settings.port, gateway, media)
    server = DrainingServer(config, gateway, media, on_started)
    await server.serve([sock] if sock is not None else None)
    return 0


def freeze_startup_heap() -> None:
    """Take what startup made (modules, models, flows, prompts: ~all of the heap) out of the
    garbage collector's view. A full collection walks every tracked object: with that heap it
    took ~170 ms of event loop at 100 calls, twice a minute, a stall every live call heard.
    Frozen, a full collection walks only what calls made since."""
    gc.collect()
    gc.freeze()


# -- several worker processes on one port -----------------------------------------------------

WORKER_START_SECONDS = 120.0
"""How long a worker may take to start serving (flows, prompt synthesis, a local model)."""
MAX_RESTARTS = 5
"""Restarts of dead workers within RESTART_WINDOW after which the parent gives up."""
RESTART_WINDOW = 60.0
_PR_SET_PDEATHSIG = 1


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (not listening yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_workers(workers: int, host: str | None = None, port: int | None = None) -> int:
    """Run ``workers`` gateway processes sharing one port until they have all exited."""
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level, log_pii=settings.log_pii)
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if workers > 1 and not settings.redis_url:
        raise ConfigError(
            f"--workers {workers} needs a shared call store (IVR_REDIS_URL): a call's webhook "
            "and its media stream may reach different workers"
        )
    host = host or settings.host
    try:
        # Held (bound, never listening) for the parent's lifetime: it proves the port is free
        # before any worker starts, resolves port 0, and keeps the port for restarted workers.
        holder = reuse_port_socket(host, port if port is not None else settings.port)
    except OSError as exc:
        raise ConfigError(f"cannot bind {host}:{port or settings.port}: {exc}") from exc
    with holder:
        return WorkerPool(workers, host, int(holder.getsockname()[1])).run()


class WorkerPool:
    """The parent of ``ivr serve --workers N`` (see the module docstring)."""

    def __init__(self, count: int, host: str, port: int) -> None:
        self._count = count
        self._host = host
        self._port = port
        self._context = multiprocessing.get_context("spawn")
        # worker number -> the process, and its flag: 1 once it serves
        self._procs: dict[int, tuple[BaseProcess, ctypes.c_byte]] = {}
        self._stopping = False
        self._exit_code = 0
        self._restarts: list[float] = []

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for number in range(self._count):
                self._start(number)
            log.info("server.workers_started", workers=self._count, port=self._port)
            while self._procs:
                sentinels = [proc.sentinel for proc, _ in self._procs.values()]
                multiprocessing.connection.wait(sentinels, timeout=1.0)
                self._reap()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all(signal.SIGKILL)  # only reached with workers left on an error
        log.info("server.workers_stopped", exit_code=self._exit_code)
        return self._exit_code

    def _start(self, number: int) -> None:
        # A flag with no lock: a multiprocessing Event's lock is shared with the worker, and a
        # worker killed while setting it (right as it starts serving) left the lock held; the
        # next is_set() here then waited forever, and no worker was ever replaced again.
        started: ctypes.c_byte = self._context.RawValue("b", 0)
        proc = self._context.Process(
            target=_run_worker,
            args=(self._host, self._port, number, started, os.getpid()),
            name=f"ivr-worker-{number}",
        )
        proc.start()
        self._procs[number] = (proc, started)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        # Workers have process groups of their own (a terminal's Ctrl-C reaches only this
        # process), so each gets each signal exactly once: first drain, then exit now.
        if not self._stopping:
            log.info("server.workers_draining", signal=signal.Signals(sig).name)
        self._stopping = True
        self._stop_all(sig)

    def _stop_all(self, sig: int) -> None:
        for proc, _ in self._procs.values():
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _reap(self) -> None:
        for number, (proc, started) in list(self._procs.items()):
            if proc.exitcode is None:
                continue
            del self._procs[number]
            code = proc.exitcode
            if self._stopping:
                # A signal that ended a worker was ours (or the operator's): not a failure.
                self._exit_code = max(self._exit_code, code)
                continue
            if not started.value and code >= 0:
                # It exited by itself before serving: its settings or environment cannot work,
                # and a restart would fail the same way.
                log.error("server.worker_failed_to_start", worker=number, exit_code=code)
                self._give_up(code)
                continue
            # Killed by a signal (the OOM killer, an operator) -- while starting or serving --
            # or died after it served: replace it, within the restart budget.
            restarting = self._restart_allowed()
            log.error(
                "server.worker_died", worker=number, exit_code=code,
                serving=bool(started.value), restarting=restarting,
            )  # fmt: skip
            if restarting:
                self._start(number)
            else:
                self._give_up(code)

    def _restart_allowed(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        return len(self._restarts) <= MAX_RESTARTS

    def _give_up(self, code: int) -> None:
        self._exit_code = abs(code) or 1
        self._stopping = True
        self._stop_all(signal.SIGTERM)


def _run_worker(host: str, port: int, number: int, started: ctypes.c_byte, parent: int) -> None:
    """A worker process: one full gateway on the shared port."""
    os.setpgrp()  # see WorkerPool._forward
    _drain_when_parent_dies(parent)
    try:
        sock = reuse_port_socket(host, port)

        def serving() -> None:
            started.value = 1

        code = run_serving(serve(host, port, sock=sock, worker=number, on_started=serving))
    except ValidationError as exc:
        print(f"ivr: worker {number}: invalid settings:\n{exc}", file=sys.stderr)
        code = 2
    except IvrError as exc:
        print(f"ivr: worker {number}: cannot start: {type(exc).__name__}:\n{exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _drain_when_parent_dies(parent: int) -> None:
    """Linux: SIGTERM this worker (so it drains) if the parent is killed outright."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def media_server_for(gateway: Gateway) -> MediaServer | None:
    """picows for the media streams unless ``IVR_MEDIA_SERVER=asgi``."""
    return MediaServer(gateway) if gateway.settings.media_server == "picows" else None


def uvicorn_config(
    app: FastAPI, host: str, port: int, gateway: Gateway, media: MediaServer | None
) -> uvicorn.Config:
    """How long an idle HTTP connection is kept is ``IVR_HTTP_KEEP_ALIVE_S``: uvicorn's 5 s
    default is shorter than what pools connections to us keeps them (nginx, ALB: 60 s): a busy
    event loop could then close one just as a request arrives on it, and Twilio plays its
    "application error" for a webhook answered with a reset. WebSocket upgrades go to
    ``media`` (``ivr.media_server``) when there is one."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # structlog owns logging
        access_log=False,
        lifespan="on",
        # uvicorn calls its ``ws`` "class" with keywords and uses what it returns as the protocol.
        ws=media.protocol if media is not None else "websockets-sansio",  # type: ignore[arg-type]
        ws_per_message_deflate=False,  # mu-law barely compresses; deflate would only cost CPU
        timeout_keep_alive=gateway.settings.http_keep_alive_s,
    )
