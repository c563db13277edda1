"""Single provider faults on real calls, and what the caller hears (issue 8's fault suite).

A real ``ivr serve`` process runs the production provider stack (``IVR_{STT,LLM,TTS}_PROVIDER``
openai: retries, stage limits and, on a fallback lane, ``IVR_*_FALLBACK_BASE_URL``) against
``FakeOpenAIServer``s in this process. A simulated caller (``place_call``) speaks three lines.
One fault is injected at one stage on the second turn only: the primary server starts answering
that stage with the fault when it sees the chat request just before the turn's first request at
that stage, and goes back to normal ``WINDOW_S`` after the first faulted request. So every
attempt of that turn (retries included) fails, the fallback server (when the lane has one) is
healthy, and the third turn is served normally.

The fake voice gives each kind of bot sentence its own pure tone, so the caller's recording says
what was heard and when: the reply, the apology, the flow's error prompt, the not-understood
prompt, or nothing. Shared by ``bench/faults.py`` (every fault, a table) and
``tests/test_fault_suite.py`` (one fault of each kind per stage).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
import time
import wave
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby, pairwise
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from gateway_procs import GatewayProcess, GatewayProcesses, gateway_env
from prometheus_client.parser import text_string_to_metric_families

from ivr import phrases
from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import Script, default_synthesize, script_from_data
from ivr.testing.openai_server import (
    SPEECH_RATE,
    ChatScript,
    FakeOpenAIServer,
    Fault,
    RecordedRequest,
    echo_script,
    sse_body,
)

AUTH_TOKEN = "fault-suite-token"
PUBLIC_URL = "https://gw.example.com"
API_KEY = "sk-faults"
# No commas: a comma pause can exceed the 300 ms endpoint silence and split a line in two.
LINES = ("What are your opening hours?", "Do you have parking nearby?", "Thank you that is all.")
TRANSCRIPT = "what are your opening hours"
REPLY = f"You said: {TRANSCRIPT}."
"""What the fake model answers every turn (``echo_script``): one sentence, one TTS request."""
FAULTED_TURN = 2
HEARD_WITHIN_S = 1.5
"""Issue 8: a reply or the apology within this long after the caller stops talking."""
MAX_DEAD_AIR_S = 2.0
"""Issue 8: no longer wait for bot audio, in any turn of the call."""
WINDOW_S = 2.0
"""The fault lasts this long after the first faulted request: longer than any stage budget
(STT 1.5 s), shorter than the time to the next turn's request at that stage (>= 3 s)."""
ENDPOINT = {"stt": "transcriptions", "llm": "chat", "tts": "speech"}
STAGES = tuple(ENDPOINT)

# -- the bot's voice: one tone per kind of sentence -----------------------------------------------

BOT_SECONDS_PER_CHAR = 0.04
TONE_HZ = {
    "reply": 500.0,
    "apology": 1000.0,
    "not-understood": 1500.0,
    "other": 2000.0,
    "error prompt": 2500.0,
}
"""Multiples of 50 Hz: each is the centre of one FFT bin of a 20 ms frame at 8 kHz."""
ANSWERS = ("reply", "apology", "error prompt", "not-understood")
"""What counts as the caller being answered (a whole reply, or one of the apologies)."""
REPLY_SECONDS = len(REPLY) * BOT_SECONDS_PER_CHAR


def sentence_kind(text: str) -> str:
    if text.startswith("You said"):
        return "reply"
    if text == phrases.LLM_FAILURE:
        return "apology"
    if text == phrases.NOT_UNDERSTOOD:
        return "not-understood"
    if text.startswith("Sorry"):  # the flow's error prompt ("Sorry, something went wrong ...")
        return "error prompt"
    return "other"


