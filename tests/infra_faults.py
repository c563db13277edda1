"""Infrastructure faults on real calls (issue 8's fault suite, the Redis and instance part).

One stack for every case: a private redis-server behind a TCP proxy in this process (so Redis
can be paused, black-holed or killed), two ``ivr serve`` processes on it behind a real HAProxy
running deploy/haproxy/haproxy.cfg, fake providers (``FakeOpenAIServer``: the echo agent, a
fast speech-like voice), and a payments backend that pays once per idempotency key (the idea of
tests/test_flows_idempotency.py). Simulated Twilio calls (``place_call``) go through HAProxy.

Each case is one faulted call of the default flow (three caller lines: a question, another,
goodbye) and, where it makes sense, calls placed during the fault (one of them pays through
flows/payments.yaml). The case measures what the caller heard on the faulted turn (from the
recording), the longest dead air, whether the call reached its next turn and its end, how many
calls were dropped, how many payments the backend made, and whether the records in Redis are
complete once the fault is over.

Redis "killed" is the real redis-server SIGKILLed; behind the proxy the gateways then see their
connections closed (and new ones accepted and closed at once) rather than refused.

The cases run one after another on the one stack, in ``CASES`` order: the destructive ones
restart what they broke (Redis, an instance) before the next case. Shared by
``bench/faults.py --infra`` (a table) and ``tests/test_infra_faults.py`` (the targets).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import secrets
import signal
import threading
import time
import uuid
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import websockets
from fault_calls import Burst, caller_turns, caller_voice
from gateway_procs import (
    AGENT_NUMBER,
    API_KEY,
    AUTH_TOKEN,
    PUBLIC_URL,
    GatewayProcess,
    GatewayProcesses,
    agent_replies,
    bot_bursts,
    fast_speak,
    free_port,
    gateway_env,
    speech_seconds,
)
from lb import LoadBalancer
from ops_stack import Child, start_haproxy
from redis_server import RedisServer
from twilio.request_validator import RequestValidator
from websockets.exceptions import InvalidStatus

from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_data
from ivr.sim.webhook import CallFailed, CallIds, TwilioSide, parse_stream, rebase
from ivr.state.base import CallRecord, CallStatus
from ivr.state.redis_store import RedisCallStore
from ivr.testing.openai_server import FakeOpenAIServer

QUESTION = "What are your opening hours on weekdays?"
GOODBYE_LINE = "Goodbye."
REPLY = "You said: what are your opening hours."
RESUME_PROMPT = "Sorry, we were cut off for a moment."  # flows/default.yaml
"""The echo agent's answer to QUESTION (the fake STT tells the lines apart by length)."""
PAYMENTS_NUMBER = "+15550100004"  # flows/payments.yaml
ACCOUNT = "12345"
FAULT_S = 10.0
"""How long Redis stays paused, black-holed or dead."""
HEARD_WITHIN_S = 1.5
"""A reply (or an apology) within this long after the caller stops talking, as for provider
faults (issue 8)."""
MAX_DEAD_AIR_S = 2.0
MAX_STREAMS = 2
"""A call resumed once (after a SIGKILL) has two streams; more is a resume loop."""
AUDIO_AGAIN_S = 1.0
"""SIGKILL of the instance carrying a call: audio again within this long of the drop."""


def fake_transcribe(wav: bytes, form: dict[str, str]) -> str:
    with wave.open(io.BytesIO(wav), "rb") as w:
        seconds = w.getnframes() / w.getframerate()
    return "thanks goodbye" if seconds < 1.5 else "what are your opening hours"


# -- the payments backend: pays once per idempotency key ------------------------------------------


@dataclass
class Backend:
    """GET answers the account and its balance; a POST pays, unless its Idempotency-Key was
    seen (then the first answer comes back again and nothing is paid)."""

    posts: list[tuple[str | None, str]] = field(default_factory=list)
    """(key, path) of every POST."""
    paid: list[str | None] = field(default_factory=list)
    """The key of every payment made."""
    answers: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    READS: ClassVar[dict[str, Any]] = {
        f"/accounts/{ACCOUNT}": {"name": "Ada"},
        f"/accounts/{ACCOUNT}/balance": {"balance": 42.5},
    }

    def answer(self, method: str, path: str, key: str | None) -> tuple[int, bytes]:
        with self.lock:
            if method == "GET":
                found = self.READS.get(path)
                return (200, json.dumps(found).encode()) if found else (404, b"{}")
            self.posts.append((key, path))
            if key is not None and key in self.answers:
                return 200, self.answers[key]
            self.paid.append(key)
            data = json.dumps({"confirmation": f"P{len(self.paid)}"}).encode()
            if key is not None:
                self.answers[key] = data
            return 200, data

    def payments_for(self, call_sid: str) -> int:
        with self.lock:
            return sum(1 for k in self.paid if k is not None and k.startswith(call_sid))


