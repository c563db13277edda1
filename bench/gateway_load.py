"""Gateway load benchmark: CPU per call-minute while listening, and what the gateway adds to a turn.

The gateway runs as its own process (``ivr serve``) so its CPU (utime+stime from /proc) is not
mixed with the callers'. Providers are ``FakeOpenAIServer`` in a thread of this process, with
fixed delays standing in for real STT / LLM / TTS.

Phase 1 (per VAD): N lightweight callers (raw websockets, one shared 20 ms ticker) send faint
line noise for D seconds and echo marks when the audio before them would have played. The
stock conversation re-prompts after 8 s of silence and hangs up after two, so callers redial;
CPU is reported both for "quiet" intervals (no call in setup or hearing bot audio: pure
listening) and for the whole steady window (listening + re-prompts + redials).

Phase 2: a few ``place_call`` callers speak three lines each. Per-turn breakdowns come from the
gateway's ``turn.latency`` log lines and its /metrics histograms; caller-side latency (end of
caller speech -> first bot audio played) from ``place_call``'s report.

    .venv/bin/python bench/gateway_load.py         # defaults: 20 calls x 60 s, 3 turn calls
    .venv/bin/python bench/gateway_load.py --calls 5 --duration 20 --vad webrtc --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import (
    AUTH_TOKEN,
    PUBLIC_URL,
    CpuSampler,
    ListenLoad,
    ListenResult,
    fake_providers,
    gateway,
    hist_stats,
    histogram,
    noise_payloads,
    py_spy,
    stats,
    summarise_listen,
)

from ivr.sim.caller import place_call
from ivr.testing.openai_server import FakeOpenAIServer

# No commas: a comma pause can exceed the 300 ms endpoint silence and split a line in two.
LINES = ["What are your opening hours?", "Do you have parking nearby?", "Thank you that is all."]


# -- phase 1: listening ------------------------------------------------------------------------


async def run_listen(
    args: argparse.Namespace, providers: FakeOpenAIServer, vad: str, workdir: Path
) -> ListenResult:
    with gateway(providers.base_url, vad, "warning", workdir) as gw:
        await gw.wait_ready()
        heard_before = len(providers.requests_for("transcriptions"))
        idle_rss = gw.rss_mb()[0]
        cpu = CpuSampler(gw)
        sampler = asyncio.create_task(cpu.run())
        load = ListenLoad(gw, args.calls, noise_payloads(args.noise_rms))
        try:
            runner = asyncio.create_task(load.run(args.duration + args.warmup))
            await asyncio.sleep(args.warmup)  # setup + greeting: excluded from "steady"
            steady_t0 = time.monotonic()
            if args.py_spy:
                await py_spy(gw, vad, min(args.py_spy, args.duration - 1), workdir)
            await runner
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        heard = len(providers.requests_for("transcriptions")) - heard_before
        return summarise_listen(vad, load, cpu, steady_t0, idle_rss, heard)


# -- phase 2: turns ---------------------------------------------------------------------------


def turn_log_lines(log: str) -> list[dict[str, float]]:
    """The gateway's ``turn.latency`` lines; ``first`` is 1.0 on each call's first turn."""
    turns = []
    seen: set[str] = set()
    for line in log.splitlines():
        if '"turn.latency"' not in line:
            continue
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            turn = {k: float(v) for k, v in rec.items() if isinstance(v, int | float)}
            turn["first"] = float(rec.get("call_sid") not in seen)
            seen.add(rec.get("call_sid"))
            turns.append(turn)
    return turns


@dataclass(slots=True)
class TurnResult:
    calls: int
    delays_ms: dict[str, int]
    turns: int
    gateway_total: dict[str, float]
    """ivr_turn_latency_seconds (from the turn.latency log lines: exact quantiles)."""
    gateway_overhead: dict[str, float]
    gateway_overhead_later_turns: dict[str, float]
    """Without each call's first turn (cold code paths, lazy imports in the process)."""
    breakdown_mean_ms: dict[str, float]
    metrics_turn_latency: dict[str, float]
    metrics_gateway_overhead: dict[str, float]
    caller_latency: dict[str, float]
    caller_excess: dict[str, float]
    """Caller-side latency minus endpoint silence and the configured provider delays."""
    cpu_per_call_min: float
    call_minutes: float
    rss_mb: float
    errors: list[str] = field(default_factory=list)