def tone_speak(text: str) -> bytes:
    """PCM16 at 24 kHz: the tone of the sentence's kind, 40 ms per character, 5 ms fades."""
    n = max(2, round(len(text) * BOT_SECONDS_PER_CHAR * SPEECH_RATE))
    t = np.arange(n) / SPEECH_RATE
    tone = 0.3 * np.sin(2 * np.pi * TONE_HZ[sentence_kind(text)] * t)
    ramp = min(n // 2, SPEECH_RATE // 200)
    envelope = np.ones(n)
    envelope[:ramp] = np.linspace(0.0, 1.0, ramp)
    envelope[n - ramp :] = np.linspace(1.0, 0.0, ramp)
    return (tone * envelope * 32767).astype("<i2").tobytes()


@functools.cache
def caller_voice(text: str) -> tuple[bytes, int]:
    """espeak, once per line: rendering stays out of every call after the first."""
    return default_synthesize(text)


def caller_script() -> Script:
    return script_from_data(
        {"steps": list(LINES), "turn_gap": 0.6, "max_wait": 8.0}, source="fault suite"
    )


# -- the faults -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultCase:
    stage: str
    name: str
    fault: Fault
    kind: str
    """The ``kind`` label it must be counted under in ``ivr_provider_errors_total``."""
    fallback: bool = False
    """The gateway has a healthy fallback endpoint for every stage."""

    @property
    def label(self) -> str:
        return f"{self.stage} {self.name}" + (" [fallback]" if self.fallback else "")


SSE = "text/event-stream"
HTML = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
RATE_LIMITED = Fault(status=429, headers={"Retry-After": "1"})
NULL_CHOICES = sse_body(
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    | {"choices": None}
)
_CASES: dict[str, list[tuple[str, Fault, str]]] = {
    "stt": [
        ("500", Fault(status=500), "status"),
        ("429 Retry-After 1", RATE_LIMITED, "status"),
        ("garbage (HTML page)", Fault(raw=HTML, content_type="text/html"), "payload"),
        ('null field {"text": null}', Fault(raw=b'{"text": null}'), "payload"),
        ("reset before headers", Fault(drop=True), "reset"),
        ("stall, no byte", Fault(hang=True), "timeout"),
    ],
    "llm": [
        ("500", Fault(status=500), "status"),
        ("429 Retry-After 1", RATE_LIMITED, "status"),
        ("garbage (SSE not JSON)", Fault(raw=sse_body("{oops"), content_type=SSE), "payload"),
        ('null field "choices": null', Fault(raw=NULL_CHOICES, content_type=SSE), "payload"),
        ("reset before headers", Fault(drop=True), "reset"),
        ("reset mid-stream", Fault(after_chunks=3), "reset"),
        ("stall, no byte", Fault(hang=True), "timeout"),
        ("stall mid-stream", Fault(after_chunks=3, then="stall"), "timeout"),
    ],
    "tts": [
        ("500", Fault(status=500), "status"),
        ("429 Retry-After 1", RATE_LIMITED, "status"),
        ("garbage (HTML page)", Fault(raw=HTML, content_type="text/html"), "payload"),
        ("JSON instead of audio", Fault(raw=b'{"error": "quota"}'), "payload"),
        ("reset before headers", Fault(drop=True), "reset"),
        ("reset mid-stream", Fault(after_chunks=2), "reset"),
        ("stall, no byte", Fault(hang=True), "timeout"),
        ("stall mid-stream", Fault(after_chunks=2, then="stall"), "timeout"),
    ],
}
"""Mid-stream faults break the answer after the first output (LLM: the role chunk and two
tokens; TTS: 200 ms of audio), where nothing may be retried any more."""
_WITH_FALLBACK = {
    "stt": ("500", "reset before headers", "stall, no byte", 'null field {"text": null}'),
    "llm": ("500", "reset before headers", "stall, no byte", 'null field "choices": null'),
    "tts": ("500", "reset before headers", "stall, no byte", "JSON instead of audio"),
}
SUBSET = {
    "stt": ("500", 'null field {"text": null}', "reset before headers", "stall, no byte"),
    "llm": (
        "429 Retry-After 1",
        'null field "choices": null',
        "reset mid-stream",
        "stall, no byte",
    ),
    "tts": ("500", "JSON instead of audio", "reset mid-stream", "stall, no byte"),
}
"""One fault of each kind (status, payload, reset, timeout) per stage: the CI test's share."""


def all_cases(*, fallback: bool = True) -> list[FaultCase]:
    cases = [FaultCase(s, n, f, k) for s in STAGES for n, f, k in _CASES[s]]
    if fallback:
        cases += [
            FaultCase(s, n, f, k, fallback=True)
            for s in STAGES
            for n, f, k in _CASES[s]
            if n in _WITH_FALLBACK[s]
        ]
    return cases


def subset_cases() -> list[FaultCase]:
    return [c for c in all_cases(fallback=False) if c.name in SUBSET[c.stage]]


# -- one lane: fake providers and the gateway that uses them --------------------------------------


@dataclass(frozen=True, slots=True)
class Delays:
    """The fake providers' answer times, seconds."""

    stt: float = 0.15
    llm: float = 0.20
    tts: float = 0.10

    def of(self, stage: str) -> float:
        return float(getattr(self, stage))


@dataclass(slots=True)
class Injection:
    """One call's fault: armed by the chat request of ``arm_turn``, lifted after WINDOW_S."""

    case: FaultCase
    fault: Fault
    arm_turn: int
    armed_at: float | None = None
    lifted_at: float | None = None


def _user_turns(request: dict[str, Any]) -> int:
    return sum(1 for m in request.get("messages") or [] if m.get("role") == "user")


class Providers:
    """A lane's fake providers: the primary (faults go here) and, optionally, a healthy fallback."""

    def __init__(self, delays: Delays, *, fallback: bool) -> None:
        self.delays = delays
        self.primary = self._server(arming=True)
        self.fallback = self._server(arming=False) if fallback else None
        self.injection: Injection | None = None

    def _server(self, *, arming: bool) -> FakeOpenAIServer:
        server = FakeOpenAIServer(api_key=API_KEY)
        server.transcribe = lambda wav, form: TRANSCRIPT
        server.speak = tone_speak
        server.chat = self._arm_and_echo if arming else self._echo
        server.faults = self.baseline()
        return server

    def baseline(self) -> dict[str, Fault]:
        """The providers' normal answer times (the LLM's is the script's first-token delay)."""
        return {
            "transcriptions": Fault(delay=self.delays.stt),
            "speech": Fault(delay=self.delays.tts),
        }

    def _echo(self, request: dict[str, Any]) -> ChatScript:
        return replace(echo_script(request), first_token_delay=self.delays.llm)

    def _arm_and_echo(self, request: dict[str, Any]) -> ChatScript:
        # The server's worker thread, after this request's own fault check: the fault hits
        # only the requests after this one.
        injection = self.injection
        if (
            injection is not None
            and injection.armed_at is None
            and _user_turns(request) == injection.arm_turn
        ):
            self.primary.faults[ENDPOINT[injection.case.stage]] = injection.fault
            injection.armed_at = time.monotonic()
        return self._echo(request)

    def inject(self, case: FaultCase) -> Injection:
        """Arm ``case`` for the next call: STT and LLM faults once turn 1's chat request is in
        (the next STT / chat request is turn 2's), TTS faults with turn 2's chat request."""
        llm_mid_stream = case.stage == "llm" and case.fault.after_chunks is not None
        # A fault answers after the stage's usual time (the LLM stream has its own delay).
        fault = replace(case.fault, delay=0.0 if llm_mid_stream else self.delays.of(case.stage))
        arm_turn = FAULTED_TURN if case.stage == "tts" else FAULTED_TURN - 1
        self.injection = Injection(case, fault, arm_turn)
        return self.injection

    async def lift_after_window(self, injection: Injection) -> None:
        """WINDOW_S after the first faulted request, the stage answers normally again."""
        endpoint = ENDPOINT[injection.case.stage]
        try:
            while (hit := self._first_faulted(injection)) is None:  # noqa: ASYNC110 - the fake server logs, it can't signal
                await asyncio.sleep(0.02)
            await asyncio.sleep(max(0.0, hit.time + WINDOW_S - time.monotonic()))
        finally:
            normal = self.baseline().get(endpoint)
            if normal is None:
                self.primary.faults.pop(endpoint, None)
            else:
                self.primary.faults[endpoint] = normal
            injection.lifted_at = time.monotonic()

    def _first_faulted(self, injection: Injection) -> RecordedRequest | None:
        return next((r for r in list(self.primary.requests) if r.fault is injection.fault), None)

    async def __aenter__(self) -> Providers:
        await asyncio.to_thread(self.primary.start)
        if self.fallback is not None:
            await asyncio.to_thread(self.fallback.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.primary.stop)
        if self.fallback is not None:
            await asyncio.to_thread(self.fallback.stop)


@dataclass(slots=True)
class Lane:
    providers: Providers
    gateway: GatewayProcess

    @property
    def fallback(self) -> bool:
        return self.providers.fallback is not None


def lane_env(providers: Providers, vad: str) -> dict[str, str]:
    env = gateway_env(
        providers_url=providers.primary.base_url, api_key=API_KEY, public_url=PUBLIC_URL,
        auth_token=AUTH_TOKEN, redis_url="", redis_prefix="ivr:", IVR_VAD=vad,
    )  # fmt: skip
    if providers.fallback is not None:
        for stage in ("STT", "LLM", "TTS"):
            env[f"IVR_{stage}_FALLBACK_BASE_URL"] = providers.fallback.base_url
            env[f"IVR_{stage}_FALLBACK_API_KEY"] = API_KEY
    return env


@contextlib.asynccontextmanager
async def open_lanes(
    fallbacks: Sequence[bool], delays: Delays, log_dir: Path, vad: str
) -> AsyncIterator[list[Lane]]:
    """One lane per entry (True: with fallback endpoints); gateways stop before providers."""
    async with contextlib.AsyncExitStack() as stack:
        all_providers = [
            await stack.enter_async_context(Providers(delays, fallback=fb)) for fb in fallbacks
        ]
        procs = stack.enter_context(GatewayProcesses(log_dir))
        lanes = [
            Lane(p, procs.start(f"gw-{i}{'-fallback' if fb else ''}", lane_env(p, vad)))
            for i, (p, fb) in enumerate(zip(all_providers, fallbacks, strict=True))
        ]
        await procs.wait_healthy(within=90.0)
        yield lanes


# -- what the caller heard ------------------------------------------------------------------------

FRAME = 160  # 20 ms at 8 kHz
AUDIBLE_RMS = 300.0  # the tones are ~7000 rms; digital silence is 0


@dataclass(frozen=True, slots=True)
class Burst:
    """Bot audio of one kind, played from ``start`` to ``end`` (seconds since the call began)."""

    kind: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def heard_bursts(wav_path: Path) -> list[Burst]:
    """The bot channel of a ``place_call`` recording as bursts of one tone each."""
    with wave.open(str(wav_path), "rb") as w:
        rate = w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    bot = samples.reshape(-1, 2)[:, 1].astype(np.float64)
    n = len(bot) // FRAME
    frames = bot[: n * FRAME].reshape(n, FRAME)
    rms = np.sqrt(np.mean(frames**2, axis=1))
    bins = [round(hz * FRAME / rate) for hz in TONE_HZ.values()]
    kinds = list(TONE_HZ)
    strongest = np.argmax(np.abs(np.fft.rfft(frames, axis=1))[:, bins], axis=1)
    step = FRAME / rate
    bursts: list[Burst] = []
    for i in np.flatnonzero(rms > AUDIBLE_RMS):
        kind, t = kinds[int(strongest[i])], i * step
        if bursts and bursts[-1].kind == kind and t - bursts[-1].end < 0.1:
            bursts[-1] = replace(bursts[-1], end=t + step)
        else:
            bursts.append(Burst(kind, t, t + step))
    # A frame where one sentence ends and the next begins may read as a third tone.
    return [b for b in bursts if b.seconds > step or b.kind != "other"]


@dataclass(frozen=True, slots=True)
class TurnHeard:
    caller_end: float
    """End of the caller's speech."""
    until: float
    """The caller's next line started (or the call ended)."""
    bursts: tuple[Burst, ...]

    @property
    def first_audio_s(self) -> float | None:
        return self.bursts[0].start - self.caller_end if self.bursts else None

    @property
    def dead_air_s(self) -> float:
        """Longest wait for bot audio: to the first burst, or between bursts; with no audio at
        all, until the caller gave up waiting and spoke again."""
        if not self.bursts:
            return self.until - self.caller_end
        gaps = [b.start - a.end for a, b in pairwise(self.bursts)]
        return max([self.bursts[0].start - self.caller_end, *gaps])

    def describe(self) -> str:
        parts = []
        for kind, group in groupby(self.bursts, key=lambda b: b.kind):
            seconds = sum(b.seconds for b in group)
            if kind == "reply" and seconds < 0.9 * REPLY_SECONDS:
                parts.append(f"partial reply ({seconds:.1f} of {REPLY_SECONDS:.1f} s)")
            else:
                parts.append(kind)
        return " + ".join(parts) or "nothing"

    @property
    def answered(self) -> bool:
        """A whole reply or an apology was heard (a cut-off reply alone is not an answer)."""
        return any(p in ANSWERS for p in self.describe().split(" + "))


def caller_turns(report: CallReport, bursts: Sequence[Burst]) -> list[TurnHeard]:
    said = [t for t in report.turns if t.caller_text is not None]
    untils = [t.caller_start_t for t in said[1:]] + [report.duration_s]
    return [
        TurnHeard(
            t.caller_end_t, until, tuple(b for b in bursts if t.caller_end_t <= b.start < until)
        )
        for t, until in zip(said, untils, strict=True)
    ]


# -- one faulted call -----------------------------------------------------------------------------


@dataclass(slots=True)
class FaultResult:
    fault: str
    stage: str
    kind: str
    fallback: bool
    heard_after_s: float | None
    """Faulted turn: end of caller speech -> first bot audio played, of any kind."""
    heard: str
    """What that turn's bot audio was: reply / apology / error prompt / not-understood /
    partial reply (... s) / nothing, in order."""
    answered: bool
    dead_air_s: float
    """Longest wait for bot audio over the three turns."""
    dead_air_turn: int
    next_turn: bool
    """The turn after the faulted one got a whole reply."""
    requests: int
    """Requests to the faulted stage's primary endpoint during the faulted turn."""
    fallback_requests: int
    faulted_requests: int
    counted: dict[str, float]
    """``ivr_provider_errors_total`` increases during the call, by ``stage/provider/kind``."""
    turn_first_audio_s: list[float | None]
    errors: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)

    def counted_as(self, stage: str, kind: str) -> float:
        return sum(
            v
            for k, v in self.counted.items()
            if k.startswith(f"{stage}/") and k.endswith(f"/{kind}")
        )


