"""Capacity: how many talking calls one process carries before callers wait.

Two loads, each on a fresh gateway (``ivr serve``, webhook path, Silero gated by WebRTC, Redis
store) pinned with ``taskset`` to ``--gateway-cpus`` (default CPU 0), while this bench's callers
and the fake providers (their own process) run on ``--caller-cpus`` (default CPU 1):

* **arrivals** (``bench/arrivals.py``, the load calls really bring): calls dial in
  ``--interval`` apart (150 ms), reach one LLM agent with no greeting and make two turns of a
  ~3 s line; about 6.7 turns end every second once the load is up, overlapping. Providers as fast
  as the cloud: STT 150 ms, LLM 120 ms then 700 tokens/s for a 40-token two-sentence reply, TTS
  120 ms then 4x real time in 40 ms chunks of 24 kHz PCM.
* **old load** (``--classic``, the bench this one replaced): callers staggered over 10 s, each
  redialling 2-turn calls of a short line after the greeting; providers answer all at once after
  STT 150 / LLM 140 / TTS 120 ms. It exercises much less per turn: kept so both are visible.

Per level: turn ends per second, voice-to-voice p50/p95 (the caller's end of speech -> the
reply's first audio *played* on Twilio's playout clock) and its change against 1 call of the
same load, errors (lines never answered, calls that failed), the most requests the providers saw
in flight at once (STT / LLM / TTS), the gateway's CPU per turn beyond listening (talking-phase
CPU less what the same calls cost listening, per turn), listening CPU-s per call-minute (the
same number of calls sending line noise first), talking CPU-s per call-minute (all of it), the
gateway's share of its cores, event-loop lag p95 and how far behind the callers' audio it hears
(``ivr_inbound_backlog_seconds`` p95). Then the knee: the first level whose p95 is
more than 50 ms over 1 call's, or that has errors.

    .venv/bin/python bench/capacity.py                                  # the sweep (~12 min)
    .venv/bin/python bench/capacity.py --levels 1,100 --classic ''      # the issue's row
    .venv/bin/python bench/capacity.py --env IVR_SPECULATE_AFTER_MS=0   # any gateway setting
    .venv/bin/python bench/capacity.py --workers 2 --gateway-cpus 0,1 --caller-cpus 0,1
    .venv/bin/python bench/capacity.py --levels 100 --classic '' --py-spy 20
    .venv/bin/python bench/capacity.py --levels 100 --classic '' --py-spy 15 --py-spy-at 0
    .venv/bin/python bench/capacity.py --levels 50,100 --classic '' --tts cartesia
    .venv/bin/python bench/capacity.py --levels 1,100,200 --classic '' --phase-slots 10
    git worktree add /tmp/issue21 059684b   # then, the bars read on the issue's machine:
    .venv/bin/python bench/capacity.py --levels 1,100,200 --classic '' --calibrate /tmp/issue21
    .venv/bin/python bench/capacity.py --calibrate /tmp/issue21 --as-issue-machine  # at its speed

``--calibrate <checkout of 059684b>``: the code the issue measured, run here at 25 calls
(~1 min more); its CPU per call-minute over the issue's table's is this machine's speed against
the issue's machine, and each level's CPU a turn and listening rate are also printed divided
by it. Machines here differ by 2x and more from one session to the next; the issue's bar of
25 ms a turn was set on its own.

``--as-issue-machine`` (with ``--calibrate``): the calibration runs first, and then, on a machine
faster than the issue's, each level's gateway is held by a cgroup quota to that share of its core
(``bench/cpu_quota.py``; root needed), so p95 and errors are read at the issue's machine's speed
rather than estimated; the calibration runs again after the levels, and the readings on the
issue's machine span the two (the machine's speed moved 16 % within an hour at stop 46).
``--cpu-share F`` holds it to any share.

``--phase-slots 10``: the callers' frames spread over ten slots of each 20 ms, as real streams
(each on its own clock) arrive; by default every stream's frame goes out in one burst.

``--tts cartesia``: the voice is a local Cartesia TTS WebSocket (in the providers' process, the
same timings, 8 kHz mu-law, so the gateway neither resamples nor encodes); the TTS in-flight
column then stays 0 (the socket is not counted).

``IVR_BENCH_DIR=/some/dir`` keeps the gateway logs and py-spy stacks. The load average is
printed with the table: the machine is shared, compare runs only at similar load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import yaml
from arrivals import (
    CLASSIC,
    LINES,
    ArrivalLoad,
    ProviderProfile,
    ProvidersProcess,
    agent_flow,
    providers,
    reply_of,
    turn_rate,
)
from capacity_callers import TalkLoad, render_lines
from cpu_quota import CpuQuota
from gateway_harness import (
    API_KEY,
    ROOT,
    CpuSampler,
    GatewayProcess,
    ListenLoad,
    gateway,
    hist_stats,
    histogram,
    live_calls,
    noise_payloads,
    pct,
    py_spy,
    summarise_listen,
)
from rtt_proxy import RttProxy

# No commas: a comma pause can exceed the 300 ms endpoint silence and split a line in two.
CLASSIC_LINES = ("What are your opening hours?", "Do you have parking nearby?")
NO_INPUT_S = 60
"""The old load's flow re-prompts after this: listening callers hear no re-prompt in a phase."""
KNEE_P95_MS = 50.0
ISSUE_TALK_CPU: dict[int, float] = {1: 3.16, 10: 1.40, 25: 1.14, 50: 1.00, 100: 0.67, 200: 0.44}
"""Issue 21's table: its harness's gateway CPU-s per call-minute for the code it measured
(059684b), by calls. ``--calibrate`` runs that code here and divides: the machine's speed
against the issue's, the one ruler the issue's bars can be read with (``sum(range(10**7))``
timings are not: they moved 2.5x between machines on which a turn moved 1.3x)."""