async def run_turns(args: argparse.Namespace, provider_url: str, workdir: Path) -> TurnResult:
    delays = {"stt": args.stt_ms, "llm_ttft": args.llm_ms, "tts_ttfb": args.tts_ms}
    with gateway(provider_url, args.turn_vad, "info", workdir) as gw:
        await gw.wait_ready()
        async with httpx.AsyncClient(timeout=10.0) as http:
            before = (await http.get(f"{gw.base_url}/metrics")).text
            cpu0, t0 = gw.cpu_seconds(), time.monotonic()
            calls = [
                place_call(
                    gw.base_url, script=LINES, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
                )
                for _ in range(args.turn_calls)
            ]
            if args.py_spy:  # the calls last ~20 s; profile the middle of them
                spy = py_spy(gw, f"turns-{args.turn_vad}", min(args.py_spy, 15), workdir)
                calls.append(spy)  # type: ignore[arg-type]
            reports = (await asyncio.gather(*calls))[: args.turn_calls]
            cpu = gw.cpu_seconds() - cpu0
            elapsed = time.monotonic() - t0
            after = (await http.get(f"{gw.base_url}/metrics")).text
        rss = gw.rss_mb()[0]
        await asyncio.sleep(0.3)  # let the last log lines land
        logged = turn_log_lines(gw.tail(10**7))
    return summarise_turns(args, delays, reports, logged, before, after, cpu, elapsed, rss)


def summarise_turns(
    args: argparse.Namespace,
    delays: dict[str, int],
    reports: list[Any],
    logged: list[dict[str, float]],
    before: str,
    after: str,
    cpu: float,
    elapsed: float,
    rss: float,
) -> TurnResult:
    caller = [
        t.latency_s for r in reports for t in r.turns if t.caller_text and t.latency_s is not None
    ]
    fixed = (args.endpoint_ms + sum(delays.values())) / 1000
    keys = (
        "endpoint_silence",
        "stt",
        "llm_ttft",
        "llm_first_clause",
        "tts_ttfb",
        "gateway",
        "total",
    )
    breakdown = {
        k: round(1000 * statistics.fmean([t[k] for t in logged if k in t]), 1)
        for k in keys
        if any(k in t for t in logged)
    }
    call_minutes = sum(r.duration_s for r in reports) / 60
    errors = [e for r in reports for e in r.errors] + [
        f"{v.code}: {v.reason}" for r in reports for v in r.violations
    ]
    name_t, name_o = "ivr_turn_latency_seconds", "ivr_gateway_overhead_seconds"
    return TurnResult(
        calls=len(reports),
        delays_ms=delays | {"endpoint_silence": args.endpoint_ms},
        turns=len(logged),
        gateway_total=stats([t["total"] for t in logged if "total" in t]),
        gateway_overhead=stats([t["gateway"] for t in logged if "gateway" in t]),
        gateway_overhead_later_turns=stats(
            [t["gateway"] for t in logged if "gateway" in t and not t["first"]]
        ),
        breakdown_mean_ms=breakdown,
        metrics_turn_latency=hist_stats(histogram(before, name_t), histogram(after, name_t)),
        metrics_gateway_overhead=hist_stats(histogram(before, name_o), histogram(after, name_o)),
        caller_latency=stats(caller),
        caller_excess=stats([c - fixed for c in caller]),
        cpu_per_call_min=round(cpu / call_minutes, 3) if call_minutes else float("nan"),
        call_minutes=round(call_minutes, 2),
        rss_mb=round(rss, 1),
        errors=errors[:5],
    )


# -- output -----------------------------------------------------------------------------------


def ms(d: dict[str, float], key: str) -> str:
    v = d.get(key)
    return "   -" if v is None else f"{1000 * v:6.1f}"