async def provider_errors(gateway: GatewayProcess) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"{gateway.base_url}/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ivr_provider_errors_total":
                out[f"{s.labels['stage']}/{s.labels['provider']}/{s.labels['kind']}"] = s.value
    return out


def _in_window(server: FakeOpenAIServer | None, endpoint: str, injection: Injection) -> int:
    if server is None or injection.armed_at is None:
        return 0
    until = injection.lifted_at or time.monotonic()
    return sum(
        1
        for r in list(server.requests)
        if r.endpoint == endpoint and injection.armed_at <= r.time <= until
    )


async def run_case(lane: Lane, case: FaultCase, script: Script, workdir: Path) -> FaultResult:
    providers = lane.providers
    before = await provider_errors(lane.gateway)
    injection = providers.inject(case)
    wav = workdir / f"{re.sub(r'[^a-z0-9]+', '-', case.label.lower()).strip('-')}.wav"
    lifter = asyncio.create_task(providers.lift_after_window(injection))
    try:
        report = await place_call(
            lane.gateway.base_url, script=script, auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL, record_path=wav, synthesize=caller_voice,
        )  # fmt: skip
    finally:
        lifter.cancel()
        await asyncio.gather(lifter, return_exceptions=True)
        providers.injection = None
    after = await provider_errors(lane.gateway)
    counted = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
    endpoint = ENDPOINT[case.stage]
    turns = caller_turns(report, await asyncio.to_thread(heard_bursts, wav))
    result = summarise(case, turns, counted, report)
    result.requests = _in_window(providers.primary, endpoint, injection)
    result.fallback_requests = _in_window(providers.fallback, endpoint, injection)
    result.faulted_requests = sum(
        1 for r in list(providers.primary.requests) if r.fault is injection.fault
    )
    return result