@dataclass(slots=True)
class Row:
    load: str
    calls: int
    workers: int
    turns: int = 0
    turns_per_s: float = float("nan")
    p50_ms: float = float("nan")
    p95_ms: float = float("nan")
    max_ms: float = float("nan")
    d_p95_ms: float = float("nan")
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    cpu_ms_per_turn: float = float("nan")
    cpu_ms_per_call: float = float("nan")
    """Beyond listening, per call (its turns included): with ``--turns 0``, a call's own."""
    """Gateway CPU in the talking phase, less listening at the measured rate, per turn."""
    listen_cpu_per_call_min: float = float("nan")
    talk_cpu_per_call_min: float = float("nan")
    """Gateway CPU-s per call-minute over the talking phase (listening, turns and replies)."""
    cpu_percent: float = float("nan")
    loop_lag_p95_ms: float = float("nan")
    behind_p95_ms: float = float("nan")
    caller_lag_p95_ms: float = float("nan")
    """How late the bench's own 20 ms ticks ran (p95): its own health."""
    loadavg: tuple[float, ...] = ()
    provider_connections: int | None = None
    """Connections the gateway opened to the providers (with ``--provider-rtt-ms``)."""


# -- gateway and store --------------------------------------------------------------------------


def redis_prefix(load: str, calls: int, workers: int) -> str:
    return f"ivr-capacity-{os.getpid()}-{load}-{calls}-{workers}:"