@contextlib.contextmanager
def serve_backend(backend: Backend) -> Any:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            if size:
                self.rfile.read(size)
            status, data = backend.answer(
                self.command, self.path, self.headers.get("Idempotency-Key")
            )
            with contextlib.suppress(OSError):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# -- Redis behind a proxy that can black-hole it ---------------------------------------------------


class RedisProxy:
    """A TCP proxy in front of Redis. ``black_hole(True)``: it goes on accepting connections
    but nothing passes either way, on new and open connections alike (as a partition, or a
    node that is gone without a reset); ``black_hole(False)``: what was held goes through. When
    Redis itself is gone, a connection is accepted and closed at once."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    def black_hole(self, on: bool) -> None:
        if on:
            self._open.clear()
        else:
            self._open.set()

    async def __aenter__(self) -> RedisProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends every pipe; cancelling the handlers would make asyncio's
        # start_server callback log their CancelledError.
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._open.wait()
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            except OSError:
                return
            self._writers.add(up_w)
            pipes = [
                asyncio.create_task(self._pipe(reader, up_w)),
                asyncio.create_task(self._pipe(up_r, writer)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                up_w.close()
                self._writers.discard(up_w)
        finally:
            writer.close()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                await self._open.wait()
                writer.write(data)
                await writer.drain()


# -- the stack ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Stack:
    workdir: Path
    fake: FakeOpenAIServer
    backend: Backend
    redis: RedisServer
    proxy: RedisProxy
    group: GatewayProcesses
    env: dict[str, str]
    gateways: list[GatewayProcess]
    haproxy: Child
    lb_port: int
    lb_metrics_port: int
    store: RedisCallStore
    """A reader on the real Redis (not through the proxy), the gateways' prefix."""
    restarts: int = 0

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    async def lb_active_servers(self) -> int:
        async with httpx.AsyncClient(timeout=2.0) as http:
            text = (await http.get(f"http://127.0.0.1:{self.lb_metrics_port}/metrics")).text
        for line in text.splitlines():
            if line.startswith('haproxy_backend_active_servers{proxy="gateways"}'):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    async def until_lb_sees_both(self, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while True:
            self.haproxy.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if await self.lb_active_servers() == 2:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy does not see both gateways within {within} s")
            await asyncio.sleep(0.2)

    async def replace(self, gone: GatewayProcess) -> GatewayProcess:
        """A new process on the port of ``gone`` (HAProxy's config names the ports)."""
        self.restarts += 1
        self.group.procs.remove(gone)  # gone: wait_healthy must not wait for it
        fresh = self.group.start(f"{gone.name.split('~')[0]}~{self.restarts}", self.env, gone.port)
        self.gateways[self.gateways.index(gone)] = fresh
        await self.group.wait_healthy(within=60)
        await self.until_lb_sees_both()
        return fresh

    def tails(self) -> str:
        return "\n".join(g.tail(15) for g in self.gateways)


@contextlib.asynccontextmanager
async def run_stack(workdir: Path) -> AsyncIterator[Stack]:
    redis = RedisServer()
    backend = Backend()
    prefix = f"ivrfault:{uuid.uuid4().hex[:8]}:"
    await asyncio.to_thread(redis.start)
    haproxy: Child | None = None
    try:
        with (
            FakeOpenAIServer(api_key=API_KEY) as fake,
            serve_backend(backend) as backend_url,
            GatewayProcesses(workdir) as group,
        ):
            fake.speak = fast_speak  # before the gateways start: they pre-synthesise prompts
            fake.chat = agent_replies
            fake.transcribe = fake_transcribe
            async with RedisProxy(redis.port) as proxy:
                env = gateway_env(
                    providers_url=fake.base_url, api_key=API_KEY, public_url=PUBLIC_URL,
                    auth_token=AUTH_TOKEN, redis_url=proxy.url, redis_prefix=prefix,
                    IVR_DRAIN_SECONDS="30", SUPPORT_BACKEND_URL=backend_url,
                )  # fmt: skip
                gateways = [group.start(f"gw-{i}", env) for i in (1, 2)]
                lb, lb_metrics = free_port(), free_port()
                haproxy = start_haproxy(workdir, [g.port for g in gateways], lb, lb_metrics)
                store = RedisCallStore(redis.url, prefix=prefix)
                stack = Stack(
                    workdir, fake, backend, redis, proxy, group, env, gateways, haproxy, lb,
                    lb_metrics, store,
                )  # fmt: skip
                try:
                    await group.wait_healthy(within=90)
                    await stack.until_lb_sees_both()
                    await asyncio.gather(
                        *(asyncio.to_thread(caller_voice, t) for t in (QUESTION, GOODBYE_LINE))
                    )
                    yield stack
                finally:
                    haproxy.stop()
                    group.close()
                    await store.aclose()
    finally:
        if haproxy is not None:
            haproxy.stop()
        redis.close()


# -- calls ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Placed:
    label: str
    task: asyncio.Task[CallReport]
    wav: Path
    users: int
    """Caller turns the record must hold once the call is over (payments: 0, DTMF only)."""
    payment: bool = False
    via: str = ""
    """Where the webhook and the stream went."""

    async def report(self, within: float = 60.0) -> CallReport:
        try:
            return await asyncio.wait_for(asyncio.shield(self.task), within)
        finally:
            if not self.task.done():
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)


