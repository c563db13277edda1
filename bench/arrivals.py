"""The arrival load: calls that come in one after another and talk at once, as a line sees them.

Each call dials in ``interval`` seconds after the one before (150 ms by default), reaches one
LLM agent with no greeting, says a ~3 s line, waits for the reply to play out, says a second
line, waits for that reply and hangs up. With 150 ms between calls about 6.7 turns end every
second once the first calls are on their second turn, whatever the number of calls; the number
of calls sets how long that lasts and how many calls are live at once (~190 at 200 calls).

The providers (their own process, on the bench's CPUs) answer as fast cloud providers do:
STT 150 ms; LLM first token 120 ms, then 40 tokens (two sentences) at 700 tokens/s; TTS first
byte 120 ms, then 24 kHz PCM in 40 ms chunks at 4x real time. They count how many requests of
each kind were in flight at once: a gateway that serialises its provider requests shows it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import yaml
from capacity_callers import TalkingStream, TalkLoad
from gateway_harness import API_KEY, GatewayProcess, free_port, pct

from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.testing.openai_wire import ChatScript, Fault, RecordedRequest, echo_script
from ivr.testing.tts_script import TtsScript

LINES = (
    "Do you have parking near the shop for my car",
    "What time do you open on Saturday morning",
)
"""Two ~2.9 s espeak lines (no commas: a comma pause could split a line in two)."""
REPLY_SENTENCES = (
    "We are open from nine in the morning until six in the evening, Monday to Friday.",
    "On Saturdays we open at ten and close at four, and on Sundays we are closed all day long.",
    "There is free parking behind the shop for about twenty cars, and two spaces for vans.",
    "If you bring your bike before noon we can usually have it ready by the end of the day.",
)
REPLY = " ".join(REPLY_SENTENCES[:2])
"""40 tokens in two sentences (``split_tokens``); about 11 s of the fake TTS's speech."""


def reply_of(sentences: int) -> str:
    """The first ``sentences`` of REPLY_SENTENCES (~5.5 s of speech each): a sweep of reply
    lengths shows what of a turn's cost grows with the bot's seconds of speech."""
    if not 1 <= sentences <= len(REPLY_SENTENCES):
        raise ValueError(f"--reply-sentences must be 1 to {len(REPLY_SENTENCES)}, got {sentences}")
    return " ".join(REPLY_SENTENCES[:sentences])


@dataclass(frozen=True, slots=True)
class ProviderProfile:
    stt_ms: float = 150
    llm_first_ms: float = 120
    llm_tokens_per_s: float = 700
    tts_first_ms: float = 120
    tts_speed: float = 4.0
    """Audio produced per second of wall time (4: a 40 ms chunk every 10 ms)."""
    tts_chunk_ms: float = 40
    reply: str | None = REPLY
    """What the LLM answers; None: ``You said: <the caller's words>.`` (the old load's)."""
    tts: str = "openai"
    """``openai``: 24 kHz PCM16 from ``/v1/audio/speech``; ``cartesia``: 8 kHz mu-law from a
    local Cartesia TTS WebSocket (same first audio, speed and chunks)."""

    def describe(self) -> str:
        return (
            (
                f"STT {self.stt_ms:.0f} ms, LLM {self.llm_first_ms:.0f} ms + "
                f"{self.llm_tokens_per_s:.0f} tok/s, TTS {self.tts_first_ms:.0f} ms + "
                f"{self.tts_speed:g}x in {self.tts_chunk_ms:.0f} ms chunks"
                + (" of 8 kHz mu-law (Cartesia WebSocket)" if self.tts == "cartesia" else "")
                + (f", a {self.reply.count('.')}-sentence reply" if self.reply else "")
            )
            .replace(" + 0 tok/s", "")
            .replace(" + 0x in", ", all at once in")
        )


CLASSIC = ProviderProfile(
    stt_ms=150, llm_first_ms=140, llm_tokens_per_s=0, tts_first_ms=120, tts_speed=0,
    tts_chunk_ms=100, reply=None,
)  # fmt: skip
"""The old load's providers: the reply's tokens and its speech all at once after the delay."""


