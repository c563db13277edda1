"""Reply latency and cut-offs after a number the caller reads out in two parts: a sweep.

Each trial is one call through the real audio path: a gateway under uvicorn in this process,
the simulated Twilio caller (espeak) over a real WebSocket, an LLM agent (``FLOW``) whose tool
takes an eight-digit ``account_number`` (``pattern: ^\\d{8}$``), and the providers on the local
OpenAI-wire server: STT with the words the audio holds (as said) after the cell's delay, LLM
first token 140 ms, TTS first byte 120 ms. Speculation at a 60 ms pause, 300 ms endpoint: the
defaults.

The sweep: the caller says "My account number is four five six seven.", pauses, then says
"Eight nine zero one." (the number read out in two groups), for

- **declared** length: the agent asked "What is your account number?" (the tool's argument
  says eight digits: four are not enough, the turn waits for the rest), and
- **unknown** length: the agent asked "How can I help you today?" (nothing says how long the
  number is: "4567" may be all of it, the turn waits ``number_silence_ms``, 700 ms),

times the pause between the groups (``--pauses``, ms) times the STT's delay (``--stt``, ms).
Per cell: the reply latency p50 (the caller's end of speech -> the first reply audio at the
caller) and **cut**: calls whose reply was heard before the caller finished (the turn ended at
the pause). Two fixed rows beside it: **complete** (declared, all eight digits in one breath)
and **issue 22**: the issue's harness line at its conditions ("My account number is", 700 ms,
"four five six seven.", unknown length, STT 150 ms).

``--code DIR`` runs the gateway from another checkout (``PYTHONPATH=DIR``): the bench prints
that checkout's cells ("before") beside this one's ("after").

    .venv/bin/python bench/expected_answers.py                       # 2 calls per cell (~6 min)
    .venv/bin/python bench/expected_answers.py --trials 3 --pauses 500,900 --stt 150
    .venv/bin/python bench/expected_answers.py --code ../old --trials 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from ivr.audio.wav import wav_to_pcm16
from ivr.config import Settings
from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.caller import place_call
from ivr.sim.script import script_from_data
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault
from ivr.tts.openai_http import OpenAIHttpTts

AUTH_TOKEN = "bench-auth-token"
PUBLIC_URL = "https://gw.example.com"
STT_S, LLM_S, TTS_S = 0.15, 0.14, 0.12
PAUSES_MS = (300, 500, 700, 900, 1200)
STTS_MS = (100, 150, 300)
GAP_S = 0.25
"""Quiet this long inside an upload separates two things the caller said (espeak leaves less
between words; the shortest pause swept is 300 ms)."""
NUMBERS = {"declared": "+15550100123", "unknown": "+15550100124"}
"""The called number picks the agent's question (``ROUTES``)."""
ROUTES = """
default: declared
routes:
  "+15550100124": unknown
"""
ASK_NUMBER, ASK_ANYTHING = "What is your account number?", "How can I help you today?"
FLOW = """
name: NAME
start: ask
nodes:
  ask:
    kind: agent
    greeting: GREETING
    system: Find the caller's account.
    max_turns: 3
    on_max_turns: bye
    on_no_input: bye
    tools:
      - name: find_account
        description: Find the caller's account by its number.
        parameters:
          type: object
          properties:
            account_number: {type: string, pattern: "^\\\\d{8}$"}
          required: [account_number]
  bye: {kind: hangup}
"""


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    length: str
    """``declared`` or ``unknown``: which question the agent asked (``NUMBERS``)."""
    said: tuple[tuple[str, str], ...]
    """(speech, its transcript) per part; ``pause_ms`` of silence between parts."""
    pause_ms: int = 700
    stt_ms: int = 150


TWO_GROUPS = (
    ("My account number is four five six seven.", "my account number is 4567"),
    ("Eight nine zero one.", "8901"),
)
FIXED = (
    Case("complete", "declared",
         (("My account number is four five six seven eight nine zero one.",
           "my account number is 4567 8901"),)),
    Case("issue 22", "unknown",
         (("My account number is", "my account number is"), ("Four five six seven.", "4567"))),
)  # fmt: skip


def sweep(pauses: list[int], stts: list[int]) -> list[Case]:
    """The fixed rows, then every (length, pause, STT delay) cell of the two-group number."""
    cells = [
        Case(f"{length} {pause} {stt}", length, TWO_GROUPS, pause, stt)
        for length in NUMBERS
        for pause in pauses
        for stt in stts
    ]
    return [*FIXED, *cells]