def dial(
    stack: Stack, label: str, steps: list[Any], *, to: str = AGENT_NUMBER,
    http_base: str | None = None, ws_base: str | None = None, via: str = "haproxy",
) -> Placed:  # fmt: skip
    script = script_from_data({"steps": steps, "max_wait": 12}, source=label)
    wav = stack.workdir / f"{label}.wav"
    task = asyncio.create_task(
        place_call(
            http_base or stack.lb_url, ws_base=ws_base, script=script, auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL, to=to, record_path=wav, synthesize=caller_voice,
        )
    )  # fmt: skip
    users = sum(1 for s in steps if isinstance(s, str))
    return Placed(label, task, wav, users, payment=to == PAYMENTS_NUMBER, via=via)


def main_call(stack: Stack, label: str, **kwargs: Any) -> Placed:
    return dial(stack, label, [QUESTION, QUESTION, GOODBYE_LINE], **kwargs)


def payment_call(stack: Stack, label: str, **kwargs: Any) -> Placed:
    return dial(stack, label, [{"press": ACCOUNT}, {"press": "1"}], to=PAYMENTS_NUMBER, **kwargs)


def ws(gateway: GatewayProcess) -> str:
    return gateway.base_url.replace("http://", "ws://")


async def said(
    fake: FakeOpenAIServer, text: str, nth: int, since: float, within: float = 30.0
) -> float:
    """When the bot asked the TTS for ``text`` the ``nth`` time since ``since``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        asked = [
            r.time
            for r in fake.requests_for("speech")
            if r.time >= since and (r.json or {}).get("input") == text
        ]
        if len(asked) >= nth:
            return asked[nth - 1]
        await asyncio.sleep(0.02)
    raise AssertionError(f"the bot never said {text!r} {nth} times")


async def transcribing(
    fake: FakeOpenAIServer, nth: int, since: float, within: float = 30.0
) -> float:
    """When the ``nth`` speech recognition request since ``since`` arrived."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        asked = [r.time for r in fake.requests_for("transcriptions") if r.time >= since]
        if len(asked) >= nth:
            return asked[nth - 1]
        await asyncio.sleep(0.005)
    raise AssertionError(f"fewer than {nth} transcription requests")


async def reply_playing(stack: Stack, nth: int, since: float, into: float) -> float:
    """Sleep until ``into`` seconds into the ``nth`` reply's playout (negative: before its end)."""
    asked = await said(stack.fake, REPLY, nth, since)
    at = asked + (into if into >= 0 else speech_seconds(REPLY) + into)
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    return time.monotonic()


def stream_started_count(gateway: GatewayProcess) -> int:
    return len(gateway.log_events("call.stream_started"))


