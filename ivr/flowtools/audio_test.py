"""``ivr flows test --audio``: the YAML conversation tests, through the real audio path.

Per test file, one gateway runs in-process under uvicorn; a local OpenAI-compatible server
(``FakeOpenAIServer``) is its STT, LLM and TTS. Each case is one call placed by the simulated
Twilio caller (``ivr.sim``): ``say`` is spoken with espeak and the STT answers the scripted
text, ``press`` is DTMF, ``silent`` waits out the (shortened) no-input timeout.

Each case runs on a copy of its flow (in a temporary directory) with the test's variables as
start values, a number of its own and short no-input timeouts. Checks:

* ``bot_says`` / ``bot_not_says``: the texts the gateway sent to TTS between this input and the
  next (static prompts are not pre-synthesised here, so every prompt goes through TTS);
* ``node`` / ``vars``: the call record in the gateway's store when the caller gave the next
  input (the flow persists after every step); ``ended`` / ``transfer_to``: the final record and
  the ``<Connect action>`` answer (``<Hangup/>`` or ``<Dial>``).

``barge_in_after_words`` is approximate in audio (N words is a time into the prompt).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import struct
import tempfile
import threading
import time
import wave
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ivr.config import Settings
from ivr.flows.loader import load_flow
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError
from ivr.flowtools.testing import (
    Case,
    CaseResult,
    LocalJsonServer,
    ScriptedLlm,
    Step,
    TestFile,
    load_test_file,
    resolve_flow,
)
from ivr.gateway import Gateway, build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import running_server
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.sim.script import Script, default_synthesize, script_from_data
from ivr.state.base import CallRecord
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.openai_server import FakeOpenAIServer, default_speak
from ivr.tts.openai_http import OpenAIHttpTts

NO_INPUT_TIMEOUT = 2.0
"""Seconds; every no-input timeout of the copied flows (the sim caller waits this long)."""
SPEAK_RATE = 8000
"""``fast_speak`` renders at this rate and the server streams it as 24 kHz: 3x speed."""
SECONDS_PER_WORD = 0.2
"""Fast speech, roughly: turns ``barge_in_after_words`` into a time into the prompt."""
AUTH_TOKEN = "flows-audio-test"
PUBLIC_URL = "https://flows-test.invalid"
CASE_TIMEOUT = 90.0


def fast_speak(text: str) -> bytes:
    """The fake TTS voice at three times its speed (about 22 ms a character): short tests."""
    return default_speak(text, SPEAK_RATE)


def speech_seconds(text: str) -> float:
    """How long ``fast_speak(text)`` plays on the line."""
    return len(fast_speak(text)) / 2 / 24_000


# ---------------------------------------------------------------- flow copies


def flow_copy_data(
    source: Path, *, name: str, number: str, variables: dict[str, Any], no_input_timeout: float
) -> dict[str, Any]:
    """The flow file as data, renamed, on its own number, with test variables as start values
    and every no-input timeout shortened."""
    data: dict[str, Any] = yaml.safe_load(source.read_text(encoding="utf-8"))
    data["name"], data["numbers"] = name, [number]
    data["variables"] = {**(data.get("variables") or {}), **variables}
    defaults = data.setdefault("defaults", {}) or {}
    defaults["no_input_timeout"] = no_input_timeout
    data["defaults"] = defaults
    for node in (data.get("nodes") or {}).values():
        if isinstance(node, dict) and "no_input_timeout" in node:
            node["no_input_timeout"] = no_input_timeout
    return data


def copy_knowledge(flow: Flow, source_dir: Path, target_dir: Path) -> None:
    for node in flow.nodes.values():
        for rel in node.knowledge_files():
            dst = target_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_dir / rel, dst)


def copy_subflows(flow: Flow, target_dir: Path) -> None:
    """The flows it includes, as they are (names kept), with no-input timeouts shortened."""
    for sub in flow.subflows.values():
        source = Path(sub.source)
        data: dict[str, Any] = yaml.safe_load(source.read_text(encoding="utf-8"))
        data.setdefault("defaults", {})["no_input_timeout"] = NO_INPUT_TIMEOUT
        for node in (data.get("nodes") or {}).values():
            if isinstance(node, dict) and "no_input_timeout" in node:
                node["no_input_timeout"] = NO_INPUT_TIMEOUT
        text = yaml.safe_dump(data, sort_keys=False)
        (target_dir / source.name).write_text(text, encoding="utf-8")
        copy_knowledge(sub, source.parent, target_dir)


def case_number(index: int) -> str:
    return f"+1555077{index:04d}"


# ---------------------------------------------------------------- observing the gateway


@dataclass(slots=True)
class _Snapshot:
    t: float
    node: str | None
    variables: dict[str, Any]


@dataclass(slots=True)
class _Observer:
    """What the call looked like over time: the store's record, polled while the call runs."""

    snapshots: list[_Snapshot] = field(default_factory=list)
    final: CallRecord | None = None

    async def poll(self, store: Any, number: str, period: float = 0.02) -> None:
        version = -1
        while True:
            for record in await store.list_active():
                if record.to_number == number and record.version != version:
                    version = record.version
                    self.snapshots.append(
                        _Snapshot(time.monotonic(), record.node, dict(record.variables))
                    )
            await asyncio.sleep(period)

    def at(self, t: float) -> _Snapshot | None:
        before = [s for s in self.snapshots if s.t <= t]
        return before[-1] if before else None


