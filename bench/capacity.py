"""Capacity: how voice-to-voice latency and CPU hold up as concurrent calls grow, per core.

The gateway (``ivr serve``, webhook path, Silero gated by WebRTC) is pinned with ``taskset`` to
``--gateway-cpus`` (default CPU 0); this bench's callers and the fake providers (their own
process, fixed delays STT 150 ms / LLM first token 140 ms / TTS first byte 120 ms) run on
``--caller-cpus`` (default CPU 1). For each level of concurrent calls, on a fresh gateway:

1. Listening: N lightweight callers (``ListenLoad``) hear the greeting and then send faint line
   noise; the bench flow waits a minute before re-prompting, so this is pure listening. Gateway
   CPU in the quiet 100 ms intervals (no call set up, no bot audio) per call-minute.
2. Talking: N callers (staggered over ``--ramp`` seconds, then redialling until ``--duration``
   is up) each make 2-turn calls: wait for the greeting to finish, say a line (espeak, rendered
   once), wait for the reply to finish, say another, wait, hang up. Voice-to-voice is the
   caller's end of speech (when its last speech frame went out) -> first reply audio *played*
   at the caller (Twilio's playout clock). CPU with replies = gateway CPU over the window /
   call-minutes in it; process CPU % = CPU over wall time; event-loop lag from the gateway's
   ``ivr_event_loop_lag_seconds`` histogram (bucket-interpolated; with ``--workers`` > 1 each
   scrape reaches one worker, so it is one worker's view).

    .venv/bin/python bench/capacity.py                      # 1, 10, 50, 100 calls (~8 min)
    .venv/bin/python bench/capacity.py --levels 1,100 --duration 30 --listen 15
    .venv/bin/python bench/capacity.py --workers 2 --gateway-cpus 0,1 --caller-cpus 0,1
    .venv/bin/python bench/capacity.py --levels 100 --py-spy 20   # profile the talking phase

``IVR_BENCH_DIR=/some/dir`` keeps the gateway logs and py-spy stacks. The load average is
printed next to the table: the machine is shared, compare runs only at similar load.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import yaml
from gateway_harness import (
    ROOT,
    CpuSampler,
    GatewayProcess,
    ListenLoad,
    Stream,
    gateway,
    hist_stats,
    histogram,
    live_calls,
    noise_payloads,
    pct,
    providers_process,
    py_spy,
    summarise_listen,
)
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ivr.sim.script import default_synthesize, to_line_audio

# No commas: a comma pause can exceed the 300 ms endpoint silence and split a line in two.
LINES = ("What are your opening hours?", "Do you have parking nearby?")
TURN_GAP_S = 0.7
"""The bot's turn is over after this much silence at the caller (as ``place_call`` waits)."""
REPLY_WAIT_S = 10.0
NO_INPUT_S = 60
"""The bench flow's no-input timeout: listening callers hear no re-prompt within a phase."""


def redis_prefix(calls: int, workers: int) -> str:
    return f"ivr-capacity-{os.getpid()}-{calls}-{workers}:"


async def delete_prefix(url: str, prefix: str) -> None:
    """What a level left in Redis (call records, tokens)."""
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1.0)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# -- the bench flow ---------------------------------------------------------------------------


@contextlib.contextmanager
def bench_flows(workdir: Path) -> Iterator[Path]:
    """flows/default.yaml, waiting ``NO_INPUT_S`` for the caller before re-prompting."""
    flow = yaml.safe_load((ROOT / "flows/default.yaml").read_text())
    flow.setdefault("defaults", {})["no_input_timeout"] = NO_INPUT_S
    flows = workdir / "flows"
    flows.mkdir(exist_ok=True)
    (flows / "default.yaml").write_text(yaml.safe_dump(flow, sort_keys=False))
    yield flows


# -- talking callers ----------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class TalkingStream(Stream):
    """A caller that speaks: its microphone queue, and when bot audio starts playing."""

    mic: list[str] = field(default_factory=list)
    spoke_until: asyncio.Future[float] | None = None
    """Resolved with the send time of the last speech frame."""
    reply: asyncio.Future[float] | None = None
    """Resolved with when the first bot audio after ``spoke_until`` starts playing."""
    last_media: float = 0.0

    def next_payload(self, line_noise: str, now: float) -> str:
        if not self.mic:
            return line_noise
        payload = self.mic.pop()
        if not self.mic and self.spoke_until is not None and not self.spoke_until.done():
            self.spoke_until.set_result(now)
        return payload

    def on_message(self, raw: str | bytes, now: float) -> None:
        plays_at = max(now, self.play_end)  # Twilio plays audio once what is queued has played
        media_before = self.media_in
        Stream.on_message(self, raw, now)
        if self.media_in > media_before:
            if self.reply is not None and not self.reply.done():
                self.reply.set_result(plays_at)
            self.last_media = now

    def bot_silent_for(self, now: float) -> float:
        return now - max(self.play_end, self.last_media)