async def carrier(stack: Stack, before: dict[str, int], within: float = 15.0) -> GatewayProcess:
    """The gateway that started a stream since ``before`` (the counts per name)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for g in stack.gateways:
            if stream_started_count(g) > before.get(g.name, 0):
                return g
        await asyncio.sleep(0.05)
    raise AssertionError(f"no gateway started a stream\n{stack.tails()}")


def counts(stack: Stack) -> dict[str, int]:
    return {g.name: stream_started_count(g) for g in stack.gateways}


async def handshake(url_path: str, base: str) -> int:
    """Twilio's signed stream handshake for ``url_path`` at ``base``: the HTTP status (101
    when the WebSocket was accepted; it is closed again at once)."""
    public = f"wss://gw.example.com{url_path}"
    headers = {"X-Twilio-Signature": RequestValidator(AUTH_TOKEN).compute_signature(public, {})}
    try:
        async with websockets.connect(
            rebase(public, base.replace("http://", "ws://")), additional_headers=headers,
            open_timeout=5, compression=None,
        ):  # fmt: skip
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


# -- results --------------------------------------------------------------------------------------


@dataclass(slots=True)
class CallOutcome:
    label: str
    via: str
    completed: bool
    """Ended the way its flow ends (``<Hangup>``), no caller-side errors, no technical
    problems, its last turn answered."""
    greeting_s: float | None
    """Call placed -> first bot audio."""
    streams: int
    record_complete: bool | None = None
    payments: int | None = None
    why: str = ""
    handshakes_refused: int = 0
    """Stream handshakes the gateway refused (the call went on through the action URL)."""
    transcript: str = field(default="", repr=False)


@dataclass(slots=True)
class InfraResult:
    fault: str
    heard_after_s: float | None
    """The faulted turn: end of the caller's speech -> first bot audio; or, for a call cut
    mid-reply (``heard_from`` "drop"), its stream dropped -> audio again."""
    heard_from: str
    dead_air_s: float
    """Longest wait for bot audio in the main call while the caller waited for an answer."""
    next_turn: bool
    """The turn after the faulted one was answered."""
    calls: list[CallOutcome]
    lb_min_servers: int | None = None
    """Fewest gateways HAProxy had in rotation during the fault."""
    refused: list[int] = field(default_factory=list)
    """Replayed handshakes: the HTTP status each got."""
    split: bool | None = None
    """Redis faults: the main call's webhook and stream were answered by different instances."""
    first_burst_s: float | None = None
    """A call cut mid-reply: how long the first bot audio after the drop lasted (the resume
    prompt, ``speech_seconds(RESUME_PROMPT)``, if that is what was said)."""
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return sum(1 for c in self.calls if not c.completed)

    @property
    def payments(self) -> int | None:
        paid = [c.payments for c in self.calls if c.payments is not None]
        return sum(paid) if paid else None

    @property
    def payment_calls(self) -> int:
        return sum(1 for c in self.calls if c.payments is not None)

    @property
    def records_complete(self) -> bool | None:
        checked = [c.record_complete for c in self.calls if c.record_complete is not None]
        return all(checked) if checked else None

    @property
    def new_calls(self) -> list[CallOutcome]:
        return [c for c in self.calls if c.label != "main"]

    def misses(self) -> list[str]:
        out = []
        if self.heard_after_s is None:
            out.append("no bot audio on the faulted turn")
        else:
            limit = AUDIO_AGAIN_S if self.heard_from == "drop" else HEARD_WITHIN_S
            if self.heard_after_s > limit:
                out.append(f"heard after {self.heard_after_s:.2f} s (target {limit} s)")
        if self.dead_air_s > MAX_DEAD_AIR_S:
            out.append(f"{self.dead_air_s:.2f} s dead air (target {MAX_DEAD_AIR_S} s)")
        if not self.next_turn:
            out.append("the next turn was not answered")
        out += [f"dropped {c.label} ({c.via}): {c.why}" for c in self.calls if not c.completed]
        out += [
            f"{c.label}: {c.payments} payments" for c in self.calls if c.payments not in (None, 1)
        ]
        out += [f"{c.label}: record incomplete" for c in self.calls if c.record_complete is False]
        out += [
            f"{c.label} ({c.via}): {c.streams} streams (a resume loop)"
            for c in self.calls
            if c.streams > MAX_STREAMS
        ]
        if any(not 400 <= status < 500 for status in self.refused if status):
            out.append(f"replays got {self.refused}, not all refused (4xx)")
        return out + self.errors


def _completed(report: CallReport) -> tuple[bool, str]:
    """Reached its end: no caller-side errors (but a 503 handshake that the action URL got
    past) or protocol violations, no "technical problems", the last caller turn answered, and
    ended with ``<Hangup>`` (or, after that answer, by the caller: an instance that cannot
    share the call's end holds the line until then). A call that loops through streams after
    its last answer is not counted here but as a loop (``MAX_STREAMS``)."""
    failed = [i for i, st in enumerate(report.streams) if st.ended_by == "handshake-failed"]
    recovered = bool(failed) and failed[-1] < len(report.streams) - 1
    problems = [
        e
        for e in report.errors
        # A handshake refused with 503 (a draining instance) sends Twilio to the action URL,
        # which connects a new stream: not a drop if that one was taken.
        if not (recovered and e.startswith("31920 stream handshake") and e.endswith("HTTP 503"))
    ]
    problems += [f"{v.code}: {v.reason}" for v in report.violations]
    if any("technical problems" in t for t in report.twiml):
        problems.append("technical problems")
    said = [t for t in report.turns if t.caller_text is not None]
    if said and said[-1].bot_first_audio_t is None:
        problems.append("the last caller turn got no answer")
    hangup = report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    by_caller = bool(report.streams) and report.streams[-1].ended_by == "caller"
    if not hangup and not by_caller and len(report.streams) <= MAX_STREAMS:
        problems.append(f"closing TwiML {report.closing_twiml!r}")
    return not problems, "; ".join(problems)


