"""What receiving Twilio's media messages costs a Python WebSocket server before any gateway code.

The listening bar of issue 21 is in CPU-s per call-minute; this measures the floor under it: a
server that only receives 50 Twilio-sized JSON messages a second per call (160-byte payloads,
as Twilio sends), ``--calls`` clients, the server pinned to CPU 0 and the clients to CPU 1.
Stacks: uvicorn + Starlette (what ``ivr serve`` runs, ``websockets-sansio``), the same with
``json.loads`` and base64 decoding of each message, and ``websockets``' own asyncio server.

    .venv/bin/python bench/ws_floor.py                 # each stack, 100 calls, 15 s (~1.5 min)
    .venv/bin/python bench/ws_floor.py --calls 50 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
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
STACKS = ("starlette", "starlette+parse", "websockets")


def serve(stack: str, port: int) -> None:
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
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    args = p.parse_args()
    print(f"{'stack':<16} {'calls':>5} {'CPU-s/call-min':>14} {'us/message':>10}")
    for stack in STACKS:
        per_min = measure(stack, args.calls, args.seconds, args.port)
        print(f"{stack:<16} {args.calls:5d} {per_min:14.3f} {per_min / 60 / 50 * 1e6:10.1f}")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
