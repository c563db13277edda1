"""What a stalled or dead Redis replica costs each caller turn (the store's WAIT after writes).

    .venv/bin/python bench/store_stall.py          # 2 modes x 3 phases x 3 calls x 4 turns, ~9 min
    .venv/bin/python bench/store_stall.py --speculate-ms 0 --calls 5 --turns 3 --json
    .venv/bin/python bench/store_stall.py --wait-ms 200    # a longer WAIT

A real Redis Sentinel deployment (tests/redis_cluster.py: one master, one replica, three
sentinels, each a ``redis-server`` on 127.0.0.1, all killed on exit) holds the call state. The
gateway runs in this process (``build_gateway`` under uvicorn) with
``IVR_REDIS_URL=redis+sentinel://.../ivrmaster/0?wait_timeout_ms=50``, so the real
``RedisCallStore`` (behind the usual ``ResilientCallStore``, budget 150 ms) follows each write
with ``WAIT 1 50`` and the flow runner awaits the write of each step before speaking. The
providers are ``FakeOpenAIServer`` in a process of their own (bench/gateway_harness.py: STT
150 ms, LLM first token 140 ms, TTS first byte 120 ms); the flow is the repo's ``default``
(an LLM agent). A simulated Twilio caller (``ivr.sim``: espeak speech in real time, playout
and mark echoes like Twilio's) speaks ``--turns`` lines per call, ``--calls`` calls one after
the other, after one warm-up call that is not counted. Everything is repeated per
``--speculate-ms`` mode (a gateway each): ``60`` is the default IVR_SPECULATE_AFTER_MS (STT, LLM
and TTS start at a 60 ms pause and the write of the turn's step overlaps what is left of them
when the turn ends), ``0`` turns speculation off (as when the caller talks on after a pause):
the write then sits between STT and LLM. Phases, in order:

- ``healthy``: the replica confirms every write at once.
- ``stalled``: the replica is SIGSTOPped for the whole phase (SIGCONT afterwards, always): its
  link stays connected, so every write waits out the WAIT and asks who the master is.
  The master's ``repl-timeout`` is raised to 600 s first so it does not drop the stalled
  replica after the default 60 s (the phase would turn into ``killed`` part-way).
- ``killed``: the replica is SIGKILLed: the store pays one WAIT, sees no replica connected and
  stops waiting until one is back. The replica is restarted after the phase.

Per phase: ``v2v p50/p95/max``, the caller's end of speech to the first reply audio played at
the caller (voice-to-voice, the simulated caller's clock; nearest-rank percentiles);
``write p50/max``, one ``RedisCallStore`` create/update/end as the gateway awaited it (timed
around the store's methods in this process); ``check p50``, the part of an unconfirmed write
after its WAIT (asking the sentinels who the master is, and ``ROLE``); ``writes/turn``, store
writes per caller turn (the call's create and end included); ``unrepl``, the store's
``unreplicated_writes`` in the phase; ``over budget``, writes the ``ResilientCallStore`` cut off
at 150 ms (the call then goes on from memory, degraded, until Redis answers in time again);
``repl``, replicas the master listed as connected at the end of the phase. ``d p50`` is
p50 minus the same mode's healthy phase's. The load average at start and end is printed: the
machine may be shared, compare runs at similar load.

Measured 2026-11-24 (2 cores, load 0.16 -> 0.04, Redis 7.0.15): with speculation (the default) a
stalled replica cost nothing audible (p50 +2 ms): the ~94 ms write overlaps the speculated
LLM and TTS. Without it, p50 +89 ms and p95 +118 ms (736 -> 825, 773 -> 891): one write per
turn is on the path, and ``WAIT 1 50`` took ~90 ms, not 50 (the check after it ~1 ms; the
server notices a blocked client's timeout only when its event loop wakes, every 100 ms at the
default ``hz 10``); the slowest writes reached the 150 ms budget. A killed replica cost one
WAIT for the first write, then nothing (p50 +2 / -2 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gateway_harness import API_KEY, AUTH_TOKEN, PUBLIC_URL, providers_process
from redis_cluster import Node, SentinelProcesses

from ivr.config import Settings
from ivr.control.summary import percentile
from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.sim.script import script_from_data
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.tts.openai_http import OpenAIHttpTts

ROOT = Path(__file__).resolve().parent.parent
LINES = [
    "What are your opening hours?",
    "I would like to book a table for four people.",
    "Can I bring my dog?",
    "Is there parking near the restaurant?",
    "My number is five five five, one two three four.",
    "Thanks, that is all.",
]
PHASES = ("healthy", "stalled", "killed")
CALL_LIMIT_S = 120.0  # one call; a hung call is an error, not a hung bench
REPL_TIMEOUT_S = 600  # the master keeps a stalled replica connected this long


@dataclass(slots=True)
class Phase:
    mode: str
    name: str
    latencies: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    checks: list[float] = field(default_factory=list)
    turns: int = 0
    unanswered: int = 0  # caller lines that got no reply audio
    unreplicated: int = 0
    over_budget: int = 0
    degraded_at_end: bool = False
    replicas_connected: int | None = None
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self, base_p50: float | None) -> dict[str, Any]:
        def ms(values: list[float], q: float) -> float | None:
            return round(percentile(values, q) * 1000) if values else None

        p50 = ms(self.latencies, 0.5)
        return {
            "mode": self.mode,
            "phase": self.name,
            "turns": self.turns,
            "v2v_p50_ms": p50,
            "v2v_p95_ms": ms(self.latencies, 0.95),
            "v2v_max_ms": round(max(self.latencies) * 1000) if self.latencies else None,
            "d_p50_ms": None if p50 is None or base_p50 is None else round(p50 - base_p50),
            "write_p50_ms": ms(self.writes, 0.5),
            "write_max_ms": round(max(self.writes) * 1000) if self.writes else None,
            "check_p50_ms": ms(self.checks, 0.5),
            "writes_per_turn": round(len(self.writes) / self.turns, 1) if self.turns else None,
            "unreplicated_writes": self.unreplicated,
            "over_budget": self.over_budget,
            "replicas_connected": self.replicas_connected,
            "unanswered": self.unanswered,
            "errors": len(self.errors),
        }


class WriteTimer:
    """Times every create/update/end of one ``RedisCallStore`` into ``writes``, and the check
    after an unconfirmed WAIT into ``checks`` (the phase's lists)."""

    def __init__(self, store: RedisCallStore) -> None:
        self.writes: list[float] = []
        self.checks: list[float] = []
        for name in ("create", "update", "end"):
            setattr(store, name, self._timed(getattr(store, name), "writes"))
        store.link._unconfirmed = self._timed(store.link._unconfirmed, "checks")  # type: ignore[method-assign,assignment]

    def _timed(
        self, method: Callable[..., Awaitable[Any]], sink: str
    ) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return await method(*args, **kwargs)
            finally:  # a write the budget cut off counts too, as long as it was awaited
                getattr(self, sink).append(time.monotonic() - started)

        return timed


@contextlib.asynccontextmanager
async def gateway(
    provider_url: str, redis_url: str, flows_dir: Path, speculate_ms: int
) -> AsyncIterator[RunningServer]:
    settings = Settings(
        public_url=PUBLIC_URL, twilio_auth_token=AUTH_TOKEN, llm_api_key=API_KEY,
        redis_url=redis_url, redis_prefix="ivr-stall:", flows_dir=str(flows_dir),
        max_loop_lag_ms=0, max_inbound_backlog_ms=0, speculate_after_ms=speculate_ms,
    )  # fmt: skip
    built = build_gateway(
        settings,
        stt=OpenAIHttpStt(base_url=provider_url, api_key=API_KEY),
        tts=OpenAIHttpTts(base_url=provider_url, api_key=API_KEY),
        llm=OpenAICompatLlm(base_url=provider_url, api_key=API_KEY, model="gemma-4-31b"),
    )
    async with running_server(built) as server:
        yield server


def stores(server: RunningServer) -> tuple[ResilientCallStore, RedisCallStore]:
    outer = server.gateway.store
    assert isinstance(outer, ResilientCallStore), type(outer)
    assert isinstance(outer.primary, RedisCallStore), type(outer.primary)
    return outer, outer.primary


async def one_call(server: RunningServer, turns: int, index: int) -> CallReport:
    script = script_from_data({"steps": LINES[:turns]})
    async with asyncio.timeout(CALL_LIMIT_S):
        return await place_call(
            server.base_url,
            script=script,
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
            from_=f"+1555000{index:04d}",
        )


async def run_phase(
    phase: Phase, server: RunningServer, timer: WriteTimer, args: argparse.Namespace
) -> None:
    outer, store = stores(server)
    unreplicated, over_budget = store.link.unreplicated_writes, outer.over_budget
    timer.writes, timer.checks = phase.writes, phase.checks
    started = time.monotonic()
    for i in range(args.calls):
        try:
            report = await one_call(server, args.turns, i)
        except Exception as exc:  # a broken call is reported, not fatal
            phase.errors.append(repr(exc))
            continue
        phase.errors += report.errors + [v.reason for v in report.violations]
        for turn in report.turns:
            if turn.caller_text is None:
                continue  # the greeting
            if turn.latency_s is None:
                phase.unanswered += 1
            else:
                phase.latencies.append(turn.latency_s)
                phase.turns += 1
    phase.seconds = time.monotonic() - started
    timer.writes, timer.checks = [], []
    phase.unreplicated = store.link.unreplicated_writes - unreplicated
    phase.over_budget = outer.over_budget - over_budget
    phase.degraded_at_end = outer.degraded


def connected_replicas(master: Node) -> int:
    role = master.run("ROLE")
    return len(role[2]) if role and role[0] == "master" else 0


async def run(args: argparse.Namespace, deployment: SentinelProcesses) -> list[Phase]:
    master = deployment.master()
    await asyncio.to_thread(master.run, "CONFIG", "SET", "repl-timeout", str(REPL_TIMEOUT_S))
    redis_url = f"{deployment.url}?wait_timeout_ms={args.wait_ms}"
    delays = (args.stt_ms / 1000, args.llm_ms / 1000, args.tts_ms / 1000)
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory() as tmp, providers_process(*delays) as provider_url:
        flows = Path(tmp)  # the repo's default flow, alone (no other flow's lookups)
        (flows / "default.yaml").write_text((ROOT / "flows" / "default.yaml").read_text())
        (flows / "routes.yaml").write_text("default: default\n")
        for speculate_ms in args.speculate_ms:
            mode = f"spec {speculate_ms}" if speculate_ms else "spec off"
            mine = [Phase(mode, name) for name in args.phases.split(",")]
            phases += mine
            async with gateway(provider_url, redis_url, flows, speculate_ms) as server:
                await run_phases(mine, server, deployment, args)
    return phases


async def run_phases(
    phases: list[Phase],
    server: RunningServer,
    deployment: SentinelProcesses,
    args: argparse.Namespace,
) -> None:
    master = deployment.master()
    replica = next(n for n in deployment.data if n is not master and n.alive)
    _, store = stores(server)
    timer = WriteTimer(store)
    await one_call(server, 2, 9999)  # warm-up: cold code paths, models, connections
    for phase in phases:
        print(f"  {phase.mode} {phase.name} ...", end="", flush=True)
        if phase.name == "stalled":
            assert replica.process is not None
            pid = replica.process.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                await run_phase(phase, server, timer, args)
                phase.replicas_connected = await asyncio.to_thread(connected_replicas, master)
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.to_thread(deployment.wait_healthy, 30.0)
        elif phase.name == "killed":
            await asyncio.to_thread(replica.kill)
            await run_phase(phase, server, timer, args)
            phase.replicas_connected = await asyncio.to_thread(connected_replicas, master)
            await asyncio.to_thread(replica.start)  # same port, --replicaof the master
            await asyncio.to_thread(deployment.wait_healthy, 30.0)
        else:
            await run_phase(phase, server, timer, args)
            phase.replicas_connected = await asyncio.to_thread(connected_replicas, master)
        print(f" {phase.seconds:.0f} s", flush=True)


def print_table(phases: list[Phase], args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {
        p.mode: percentile(p.latencies, 0.5) * 1000
        for p in phases
        if p.name == "healthy" and p.latencies
    }
    rows = [p.row(base.get(p.mode)) for p in phases]
    print(
        f"\nstore stall: Sentinel, WAIT 1 {args.wait_ms} ms, store budget 150 ms;"
        f" {args.calls} calls x {args.turns} turns per phase; providers STT {args.stt_ms}"
        f" / LLM {args.llm_ms} / TTS {args.tts_ms} ms"
    )
    columns = [
        ("mode", "mode", 8), ("phase", "phase", 7), ("turns", "turns", 5),
        ("v2v p50", "v2v_p50_ms", 8),
        ("p95", "v2v_p95_ms", 5), ("max", "v2v_max_ms", 5), ("d p50", "d_p50_ms", 6),
        ("write p50", "write_p50_ms", 9), ("max", "write_max_ms", 5),
        ("check p50", "check_p50_ms", 9),
        ("writes/turn", "writes_per_turn", 11), ("unrepl", "unreplicated_writes", 6),
        ("over budget", "over_budget", 11), ("repl", "replicas_connected", 4),
        ("no reply", "unanswered", 8), ("err", "errors", 3),
    ]  # fmt: skip
    print(" ".join(f"{title:>{width}}" for title, _, width in columns))
    for row in rows:
        cells = []
        for _, key, width in columns:
            value = row[key]
            if key == "d_p50_ms" and isinstance(value, int):
                value = f"{value:+d}"
            cells.append(f"{'-' if value is None else value!s:>{width}}")
        print(" ".join(cells))
    print("(ms; v2v: caller's end of speech -> first reply audio played at the caller)")
    for p in phases:
        if p.degraded_at_end:
            print(f"  {p.mode} {p.name}: the store was degraded (serving from memory) at the end")
        for error in p.errors[:3]:
            print(f"  {p.mode} {p.name} error: {error[:200]}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3, help="per phase, one after the other")
    parser.add_argument("--turns", type=int, default=4, choices=range(1, len(LINES) + 1))
    parser.add_argument("--wait-ms", type=int, default=50, help="the URL's wait_timeout_ms")
    parser.add_argument(
        "--speculate-ms",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[60, 0],
        help="IVR_SPECULATE_AFTER_MS per mode, comma-separated (0: off); default 60,0",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="of: " + ",".join(PHASES))
    parser.add_argument("--stt-ms", type=int, default=150)
    parser.add_argument("--llm-ms", type=int, default=140)
    parser.add_argument("--tts-ms", type=int, default=120)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}: use {','.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    load0, started = os.getloadavg()[0], time.monotonic()
    with SentinelProcesses(replicas=1, sentinels=3, down_after_ms=1000) as deployment:
        phases = asyncio.run(run(args, deployment))
    rows = print_table(phases, args)
    print(
        f"took {time.monotonic() - started:.0f} s;"
        f" load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        print(json.dumps([asdict(p) | row for p, row in zip(phases, rows, strict=True)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