def profiled_server(profile: ProviderProfile, port: int = 0) -> FakeOpenAIServer:
    """A FakeOpenAIServer that answers every call of the arrival load as ``profile`` says."""
    server = FakeOpenAIServer(api_key=API_KEY, port=port)
    server.transcribe = lambda wav, form: "do you have parking near the shop"
    first = profile.llm_first_ms / 1000
    token_delay = 1 / profile.llm_tokens_per_s if profile.llm_tokens_per_s else 0.0
    reply = profile.reply
    if reply is None:
        server.chat = lambda request: replace(echo_script(request), first_token_delay=first)
    else:
        script = ChatScript(text=reply, first_token_delay=first, token_delay=token_delay)
        server.chat = lambda request: script
    server.faults = {
        "transcriptions": Fault(delay=profile.stt_ms / 1000),
        "speech": Fault(delay=profile.tts_first_ms / 1000),
    }
    server.speech_chunk_bytes = round(24_000 * 2 * profile.tts_chunk_ms / 1000)
    if profile.tts_speed:
        server.speech_chunk_delay = profile.tts_chunk_ms / 1000 / profile.tts_speed
    return server


CARTESIA_SECONDS_PER_CHAR = 0.068
"""The Cartesia stand-in's words at this pace make ``REPLY`` 11.0 s long, as the batch fake's
speech of it is: both voices give the caller the same audio to play."""


def cartesia_server(profile: ProviderProfile, port: int = 0) -> FakeCartesiaServer:
    """The Cartesia stand-in timed as ``profile`` says: first audio ``tts_first_ms`` after the
    reply's first text, then ``tts_speed`` x real time in ``tts_chunk_ms`` chunks."""
    server = FakeCartesiaServer(api_key=API_KEY, port=port)
    server.script = TtsScript(
        first_audio=profile.tts_first_ms / 1000,
        speed=profile.tts_speed,
        chunk_seconds=profile.tts_chunk_ms / 1000,
        seconds_per_char=CARTESIA_SECONDS_PER_CHAR,
    )
    return server


def max_in_flight(requests: list[RecordedRequest], endpoint: str) -> int:
    """Most requests to ``endpoint`` the server was answering at one moment."""
    edges: list[tuple[float, int]] = []
    for r in requests:
        if r.endpoint != endpoint:
            continue
        edges.append((r.time, 1))
        edges.append((r.finished_at if r.finished_at is not None else float("inf"), -1))
    busy = peak = 0
    for _, step in sorted(edges):  # at a tie the -1 sorts first: back to back is not overlap
        busy += step
        peak = max(peak, busy)
    return peak


# -- the providers' process ---------------------------------------------------------------------


def _serve(ports: tuple[int, int], profile: ProviderProfile, stats: Path) -> None:
    """Serve until SIGTERM; on SIGUSR1 write the requests' in-flight peaks to ``stats`` and
    forget them (one level's worth at a time). The Cartesia stand-in (on ``ports[1]``) runs
    only when the profile's voice is Cartesia's."""
    voice = cartesia_server(profile, ports[1]) if profile.tts == "cartesia" else None
    with contextlib.ExitStack() as stack:
        if voice is not None:  # up before the HTTP server that wait_ready polls
            voice.start()
            stack.callback(voice.stop)
        server = stack.enter_context(profiled_server(profile, ports[0]))
        while True:
            sig = signal.sigwait({signal.SIGTERM, signal.SIGUSR1})
            if sig == signal.SIGTERM:
                return
            requests, server.requests = list(server.requests), []
            peaks = {e: max_in_flight(requests, e) for e in ("transcriptions", "chat", "speech")}
            counts = {e: sum(r.endpoint == e for r in requests) for e in peaks}
            # Written aside, then renamed: the bench polls for the file and must never read
            # it half written (it once did, and the sweep died on a JSONDecodeError).
            partial = stats.with_suffix(".partial")
            partial.write_text(json.dumps({"max_in_flight": peaks, "requests": counts}))
            partial.replace(stats)


