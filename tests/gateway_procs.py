"""Real ``ivr serve`` processes for multi-instance tests: started with env settings, waited on
(/healthz), logs captured to files, stopped or SIGKILLed on demand, always cleaned up.

    with GatewayProcesses(tmp_path) as procs:
        a = procs.start("gw-a", gateway_env(...))
        await procs.wait_healthy()
        a.kill()                      # SIGKILL: the instance is gone mid-call
        a.log_events("call.stream_started")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
import wave
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis.asyncio as aioredis
from lb import LoadBalancer

from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_data
from ivr.state.base import CallRecord
from ivr.state.redis_store import RedisCallStore
from ivr.testing.openai_server import (
    SPEECH_RATE,
    ChatScript,
    FakeOpenAIServer,
    ScriptToolCall,
    default_speak,
    echo_script,
    last_user_text,
)

REPO = Path(__file__).resolve().parent.parent
IVR = REPO / ".venv" / "bin" / "ivr"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway_env(
    *,
    providers_url: str,
    api_key: str,
    public_url: str,
    auth_token: str,
    redis_url: str,
    redis_prefix: str,
    **extra: str,
) -> dict[str, str]:
    """Settings for ``ivr serve`` with every provider at one OpenAI-compatible server."""
    env = {
        "IVR_PUBLIC_URL": public_url,
        "TWILIO_AUTH_TOKEN": auth_token,
        "IVR_REDIS_URL": redis_url,
        "IVR_REDIS_PREFIX": redis_prefix,
        "IVR_STT_PROVIDER": "openai",
        "IVR_STT_BASE_URL": providers_url,
        "IVR_STT_API_KEY": api_key,
        "IVR_TTS_PROVIDER": "openai",
        "IVR_TTS_BASE_URL": providers_url,
        "IVR_TTS_API_KEY": api_key,
        "IVR_LLM_PROVIDER": "openai",
        "IVR_LLM_BASE_URL": providers_url,
        "IVR_LLM_API_KEY": api_key,
        "IVR_LLM_MODEL": "gemma-test",
        "IVR_VAD": "webrtc",
        "IVR_LOG_FORMAT": "json",
        "IVR_FLOWS_DIR": str(REPO / "flows"),
    }
    env.update(extra)
    return env


@dataclass(slots=True)
class GatewayProcess:
    name: str
    instance_id: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> float:
        """SIGKILL (no graceful shutdown, no teardown writes); returns ``time.monotonic()``."""
        t = time.monotonic()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=5)
        return t

    def stop(self, timeout: float = 5.0) -> None:
        if not self.alive:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The process's JSON log lines (optionally one event, with matching fields)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue  # tracebacks and other non-JSON output
            if not isinstance(item, dict):
                continue
            if event is not None and item.get("event") != event:
                continue
            if all(item.get(k) == v for k, v in match.items()):
                out.append(item)
        return out

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} ({self.log_path}) ---\n" + "\n".join(text[-lines:])

    async def metric(self, sample: str) -> float | None:
        """One sample from the process's /metrics, e.g. ``ivr_store_degraded`` or
        ``ivr_webhooks_total{outcome="accepted"}``; None if it is not exposed."""
        async with httpx.AsyncClient(timeout=5.0) as http:
            text = (await http.get(f"{self.base_url}/metrics")).text
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        return None


class GatewayProcesses:
    """Owns every process it starts; ``close()`` (or leaving the ``with``) ends them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[GatewayProcess] = []

    def start(
        self,
        name: str,
        env: dict[str, str],
        port: int | None = None,
        serve_args: tuple[str, ...] = (),
    ) -> GatewayProcess:
        """``serve_args``: more options for ``ivr serve`` (e.g. ``("--workers", "2")``)."""
        port = port or free_port()
        instance_id = env.get("IVR_INSTANCE_ID") or f"{name}-{port}"
        full = {**_base_env(), **env, "IVR_PORT": str(port), "IVR_INSTANCE_ID": instance_id}
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            # cwd: an empty directory, so no developer .env leaks into the settings.
            process = subprocess.Popen(
                [str(IVR), "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args],
                env=full,
                cwd=self.log_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        proc = GatewayProcess(name, instance_id, port, log_path, process)
        self.procs.append(proc)
        return proc

    async def wait_healthy(self, within: float = 30.0) -> None:
        """Until every live process answers /healthz (and, since the store starts first, is up)."""
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=1.0) as http:
            for proc in self.procs:
                while True:
                    if not proc.alive:
                        raise RuntimeError(f"{proc.name} exited during startup\n{proc.tail()}")
                    try:
                        resp = await http.get(f"{proc.base_url}/healthz")
                        if resp.status_code == 200 and proc.log_events("gateway.started"):
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{proc.name} not healthy in {within} s\n{proc.tail()}")
                    await asyncio.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive:
                proc.stop()

    def __enter__(self) -> GatewayProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _base_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    env["VIRTUAL_ENV"] = str(REPO / ".venv")
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
    return env


# -- a cluster: providers + Redis + N gateway processes behind the load balancer ----------------

AUTH_TOKEN = "test-auth-token"
PUBLIC_URL = "https://gw.example.com"
API_KEY = "sk-test"
AGENT_NUMBER = "+15550002222"  # default flow: the LLM agent
SUPPORT_NUMBER = "+15550100001"  # support flow: the IVR menu
SPEAK_RATE = 12_000
"""The fake TTS renders at half rate, so the bot talks twice as fast (32.5 ms a character) and
the tests spend less time listening; the audio is still deterministic and speech-like."""


def fast_speak(text: str) -> bytes:
    return default_speak(text, sample_rate=SPEAK_RATE)


def speech_seconds(text: str) -> float:
    """How long the fake TTS takes to say ``text`` at the caller."""
    return len(fast_speak(text)) / 2 / SPEECH_RATE


def agent_replies(request: dict[str, Any]) -> ChatScript:
    """The fake model: ``end_call`` when the caller says goodbye, else it echoes them."""
    if "goodbye" in last_user_text(request).lower():
        return ChatScript(tool_calls=[ScriptToolCall("end_call")])
    return echo_script(request)


@dataclass(slots=True)
class Cluster:
    fake: FakeOpenAIServer
    procs: list[GatewayProcess]
    lb: LoadBalancer
    store: RedisCallStore
    """A reader on the same Redis and prefix as the gateways (the test's own client)."""

    def proc_for(self, instance_id: str | None) -> GatewayProcess:
        return next(p for p in self.procs if p.instance_id == instance_id)

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    async def only_active_call(self, within: float = 15.0) -> CallRecord:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            active = await self.store.list_active()
            if active:
                return active[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no active call in Redis after {within} s\n{self.tails()}")

    async def wait_record(
        self, call_sid: str, check: Callable[[CallRecord], bool], within: float = 15.0
    ) -> CallRecord:
        deadline = time.monotonic() + within
        record = None
        while time.monotonic() < deadline:
            record = await self.store.get(call_sid)
            if record is not None and check(record):
                return record
            await asyncio.sleep(0.05)
        raise AssertionError(f"record never matched: {record}\n{self.tails()}")


@contextlib.asynccontextmanager
async def cluster(
    log_dir: Path,
    fake: FakeOpenAIServer,
    redis_url: str,
    *,
    instances: int = 2,
    per_instance: list[dict[str, str]] | None = None,
) -> AsyncIterator[Cluster]:
    """``instances`` real ``ivr serve`` processes on one Redis (fresh prefix), behind one LB;
    ``per_instance[i]`` adds settings for instance i (e.g. its own ``IVR_FLOWS_DIR``)."""
    prefix = f"ivrtest:{uuid.uuid4().hex[:12]}:"
    env = gateway_env(
        providers_url=fake.base_url, api_key=API_KEY, public_url=PUBLIC_URL,
        auth_token=AUTH_TOKEN, redis_url=redis_url, redis_prefix=prefix,
    )  # fmt: skip
    store = RedisCallStore(redis_url, prefix=prefix)
    with GatewayProcesses(log_dir) as group:
        names = [f"gw-{chr(ord('a') + i)}" for i in range(instances)]
        extra = per_instance or [{} for _ in names]
        procs = [
            group.start(name, {**env, **more}) for name, more in zip(names, extra, strict=True)
        ]
        await group.wait_healthy()
        try:
            async with LoadBalancer([p.port for p in procs]) as lb:
                yield Cluster(fake, procs, lb, store)
        finally:
            group.close()
            with contextlib.suppress(Exception):
                await store.aclose()
            await _delete_prefix(redis_url, prefix)


async def _delete_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1.0)
    with contextlib.suppress(Exception):
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
    await client.aclose()


# -- resume timing --------------------------------------------------------------------------------

SILENCE_GAP_S = 0.15  # a quieter stretch than this ends a burst of bot speech
AUDIBLE = 100  # PCM16 amplitude; the fake voice never dips below it for long inside a phrase


@dataclass(frozen=True, slots=True)
class ResumeTiming:
    """One resume, in seconds. Caller-side times come from its report and its recording;
    network-side parts from the load balancer's timeline (all on one monotonic clock)."""

    heard_gap_s: float
    """Caller: old stream ended -> first bot audio played on the new stream (the headline)."""
    reconnect_s: float
    """Caller: old stream ended -> new stream's ``start`` sent (the report's resume gap)."""
    new_stream_to_audio_s: float
    """Caller: new stream's ``start`` sent -> first bot audio played."""
    first_burst_s: float
    """Length of the first bot speech after the resume (the resume prompt)."""
    kill_to_drop_s: float
    """LB: SIGKILL -> the dead backend's stream connection closed."""
    action_rtt_s: float
    """LB: ``POST /twilio/after-stream`` sent -> first response byte (survivor's work)."""
    ws_handshake_s: float
    """LB: ``GET /twilio/stream/...`` sent -> 101 back (token check on the survivor)."""
    upgrade_to_media_s: float
    """LB: 101 -> first media frame from the survivor (start, attach, load flow, speak)."""
    kill_to_media_s: float
    """LB: SIGKILL -> first media frame from the survivor."""


def bot_bursts(wav_path: Path, after_s: float) -> list[tuple[float, float]]:
    """(start, end) seconds of the bot's speech bursts after ``after_s`` in a call recording."""
    with wave.open(str(wav_path), "rb") as w:
        rate = w.getframerate()
        frames = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    bot = frames.reshape(-1, 2)[:, 1].astype(np.int32)
    loud = np.flatnonzero(np.abs(bot[int(after_s * rate) :]) > AUDIBLE) + int(after_s * rate)
    if loud.size == 0:
        return []
    gap = int(SILENCE_GAP_S * rate)
    splits = np.flatnonzero(np.diff(loud) > gap)
    starts = np.concatenate(([loud[0]], loud[splits + 1]))
    ends = np.concatenate((loud[splits], [loud[-1]]))
    return [(s / rate, e / rate) for s, e in zip(starts, ends, strict=True)]


def resume_timing(
    report: CallReport, wav_path: Path, lb: LoadBalancer, killed_at: float
) -> ResumeTiming:
    """Split the (single) resume of ``report`` into its parts; raises if it did not happen."""
    if len(report.streams) < 2:
        raise AssertionError(f"the call never resumed:\n{report.format_transcript()}")
    old, new = report.streams[0], report.streams[1]
    bursts = bot_bursts(wav_path, old.ended_t)
    if not bursts:
        raise AssertionError("no bot audio after the resume")
    heard_at, burst_end = bursts[0]
    dropped = [c for c in lb.connections if c.closed_by == "backend" and c.closed_t]
    drop_t = min(c.closed_t for c in dropped if c.closed_t and c.closed_t >= killed_at)
    _, action = next((c, r) for c, r in lb.requests("POST /twilio/after-stream")
                     if r.sent_t >= killed_at)  # fmt: skip
    ws_conn, ws_req = next((c, r) for c, r in lb.requests("GET /twilio/stream/")
                           if r.sent_t >= killed_at)  # fmt: skip
    assert action.answered_t is not None and ws_req.answered_t is not None
    media_t = next(t for t in ws_conn.down_t if t > ws_req.answered_t)
    return ResumeTiming(
        heard_gap_s=heard_at - old.ended_t,
        reconnect_s=new.started_t - old.ended_t,
        new_stream_to_audio_s=heard_at - new.started_t,
        first_burst_s=burst_end - heard_at,
        kill_to_drop_s=drop_t - killed_at,
        action_rtt_s=action.answered_t - action.sent_t,
        ws_handshake_s=ws_req.answered_t - ws_req.sent_t,
        upgrade_to_media_s=media_t - ws_req.answered_t,
        kill_to_media_s=media_t - killed_at,
    )


# -- the failover call: kill the instance carrying it after one completed turn ------------------

FIRST_QUESTION = "What are your opening hours?"
FIRST_TRANSCRIPT = "what are your opening hours"
FIRST_REPLY = "You said: what are your opening hours."
LAST_TRANSCRIPT = "thanks goodbye"


@dataclass(slots=True)
class FailoverCall:
    report: CallReport
    wav_path: Path
    call_sid: str
    carrier: GatewayProcess
    """The instance that carried the stream when it was killed."""
    killed_at: float


async def failover_call(cl: Cluster, wav_path: Path) -> FailoverCall:
    """One agent call: a completed turn, SIGKILL of the carrier, resume, goodbye."""
    cl.fake.transcripts.extend([FIRST_TRANSCRIPT, LAST_TRANSCRIPT])
    cl.fake.chat = agent_replies
    script = script_from_data(
        # The silence outlasts kill + resume + resume prompt, so the caller does not talk
        # over the prompt; it stays well under the agent's 6 s no-input timeout.
        [FIRST_QUESTION, {"silence": 5.5}, "Thanks, goodbye."],
        source="failover",
    )
    call = asyncio.create_task(
        place_call(
            cl.lb.url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
            to=AGENT_NUMBER, record_path=wav_path,
        )
    )  # fmt: skip
    try:
        record = await cl.only_active_call()
        await _reply_heard(cl, FIRST_REPLY)
        record = await cl.wait_record(record.call_sid, lambda r: r.instance_id is not None)
        carrier = cl.proc_for(record.instance_id)
        killed_at = carrier.kill()
        report = await asyncio.wait_for(asyncio.shield(call), 40)
    finally:
        if not call.done():
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
    return FailoverCall(report, wav_path, record.call_sid, carrier, killed_at)


async def _reply_heard(cl: Cluster, text: str, within: float = 20.0) -> None:
    """Until the bot's ``text`` has been synthesised and fully played at the caller."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        asked = [r for r in cl.fake.requests_for("speech") if (r.json or {}).get("input") == text]
        if asked:
            # Playout is real time from about the request: wait out the audio plus slack.
            end = asked[0].time + speech_seconds(text) + 0.6
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the bot never said {text!r}\n{cl.tails()}")
