"""A tiny real TCP load balancer for tests: round-robin per connection over backend ports,
failing over to the next backend when a connect is refused. It forwards bytes both ways, so
HTTP and WebSocket both pass through unchanged, and it keeps a timeline of every connection
(which backend, when each request line went up, when bytes came back, who closed it) so a
test can tell which instance served what and a benchmark can split a resume into parts.

    async with LoadBalancer([port_a, port_b]) as lb:
        ... http://127.0.0.1:{lb.port} ...
        lb.connections[0].backend, lb.requests("POST /twilio/voice")
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

CHUNK = 65536
MAX_CHUNKS = 4096  # per direction per connection; a long WebSocket keeps only its beginning
_METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"PATCH ", b"OPTIONS ")


@dataclass(slots=True)
class Request:
    """One HTTP request line seen going up, and when the first byte came back after it."""

    line: str
    sent_t: float
    answered_t: float | None = None


@dataclass(slots=True)
class Connection:
    id: int
    backend: int | None
    """Backend port that took the connection; None if every backend refused."""
    accepted_t: float
    refused: list[int] = field(default_factory=list)
    """Backends tried first that refused the connect (failover)."""
    requests: list[Request] = field(default_factory=list)
    down_t: list[float] = field(default_factory=list)
    """Arrival time of each chunk from the backend (bounded)."""
    closed_t: float | None = None
    closed_by: str = ""
    """``client`` or ``backend``: whose side ended first."""


class LoadBalancer:
    def __init__(self, backends: list[int], host: str = "127.0.0.1") -> None:
        if not backends:
            raise ValueError("LoadBalancer needs at least one backend port")
        self.backends = list(backends)
        self.host = host
        self.port = 0
        self.connections: list[Connection] = []
        self._next = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> LoadBalancer:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends every pipe on its own; cancelling the handler tasks instead
        # makes asyncio's start_server callback log a spurious CancelledError traceback.
        for writer in list(self._writers):
            writer.close()
        if self._pipes:
            await asyncio.wait(set(self._pipes), timeout=5.0)
        for task in list(self._pipes):  # only if a pipe ignored its closed socket
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def requests(self, prefix: str) -> list[tuple[Connection, Request]]:
        """Every request whose line starts with ``prefix`` (e.g. ``POST /twilio/voice``)."""
        return [(c, r) for c in self.connections for r in c.requests if r.line.startswith(prefix)]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(len(self.connections), None, time.monotonic())
        self.connections.append(conn)
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        self._writers.add(writer)
        try:
            upstream = await self._connect(conn)
            if upstream is None:
                return
            self._writers.add(upstream[1])
            try:
                await self._forward(conn, reader, writer, *upstream)
            finally:
                self._writers.discard(upstream[1])
        finally:
            self._pipes.discard(task)
            self._writers.discard(writer)
            with contextlib.suppress(OSError):
                writer.close()

    async def _connect(
        self, conn: Connection
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        start = self._next
        self._next = (self._next + 1) % len(self.backends)
        for i in range(len(self.backends)):
            port = self.backends[(start + i) % len(self.backends)]
            try:
                streams = await asyncio.open_connection(self.host, port)
            except OSError:
                conn.refused.append(port)
                continue
            conn.backend = port
            return streams
        conn.closed_t, conn.closed_by = time.monotonic(), "no-backend"
        return None

    async def _forward(
        self,
        conn: Connection,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        back_r: asyncio.StreamReader,
        back_w: asyncio.StreamWriter,
    ) -> None:
        up = asyncio.create_task(self._pipe(client_r, back_w, conn, up=True))
        down = asyncio.create_task(self._pipe(back_r, client_w, conn, up=False))
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            conn.closed_t = time.monotonic()
            # A pipe ends when its reader's side closes or its writer's side is gone: a caller
            # still sending when the backend dies ends the upward pipe by a failed write.
            backend_gone = (down in done and down.result() == "reader") or (
                up in done and up.result() == "writer"
            )
            conn.closed_by = "backend" if backend_gone else "client"
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            with contextlib.suppress(OSError):
                back_w.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection, *, up: bool
    ) -> str:
        """Copy until one side closes; which one ended it: ``reader`` or ``writer``."""
        while True:
            try:
                data = await reader.read(CHUNK)
            except (OSError, asyncio.IncompleteReadError):
                return "reader"
            if not data:
                return "reader"
            now = time.monotonic()
            if up and data.startswith(_METHODS):
                line = data.split(b"\r\n", 1)[0].decode("latin-1")
                conn.requests.append(Request(line, now))
            elif not up:
                if len(conn.down_t) < MAX_CHUNKS:
                    conn.down_t.append(now)
                for request in conn.requests:
                    if request.answered_t is None:
                        request.answered_t = now
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return "writer"