@dataclass(slots=True)
class Result:
    case: str
    latencies: list[float] = field(default_factory=list)
    cut: int = 0
    errors: list[str] = field(default_factory=list)


class WordsAsSaid:
    """STT: the transcripts of as many parts as the upload holds stretches of speech."""

    def __init__(self, parts: list[str]) -> None:
        self.parts = parts

    def __call__(self, wav: bytes, form: object = None) -> str:
        audio = wav_to_pcm16(wav)
        x = np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float64)
        frame = audio.sample_rate // 50
        n = x.size // frame
        rms = np.sqrt((x[: n * frame].reshape(n, frame) ** 2).mean(axis=1))
        loud = np.nonzero(rms > 300)[0]
        stretches = 1 + int(np.sum(np.diff(loud) * 0.02 >= GAP_S)) if loud.size else 0
        return " ".join(self.parts[:stretches])


@asynccontextmanager
async def gateway_at(flows: Path) -> AsyncIterator[tuple[RunningServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer(api_key="sk-test") as fake:
        settings = Settings(
            public_url=PUBLIC_URL, twilio_auth_token=AUTH_TOKEN, llm_api_key="sk-test",
            redis_url="", flows_dir=str(flows), max_loop_lag_ms=0, max_inbound_backlog_ms=0,
        )  # fmt: skip
        gateway = build_gateway(
            settings,
            stt=OpenAIHttpStt(base_url=fake.base_url, api_key="sk-test"),
            tts=OpenAIHttpTts(base_url=fake.base_url, api_key="sk-test"),
            llm=OpenAICompatLlm(base_url=fake.base_url, api_key="sk-test", model="bench"),
        )
        async with running_server(gateway) as server:
            yield server, fake


async def run_trial(server: RunningServer, fake: FakeOpenAIServer, case: Case, out: Result) -> None:
    fake.reset()
    fake.transcribe = WordsAsSaid([text for _, text in case.said])
    fake.faults["transcriptions"] = Fault(delay=case.stt_ms / 1000)
    fake.faults["speech"] = Fault(delay=TTS_S)
    fake.chat = lambda request: ChatScript(text="Thank you, one moment.", first_token_delay=LLM_S)
    steps: list[Any] = []
    for i, (speech, _) in enumerate(case.said):
        if i:
            steps.append({"silence": case.pause_ms / 1000})
        steps.append({"say": speech, "wait": i == 0})
    steps += [{"silence": 2.5}, {"hangup": None}]
    report = await place_call(
        server.base_url,
        script=script_from_data({"steps": steps, "max_wait": 10}),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        to=NUMBERS[case.length],
    )
    if report.errors or report.violations:
        out.errors.append("; ".join(report.errors + [v.reason for v in report.violations]))
    caller = [t for t in report.turns if t.caller_text is not None]
    if not caller:
        out.errors.append("the caller said nothing")
        return
    start, done = caller[0].caller_start_t, caller[-1].caller_end_t
    heard = [
        t.bot_first_audio_t
        for t in report.turns
        if t.bot_first_audio_t is not None and t.bot_first_audio_t > start
    ]
    if not heard:
        out.errors.append("no reply heard")
        return
    if min(heard) < done:
        out.cut += 1
    later = [t for t in heard if t >= done]
    if later:
        out.latencies.append(min(later) - done)


async def measure(cases: list[Case], trials: int, lanes: int) -> list[Result]:
    """Every case ``trials`` times, over ``lanes`` gateways (one call at a time each)."""
    results = {case.name: Result(case.name) for case in cases}
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for _ in range(trials):
        for case in cases:
            queue.put_nowait(case)
    with tempfile.TemporaryDirectory() as tmp:
        flows = Path(tmp)
        for length, greeting in (("declared", ASK_NUMBER), ("unknown", ASK_ANYTHING)):
            flow = FLOW.replace("NAME", length).replace("GREETING", greeting)
            (flows / f"{length}.yaml").write_text(flow)
        (flows / "routes.yaml").write_text(ROUTES)

        async def lane() -> None:
            async with gateway_at(flows) as (server, fake):
                while not queue.empty():
                    case = queue.get_nowait()
                    try:
                        await run_trial(server, fake, case, results[case.name])
                    except Exception as exc:  # a broken trial is reported, not fatal
                        results[case.name].errors.append(repr(exc)[:200])

        await asyncio.gather(*(lane() for _ in range(lanes)))
    return [results[case.name] for case in cases]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cell(result: Result | None) -> str:
    """``p50 cut/n`` of one cell."""
    if result is None:
        return "-"
    lat = result.latencies
    n = len(lat) + len(result.errors)
    p50 = f"{1000 * statistics.median(lat):.0f}" if lat else "-"
    return f"{p50} {result.cut}/{n}"


def row(label: str, result: Result) -> str:
    lat = result.latencies
    if lat:
        cells = f"{1000 * statistics.median(lat):8.0f} {1000 * pct(lat, 0.95):6.0f}"
    else:
        cells = f"{'-':>8} {'-':>6}"
    n = len(lat) + len(result.errors)
    return f"{result.case:12} {label:7} {cells} {result.cut:>4}/{n:<3} {len(result.errors):>6}"


def print_grid(
    cases: list[Case], after: list[Result], before: list[Result] | None, stts: list[int]
) -> None:
    """Per length: a row per pause, a column per STT delay ("before -> after" with --code)."""
    by_name = {r.case: r for r in after}
    old = {r.case: r for r in before} if before is not None else None
    width = 22 if old is not None else 12
    for length in NUMBERS:
        print(f"\n{length} length: reply p50 ms and cut/calls, per pause between the groups x STT")
        print(f"{'pause':>8}  " + "  ".join(f"{f'STT {stt} ms':>{width}}" for stt in stts))
        pauses = sorted({c.pause_ms for c in cases if c.length == length and c.said is TWO_GROUPS})
        for pause in pauses:
            cells = []
            for stt in stts:
                name = f"{length} {pause} {stt}"
                text = cell(by_name.get(name))
                if old is not None:
                    text = f"{cell(old.get(name))} -> {text}"
                cells.append(f"{text:>{width}}")
            print(f"{pause:>5} ms  " + "  ".join(cells))


def run_elsewhere(code: str, args: argparse.Namespace) -> list[Result]:
    """This bench with the gateway's code from the checkout ``code`` (its results as JSON)."""
    env = {**os.environ, "PYTHONPATH": str(Path(code).resolve())}
    cmd = [sys.executable, __file__, "--trials", str(args.trials), "--lanes", str(args.lanes),
           "--pauses", args.pauses, "--stt", args.stt, "--json"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [Result(**item) for item in json.loads(done.stdout.splitlines()[-1])]


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2, help="calls per cell")
    parser.add_argument("--lanes", type=int, default=3, help="calls at once (one gateway each)")
    parser.add_argument("--pauses", default=",".join(map(str, PAUSES_MS)), help="ms")
    parser.add_argument("--stt", default=",".join(map(str, STTS_MS)), help="STT delays, ms")
    parser.add_argument("--code", help="another checkout to compare with (a path to its checkout)")
    parser.add_argument("--json", action="store_true", help="print only the results as JSON")
    args = parser.parse_args()
    pauses = [int(x) for x in args.pauses.split(",")]
    stts = [int(x) for x in args.stt.split(",")]
    cases = sweep(pauses, stts)
    if args.json:
        results = asyncio.run(measure(cases, args.trials, args.lanes))
        print(json.dumps([asdict(r) for r in results]))
        return
    load = os.getloadavg()[0]
    before = run_elsewhere(args.code, args) if args.code else None
    after = asyncio.run(measure(cases, args.trials, args.lanes))
    import ivr

    print(f"\nReply after a number read out ({args.trials} calls per cell; LLM first token "
          f"{LLM_S * 1000:.0f} ms, TTS first byte {TTS_S * 1000:.0f} ms, 300 ms endpoint, "
          f"speculation at 60 ms; load {load:.2f} -> {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"before: {args.code or '-'}; after: {Path(ivr.__file__).parent.parent}")
    print(f"{'case':12} {'code':7} {'p50 ms':>8} {'p95':>6} {'cut':>8} {'errors':>6}")
    for i, result in enumerate(after[: len(FIXED)]):
        if before is not None:
            print(row("before", before[i]))
        print(row("after", result))
    print_grid(cases, after, before, stts)
    print("latency: the caller's end of speech -> first reply audio at the caller; cut: replies")
    print("heard before the caller finished")
    for result in (before or []) + after:
        for error in result.errors[:2]:
            print(f"  error ({result.case}): {error[:160]}")


if __name__ == "__main__":
    main()
