"""Providers a round trip away: a TCP proxy in front of the local fake providers.

Every byte waits half the round trip each way, in order. A new connection's first byte to the
server waits two more round trips (TCP's handshake and TLS 1.3's, which a connect on loopback
skips): what a request on a fresh connection to a remote provider pays and one on a pooled
connection does not. No TLS is spoken; its handshake is that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

HANDSHAKE_ROUND_TRIPS = 2
"""TCP (SYN, SYN-ACK) and TLS 1.3 (ClientHello, ServerHello...Finished) before a request."""

_READ = 64 * 1024


class RttProxy:
    """Listens on ``port`` (after ``start``) and forwards to ``upstream_port``."""

    def __init__(self, upstream_port: int, rtt_ms: float) -> None:
        self.upstream_port = upstream_port
        self.rtt = rtt_ms / 1000
        self.port = 0
        self.connections = 0
        """Connections the gateway opened through the proxy."""
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RttProxy]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self._server.close()
            for pipe in self._pipes:
                pipe.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)
            await self._server.wait_closed()

    def url(self, provider_url: str) -> str:
        """``provider_url`` (http://127.0.0.1:<upstream>/v1) through the proxy."""
        return provider_url.replace(f":{self.upstream_port}", f":{self.port}")

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        loop = asyncio.get_running_loop()
        opened = loop.time() + HANDSHAKE_ROUND_TRIPS * self.rtt
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        up = loop.create_task(self._pipe(client_r, server_w, not_before=opened))
        down = loop.create_task(self._pipe(server_r, client_w, not_before=0.0))
        self._pipes.update((up, down))
        try:
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in (up, down):
                pipe.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            self._pipes.difference_update((up, down))
            for writer in (client_w, server_w):
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, not_before: float
    ) -> None:
        """Copy ``reader`` to ``writer``, each piece half a round trip late (and not before
        ``not_before``), in order; a reader's end is passed on the same way."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=1024)

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = loop.create_task(deliver())
        try:
            while True:
                data = await reader.read(_READ)
                await queue.put((max(loop.time() + self.rtt / 2, not_before), data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