class ProvidersProcess:
    """``profiled_server`` in a process of its own, pinned to ``cpus``."""

    def __init__(self, profile: ProviderProfile, cpus: str | None, workdir: Path) -> None:
        self.port, self.ws_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.cartesia_url = f"ws://127.0.0.1:{self.ws_port}"
        """The Cartesia stand-in, when ``profile.tts`` is ``cartesia``."""
        self._stats = workdir / f"providers-{self.port}.json"
        args = json.dumps([[self.port, self.ws_port], asdict(profile)])
        cmd = [sys.executable, __file__, "serve", args, str(self._stats)]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        self._log = (workdir / "providers.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{self.url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("the arrival load's providers did not start (see providers.log)")

    async def take_stats(self) -> dict[str, dict[str, int]]:
        """In-flight peaks and request counts since the last call."""
        self._stats.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(100):
            if self._stats.exists():
                return json.loads(self._stats.read_text())  # type: ignore[no-any-return]
            await asyncio.sleep(0.05)
        raise RuntimeError("the providers did not report their in-flight peaks")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
        self._log.close()


@contextlib.contextmanager
def providers(
    profile: ProviderProfile, cpus: str | None, workdir: Path
) -> Iterator[ProvidersProcess]:
    proc = ProvidersProcess(profile, cpus, workdir)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


# -- the flow and the callers -------------------------------------------------------------------


def agent_flow(workdir: Path) -> Path:
    """flows/ with one LLM agent and no greeting: the caller speaks first."""
    flow = {
        "name": "default",
        "start": "agent",
        "nodes": {
            "agent": {
                "kind": "agent",
                "system": "You answer questions about a bike shop in two short sentences.",
                "max_turns": 20,
                "on_max_turns": "bye",
                "on_no_input": "bye",
                "no_input_timeout": 60,
            },
            "bye": {"kind": "hangup", "say": "Goodbye."},
        },
    }
    flows = workdir / "arrival-flows"
    flows.mkdir(exist_ok=True)
    (flows / "default.yaml").write_text(yaml.safe_dump(flow, sort_keys=False))
    return flows


class ArrivalLoad(TalkLoad):
    """``calls`` callers, ``interval`` s apart, one two-turn call each (no redial)."""

    def __init__(
        self, gw: GatewayProcess, calls: int, payloads: list[str], lines: list[list[str]],
        interval: float,
    ) -> None:  # fmt: skip
        super().__init__(gw, calls, payloads, lines, ramp=interval * calls)
        self.greeting = False

    async def _caller(self, http: httpx.AsyncClient, index: int) -> None:
        await asyncio.sleep(self.start_delay(index))
        try:
            await self._one_call(http, f"CA{index:06d}{os.urandom(13).hex()}")
        except Exception as exc:  # a failed call is reported, not fatal
            self.errors.append(f"caller {index}: {exc!r}")


def turn_rate(turns: list[tuple[float, float]]) -> float:
    """Turn ends per second over the middle 80 % of them (ramp-up and tail left out)."""
    ends = sorted(end for end, _ in turns)
    if len(ends) < 10:
        return float("nan")
    lo, hi = ends[len(ends) // 10], ends[-1 - len(ends) // 10]
    inside = sum(lo <= e <= hi for e in ends)
    return inside / (hi - lo) if hi > lo else float("nan")


def v2v_ms(turns: list[tuple[float, float]], q: float) -> float:
    return round(1000 * pct([d for _, d in turns], q), 1)


__all__ = [
    "ArrivalLoad",
    "ProviderProfile",
    "TalkingStream",
    "agent_flow",
    "max_in_flight",
    "providers",
    "turn_rate",
    "v2v_ms",
]

if __name__ == "__main__":  # ProvidersProcess runs this
    if sys.argv[1:2] == ["serve"]:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
        ports, fields = json.loads(sys.argv[2])
        _serve(tuple(ports), ProviderProfile(**fields), Path(sys.argv[3]))