def print_listen(results: list[ListenResult]) -> None:
    print("\nListening (gateway process only; bar <= 0.5 CPU-s per call-minute)")
    print(
        f"{'vad':8} {'calls':>5} {'quiet CPU-s/call-min':>21} {'steady CPU-s/call-min':>22} "
        f"{'RSS MiB (idle/now/peak)':>24} {'placed':>6} {'reprompts':>9} {'STT':>4}"
    )
    for r in results:
        rss = f"{r.idle_rss_mb:.0f}/{r.rss_mb:.0f}/{r.peak_rss_mb:.0f}"
        print(
            f"{r.vad:8} {r.calls:5d} {r.quiet_cpu_per_call_min:21.3f} "
            f"{r.steady_cpu_per_call_min:22.3f} {rss:>24} {r.calls_placed:6d} {r.reprompts:9d} "
            f"{r.stt_requests:4d}"
        )
        print(
            f"{'':8} quiet {r.quiet_cpu_s:.1f} CPU-s over {r.quiet_call_minutes:.1f} call-min; "
            f"steady {r.steady_cpu_s:.1f} CPU-s over {r.steady_call_minutes:.1f} call-min "
            f"({r.duration_s:.0f} s window)"
        )
        for e in r.errors:
            print(f"{'':8} error: {e}")


def print_turns(r: TurnResult) -> None:
    print(f"\nTurns ({r.calls} calls, {r.turns} turns; provider delays ms {r.delays_ms})")
    print(f"{'':34} {'mean':>6} {'p50':>6} {'p95':>6} {'max':>6}  (ms)")
    rows = [
        ("gateway turn latency (log)", r.gateway_total),
        ("gateway overhead (log)  bar<=20", r.gateway_overhead),
        ("  same, 2nd+ turn of each call", r.gateway_overhead_later_turns),
        ("caller latency (place_call)", r.caller_latency),
        ("caller latency - silence - delays", r.caller_excess),
    ]
    for label, d in rows:
        print(f"{label:34} {ms(d, 'mean')} {ms(d, 'p50')} {ms(d, 'p95')} {ms(d, 'max')}")
    for label, d in (
        ("/metrics ivr_turn_latency_seconds", r.metrics_turn_latency),
        ("/metrics ivr_gateway_overhead_s", r.metrics_gateway_overhead),
    ):
        print(f"{label:34} {ms(d, 'mean')} {ms(d, 'p50')} {ms(d, 'p95')}   (bucket-interpolated)")
    print("mean breakdown (ms): " + ", ".join(f"{k} {v}" for k, v in r.breakdown_mean_ms.items()))
    print(
        f"CPU with replies: {r.cpu_per_call_min:.3f} CPU-s per call-minute "
        f"({r.call_minutes:.2f} call-min), RSS {r.rss_mb:.0f} MiB"
    )
    for e in r.errors:
        print(f"  error: {e}")


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=20, help="concurrent listening callers")
    p.add_argument("--duration", type=float, default=60.0, help="steady listening window, s")
    p.add_argument("--warmup", type=float, default=4.0, help="setup + greeting excluded, s")
    p.add_argument("--vad", default="silero,webrtc", help="comma list; empty skips phase 1")
    p.add_argument("--noise-rms", type=float, default=16.0, help="caller line noise (PCM16 rms)")
    p.add_argument("--turn-calls", type=int, default=3, help="0 skips phase 2")
    p.add_argument("--turn-vad", default="silero")
    p.add_argument("--stt-ms", type=int, default=150, help="fake STT response delay")
    p.add_argument("--llm-ms", type=int, default=200, help="fake LLM time to first token")
    p.add_argument("--tts-ms", type=int, default=100, help="fake TTS time to first byte")
    p.add_argument("--endpoint-ms", type=int, default=300, help="the gateway's endpoint silence")
    p.add_argument("--py-spy", type=float, default=0.0, help="profile N s of each listen phase")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    vads = [v for v in args.vad.split(",") if v]
    out: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="ivr-bench-") as tmp:
        workdir = Path(os.environ.get("IVR_BENCH_DIR", tmp))
        os.makedirs(workdir, exist_ok=True)
        providers = fake_providers(args.stt_ms / 1000, args.llm_ms / 1000, args.tts_ms / 1000)
        with providers:
            listen = [await run_listen(args, providers, v, workdir) for v in vads]
            if listen:
                print_listen(listen)
            turns = await run_turns(args, providers.base_url, workdir) if args.turn_calls else None
            if turns is not None:
                print_turns(turns)
    out |= {"listen": [asdict(r) for r in listen], "turns": turns and asdict(turns)}
    out["loadavg_end"] = os.getloadavg()
    print(
        f"\nload average: start {out['loadavg_start']}, end {out['loadavg_end']} "
        f"on {os.cpu_count()} CPUs"
    )
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> KeyboardInterrupt, so the gateway's process group is killed on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        out = asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