async def record_complete(stack: Stack, placed: Placed, report: CallReport, within: float) -> bool:
    """The call's record in Redis is whole: ended, every caller turn kept (a payment: its
    confirmation)."""

    def whole(r: CallRecord | None) -> bool:
        if r is None or r.status != CallStatus.ENDED:
            return False
        if placed.payment:
            return bool(r.variables.get("confirmation"))
        return sum(1 for m in r.history if m.role == "user") == placed.users

    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(Exception):
            if whole(await stack.store.get(report.call_sid)):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)


async def outcome(
    stack: Stack, placed: Placed, *, check_record: bool, within: float = 60.0
) -> tuple[CallOutcome, CallReport | None]:
    try:
        report = await placed.report(within)
    except Exception as exc:  # a broken call is a dropped call, with its reason
        return CallOutcome(placed.label, placed.via, False, None, 0, why=repr(exc)), None
    ok, why = _completed(report)
    greeting = report.turns[0].bot_first_audio_t if report.turns else None
    result = CallOutcome(placed.label, placed.via, ok, greeting, len(report.streams), why=why)
    result.transcript = report.format_transcript()
    result.handshakes_refused = sum(1 for st in report.streams if st.ended_by == "handshake-failed")
    if placed.payment:
        result.payments = stack.backend.payments_for(report.call_sid)
    if check_record:
        result.record_complete = await record_complete(stack, placed, report, within=15.0)
    return result, report


def heard(
    report: CallReport,
    wav: Path,
    fault_t: float,
    placed_t: float,
    *,
    cut: bool = False,
    turn: int | None = None,
) -> tuple[float | None, str, float, bool]:
    """(heard after, from what, longest dead air, next turn answered) for the main call. The
    faulted turn is the first whose caller speech ended after the fault (call time
    ``fault_t - placed_t``) or caller turn ``turn`` (0-based); with ``cut``, the one the fault
    cut into, measured from the drop of its stream to the first bot audio on the next."""
    turns = caller_turns(report, [Burst("audio", s, e) for s, e in bot_bursts(wav, 0.0)])
    if not turns:
        return None, "speech end", float("nan"), False
    worst = max(t.dead_air_s for t in turns)
    at = fault_t - placed_t
    if cut:
        dropped = next((s for s in report.streams[:-1] if s.ended_by == "gateway"), None)
        if dropped is None:
            return None, "drop", worst, False
        again = bot_bursts(wav, dropped.ended_t)
        index = next(
            (i for i, t in enumerate(turns) if t.caller_end <= dropped.ended_t < t.until), 0
        )
        after = again[0][0] - dropped.ended_t if again else None
        return after, "drop", worst, _answered(turns, index + 1)
    index = next((i for i, t in enumerate(turns) if t.caller_end >= at), len(turns) - 1)
    index = min(turn, len(turns) - 1) if turn is not None else index
    return turns[index].first_audio_s, "speech end", worst, _answered(turns, index + 1)


def _answered(turns: list[Any], index: int) -> bool:
    """The turn at ``index`` got bot audio (past the last turn: the call's end counts)."""
    return index >= len(turns) or turns[index].first_audio_s is not None


# -- the cases ------------------------------------------------------------------------------------