class _Synth:
    """espeak for the caller's voice, cached, and the time the script finished rendering (the
    call's clock starts right after: it bounds the report's t=0 from below)."""

    def __init__(self) -> None:
        self.cache: dict[str, tuple[bytes, int]] = {}
        self.last = 0.0
        self.lock = threading.Lock()

    def __call__(self, text: str) -> tuple[bytes, int]:
        with self.lock:
            if text not in self.cache:
                self.cache[text] = default_synthesize(text)
            self.last = time.monotonic()
            return self.cache[text]


# ---------------------------------------------------------------- running


@dataclass(slots=True)
class AudioRun:
    """Servers shared by the cases of one test file."""

    fake: FakeOpenAIServer
    gateway: Gateway
    base_url: str
    backend: LocalJsonServer | None
    script: ScriptedLlm
    transcripts: collections.deque[str]
    blip: Path


async def run_audio_test_file(path: Path) -> list[CaseResult]:
    """Run every case of one test file through the audio path; a broken file is one failure."""
    try:
        spec, _ = load_test_file(path)
        flow_path = resolve_flow(path, spec.flow)
        flow = load_flow(flow_path)
    except FlowLoadError as exc:
        return [CaseResult(str(path), "(load)", [str(p) for p in exc.problems])]
    except OSError as exc:
        return [CaseResult(str(path), "(load)", [f"cannot read: {exc}"])]
    with tempfile.TemporaryDirectory(prefix="ivr-flows-audio-") as tmp:
        async with _serve(spec, flow, flow_path, Path(tmp)) as run:
            results = []
            for index, case in enumerate(spec.tests):
                result = CaseResult(str(path), f"{case.name} [audio]")
                try:
                    await asyncio.wait_for(_run_case(run, case, index, result), CASE_TIMEOUT)
                except Exception as exc:  # one broken case must not hide the others
                    result.failures.append(f"the call crashed: {type(exc).__name__}: {exc}")
                results.append(result)
            return results


@contextlib.asynccontextmanager
async def _serve(spec: TestFile, flow: Flow, flow_path: Path, tmp: Path) -> AsyncIterator[AudioRun]:
    flows_dir = tmp / "flows"
    flows_dir.mkdir()
    blip = tmp / "blip.wav"
    write_blip(blip)
    with contextlib.ExitStack() as stack:
        backend = None
        if spec.backend is not None:
            backend = stack.enter_context(LocalJsonServer(spec.backend.routes))
        for index, case in enumerate(spec.tests):
            variables = {**spec.variables, **case.variables}
            if backend is not None and spec.backend is not None:
                variables.setdefault(spec.backend.variable, backend.url)
            data = flow_copy_data(
                flow_path,
                name=f"{flow.name}_case{index}",
                number=case_number(index),
                variables=variables,
                no_input_timeout=NO_INPUT_TIMEOUT,
            )
            target = flows_dir / f"{flow.name}_case{index}.yaml"
            target.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        copy_knowledge(flow, flow_path.parent, flows_dir)
        copy_subflows(flow, flows_dir)
        script = ScriptedLlm()
        transcripts: collections.deque[str] = collections.deque()
        async with FakeOpenAIServer(api_key="sk-flows") as fake:
            fake.chat = script
            fake.speak = fast_speak
            fake.transcribe = lambda wav, form: transcripts.popleft() if transcripts else ""
            settings = Settings(
                public_url=PUBLIC_URL,
                twilio_auth_token=AUTH_TOKEN,
                llm_api_key="sk-flows",
                redis_url="",
                flows_dir=str(flows_dir),
                vad="webrtc",
            )
            base = fake.base_url
            gateway = build_gateway(
                settings,
                stt=OpenAIHttpStt(base_url=base, api_key="sk-flows"),
                tts=OpenAIHttpTts(base_url=base, api_key="sk-flows"),
                llm=OpenAICompatLlm(base_url=base, api_key="sk-flows", model="flow-test"),
                # Every prompt goes through TTS, so each turn's bot text is observable there.
                prewarm_prompts=False,
            )
            async with running_server(gateway) as server:
                yield AudioRun(fake, gateway, server.base_url, backend, script, transcripts, blip)


