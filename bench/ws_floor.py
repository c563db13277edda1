"""What receiving Twilio's media messages costs a Python WebSocket server before any gateway code.

The listening bar of issue 21 is in CPU-s per call-minute; this measures the floor under it: a
server that only receives 50 Twilio-sized JSON messages a second per call (160-byte payloads,
as Twilio sends), ``--calls`` clients, the server pinned to CPU 0 and the clients to CPU 1.
Stacks: uvicorn + Starlette (``IVR_MEDIA_SERVER=asgi``, ``websockets-sansio``), the same with
``json.loads`` and base64 decoding of each message, ``websockets``' own asyncio server,
aiohttp's server, and picows (C frames, what
``ivr.media_server`` builds on, here without the hand-off to a task that the gateway adds).

    .venv/bin/python bench/ws_floor.py                 # each stack, 100 calls, 15 s (~3 min)
    .venv/bin/python bench/ws_floor.py --calls 50 --seconds 20 --stacks starlette,picows
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MESSAGE = json.dumps({
    "event": "media", "sequenceNumber": "5", "streamSid": "MZ" + "a" * 32,
    "media": {"track": "inbound", "chunk": "4", "timestamp": "80",
              "payload": base64.b64encode(bytes(160)).decode()},
})  # fmt: skip
STACKS = ("starlette", "starlette+parse", "websockets", "aiohttp", "picows")


def serve(stack: str, port: int) -> None:
    if stack == "picows":
        import uvloop
        from picows import WSListener, ws_create_server

        class Sink(WSListener):
            def on_ws_frame(self, transport, frame) -> None:  # type: ignore[no-untyped-def]
                frame.get_payload_as_bytes()

        async def main_picows() -> None:
            server = await ws_create_server(lambda _: Sink(), "127.0.0.1", port)
            await server.serve_forever()

        uvloop.run(main_picows())
        return
    if stack == "aiohttp":
        import uvloop
        from aiohttp import web

        async def handle(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(compress=False)
            await ws.prepare(request)
            async for _ in ws:
                pass
            return ws

        app_ = web.Application()
        app_.router.add_get("/ws", handle)
        web.run_app(app_, host="127.0.0.1", port=port, loop=uvloop.new_event_loop(),
                    print=None)  # fmt: skip
        return
    if stack == "websockets":
        import uvloop
        from websockets.asyncio.server import ServerConnection, serve

        async def handler(ws: ServerConnection) -> None:
            async for _ in ws:
                pass

        async def main() -> None:
            async with serve(handler, "127.0.0.1", port, compression=None):
                await asyncio.Future()

        uvloop.run(main())
        return
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket

    parse = stack.endswith("+parse")

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        while (message := await ws.receive())["type"] != "websocket.disconnect":
            if parse:
                media = json.loads(message["text"])["media"]
                binascii.a2b_base64(media["payload"], strict_mode=True)

    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    uvicorn.run(app, host="127.0.0.1", port=port, ws="websockets-sansio", loop="uvloop",
                log_level="warning", ws_per_message_deflate=False)  # fmt: skip


async def callers(port: int, calls: int, seconds: float) -> None:
    import websockets

    stop = time.monotonic() + seconds

    async def one() -> None:
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws", compression=None) as ws:
            due = time.monotonic()
            while time.monotonic() < stop:
                await ws.send(MESSAGE)
                due += 0.02
                await asyncio.sleep(max(0.0, due - time.monotonic()))

    await asyncio.gather(*(one() for _ in range(calls)))


def cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and its descendants (a server may run its worker in a child)."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    tree, grew = {pid}, True
    while grew:
        kids = {p for p, f in stats.items() if int(f[1]) in tree} - tree
        grew = bool(kids)
        tree |= kids
    ticks = sum(int(stats[p][11]) + int(stats[p][12]) for p in tree if p in stats)
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(stack: str, calls: int, seconds: float, port: int) -> float:
    """CPU-s per call-minute of the server while ``calls`` clients send."""
    pin = ["taskset", "-c"]
    server = subprocess.Popen([*pin, "0", sys.executable, str(HERE), "serve", stack, str(port)])
    try:
        time.sleep(2.0)
        client = subprocess.Popen(
            [*pin, "1", sys.executable, str(HERE), "call", str(port), str(calls), str(seconds + 4)]
        )
        time.sleep(3.0)  # every client connected and sending
        before = cpu_seconds(server.pid)
        time.sleep(seconds)
        used = cpu_seconds(server.pid) - before
        client.wait()
    finally:
        server.terminate()
        server.wait()
    return used / (calls * seconds / 60)


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1:2] == ["call"]:
        asyncio.run(callers(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--port", type=int, default=8899)
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, of " + str(STACKS))
    args = p.parse_args()
    print(f"{'stack':<16} {'calls':>5} {'CPU-s/call-min':>14} {'us/message':>10}")
    for stack in args.stacks.split(","):
        per_min = measure(stack, args.calls, args.seconds, args.port)
        print(f"{stack:<16} {args.calls:5d} {per_min:14.3f} {per_min / 60 / 50 * 1e6:10.1f}")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