async def _sample_lb(stack: Stack, stop: asyncio.Event, seen: list[int]) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            seen.append(await stack.lb_active_servers())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def redis_fault(stack: Stack, kind: str) -> InfraResult:
    """Redis paused (SIGSTOP), black-holed or killed for FAULT_S from the moment the main
    call's second question reaches speech recognition (the gateway is working on that turn,
    saving it as it goes); during it, one new call on each gateway (webhook on one, stream on the
    other; one of them pays). Records must be complete once Redis is back."""
    redis = stack.redis
    a, b = stack.gateways
    hooks, streams = await webhooks(stack), counts(stack)
    t0 = time.monotonic()
    main = main_call(stack, "main")
    stream_on = await carrier(stack, streams)
    hooked = await webhooks(stack)
    webhook_on = [g.name for g in stack.gateways if hooked[g.name] > hooks[g.name]]
    fault_t = await transcribing(stack.fake, 2, t0)
    if kind == "paused":
        assert redis.process is not None
        redis.process.send_signal(signal.SIGSTOP)
    elif kind == "black-holed":
        stack.proxy.black_hole(True)
    else:
        assert redis.process is not None
        redis.process.kill()
        redis.process.wait()
        redis.process = None
    stop, seen = asyncio.Event(), []
    sampler = asyncio.create_task(_sample_lb(stack, stop, seen))
    try:
        new = [
            dial(stack, "new", [GOODBYE_LINE], http_base=a.base_url, ws_base=ws(b),
                 via=f"{a.name} -> {b.name}"),
            payment_call(stack, "pay", http_base=b.base_url, ws_base=ws(a),
                         via=f"{b.name} -> {a.name}"),
        ]  # fmt: skip
        await asyncio.sleep(max(0.0, fault_t + FAULT_S - time.monotonic()))
    finally:
        if kind == "paused" and redis.process is not None:
            redis.process.send_signal(signal.SIGCONT)
        elif kind == "black-holed":
            stack.proxy.black_hole(False)
        elif redis.process is None:
            await asyncio.to_thread(redis.start)
        stop.set()
        await sampler
    calls = [(main, *await outcome(stack, main, check_record=True))]
    calls += [(p, *await outcome(stack, p, check_record=True)) for p in new]
    result = _result(f"Redis {kind} {FAULT_S:g} s", calls, fault_t, t0, lb_seen=seen, turn=1)
    result.split = webhook_on != [stream_on.name]
    result.notes.append(f"main: webhook on {', '.join(webhook_on)}, stream on {stream_on.name}")
    if calls[0][2] is not None:
        result.notes.append(placement(stack, calls[0][2].call_sid))
    return result


async def webhooks(stack: Stack) -> dict[str, float]:
    """Voice webhooks each gateway accepted so far."""
    return {
        g.name: await g.metric('ivr_webhooks_total{outcome="accepted"}') or 0.0
        for g in stack.gateways
    }


def placement(stack: Stack, call_sid: str) -> str:
    """Which instance carried the call's first stream and which answered its action URL."""
    streams = [
        g.name for g in stack.gateways if g.log_events("call.stream_started", call_sid=call_sid)
    ]
    actions = [
        g.name for g in stack.gateways if g.log_events("call.resume_requested", call_sid=call_sid)
    ]
    stream_on, action_on = ", ".join(streams) or "-", ", ".join(actions) or "-"
    return f"main: streams on {stream_on}; action URL resumed on {action_on}"


def _result(
    fault: str,
    calls: list[tuple[Placed, CallOutcome, CallReport | None]],
    fault_t: float,
    placed_t: float,
    *,
    lb_seen: list[int] | None = None,
    cut: bool = False,
    turn: int | None = None,
) -> InfraResult:
    main, main_outcome, report = calls[0]
    if report is None:
        result = InfraResult(
            fault, None, "speech end", float("nan"), False, [c for _, c, _ in calls]
        )
        result.errors.append(f"the main call failed: {main_outcome.why}")
        return result
    after, source, dead_air, next_turn = heard(
        report, main.wav, fault_t, placed_t, cut=cut, turn=turn
    )
    result = InfraResult(
        fault, after, source, dead_air, next_turn, [c for _, c, _ in calls],
        lb_min_servers=min(lb_seen) if lb_seen else None,
    )  # fmt: skip
    for placed, o, _ in calls[1:]:
        greeting = "never" if o.greeting_s is None else f"{o.greeting_s:.2f} s"
        refused = f", {o.handshakes_refused} stream handshake refused" * bool(o.handshakes_refused)
        result.notes.append(f"{placed.label} ({placed.via}): greeting after {greeting}{refused}")
    return result


async def instance_killed(stack: Stack) -> InfraResult:
    """SIGKILL of the instance carrying the main call, 0.5 s into its second reply."""
    before = counts(stack)
    t0 = time.monotonic()
    main = main_call(stack, "main")
    gw = await carrier(stack, before)
    fault_t = await reply_playing(stack, 2, t0, into=0.5)
    gw.kill()
    o, report = await outcome(stack, main, check_record=True)
    result = _result("instance SIGKILLed mid-reply", [(main, o, report)], fault_t, t0, cut=True)
    result.notes.append(f"killed {gw.name}; streams {o.streams}")
    if report is not None:
        drop = next((s.ended_t for s in report.streams[:-1] if s.ended_by == "gateway"), None)
        again = bot_bursts(main.wav, drop) if drop is not None else []
        if again:
            result.first_burst_s = again[0][1] - again[0][0]
            result.notes.append(
                f"first audio after the drop lasted {result.first_burst_s:.2f} s (the resume "
                f"prompt {speech_seconds(RESUME_PROMPT):.2f} s, run on into the reply said "
                f"again {speech_seconds(RESUME_PROMPT + REPLY):.2f} s)"
            )
    return result