def write_blip(path: Path) -> None:
    """A single faint click: audible to the sim caller's trimmer, never speech to a VAD. It lets
    a silent step wait for the bot's turn to end first, like the other steps do."""
    samples = [0] * 160
    samples[80] = 400
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(struct.pack(f"<{len(samples)}h", *samples))


def caller_steps(steps: list[Step], blip: Path) -> tuple[list[dict[str, Any]], list[str], bool]:
    """Sim caller steps, the STT answers in order, and whether to wait for the greeting."""
    out: list[dict[str, Any]] = []
    said: list[str] = []
    wait_greeting = True
    for i, step in enumerate(steps):
        barge = step.barge_in_after_words
        if step.say is not None:
            said.append(step.say)
            if barge is not None:
                out.append({"barge_in": {"say": step.say, "after": barge * SECONDS_PER_WORD}})
            else:
                out.append({"say": step.say})
        elif step.press is not None:
            if barge is not None:
                # No "press while the bot talks" step: start early, press without waiting.
                if i == 0:
                    wait_greeting = False
                out.append({"silence": 1.0 + barge * SECONDS_PER_WORD})
                out.append({"press": step.press, "wait": False})
            else:
                out.append({"press": step.press})
        elif step.silent:
            out.append({"wav": str(blip)})
            out.append({"silence": NO_INPUT_TIMEOUT})
        elif step.hangup:
            out.append({"hangup": None})
    return out, said, wait_greeting


async def _run_case(run: AudioRun, case: Case, index: int, result: CaseResult) -> None:
    steps = list(case.steps)
    if steps[0].turn() is not None:
        steps.insert(0, Step())
    inputs = [s for s in steps[1:] if s.turn() is not None]
    sim_steps, said, wait_greeting = caller_steps(inputs, run.blip)
    run.script.load(steps)
    run.transcripts.clear()
    run.transcripts.extend(said)
    if not sim_steps:  # only checks after the greeting: stay on the line for it
        sim_steps = [{"wav": str(run.blip)}]
    script = script_from_data(
        {"steps": sim_steps, "wait_for_greeting": wait_greeting, "max_wait": 15},
        source=case.name,
    )
    call = await _place(run, script, case_number(index))
    report = call.report
    result.transcript = _transcript(report, call.speech, call.t0)
    result.failures += [f"sim caller: {e}" for e in report.errors]
    result.failures += [f"protocol violation: {v.code} {v.reason}" for v in report.violations]
    checkpoints = _checkpoints(report, call.observer, call.speech, call.t0, len(inputs), steps[-1])
    final_record = call.observer.final
    for i, (step, cp) in enumerate(zip(steps, checkpoints, strict=True)):
        final = i == len(steps) - 1
        for problem in _check(step, cp, final_record, report.closing_twiml, final):
            result.failures.append(f"step {i}: {problem}")
    if any(s.barge_in_after_words is not None for s in inputs) and not report.clears:
        result.failures.append("the caller talked over the bot, but no clear reached Twilio")
    result.failures += run.script.leftovers()
    if run.transcripts:
        result.failures.append(f"{len(run.transcripts)} caller utterances were never transcribed")


@dataclass(slots=True)
class _Call:
    """One call placed: the sim caller's report, the store's view of it, what went to TTS."""

    report: CallReport
    observer: _Observer
    speech: list[tuple[float, str]]
    """(time, text) of every TTS request the call caused."""
    t0: float
    """When the call's clock started (the report's times are relative to it)."""


