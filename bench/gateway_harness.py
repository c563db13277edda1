"""Pieces shared by the gateway benchmarks (gateway_load.py, capacity.py).

A real ``ivr serve`` process (optionally pinned to CPUs with ``taskset``, optionally several
workers), fake OpenAI-compatible providers with fixed delays, CPU sampling from /proc over the
gateway's whole process tree, lightweight Twilio-like callers that listen, py-spy, quantiles.
"""

from __future__ import annotations

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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
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
from ivr.testing.openai_server import FakeOpenAIServer, Fault, echo_script

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_URL = "https://gw.example.com"
AUTH_TOKEN = "bench-auth-token"
API_KEY = "sk-bench"
FRAME_S = 0.02
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TRANSCRIPT = "what are your opening hours"


# -- the gateway process ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """``ivr serve`` in its own process group; killed (group-wide) on exit.

    ``cpus`` pins it (and its workers) with ``taskset -c``; ``workers`` > 1 runs
    ``ivr serve --workers N``; ``env`` adds or overrides settings.
    """

    def __init__(
        self,
        provider_url: str,
        vad: str,
        log_level: str,
        log_path: Path,
        *,
        cpus: str | None = None,
        workers: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        extra_env = env
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
        env.update(extra_env or {})
        cmd = [str(ROOT / ".venv/bin/ivr"), "serve"]
        if workers > 1:
            cmd += ["--workers", str(workers)]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]  # taskset execs: the pid stays the gateway's
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
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

    def pids(self) -> list[int]:
        """The gateway and its live descendants (workers)."""
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return out

    def runqueue_wait_seconds(self) -> float:
        """Time the gateway's threads were runnable but waiting for a CPU (other processes on
        its core): latency under a busy machine comes from here, not from the gateway."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    total += int((task / "schedstat").read_text().split()[1])
        return total / 1e9

    def cpu_seconds(self) -> float:
        """utime + stime of the whole process tree (children reaped count via cutime/cstime)."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(f) for f in fields[11:15])
        return total / TICKS

    def rss_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB, summed over the process tree."""
        now = peak = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in status if ln.startswith("Vm")}
                now += kb.get("VmRSS", 0)
                peak += kb.get("VmHWM", 0)
        return now / 1024, peak / 1024

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
def gateway(
    provider_url: str, vad: str, log_level: str, workdir: Path, **options: Any
) -> Iterator[GatewayProcess]:
    """A ``GatewayProcess`` (``options``: its keyword arguments) stopped on the way out."""
    name = options.pop("name", f"gateway-{vad}-{log_level}")
    gw = GatewayProcess(provider_url, vad, log_level, workdir / f"{name}.log", **options)
    try:
        yield gw
    finally:
        gw.stop()


def fake_providers(
    stt_delay: float, llm_delay: float, tts_delay: float, port: int = 0
) -> FakeOpenAIServer:
    server = FakeOpenAIServer(api_key=API_KEY, port=port)
    server.transcribe = lambda wav, form: TRANSCRIPT
    if os.environ.get("IVR_BENCH_TRANSCRIPTS") == "by-length":
        server.transcribe = transcript_by_length
    server.chat = lambda request: replace(echo_script(request), first_token_delay=llm_delay)
    server.faults = {
        "transcriptions": Fault(delay=stt_delay),
        "speech": Fault(delay=tts_delay),
    }
    return server


def transcript_by_length(wav: bytes, form: dict[str, str]) -> str:
    """Words in proportion to the audio's length (one per 0.3 s): a transcription of the
    first half of a turn differs from the whole turn's, as a real STT's would, so speculation
    started on a pause the caller talks on after is really wasted."""
    seconds = max(0, len(wav) - 44) / 2 / 16000
    # Content words only: none leaves a clause open, so the end-of-turn rules stay neutral.
    content = ("opening", "hours", "saturday", "weekend", "booking", "table", "people", "dog")
    words = list(content) * 12
    return " ".join(words[: max(1, round(seconds / 0.3))])