def summarise(
    case: FaultCase, turns: list[TurnHeard], counted: dict[str, float], report: CallReport
) -> FaultResult:
    errors = list(report.errors) + [f"{v.code}: {v.reason}" for v in report.violations]
    if len(turns) != len(LINES):
        errors.append(f"expected {len(LINES)} caller turns, the report has {len(turns)}")
        turns += [TurnHeard(report.duration_s, report.duration_s, ())] * (len(LINES) - len(turns))
    faulted, following = turns[FAULTED_TURN - 1], turns[FAULTED_TURN]
    worst = max(range(len(turns)), key=lambda i: turns[i].dead_air_s)
    result = FaultResult(
        fault=case.label, stage=case.stage, kind=case.kind, fallback=case.fallback,
        heard_after_s=faulted.first_audio_s, heard=faulted.describe(), answered=faulted.answered,
        dead_air_s=turns[worst].dead_air_s, dead_air_turn=worst + 1,
        next_turn=following.describe() == "reply", requests=0, fallback_requests=0,
        faulted_requests=0, counted=counted,
        turn_first_audio_s=[t.first_audio_s for t in turns], errors=errors,
    )  # fmt: skip
    result.misses = misses(result)
    return result


def misses(r: FaultResult) -> list[str]:
    """Which of issue 8's targets this call missed, in words."""
    out = []
    if not r.answered:
        out.append(f"heard {r.heard}, not a reply or an apology")
    if r.heard_after_s is None or r.heard_after_s > HEARD_WITHIN_S:
        after = "never" if r.heard_after_s is None else f"after {r.heard_after_s:.2f} s"
        out.append(f"first audio {after} (target {HEARD_WITHIN_S} s)")
    if r.dead_air_s > MAX_DEAD_AIR_S:
        out.append(f"{r.dead_air_s:.2f} s dead air in turn {r.dead_air_turn}")
    if not r.next_turn:
        out.append("the next turn got no whole reply")
    if not r.counted_as(r.stage, r.kind):
        out.append(f"not counted as {r.stage}/{r.kind} in ivr_provider_errors_total")
    return out + [f"call: {e}" for e in r.errors]