async def delete_prefix(url: str, prefix: str) -> None:
    """What a level left in Redis (call records, tokens)."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1.0)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@contextlib.contextmanager
def level_gateway(
    args: argparse.Namespace,
    prov: ProvidersProcess,
    flows: Path,
    workdir: Path,
    name: str,
    provider_url: str,
) -> Iterator[GatewayProcess]:
    env = {
        "IVR_FLOWS_DIR": str(flows),
        "IVR_REDIS_URL": args.redis,
        "IVR_REDIS_PREFIX": redis_prefix(name, 0, args.workers),
        "IVR_CALL_TTL_SECONDS": "600",
        **voice_env(args.tts, prov),
        **dict(kv.split("=", 1) for kv in args.env),
    }
    options: dict[str, Any] = {"cpus": args.gateway_cpus, "workers": args.workers, "env": env}
    with contextlib.ExitStack() as stack:
        quota = None
        if args.cpu_share:  # of each of its CPUs (--workers 2 on 0,1: two shares)
            share = CpuQuota(args.cpu_share, name, cores=len(cpus(args.gateway_cpus)))
            quota = stack.enter_context(share)
        gw = stack.enter_context(
            gateway(provider_url, args.vad, args.log_level, workdir, name=name, **options)
        )
        if quota is not None:  # at once: its workers, forked once it has started, go in too
            quota.add(gw.pid)
        yield gw


def voice_env(tts: str, prov: ProvidersProcess) -> dict[str, str]:
    """The gateway's voice: the batch fake's (the harness's default) or Cartesia's stand-in."""
    if tts != "cartesia":
        return {}
    return {
        "IVR_TTS_PROVIDER": "cartesia",
        "IVR_CARTESIA_API_KEY": API_KEY,
        "IVR_CARTESIA_VOICE": "bench-voice",
        "IVR_CARTESIA_URL": prov.cartesia_url,
    }


def classic_flows(workdir: Path) -> Path:
    """flows/default.yaml (greeting, one agent), waiting ``NO_INPUT_S`` before re-prompting."""
    flow = yaml.safe_load((ROOT / "flows/default.yaml").read_text())
    flow.setdefault("defaults", {})["no_input_timeout"] = NO_INPUT_S
    flows = workdir / "classic-flows"
    flows.mkdir(exist_ok=True)
    (flows / "default.yaml").write_text(yaml.safe_dump(flow, sort_keys=False))
    return flows


# -- measuring ----------------------------------------------------------------------------------


async def listen_rate(args: argparse.Namespace, gw: GatewayProcess, calls: int) -> float:
    """Gateway CPU-s per call-minute of ``calls`` callers sending line noise (their setup and
    anything the bot says left out)."""
    cpu = CpuSampler(gw)
    sampler = asyncio.create_task(cpu.run())
    load = ListenLoad(gw, calls, noise_payloads(args.noise_rms))
    load.phase_slots = args.phase_slots
    warmup = 6.0 + calls * 0.03
    try:
        runner = asyncio.create_task(load.run(args.listen + warmup))
        await asyncio.sleep(warmup)
        steady_t0 = time.monotonic()
        await runner
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return summarise_listen(args.vad, load, cpu, steady_t0, 0.0, 0).quiet_cpu_per_call_min


async def talk(
    args: argparse.Namespace,
    gw: GatewayProcess,
    prov: ProvidersProcess,
    load: TalkLoad,
    duration: float,
    row: Row,
) -> None:
    """Run ``load`` for ``duration`` s and fill ``row`` with what it measured."""
    cpu = CpuSampler(gw)
    sampler = asyncio.create_task(cpu.run())
    await prov.take_stats()
    async with httpx.AsyncClient(timeout=10.0) as http:
        lag_before = (await http.get(f"{gw.base_url}/metrics")).text
        t0 = time.monotonic()
        try:
            runner = asyncio.create_task(load.run(duration))
            if args.py_spy and row.calls == max(levels(args.levels), default=0):
                # By default once every call is up (steady state); --py-spy-at 0: the arrivals.
                at = args.py_spy_at
                await asyncio.sleep(at if at >= 0 else min(duration / 3, row.calls * args.interval))
                await py_spy(
                    gw,
                    f"capacity-{row.load}-{row.calls}",
                    args.py_spy,
                    gw.log_path.parent,
                    rate=args.py_spy_rate,
                )
            await runner
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        t1 = time.monotonic()
        lag_after = (await http.get(f"{gw.base_url}/metrics")).text
    stats = await prov.take_stats()
    name = "ivr_event_loop_lag_seconds"
    lag = hist_stats(histogram(lag_before, name), histogram(lag_after, name))
    name = "ivr_inbound_backlog_seconds"
    behind = hist_stats(histogram(lag_before, name), histogram(lag_after, name))
    call_min = sum(
        live_calls((a + b) / 2, load.streams) * (b - a) / 60
        for (a, _), (b, _) in pairwise(s for s in cpu.samples if t0 <= s[0] <= t1)
    )
    busy = cpu.between(t0, t1)
    v2v = [d for _, d in load.turns]
    row.turns = len(v2v)
    row.turns_per_s = round(turn_rate(load.turns), 2)
    row.p50_ms = round(1000 * pct(v2v, 0.5), 1)
    row.p95_ms = round(1000 * pct(v2v, 0.95), 1)
    row.max_ms = round(1000 * max(v2v, default=float("nan")), 1)
    row.errors = load.missed + len(load.errors)
    row.error_samples = load.errors[:3]
    row.in_flight = stats["max_in_flight"]
    listening = row.listen_cpu_per_call_min * call_min
    row.cpu_ms_per_call = round(1000 * (busy - listening) / load.calls, 1)
    row.cpu_ms_per_turn = (
        round(1000 * (busy - listening) / row.turns, 1) if row.turns else row.cpu_ms_per_turn
    )
    row.talk_cpu_per_call_min = round(busy / call_min, 3) if call_min else float("nan")
    row.cpu_percent = round(100 * busy / (t1 - t0) / len(cpus(args.gateway_cpus)), 1)
    row.loop_lag_p95_ms = round(1000 * lag.get("p95", float("nan")), 1)
    row.behind_p95_ms = round(1000 * behind.get("p95", float("nan")), 1)
    row.caller_lag_p95_ms = round(1000 * pct(load.tick_lag, 0.95), 1)
    row.loadavg = os.getloadavg()


async def run_level(
    args: argparse.Namespace, load_name: str, calls: int, prov: ProvidersProcess, workdir: Path
) -> Row:
    """One level of ``load_name`` ("arrivals" or "old load") on a fresh gateway."""
    row = Row(load_name, calls, args.workers)
    arrivals = load_name == "arrivals"
    name = f"{'arrivals' if arrivals else 'classic'}-{calls}-w{args.workers}"
    flows = agent_flow(workdir) if arrivals else classic_flows(workdir)
    noise = noise_payloads(args.noise_rms)
    try:
        async with contextlib.AsyncExitStack() as stack:
            url = prov.url
            proxy = None
            if args.provider_rtt_ms > 0:  # the providers a round trip away (bench/rtt_proxy.py)
                proxy = await stack.enter_async_context(
                    RttProxy(prov.port, args.provider_rtt_ms).running()
                )
                url = proxy.url(prov.url)
            gw = stack.enter_context(level_gateway(args, prov, flows, workdir, name, url))
            await gw.wait_ready()
            if args.listen > 0:
                row.listen_cpu_per_call_min = round(await listen_rate(args, gw, calls), 3)
                await asyncio.sleep(1.0)  # the listeners' teardown is not the talkers'
            if arrivals:
                lines = render_lines([LINES[i % len(LINES)] for i in range(args.turns)])
                load: TalkLoad = ArrivalLoad(gw, calls, noise, lines, args.interval)
                duration = calls * args.interval + 11 + 17 * args.turns  # turn: ~3 s + 11 s
            else:
                load = TalkLoad(gw, calls, noise, render_lines(CLASSIC_LINES), ramp=10.0)
                duration = 10.0 + args.classic_duration
            load.phase_slots = args.phase_slots
            await talk(args, gw, prov, load, duration, row)
            if proxy is not None:
                row.provider_connections = proxy.connections
    finally:
        if args.redis:
            await delete_prefix(args.redis, redis_prefix(name, 0, args.workers))
    return row


# -- output -------------------------------------------------------------------------------------


def knee(rows: list[Row]) -> str:
    """Where the arrival load breaks: the first level over the p95 bar or with errors."""
    ordered = sorted((r for r in rows if r.load == "arrivals"), key=lambda r: r.calls)
    good = None
    for r in ordered:
        if r.errors or r.d_p95_ms > KNEE_P95_MS:
            why = f"{r.errors} errors" if r.errors else f"p95 {r.d_p95_ms:+.0f} ms over 1 call"
            last = f"the last level within it: {good} calls" if good else "no level within it"
            return f"knee: {r.calls} calls ({why}); {last}"
        good = r.calls
    return f"knee: not reached (every level within +{KNEE_P95_MS:.0f} ms p95 and no error)"


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    head = (
        f"{'load':<9} {'calls':>5} {'turns':>5} {'turn/s':>6} {'p50':>6} {'p95':>6} {'d p95':>6} "
        f"{'errors':>6} {'in flight':>10} {'CPU/turn':>8} {'listen':>6} {'talk':>6} {'CPU %':>5} "
        f"{'lag p95':>7} {'behind':>6} {'bench':>5}"
    )
    print(head)
    print(
        f"{'':<9} {'':>5} {'':>5} {'ends':>6} {'(ms)':>6} {'(ms)':>6} {'(ms)':>6} {'':>6} "
        f"{'STT/LLM/TTS':>10} {'(ms)':>8} {'s/c-min':>6} {'s/c-min':>6} {'':>5} {'(ms)':>7} "
        f"{'p95 ms':>6} {'lag':>5}"
    )
    for r in rows:
        flight = "/".join(
            str(r.in_flight.get(k, "-")) for k in ("transcriptions", "chat", "speech")
        )
        print(
            f"{r.load:<9} {r.calls:5d} {r.turns:5d} {r.turns_per_s:6.2f} {r.p50_ms:6.0f} "
            f"{r.p95_ms:6.0f} {r.d_p95_ms:+6.0f} {r.errors:6d} {flight:>10} "
            f"{r.cpu_ms_per_turn:8.1f} {r.listen_cpu_per_call_min:6.3f} "
            f"{r.talk_cpu_per_call_min:6.3f} {r.cpu_percent:5.0f} "
            f"{r.loop_lag_p95_ms:7.1f} {r.behind_p95_ms:6.0f} {r.caller_lag_p95_ms:5.0f}"
        )
        for e in r.error_samples:
            print(f"{'':<9} error: {e}")


# -- main ---------------------------------------------------------------------------------------


def levels(spec: str) -> list[int]:
    return [int(n) for n in spec.split(",") if n]


def cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="1,10,25,50,100,150,200,300", help="arrival-load calls")
    p.add_argument("--interval", type=float, default=0.15, help="seconds between arrivals")
    p.add_argument(
        "--turns",
        type=int,
        default=2,
        help="turns per arrival call (runs at 1 and 4 split a turn's CPU from the call's)",
    )
    p.add_argument("--classic", default="1,100", help="old-load calls ('' = none)")
    p.add_argument("--classic-duration", type=float, default=45.0, help="old load, talking s")
    p.add_argument("--listen", type=float, default=15.0, help="listening window per level, s")
    p.add_argument("--workers", type=int, default=1, help="ivr serve --workers N")
    p.add_argument("--gateway-cpus", default="0", help="taskset -c for the gateway")
    p.add_argument("--caller-cpus", default="1", help="CPUs of this bench and the providers")
    p.add_argument("--vad", default="silero")
    p.add_argument("--log-level", default="info", help="the gateway's (info: as in production)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="the shared call store")
    p.add_argument(
        "--phase-slots",
        type=int,
        default=1,
        help="spread the callers' frames over N slots of each 20 ms, as real streams arrive"
        " (1: all in one burst, the issue's harness)",
    )
    p.add_argument("--noise-rms", type=float, default=16.0, help="caller line noise (PCM16 rms)")
    p.add_argument(
        "--tts",
        default="openai",
        choices=["openai", "cartesia"],
        help="the voice: batch 24 kHz PCM (/v1/audio/speech) or Cartesia's 8 kHz mu-law socket",
    )
    p.add_argument(
        "--reply-sentences", type=int, default=2,
        help="sentences in the LLM's reply (1-4, ~5.5 s of speech each; 2 is the issue's)",
    )  # fmt: skip
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway")
    p.add_argument(
        "--provider-rtt-ms", type=float, default=0.0,
        help="the providers this far away, new connections 2 round trips more (rtt_proxy.py)",
    )  # fmt: skip
    p.add_argument("--py-spy", type=float, default=0.0, help="profile N s at the top level")
    p.add_argument("--py-spy-at", type=float, default=-1.0, help="s into the talk (-1: steady)")
    p.add_argument("--py-spy-rate", type=int, default=100, help="py-spy samples a second")
    p.add_argument(
        "--calibrate", default="",
        help="a checkout of the issue's code (059684b): also read CPU/turn on the issue's machine",
    )  # fmt: skip
    p.add_argument(
        "--calibrate-calls", type=int, default=25, choices=sorted(ISSUE_TALK_CPU),
        help="arrival calls the issue's code is run at (25: loaded, not yet behind, in both)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-share", type=float, default=0.0,
        help="hold the gateway to this share of its core (a cgroup quota): a slower machine",
    )  # fmt: skip
    p.add_argument(
        "--as-issue-machine", action="store_true",
        help="with --calibrate: calibrate first, then run the levels with the gateway held to"
        " the issue's machine's speed (--cpu-share from the calibration)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args(argv)
    if args.calibrate:  # the gateway runs elsewhere: its PYTHONPATH must not be relative
        args.calibrate = str(Path(args.calibrate).resolve())
    if args.as_issue_machine and not args.calibrate:
        p.error("--as-issue-machine needs --calibrate <checkout of 059684b>")
    if args.as_issue_machine and args.cpu_share:
        p.error("--as-issue-machine sets the CPU share itself: drop --cpu-share")
    return args


def with_deltas(rows: list[Row]) -> None:
    for load in {r.load for r in rows}:
        base = next((r for r in rows if r.load == load and r.calls == 1), None)
        for r in rows:
            if base is not None and r.load == load:
                r.d_p95_ms = round(r.p95_ms - base.p95_ms, 1)


async def main_async(args: argparse.Namespace) -> list[Row]:
    os.sched_setaffinity(0, cpus(args.caller_cpus))
    start_load = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ivr-capacity-") as tmp:
        workdir = Path(os.environ.get("IVR_BENCH_DIR", tmp))
        os.makedirs(workdir, exist_ok=True)
        profile = ProviderProfile(tts=args.tts, reply=reply_of(args.reply_sentences))
        with providers(profile, args.caller_cpus, workdir) as prov:
            factors: list[float] = []
            if args.as_issue_machine:  # measured on the whole core, before it is held back
                factors.append(await calibrate(args, prov, workdir, "calibration"))
                args.cpu_share = issue_machine_share(factors[0])
            for calls in levels(args.levels):
                rows.append(await run_level(args, "arrivals", calls, prov, workdir))
                report(rows[-1])
            if args.calibrate:  # (again) after the levels: how far the machine moved meanwhile
                factors.append(await calibrate(args, prov, workdir, "calibration-after"))
        with providers(replace(CLASSIC, tts=args.tts), args.caller_cpus, workdir) as prov:
            for calls in levels(args.classic):
                rows.append(await run_level(args, "old load", calls, prov, workdir))
                report(rows[-1])
    with_deltas(rows)
    settings = " ".join(args.env) or "default settings"
    frames = (
        "all callers' frames in one burst every 20 ms"
        if args.phase_slots <= 1
        else f"callers' frames spread over {args.phase_slots} slots of each 20 ms"
    )
    held = (
        f" held to {args.cpu_share:.2f} of it (a cgroup quota)"
        + (": the issue's machine's speed" if args.as_issue_machine else "")
        if args.cpu_share
        else ""
    )
    print_table(
        rows,
        f"Capacity: gateway on CPU {args.gateway_cpus}{held}, {args.workers} worker(s), "
        f"{settings}; "
        f"{frames}; "
        f"arrivals every {args.interval * 1000:.0f} ms, providers {profile.describe()}; "
        f"old load: {replace(CLASSIC, tts=args.tts).describe()}",
    )
    print(knee(rows))
    if factors:
        print_on_issue_machine(rows, factors)
    print(f"load average: start {start_load}, end {os.getloadavg()} on {os.cpu_count()} CPUs")
    return rows


async def calibrate(
    args: argparse.Namespace, prov: ProvidersProcess, workdir: Path, name: str
) -> float:
    """This machine's speed against the issue's: the issue's code (a checkout at
    ``--calibrate``) at ``--calibrate-calls`` arrival calls, with the arrival levels' providers,
    its talking CPU-s per call-minute over the issue's figure for the same load (> 1: this
    machine is slower). ``name``: the folder of ``workdir`` its logs go to."""
    calls = args.calibrate_calls
    ref = argparse.Namespace(**vars(args))
    ref.env = [*args.env, f"PYTHONPATH={args.calibrate}"]
    ref.listen = 0.0  # the talking rate is the ruler; its listening is not needed
    ref.py_spy = 0.0
    ref.cpu_share = 0.0  # the ruler is the whole core
    own = workdir / name  # its logs apart from a level with as many calls
    own.mkdir(exist_ok=True)
    row = await run_level(ref, "arrivals", calls, prov, own)
    factor = row.talk_cpu_per_call_min / ISSUE_TALK_CPU[calls]
    print(
        f"\n{name}: the issue's code ({args.calibrate}) at {calls} calls here: "
        f"{row.talk_cpu_per_call_min:.3f} CPU-s per call-minute talking, the issue's table "
        f"{ISSUE_TALK_CPU[calls]:.2f}: this machine is {factor:.2f}x the issue's "
        f"(p50 {row.p50_ms:.0f} ms, {row.errors} errors, {row.cpu_percent:.0f} % CPU)"
    )
    return factor


def issue_machine_share(factor: float) -> float:
    """The share of its core that makes the gateway as fast as on the issue's machine: this
    machine's speed against it (``factor`` < 1: faster); a slower machine cannot be sped up."""
    if factor >= 1.0:
        print(
            f"this machine is slower than the issue's ({factor:.2f}x): the levels run on the "
            "whole core, and its bars are harder to hold here than there"
        )
        return 0.0
    return round(factor, 2)