class TalkLoad(ListenLoad):
    """N callers making 2-turn calls back to back; voice-to-voice per turn."""

    def __init__(
        self,
        gw: GatewayProcess,
        calls: int,
        payloads: list[str],
        lines: list[list[str]],
        ramp: float,
    ) -> None:
        super().__init__(gw, calls, payloads)
        self.lines = lines
        self.ramp = ramp
        self.turns: list[tuple[float, float]] = []
        """(caller's end of speech, voice-to-voice seconds)."""
        self.missed = 0
        """Caller lines that got no reply within REPLY_WAIT_S."""

    def start_delay(self, index: int) -> float:
        return index * self.ramp / self.calls

    def new_stream(self, ws: ClientConnection, sid: str, t0: float) -> Stream:
        return TalkingStream(ws, sid, t0, time.monotonic())

    async def converse(self, stream: Stream) -> bool:
        assert isinstance(stream, TalkingStream)
        receiver = asyncio.create_task(self._receive(stream))
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await self._talk(stream, receiver)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return True  # the caller hangs up (the bench sends `stop`)

    async def _talk(self, stream: TalkingStream, receiver: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        await self._bot_turn_over(stream, receiver)  # the greeting
        for line in self.lines:
            if time.monotonic() > self.stop_at - 2 or receiver.done():
                return
            stream.spoke_until = loop.create_future()
            stream.mic = list(reversed(line))
            end = await stream.spoke_until
            stream.reply = loop.create_future()
            await asyncio.wait({stream.reply, receiver}, timeout=REPLY_WAIT_S)
            if not stream.reply.done():
                # Cut by the end of the run is not a miss; a gateway that hung up or went
                # quiet on a caller's line is.
                if not (receiver.done() and time.monotonic() >= self.stop_at):
                    self.missed += 1
                return
            plays_at = stream.reply.result()
            self.turns.append((end, plays_at - end))
            await self._bot_turn_over(stream, receiver)

    async def _bot_turn_over(self, stream: TalkingStream, receiver: asyncio.Task[None]) -> None:
        """Until bot audio has played and none followed for TURN_GAP_S."""
        deadline = time.monotonic() + 3 * REPLY_WAIT_S
        while not receiver.done() and time.monotonic() < deadline:
            now = time.monotonic()
            if stream.last_media and stream.bot_silent_for(now) >= TURN_GAP_S:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError


def render_lines() -> list[list[str]]:
    """Each caller line as base64 mu-law 20 ms payloads (espeak, once per run)."""
    out = []
    for text in LINES:
        ulaw = to_line_audio(*default_synthesize(text))
        out.append([base64.b64encode(ulaw[i : i + 160]).decode() for i in range(0, len(ulaw), 160)])
    return out


# -- one level ----------------------------------------------------------------------------------


@dataclass(slots=True)
class LevelResult:
    calls: int
    workers: int
    turns: int
    missed: int
    v2v_p50_ms: float
    v2v_p95_ms: float
    v2v_max_ms: float
    listen_cpu_per_call_min: float
    talk_cpu_per_call_min: float
    cpu_percent: float
    runqueue_percent: float
    """Of the window, how long the gateway waited for its CPU (other processes on its core)."""
    caller_lag_p95_ms: float
    """How late the callers' 20 ms ticks ran (p95): the bench's own health."""
    loop_lag: dict[str, float]
    calls_placed: int
    loadavg: tuple[float, float, float]
    errors: list[str] = field(default_factory=list)
    delta_p95_ms: float = float("nan")
    delta_p50_ms: float = float("nan")


async def run_level(
    args: argparse.Namespace, calls: int, provider_url: str, flows: Path, workdir: Path
) -> LevelResult:
    lines = render_lines()
    options: dict[str, Any] = {
        "cpus": args.gateway_cpus,
        "workers": args.workers,
        "env": {
            "IVR_FLOWS_DIR": str(flows),
            "IVR_REDIS_URL": args.redis,
            "IVR_REDIS_PREFIX": redis_prefix(calls, args.workers),
            "IVR_CALL_TTL_SECONDS": "600",
        },
        "name": f"capacity-{calls}-w{args.workers}",
    }
    with gateway(provider_url, args.vad, args.log_level, workdir, **options) as gw:
        await gw.wait_ready()
        listen = await listen_phase(args, gw, calls) if args.listen > 0 else float("nan")
        await asyncio.sleep(1.0)  # listening streams close; their teardown is not the talkers'
        cpu = CpuSampler(gw)
        sampler = asyncio.create_task(cpu.run())
        load = TalkLoad(gw, calls, noise_payloads(args.noise_rms), lines, args.ramp)
        async with httpx.AsyncClient(timeout=10.0) as http:
            try:
                runner = asyncio.create_task(load.run(args.duration + args.ramp))
                await asyncio.sleep(args.ramp)  # callers dial in: not the steady state
                lag_before = (await http.get(f"{gw.base_url}/metrics")).text
                t0 = time.monotonic()
                wait0 = gw.runqueue_wait_seconds()
                if args.py_spy and calls == max(levels(args)):
                    spy_s = min(args.py_spy, args.duration - 2)
                    await py_spy(gw, f"capacity-{calls}-w{args.workers}", spy_s, workdir)
                await runner
                t1 = time.monotonic()
                waited = gw.runqueue_wait_seconds() - wait0
                lag_after = (await http.get(f"{gw.base_url}/metrics")).text
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
    name = "ivr_event_loop_lag_seconds"
    lag = hist_stats(histogram(lag_before, name), histogram(lag_after, name))
    call_min = sum(
        live_calls((a + b) / 2, load.streams) * (b - a) / 60
        for (a, _), (b, _) in pairwise(s for s in cpu.samples if t0 <= s[0] <= t1)
    )
    busy = cpu.between(t0, t1)
    v2v = [d for end, d in load.turns if t0 <= end <= t1]
    return LevelResult(
        calls=calls,
        workers=args.workers,
        turns=len(v2v),
        missed=load.missed,
        v2v_p50_ms=round(1000 * pct(v2v, 0.5), 1),
        v2v_p95_ms=round(1000 * pct(v2v, 0.95), 1),
        v2v_max_ms=round(1000 * max(v2v, default=float("nan")), 1),
        listen_cpu_per_call_min=listen,
        talk_cpu_per_call_min=round(busy / call_min, 3) if call_min else float("nan"),
        cpu_percent=round(100 * busy / (t1 - t0), 1),
        runqueue_percent=round(100 * waited / (t1 - t0), 1),
        caller_lag_p95_ms=round(1000 * pct(load.tick_lag, 0.95), 1),
        loop_lag={k: round(v * 1000, 1) if k != "count" else v for k, v in lag.items()},
        calls_placed=len(load.streams),
        loadavg=os.getloadavg(),
        errors=load.errors[:5],
    )


async def listen_phase(args: argparse.Namespace, gw: GatewayProcess, calls: int) -> float:
    cpu = CpuSampler(gw)
    sampler = asyncio.create_task(cpu.run())
    load = ListenLoad(gw, calls, noise_payloads(args.noise_rms))
    warmup = 6.0 + calls * 0.03  # setup + greeting of every call: not listening
    try:
        runner = asyncio.create_task(load.run(args.listen + warmup))
        await asyncio.sleep(warmup)
        steady_t0 = time.monotonic()
        await runner
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return summarise_listen(args.vad, load, cpu, steady_t0, 0.0, 0).quiet_cpu_per_call_min


# -- output -------------------------------------------------------------------------------------


def print_table(results: list[LevelResult], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'calls':>5} {'turns':>5} {'v2v p50':>8} {'p95':>7} {'max':>7} {'d p50':>6} "
        f"{'d p95':>6} {'listen':>7} {'replies':>8} {'CPU %':>6} {'runq %':>6} {'lag mean':>8} "
        f"{'lag p95':>7} {'callers':>7}  {'load avg':>14}"
    )
    print(
        f"{'':5} {'':5} {'(ms)':>8} {'':7} {'':7} {'(vs 1 call)':>13} "
        f"{'(CPU-s/call-min)':>16} {'':13} {'(loop lag, ms)':>16} {'p95 ms':>7}"
    )
    for r in results:
        load = "/".join(f"{x:.1f}" for x in r.loadavg)
        print(
            f"{r.calls:5d} {r.turns:5d} {r.v2v_p50_ms:8.0f} {r.v2v_p95_ms:7.0f} "
            f"{r.v2v_max_ms:7.0f} {r.delta_p50_ms:+6.0f} {r.delta_p95_ms:+6.0f} "
            f"{r.listen_cpu_per_call_min:7.3f} {r.talk_cpu_per_call_min:8.3f} "
            f"{r.cpu_percent:6.1f} {r.runqueue_percent:6.1f} "
            f"{r.loop_lag.get('mean', float('nan')):8.1f} "
            f"{r.loop_lag.get('p95', float('nan')):7.1f} {r.caller_lag_p95_ms:7.1f}  {load:>14}"
        )
        if r.missed:
            print(f"{'':5} {r.missed} caller lines got no reply within {REPLY_WAIT_S:.0f} s")
        for e in r.errors:
            print(f"{'':5} error: {e}")