# -- many faulted calls, a few at a time ----------------------------------------------------------


async def run_cases(
    cases: Sequence[FaultCase],
    workdir: Path,
    *,
    lanes: int = 4,
    delays: Delays = Delays(),
    vad: str = "silero",
    on_result: Callable[[FaultResult], None] | None = None,
) -> list[FaultResult]:
    """Every case, each in its own call; ``lanes`` gateways (fallback ones in proportion to
    the fallback cases) each run their calls one after another. Results in ``cases`` order."""
    queues = {fb: collections.deque(c for c in cases if c.fallback == fb) for fb in (False, True)}
    fallbacks = _lane_kinds(len(queues[False]), len(queues[True]), lanes)
    await asyncio.gather(*(asyncio.to_thread(caller_voice, line) for line in LINES))
    script = caller_script()
    done: dict[str, FaultResult] = {}

    async def work(lane: Lane) -> None:
        queue = queues[lane.fallback]
        while queue:
            case = queue.popleft()
            try:
                result = await run_case(lane, case, script, workdir)
            except Exception as exc:  # one broken call must not hide the others' numbers
                result = _failed(case, exc)
            done[case.label] = result
            if on_result is not None:
                on_result(result)

    async with open_lanes(fallbacks, delays, workdir, vad) as opened:
        await asyncio.gather(*(work(lane) for lane in opened))
    return [done[c.label] for c in cases]


def _lane_kinds(plain: int, fallback: int, lanes: int) -> list[bool]:
    """How many of ``lanes`` get fallback endpoints: in proportion, at least one of each kind
    that has cases, never more lanes than cases."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, got {lanes}")
    total = plain + fallback
    with_fb = min(fallback, max(1 if fallback else 0, round(lanes * fallback / max(total, 1))))
    without = min(plain, max(1 if plain else 0, lanes - with_fb))
    return [False] * without + [True] * with_fb


def _failed(case: FaultCase, exc: Exception) -> FaultResult:
    result = FaultResult(
        fault=case.label, stage=case.stage, kind=case.kind, fallback=case.fallback,
        heard_after_s=None, heard="(call failed)", answered=False, dead_air_s=float("nan"),
        dead_air_turn=0, next_turn=False, requests=0, fallback_requests=0, faulted_requests=0,
        counted={}, turn_first_audio_s=[], errors=[f"{type(exc).__name__}: {exc}"],
    )  # fmt: skip
    result.misses = [f"the call failed: {type(exc).__name__}: {exc}"]
    return result