def print_on_issue_machine(rows: list[Row], factors: list[float]) -> None:
    """The per-turn CPU and the listening rate read on the issue's machine (bars: 25 ms and
    0.15 CPU-s per call-minute), by each calibration: the machine's speed moves between runs
    (16 % within an hour, stop 46), and two calibrations, before and after the levels, show
    how far these readings can be trusted."""
    lo, hi = min(factors), max(factors)
    if len(factors) > 1:
        print(
            "calibrations: "
            + ", then ".join(f"{f:.2f}x" for f in factors)
            + f" ({100 * (hi / lo - 1):.0f} % apart): the readings below span them"
        )

    def there(value: float, digits: int) -> str:
        a, b = round(value / hi, digits), round(value / lo, digits)
        return f"{a:.{digits}f}" if a == b else f"{a:.{digits}f}-{b:.{digits}f}"

    measured = [r for r in rows if r.load == "arrivals" and not math.isnan(r.cpu_ms_per_turn)]
    none = "none measured (it needs the listening rate: --listen > 0)"
    turns = ", ".join(f"{r.calls} calls {there(r.cpu_ms_per_turn, 1)}" for r in measured)
    print(f"CPU a turn beyond listening on the issue's machine (est., ms; bar 25): {turns or none}")
    listen = ", ".join(f"{r.calls} calls {there(r.listen_cpu_per_call_min, 3)}" for r in measured)
    print(f"listening on the issue's machine (est., CPU-s per call-minute; bar 0.15): "
          f"{listen or none}")  # fmt: skip


def report(row: Row) -> None:
    print(
        f"  {row.load} {row.calls} calls: p50 {row.p50_ms:.0f} ms, p95 {row.p95_ms:.0f} ms, "
        f"{row.turns} turns, {row.errors} errors, {row.cpu_ms_per_turn:.0f} ms CPU a turn, "
        f"{row.cpu_ms_per_call:.0f} ms a call"
        + (
            f", {row.provider_connections} provider connections"
            if row.provider_connections is not None
            else ""
        ),
        file=sys.stderr,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # so the gateway's process group is killed
    try:
        rows = asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