# -- main ---------------------------------------------------------------------------------------


def levels(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in args.levels.split(",") if n]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="1,10,50,100", help="concurrent calls, comma list")
    p.add_argument("--duration", type=float, default=45.0, help="talking window per level, s")
    p.add_argument("--ramp", type=float, default=10.0, help="callers' staggered start, s")
    p.add_argument("--listen", type=float, default=15.0, help="listening window per level, s")
    p.add_argument("--workers", type=int, default=1, help="ivr serve --workers N")
    p.add_argument("--gateway-cpus", default="0", help="taskset -c for the gateway")
    p.add_argument("--caller-cpus", default="1", help="CPUs of this bench and the providers")
    p.add_argument("--vad", default="silero")
    p.add_argument("--log-level", default="info", help="the gateway's (info: as in production)")
    p.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="the shared call store ('' = in-memory; --workers > 1 needs Redis)",
    )
    p.add_argument("--noise-rms", type=float, default=16.0, help="caller line noise (PCM16 rms)")
    p.add_argument("--stt-ms", type=int, default=150, help="fake STT response delay")
    p.add_argument("--llm-ms", type=int, default=140, help="fake LLM time to first token")
    p.add_argument("--tts-ms", type=int, default=120, help="fake TTS time to first byte")
    p.add_argument("--py-spy", type=float, default=0.0, help="profile N s at the top level")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    return p.parse_args(argv)