@contextlib.contextmanager
def providers_process(
    stt_delay: float,
    llm_delay: float,
    tts_delay: float,
    cpus: str | None = None,
    log_path: Path | None = None,
) -> Iterator[str]:
    """``fake_providers`` in a process of its own (pinned to ``cpus``), so their work neither
    shares the GIL with the bench's callers nor lands on the gateway's CPU; yields the URL."""
    port = free_port()
    cmd = [sys.executable, __file__, "providers", str(port)]
    cmd += [str(stt_delay), str(llm_delay), str(tts_delay)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    log = open(os.devnull, "wb") if log_path is None else log_path.open("wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake providers did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(5)
        log.close()


def _serve_providers(port: int, stt: float, llm: float, tts: float) -> None:
    with fake_providers(stt, llm, tts, port):
        signal.sigwait({signal.SIGTERM})


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


def noise_payloads(rms: float, seconds: float = 2.0, seed: int = 7) -> list[str]:
    """Base64 mu-law frames of faint Gaussian line noise (rms in PCM16 units; 16 ~ -66 dBFS)."""
    rng = np.random.default_rng(seed)
    pcm = rng.normal(0, rms, int(8000 * seconds)).clip(-32768, 32767).astype("<i2")
    ulaw = pcm16_to_ulaw(pcm.tobytes())
    return [base64.b64encode(ulaw[i : i + 160]).decode() for i in range(0, len(ulaw), 160)]


def inbound_media_json(sid: str, seq: int, chunk: int, payload: str) -> str:
    """Twilio's media message for the caller's ``chunk``-th 20 ms (``payload``: base64 mu-law)."""
    return (
        f'{{"event":"media","sequenceNumber":"{seq}","media":{{"track":"inbound",'
        f'"chunk":"{chunk}","timestamp":"{chunk * 20}","payload":"{payload}"}},'
        f'"streamSid":"{sid}"}}'
    )


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
    slot: int = 0
    """Which of the ticker's ``phase_slots`` of each 20 ms its frames go out in."""

    def media_json(self, payload: str) -> str:
        self.seq += 1
        self.chunk += 1
        return inbound_media_json(self.sid, self.seq, self.chunk, payload)

    def next_payload(self, line_noise: str, now: float) -> str:
        """What the caller's microphone picks up in this 20 ms (a talking caller speaks)."""
        return line_noise

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
        self.tick_lag: list[float] = []
        """How late each tick of the callers ran (the bench's own loop health)."""
        self.phase_slots = 1
        """Each 20 ms is cut into this many slots, and each stream sends its frame in its own
        slot (streams take them in turn): real Twilio streams each keep their own clock, so
        frames of different calls arrive spread over the 20 ms. 1: every stream's frame at
        once, in one burst (the issue's harness)."""

    async def run(self, duration: float) -> None:
        self.stop_at = time.monotonic() + duration
        async with httpx.AsyncClient(timeout=10.0) as http:
            ticker = asyncio.create_task(self._ticker())
            try:
                await asyncio.gather(*(self._caller(http, i) for i in range(self.calls)))
            finally:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)

    def start_delay(self, index: int) -> float:
        """When caller ``index`` first dials, seconds after the start (subclasses stagger)."""
        return 0.0

    def new_stream(self, ws: ClientConnection, sid: str, t0: float) -> Stream:
        return Stream(ws, sid, t0, time.monotonic())

    async def converse(self, stream: Stream) -> bool:
        """The call's life on its stream; True when the caller hung up (no action request)."""
        await self._receive(stream)
        return False

    async def _caller(self, http: httpx.AsyncClient, index: int) -> None:
        await asyncio.sleep(self.start_delay(index))
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
            stream = self.new_stream(ws, sid, t0)
            stream.slot = len(self.streams) % max(1, self.phase_slots)
            self.streams.append(stream)
            self.active.add(stream)
            try:
                hung_up = await self.converse(stream)
            finally:
                self.active.discard(stream)
                stream.closed_t = time.monotonic()
            if ws.state.name == "OPEN":
                stop = {"accountSid": "AC1", "callSid": call_sid}
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(json.dumps({"event": "stop", "streamSid": sid, "stop": stop}))
        if not hung_up and time.monotonic() < self.stop_at:
            # The gateway hung up: Twilio fetches the action URL.
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
        if "wss://gw.example.com" not in resp.text:  # the overflow: overloaded, full, draining
            raise RuntimeError(f"call refused by the gateway: {resp.text[-160:]}")
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
        """Every 20 ms: one media frame per live stream, plus marks whose audio has played
        (the streams spread over ``phase_slots`` of the 20 ms)."""
        origin = time.monotonic()
        slots = max(1, self.phase_slots)
        step = FRAME_S / slots
        tick = 0
        while True:
            tick += 1
            delay = origin + tick * step - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            self.tick_lag.append(now - (origin + tick * step))
            frame, slot = divmod(tick, slots)
            payload = self.payloads[frame % len(self.payloads)]
            for stream in list(self.active):
                if stream.slot != slot:
                    continue
                with contextlib.suppress(ConnectionClosed):
                    while stream.marks and stream.marks[0][0] <= now:
                        await stream.ws.send(stream.mark_json(stream.marks.pop(0)[1]))
                    await stream.ws.send(stream.media_json(stream.next_payload(payload, now)))


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


async def py_spy(
    gw: GatewayProcess, vad: str, seconds: float, workdir: Path, *, rate: int = 100
) -> None:
    """Sample the gateway's stacks; write collapsed stacks and print the top self-time frames.
    (A "Runner.run" self share is time py-spy found in no Python frame: the loop's own C, and
    samples it could not unwind; `perf record -g -p PID` tells those apart.)"""
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
        str(rate),
        "--nonblocking",
        "--subprocesses",  # ivr serve --workers N: the workers are the master's children
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
        if not stack or not count_s.isdigit():  # a thread py-spy could not name, cut short
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


# -- quantiles, /metrics histograms ---------------------------------------------------------


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


if __name__ == "__main__":  # providers_process runs this
    if sys.argv[1:2] == ["providers"]:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _serve_providers(int(sys.argv[2]), *(float(a) for a in sys.argv[3:6]))