async def instance_terminated(stack: Stack) -> InfraResult:
    """SIGTERM (drain) of the instance carrying the main call at the end of its first reply;
    a payment call on the same instance is in progress; a new call comes 0.5 s later."""
    before = counts(stack)
    t0 = time.monotonic()
    main = main_call(stack, "main")
    gw = await carrier(stack, before)
    pay = payment_call(stack, "pay", ws_base=ws(gw), via=f"haproxy, stream on {gw.name}")
    fault_t = await reply_playing(stack, 1, t0, into=-0.2)
    gw.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    late = dial(stack, "new", [GOODBYE_LINE], via="haproxy, 0.5 s after SIGTERM")
    calls = [(p, *await outcome(stack, p, check_record=True)) for p in (main, pay, late)]
    result = _result("instance SIGTERMed mid-call", calls, fault_t, t0)
    deadline = time.monotonic() + 15
    while gw.alive and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a child process
        await asyncio.sleep(0.1)
    code = gw.process.poll()
    result.notes.append(f"{gw.name} exited {code} after its calls")
    if code != 0:
        result.errors.append(f"{gw.name} exit code {code}")
    if gw.alive:
        gw.kill()
    await stack.replace(gw)
    return result


async def replayed_handshake(stack: Stack) -> InfraResult:
    """The main call's signed stream handshake (its one-use token) replayed while the call
    runs: through HAProxy and at each gateway directly."""
    async with LoadBalancer([stack.lb_port]) as tap:  # to read the stream's URL off the wire
        t0 = time.monotonic()
        main = main_call(stack, "main", ws_base=tap.url.replace("http://", "ws://"))
        fault_t = await reply_playing(stack, 1, t0, into=0.2)
        [(_, request)] = tap.requests("GET /twilio/stream/")
        path = request.line.split(" ")[1]
        refused = [
            await handshake(path, base)
            for base in (stack.lb_url, *(g.base_url for g in stack.gateways))
        ]
        o, report = await outcome(stack, main, check_record=True)
    result = _result("replayed stream handshake", [(main, o, report)], fault_t, t0)
    result.refused = refused
    if o.streams != 1:
        result.notes.append(f"MISS the real call had {o.streams} streams: it was cut off")
    return result


def call_sid_of(stream_path: str) -> str:
    """The CallSid a stream token names (its payload: version|CallSid|expiry|nonce|flags)."""
    payload = stream_path.rsplit("/", 1)[1].split(".")[0]
    return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode().split("|")[1]


async def hijack(url: str, base: str, call_sid: str) -> tuple[int, int]:
    """Open the stream at public ``url`` through ``base`` as Twilio would and start it for
    ``call_sid``; hold it a second. (The handshake's HTTP status, 101 when it was accepted;
    media frames the gateway sent on it.)"""
    headers = {"X-Twilio-Signature": RequestValidator(AUTH_TOKEN).compute_signature(url, {})}
    sid = "MZ" + secrets.token_hex(16)
    start = {
        "accountSid": "AC" + secrets.token_hex(16), "streamSid": sid, "callSid": call_sid,
        "tracks": ["inbound"], "customParameters": {},
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
    }  # fmt: skip
    media = 0
    try:
        async with websockets.connect(
            rebase(url, base.replace("http://", "ws://")), additional_headers=headers,
            open_timeout=5, compression=None,
        ) as conn:  # fmt: skip
            hello = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
            await conn.send(json.dumps(hello))
            begin = {"event": "start", "sequenceNumber": "1", "start": start, "streamSid": sid}
            await conn.send(json.dumps(begin))
            with contextlib.suppress(TimeoutError, websockets.ConnectionClosed):
                async with asyncio.timeout(1.0):
                    async for message in conn:
                        media += json.loads(message).get("event") == "media"
            return 101, media
    except InvalidStatus as exc:
        return exc.response.status_code, media