async def _place(run: AudioRun, script: Script, number: str) -> _Call:
    observer = _Observer()
    synth = _Synth()
    speech_before = len(run.fake.requests_for("speech"))
    poller = asyncio.create_task(observer.poll(run.gateway.store, number))
    started = time.monotonic()
    try:
        report = await place_call(
            run.base_url,
            script=script,
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
            to=number,
            synthesize=synth,
        )
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    observer.final = await run.gateway.store.get(report.call_sid)
    speech = [
        (r.time, str((r.json or {}).get("input", "")))
        for r in run.fake.requests_for("speech")[speech_before:]
    ]
    return _Call(report, observer, speech, max(started, synth.last))


@dataclass(slots=True)
class _Checkpoint:
    bot: list[str]
    snapshot: _Snapshot | None


def _checkpoints(
    report: CallReport,
    observer: _Observer,
    speech: list[tuple[float, str]],
    t0: float,
    n_inputs: int,
    last: Step,
) -> list[_Checkpoint]:
    """What the bot said and where the flow was, between one caller input and the next."""
    turns = [t for t in report.turns if t.caller_text is not None]
    # A silent step is one caller turn (the click); a hangup is none.
    starts = [t0 + t.caller_start_t for t in turns][:n_inputs]
    ends = [t0, *[t0 + t.caller_end_t for t in turns][:n_inputs]]
    out = []
    for i, begin in enumerate(ends):
        until = starts[i] if i < len(starts) else float("inf")
        bot = [text for t, text in speech if begin <= t < until]
        snap = observer.at(until) if until != float("inf") else None
        out.append(_Checkpoint(bot, snap))
    if last.hangup and len(out) > n_inputs:
        out = out[: n_inputs + 1]
    while len(out) < n_inputs + 1:
        out.append(_Checkpoint([], None))
    return out


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def _check(
    step: Step, cp: _Checkpoint, record: CallRecord | None, closing: str | None, final: bool
) -> Iterator[str]:
    said = " ".join(cp.bot)
    node = cp.snapshot.node if cp.snapshot else None
    variables = cp.snapshot.variables if cp.snapshot else {}
    if final and record is not None:
        node, variables = record.node, record.variables
    if step.node is not None and node != step.node.rpartition(".")[2]:  # flow.node: a sub-flow
        yield f"expected node '{step.node}', at '{node}'"
    for text in _as_list(step.bot_says):
        if text.lower() not in said.lower():
            yield f"expected the bot to say {text!r}; TTS got {said!r}"
    for text in _as_list(step.bot_not_says):
        if text.lower() in said.lower():
            yield f"the bot said {text!r}: {said!r}"
    for name, want in step.vars.items():
        got = variables.get(name)
        if got != want and str(got) != str(want):
            yield f"expected variable {name} = {want!r}, got {got!r}"
    if step.ended is not None:
        yield from _check_end(step, record if final else None, closing)
    if step.transfer_to is not None:
        if record is None or record.transfer_to != step.transfer_to:
            got = record.transfer_to if record else None
            yield f"expected a transfer to {step.transfer_to}, the call record has {got!r}"
        if closing is None or f"<Number>{step.transfer_to}</Number>" not in closing:
            yield f"expected <Dial> to {step.transfer_to}, Twilio got {closing!r}"


def _check_end(step: Step, record: CallRecord | None, closing: str | None) -> Iterator[str]:
    outcome = (record.flow_state or {}).get("outcome") if record else None
    if outcome != step.ended:
        yield f"expected the call to end with {step.ended}, got {outcome or 'no end'}"
    want = {"hangup": "<Hangup", "transfer": "<Dial"}.get(step.ended or "")
    if want is not None and (closing is None or want not in closing):
        yield f"expected the <Connect action> answer to contain {want}, got {closing!r}"


def _transcript(
    report: CallReport, speech: list[tuple[float, str]], t0: float
) -> list[tuple[str, str]]:
    events = [(t - t0, "bot", text) for t, text in speech]
    events += [(t.caller_start_t, "caller", t.caller_text) for t in report.turns if t.caller_text]
    events += [(report.duration_s, "call", report.closing_twiml or "(no closing TwiML)")]
    return [(who, f"{t:6.2f}  {text}") for t, who, text in sorted(events)]
