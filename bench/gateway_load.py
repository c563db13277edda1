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
import base64
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from twilio.request_validator import RequestValidator
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from ivr.audio.codec import pcm16_to_ulaw
from ivr.sim.caller import place_call
from ivr.testing.openai_server import FakeOpenAIServer, Fault, echo_script

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_URL = "https://gw.example.com"
AUTH_TOKEN = "bench-auth-token"
API_KEY = "sk-bench"
FRAME_S = 0.02
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TRANSCRIPT = "what are your opening hours"
# No commas: a comma pause can exceed the 300 ms endpoint silence and split a line in two.
LINES = ["What are your opening hours?", "Do you have parking nearby?", "Thank you that is all."]


# -- the gateway process ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """``ivr serve`` in its own process group; killed (group-wide) on exit."""

    def __init__(self, provider_url: str, vad: str, log_level: str, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ)
        env.update(
            IVR_PUBLIC_URL=PUBLIC_URL,
            TWILIO_AUTH_TOKEN=AUTH_TOKEN,
            IVR_STT_PROVIDER="openai",
            IVR_STT_BASE_URL=provider_url,
            IVR_STT_API_KEY=API_KEY,
            IVR_TTS_PROVIDER="openai",
            IVR_TTS_BASE_URL=provider_url,
            IVR_TTS_API_KEY=API_KEY,
            IVR_LLM_PROVIDER="openai",
            IVR_LLM_BASE_URL=provider_url,
            IVR_LLM_API_KEY=API_KEY,
            IVR_LLM_MODEL="gemma-4-31b",
            IVR_PORT=str(self.port),
            IVR_HOST="127.0.0.1",
            IVR_LOG_LEVEL=log_level,
            IVR_LOG_FORMAT="json",
            IVR_VAD=vad,
            IVR_REDIS_URL="",
        )
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(ROOT / ".venv/bin/ivr"), "serve"],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so we can kill all of it
        )
        self.pid = self.proc.pid

    async def wait_ready(self, limit_s: float = 60.0) -> None:
        deadline = time.monotonic() + limit_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited ({self.proc.returncode}): {self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.base_url}/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"gateway not ready after {limit_s} s: {self.tail()}")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    def rss_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB."""
        status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in status if ln.startswith("Vm")}
        return kb.get("VmRSS", 0) / 1024, kb.get("VmHWM", 0) / 1024

    def tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def gateway(provider_url: str, vad: str, log_level: str, workdir: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(provider_url, vad, log_level, workdir / f"gateway-{vad}-{log_level}.log")
    try:
        yield gw
    finally:
        gw.stop()


def fake_providers(stt_delay: float, llm_delay: float, tts_delay: float) -> FakeOpenAIServer:
    server = FakeOpenAIServer(api_key=API_KEY)
    server.transcribe = lambda wav, form: TRANSCRIPT
    server.chat = lambda request: replace(echo_script(request), first_token_delay=llm_delay)
    server.faults = {
        "transcriptions": Fault(delay=stt_delay),
        "speech": Fault(delay=tts_delay),
    }
    return server


# -- CPU sampling -----------------------------------------------------------------------------


@dataclass(slots=True)
class CpuSampler:
    """Gateway CPU every ``period`` seconds, as (monotonic time, cumulative CPU seconds)."""

    gw: GatewayProcess
    period: float = 0.1
    samples: list[tuple[float, float]] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.gw.cpu_seconds()))
            await asyncio.sleep(self.period)

    def between(self, t0: float, t1: float) -> float:
        inside = [c for t, c in self.samples if t0 <= t <= t1]
        return inside[-1] - inside[0] if len(inside) >= 2 else 0.0


# -- phase 1: lightweight listening callers ---------------------------------------------------


def noise_payloads(rms: float, seconds: float = 2.0) -> list[str]:
    """Base64 mu-law frames of faint Gaussian line noise (rms in PCM16 units; 16 ~ -66 dBFS)."""
    rng = np.random.default_rng(7)
    pcm = rng.normal(0, rms, int(8000 * seconds)).clip(-32768, 32767).astype("<i2")
    ulaw = pcm16_to_ulaw(pcm.tobytes())
    return [base64.b64encode(ulaw[i : i + 160]).decode() for i in range(0, len(ulaw), 160)]


@dataclass(slots=True, eq=False)
class Stream:
    """One media stream of a lightweight caller, and what the bench saw on it."""

    ws: ClientConnection
    sid: str
    setup_t0: float
    setup_t1: float
    seq: int = 2
    chunk: int = 0
    play_end: float = 0.0
    marks: list[tuple[float, str]] = field(default_factory=list)
    bursts: list[list[float]] = field(default_factory=list)
    closed_t: float | None = None
    media_in: int = 0

    def media_json(self, payload: str) -> str:
        self.seq += 1
        self.chunk += 1
        return (
            f'{{"event":"media","sequenceNumber":"{self.seq}","media":{{"track":"inbound",'
            f'"chunk":"{self.chunk}","timestamp":"{self.chunk * 20}","payload":"{payload}"}},'
            f'"streamSid":"{self.sid}"}}'
        )

    def mark_json(self, name: str) -> str:
        self.seq += 1
        return (
            f'{{"event":"mark","sequenceNumber":"{self.seq}","streamSid":"{self.sid}",'
            f'"mark":{{"name":"{name}"}}}}'
        )

    def on_message(self, raw: str | bytes, now: float) -> None:
        msg = json.loads(raw)
        event = msg.get("event")
        if event == "media":
            self.media_in += 1
            # Twilio's playout clock: audio plays back to back, starting no earlier than now.
            self.play_end = max(now, self.play_end) + len(msg["media"]["payload"]) * 3 / 4 / 8000
            if self.bursts and now - self.bursts[-1][1] < 0.5:
                self.bursts[-1][1] = now
            else:
                self.bursts.append([now, now])
        elif event == "mark":
            self.marks.append((max(now, self.play_end), msg["mark"]["name"]))
        elif event == "clear":  # Twilio echoes every pending mark at once
            self.play_end = now
            self.marks = [(now, name) for _, name in self.marks]


class ListenLoad:
    """N callers, each redialling when the gateway hangs up, until the deadline."""

    def __init__(self, gw: GatewayProcess, calls: int, payloads: list[str]) -> None:
        self.gw = gw
        self.calls = calls
        self.payloads = payloads
        self.validator = RequestValidator(AUTH_TOKEN)
        self.active: set[Stream] = set()
        self.streams: list[Stream] = []
        self.errors: list[str] = []
        self.stop_at = 0.0

    async def run(self, duration: float) -> None:
        self.stop_at = time.monotonic() + duration
        async with httpx.AsyncClient(timeout=10.0) as http:
            ticker = asyncio.create_task(self._ticker())
            try:
                await asyncio.gather(*(self._caller(http, i) for i in range(self.calls)))
            finally:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)

    async def _caller(self, http: httpx.AsyncClient, index: int) -> None:
        n = 0
        while time.monotonic() < self.stop_at - 1.0:
            n += 1
            try:
                await self._one_call(http, f"CA{index:04d}{n:04d}{os.urandom(11).hex()}")
            except Exception as exc:  # a failed call is reported, not fatal
                self.errors.append(f"caller {index}: {exc!r}")
                await asyncio.sleep(1.0)

    async def _one_call(self, http: httpx.AsyncClient, call_sid: str) -> None:
        t0 = time.monotonic()
        path = await self._webhook(http, call_sid)
        signature = self.validator.compute_signature(f"wss://gw.example.com{path}", {})
        ws_url = self.gw.base_url.replace("http://", "ws://") + path
        headers = {"X-Twilio-Signature": signature}
        # Twilio does not negotiate permessage-deflate; websockets would by default.
        async with connect(ws_url, additional_headers=headers, compression=None) as ws:
            sid = "MZ" + os.urandom(16).hex()
            await ws.send(
                json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            )
            await ws.send(json.dumps(start_message(call_sid, sid)))
            stream = Stream(ws, sid, t0, time.monotonic())
            self.streams.append(stream)
            self.active.add(stream)
            try:
                await self._receive(stream)
            finally:
                self.active.discard(stream)
                stream.closed_t = time.monotonic()
            if ws.state.name == "OPEN":
                stop = {"accountSid": "AC1", "callSid": call_sid}
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(json.dumps({"event": "stop", "streamSid": sid, "stop": stop}))
        if time.monotonic() < self.stop_at:  # the gateway hung up: Twilio fetches the action
            await self._after_stream(http, call_sid)

    async def _receive(self, stream: Stream) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                timeout = self.stop_at - time.monotonic()
                if timeout <= 0:
                    return
                try:
                    raw = await asyncio.wait_for(stream.ws.recv(), timeout)
                except TimeoutError:
                    return
                stream.on_message(raw, time.monotonic())

    async def _webhook(self, http: httpx.AsyncClient, call_sid: str) -> str:
        params = {"CallSid": call_sid, "AccountSid": "AC1", "From": "+15550001111", "To": "+1555"}
        sig = self.validator.compute_signature(f"{PUBLIC_URL}/twilio/voice", params)
        resp = await http.post(
            f"{self.gw.base_url}/twilio/voice", data=params, headers={"X-Twilio-Signature": sig}
        )
        resp.raise_for_status()
        start = resp.text.index("wss://gw.example.com") + len("wss://gw.example.com")
        return resp.text[start : resp.text.index('"', start)]

    async def _after_stream(self, http: httpx.AsyncClient, call_sid: str) -> None:
        params = {"CallSid": call_sid, "AccountSid": "AC1", "CallStatus": "in-progress"}
        sig = self.validator.compute_signature(f"{PUBLIC_URL}/twilio/after-stream", params)
        await http.post(
            f"{self.gw.base_url}/twilio/after-stream",
            data=params,
            headers={"X-Twilio-Signature": sig},
        )

    async def _ticker(self) -> None:
        """Every 20 ms: one media frame per live stream, plus marks whose audio has played."""
        origin = time.monotonic()
        tick = 0
        while True:
            tick += 1
            delay = origin + tick * FRAME_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            payload = self.payloads[tick % len(self.payloads)]
            for stream in list(self.active):
                with contextlib.suppress(ConnectionClosed):
                    while stream.marks and stream.marks[0][0] <= now:
                        await stream.ws.send(stream.mark_json(stream.marks.pop(0)[1]))
                    await stream.ws.send(stream.media_json(payload))


def start_message(call_sid: str, sid: str) -> dict[str, Any]:
    fmt = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
    start = {
        "accountSid": "AC1",
        "streamSid": sid,
        "callSid": call_sid,
        "tracks": ["inbound"],
        "customParameters": {},
        "mediaFormat": fmt,
    }
    return {"event": "start", "sequenceNumber": "1", "start": start, "streamSid": sid}


def busy_intervals(streams: list[Stream]) -> list[tuple[float, float]]:
    """When any call was being set up or torn down, or the bot was speaking (TTS fetch included)."""
    spans: list[tuple[float, float]] = []
    for s in streams:
        spans.append((s.setup_t0 - 0.05, s.setup_t1 + 0.3))
        spans += [(b0 - 0.5, b1 + 0.3) for b0, b1 in s.bursts]
        if s.closed_t is not None:
            spans.append((s.closed_t - 0.3, s.closed_t + 0.5))
    return sorted(spans)


def overlaps(t0: float, t1: float, spans: list[tuple[float, float]]) -> bool:
    return any(a < t1 and b > t0 for a, b in spans)


def live_calls(t: float, streams: list[Stream]) -> int:
    return sum(1 for s in streams if s.setup_t1 <= t and (s.closed_t is None or t < s.closed_t))


@dataclass(slots=True)
class ListenResult:
    vad: str
    calls: int
    duration_s: float
    quiet_call_minutes: float
    quiet_cpu_s: float
    quiet_cpu_per_call_min: float
    steady_call_minutes: float
    steady_cpu_s: float
    steady_cpu_per_call_min: float
    calls_placed: int
    reprompts: int
    rss_mb: float
    peak_rss_mb: float
    idle_rss_mb: float
    stt_requests: int
    """Utterances the gateway heard in the line noise (should be 0: otherwise not listening)."""
    errors: list[str]


def summarise_listen(
    vad: str,
    load: ListenLoad,
    cpu: CpuSampler,
    steady_t0: float,
    idle_rss: float,
    stt_requests: int,
) -> ListenResult:
    spans = busy_intervals(load.streams)
    quiet_cpu = quiet_min = steady_cpu = steady_min = 0.0
    samples = [s for s in cpu.samples if steady_t0 <= s[0] <= load.stop_at]
    for (t0, c0), (t1, c1) in pairwise(samples):
        calls_min = live_calls((t0 + t1) / 2, load.streams) * (t1 - t0) / 60
        steady_cpu += c1 - c0
        steady_min += calls_min
        if not overlaps(t0, t1, spans):
            quiet_cpu += c1 - c0
            quiet_min += calls_min
    bursts = sum(len(s.bursts) for s in load.streams)
    rss, peak = load.gw.rss_mb()
    return ListenResult(
        vad=vad,
        calls=load.calls,
        duration_s=round(load.stop_at - steady_t0, 1),
        quiet_call_minutes=round(quiet_min, 2),
        quiet_cpu_s=round(quiet_cpu, 2),
        quiet_cpu_per_call_min=round(quiet_cpu / quiet_min, 3) if quiet_min else float("nan"),
        steady_call_minutes=round(steady_min, 2),
        steady_cpu_s=round(steady_cpu, 2),
        steady_cpu_per_call_min=round(steady_cpu / steady_min, 3) if steady_min else float("nan"),
        calls_placed=len(load.streams),
        reprompts=bursts - len(load.streams),
        rss_mb=round(rss, 1),
        peak_rss_mb=round(peak, 1),
        idle_rss_mb=round(idle_rss, 1),
        stt_requests=stt_requests,
        errors=load.errors[:5],
    )


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


async def py_spy(gw: GatewayProcess, vad: str, seconds: float, workdir: Path) -> None:
    """Sample the gateway's stacks; write collapsed stacks and print the top self-time frames."""
    out = workdir / f"py-spy-{vad}.txt"
    cmd = [
        str(ROOT / ".venv/bin/py-spy"),
        "record",
        "--pid",
        str(gw.pid),
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--rate",
        "100",
        "--nonblocking",
        "-o",
        str(out),
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    await proc.wait()
    if out.exists():
        print(f"\npy-spy ({vad}): {out}", file=sys.stderr)
        print(top_frames(out.read_text()), file=sys.stderr)


def top_frames(collapsed: str, n: int = 25) -> str:
    """Self and inclusive sample shares per frame, from py-spy's collapsed ('raw') stacks."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        total += count
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            incl[frame] = incl.get(frame, 0) + count
    rows = [f"{'self%':>6} {'incl%':>6}  frame   ({total} samples)"]
    for frame, count in sorted(own.items(), key=lambda kv: -kv[1])[:n]:
        rows.append(f"{100 * count / total:6.1f} {100 * incl[frame] / total:6.1f}  {frame[:110]}")
    return "\n".join(rows)


# -- phase 2: turns ---------------------------------------------------------------------------


def histogram(text: str, name: str) -> dict[str, float]:
    """Cumulative bucket counts (by upper bound), _sum and _count of an unlabelled histogram."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name.removesuffix("_seconds") and family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out[sample.labels["le"]] = out.get(sample.labels["le"], 0.0) + sample.value
            elif sample.name.endswith(("_sum", "_count")):
                key = sample.name.rsplit("_", 1)[1]
                out[key] = out.get(key, 0.0) + sample.value
    return out


def hist_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean, and p50/p95 interpolated within buckets, of the observations between two scrapes."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    count = delta.get("count", 0.0)
    if not count:
        return {"count": 0}
    bounds = sorted((float(k), v) for k, v in delta.items() if k not in ("sum", "count"))
    return {
        "count": count,
        "mean": delta["sum"] / count,
        "p50": bucket_quantile(bounds, 0.5),
        "p95": bucket_quantile(bounds, 0.95),
    }


def bucket_quantile(bounds: list[tuple[float, float]], q: float) -> float:
    total = bounds[-1][1]
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for bound, cum in bounds:
        if cum >= rank:
            if bound == float("inf"):
                return lo_bound
            frac = (rank - lo_count) / (cum - lo_count) if cum > lo_count else 0.0
            return lo_bound + (bound - lo_bound) * frac
        lo_bound, lo_count = bound, cum
    return lo_bound


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "p50": pct(values, 0.5),
        "p95": pct(values, 0.95),
        "max": max(values),
    }


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