async def replayed_webhook(stack: Stack) -> InfraResult:
    """The main call's signed voice webhook replayed while the call runs (same CallSid, same
    form, a valid signature: what a captured request gives), then the stream its answer
    names opened and started for the call: the takeover of issue 8's item 4, one step back."""
    async with LoadBalancer([stack.lb_port]) as tap:  # to read the stream's URL off the wire
        t0 = time.monotonic()
        main = main_call(stack, "main", ws_base=tap.url.replace("http://", "ws://"))
        fault_t = await reply_playing(stack, 1, t0, into=0.2)
        [(_, request)] = tap.requests("GET /twilio/stream/")
        call_sid = call_sid_of(request.line.split(" ")[1])
        record = await stack.store.get(call_sid)
        account = record.account_sid if record is not None else ""
        ids = CallIds(call_sid, account, "+15550001111", AGENT_NUMBER)
        async with httpx.AsyncClient(timeout=5.0) as http:
            side = TwilioSide(http, stack.lb_url, PUBLIC_URL, AUTH_TOKEN, ids)
            try:
                twiml = await side.request("/twilio/voice", side.params("ringing"))
            except CallFailed:  # refused outright (not 200): no stream to open
                twiml = ""
        stream = parse_stream(twiml) if twiml else None
        status, media = (
            (0, 0) if stream is None else await hijack(stream.url, stack.lb_url, call_sid)
        )
        o, report = await outcome(stack, main, check_record=True)
    result = _result("replayed voice webhook", [(main, o, report)], fault_t, t0)
    result.refused = [status]
    result.notes.append(
        "the replayed webhook got "
        + ("no stream" if stream is None else f"a stream; its handshake got {status}")
        + (f", then {media} media frames of the call ({media * 0.02:.2f} s)" if media else "")
    )
    if o.streams != 1:
        result.notes.append(f"MISS the real call had {o.streams} streams: it was cut off")
    return result


CASES: dict[str, Callable[[Stack], Awaitable[InfraResult]]] = {
    "replay": replayed_handshake,
    "replay-webhook": replayed_webhook,
    "redis-paused": lambda s: redis_fault(s, "paused"),
    "redis-black-holed": lambda s: redis_fault(s, "black-holed"),
    "redis-killed": lambda s: redis_fault(s, "killed"),
    "sigterm": instance_terminated,
    "sigkill": instance_killed,
}
"""In the order they run: the last one leaves an instance dead."""


async def run_infra_cases(
    workdir: Path,
    names: list[str] | None = None,
    on_result: Callable[[InfraResult], None] | None = None,
) -> list[InfraResult]:
    results = []
    async with run_stack(workdir) as stack:
        for name in names or list(CASES):
            try:
                result = await CASES[name](stack)
            except Exception as exc:  # one broken case must not hide the others' numbers
                result = InfraResult(name, None, "", float("nan"), False, [])
                result.errors.append(f"{type(exc).__name__}: {exc}")
            results.append(result)
            if on_result is not None:
                on_result(result)
            await asyncio.sleep(0.5)  # the last call's records settle
    return results


def format_row(r: InfraResult) -> str:
    after = "never" if r.heard_after_s is None else f"{r.heard_after_s:.2f} s ({r.heard_from})"
    payments = "-" if r.payments is None else f"{r.payments}/{r.payment_calls}"
    records = {None: "-", True: "yes", False: "NO"}[r.records_complete]
    lb = "-" if r.lb_min_servers is None else str(r.lb_min_servers)
    news = r.new_calls
    new = f"{sum(c.completed for c in news)}/{len(news)}" if news else "-"
    refused = ",".join(map(str, r.refused)) or "-"
    streams = str(max((c.streams for c in r.calls), default=0))
    return (
        f"{r.fault:30} {after:>20} {r.dead_air_s:7.2f} s  {'yes' if r.next_turn else 'NO':4}  "
        f"{r.dropped}/{len(r.calls):<5} {new:5}  {payments:8} {records:7} {streams:>7} {lb:3} "
        f"{refused:11} "
        f"{'ok' if not r.misses() else 'MISS'}"
    )


HEADER = (
    f"{'fault':30} {'heard after':>20} {'dead air':>9}  {'next':4}  {'dropped':7} {'new':5}  "
    f"{'payments':8} {'records':7} {'streams':>7} {'lb':3} {'replays':11} targets"
)


def format_table(results: list[InfraResult]) -> str:
    lines = [HEADER, "-" * len(HEADER)]
    lines += [format_row(r) for r in results]
    lines.append("")
    for r in results:
        for note in r.notes:
            lines.append(f"  {r.fault}: {note}")
        for miss in r.misses():
            lines.append(f"  {r.fault}: MISS {miss}")
    return "\n".join(lines)
