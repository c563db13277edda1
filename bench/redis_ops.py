"""Redis cost of one call: commands per call-minute and time per update, via RedisCallStore.

A simulated 1-minute call = create + stream token + 10 turns, each turn: 3 flow steps, the
caller's and the assistant's message appended to history, one latency record; then end.
Commands are counted with INFO commandstats deltas, so run it against a Redis nobody else is
using (``--private`` starts one on a free port) for exact numbers.

    .venv/bin/python bench/redis_ops.py [--url redis://127.0.0.1:6379/0 | --private] [--calls 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from ivr.state.base import CallRecord, CallStatus
from ivr.state.redis_store import RedisCallStore

TURNS = 10
FLOW_STEPS = 3
ASSISTANT_TEXT = "Thanks, I can help with that. " * 5  # ~150 chars, a typical spoken reply


async def commandstats(client: aioredis.Redis) -> dict[str, int]:
    """Per-command counts; commands run inside a Lua script are counted too."""
    info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def step(i: int, s: int) -> Any:
    def mutate(r: CallRecord) -> None:
        r.node = f"turn{i}-step{s}"
        r.variables[f"slot{s}"] = i
        r.flow_state["cursor"] = [i, s]

    return mutate


def heard(i: int) -> Any:
    def mutate(r: CallRecord) -> None:
        r.add_message("user", f"caller utterance number {i}")
        r.add_message("assistant", ASSISTANT_TEXT)

    return mutate


def latency(i: int) -> Any:
    def mutate(r: CallRecord) -> None:
        r.add_turn({"turn": i, "stt_ms": 180.0, "llm_ttft_ms": 240.0, "tts_ttfb_ms": 90.0})

    return mutate


async def one_call(store: RedisCallStore, timings: list[float]) -> None:
    sid = f"CAbench{uuid.uuid4().hex[:24]}"
    await store.create(CallRecord(call_sid=sid, from_number="+14155550123", flow_name="bench"))
    await store.put_stream_token(sid, uuid.uuid4().hex, ttl=60)
    await store.update(sid, lambda r: setattr(r, "status", CallStatus.ACTIVE))
    for i in range(TURNS):
        mutations = [step(i, s) for s in range(FLOW_STEPS)] + [heard(i), latency(i)]
        for mutate in mutations:
            started = time.perf_counter()
            await store.update(sid, mutate)
            timings.append(time.perf_counter() - started)
    await store.end(sid)


async def run(url: str, calls: int, concurrency: int) -> None:
    prefix = f"ivrbench:{uuid.uuid4().hex[:8]}:"
    store = RedisCallStore(url, prefix=prefix, ended_ttl=60)
    client = aioredis.Redis.from_url(url)
    timings: list[float] = []
    await one_call(store, [])  # warm-up: connections and script cache
    before = await commandstats(client)
    started = time.perf_counter()
    for first in range(0, calls, concurrency):
        batch = min(concurrency, calls - first)
        await asyncio.gather(*(one_call(store, timings) for _ in range(batch)))
    wall = time.perf_counter() - started
    after = await commandstats(client)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await store.aclose()
    await client.aclose()
    report(before, after, calls, timings, wall, concurrency)


def report(
    before: dict[str, int],
    after: dict[str, int],
    calls: int,
    timings: list[float],
    wall: float,
    concurrency: int,
) -> None:
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta["info"] -= 1  # our own second INFO
    delta = {k: v for k, v in delta.items() if v > 0}
    total = sum(delta.values())
    ms = sorted(t * 1000 for t in timings)
    print(f"calls: {calls} x 1 simulated minute ({TURNS} turns), concurrency {concurrency}")
    print(f"updates per call: {len(timings) // calls}")
    print(f"redis commands per call-minute (all, incl. inside Lua): {total / calls:.1f}")
    # Every script (create, update) GETs and SETs once inside Redis: GETs and SETs beyond the
    # scripts' were sent by the client (a GET before an update whose record this store does
    # not remember; a token's SET).
    scripts = delta.get("evalsha", 0)
    client_gets = delta.get("get", 0) - scripts
    client_sets = delta.get("set", 0) - scripts
    round_trips = scripts + client_gets + client_sets
    print(f"  client round trips per call-minute: {round_trips / calls:.1f}")
    for name, count in sorted(delta.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<20} {count / calls:8.1f}")
    print(
        f"update time: mean {statistics.fmean(ms):.3f} ms, p50 {ms[len(ms) // 2]:.3f} ms, "
        f"p95 {ms[int(len(ms) * 0.95)]:.3f} ms, max {ms[-1]:.3f} ms"
    )
    print(f"wall: {wall:.2f} s, {len(timings) / wall:.0f} updates/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--private", action="store_true", help="start a private redis-server")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    if not args.private:
        print(f"redis: {args.url} (shared: counts include other clients' traffic)")
        asyncio.run(run(args.url, args.calls, args.concurrency))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from redis_server import RedisServer

    server = RedisServer()
    server.start()
    try:
        print(f"redis: private redis-server on port {server.port}")
        asyncio.run(run(server.url, args.calls, args.concurrency))
    finally:
        server.close()


if __name__ == "__main__":
    main()