def cpu_set(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


async def main_async(args: argparse.Namespace) -> list[LevelResult]:
    os.sched_setaffinity(0, cpu_set(args.caller_cpus))
    start_load = os.getloadavg()
    results: list[LevelResult] = []
    delays = (args.stt_ms / 1000, args.llm_ms / 1000, args.tts_ms / 1000)
    with tempfile.TemporaryDirectory(prefix="ivr-capacity-") as tmp:
        workdir = Path(os.environ.get("IVR_BENCH_DIR", tmp))
        os.makedirs(workdir, exist_ok=True)
        with (
            providers_process(
                *delays, cpus=args.caller_cpus, log_path=workdir / "providers.log"
            ) as url,
            bench_flows(workdir) as flows,
        ):
            for calls in levels(args):
                try:
                    result = await run_level(args, calls, url, flows, workdir)
                finally:
                    if args.redis:
                        await delete_prefix(args.redis, redis_prefix(calls, args.workers))
                results.append(result)
                print(
                    f"  {calls} calls: p50 {result.v2v_p50_ms:.0f} ms, p95 "
                    f"{result.v2v_p95_ms:.0f} ms, {result.turns} turns",
                    file=sys.stderr,
                )
    base = next((r for r in results if r.calls == 1), None)
    for r in results:
        if base is not None:
            r.delta_p50_ms = round(r.v2v_p50_ms - base.v2v_p50_ms, 1)
            r.delta_p95_ms = round(r.v2v_p95_ms - base.v2v_p95_ms, 1)
    title = (
        f"Capacity: gateway on CPU {args.gateway_cpus}, {args.workers} worker(s), vad "
        f"{args.vad}; providers STT {args.stt_ms} / LLM {args.llm_ms} / TTS {args.tts_ms} ms; "
        f"2-turn calls. Bars: d p95 <= +50 ms at 100 calls, listen <= 0.3, replies <= 0.5"
    )
    print_table(results, title)
    print(f"\nload average: start {start_load}, end {os.getloadavg()} on {os.cpu_count()} CPUs")
    return results


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # so the gateway's process group is killed
    try:
        results = asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
