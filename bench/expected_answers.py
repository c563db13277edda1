"""Reply latency after a number the caller reads out: declared, half read, of unknown length.

Each trial is one call through the real audio path: a gateway under uvicorn in this process,
the simulated Twilio caller (espeak) over a real WebSocket, an LLM agent (``FLOW``) whose tool
takes an eight-digit ``account_number`` (``pattern: ^\\d{8}$``), and the providers on the local
OpenAI-wire server at the issue's speed: STT 150 ms with the words the audio holds (as said),
LLM first token 140 ms, TTS first byte 120 ms. Speculation at a 60 ms pause, 300 ms endpoint:
the defaults. Cases:

- ``complete``: the agent asked "What is your account number?"; the caller reads all eight
  digits in one breath.
- ``half, 700 ms, rest``: the same question; four digits, 700 ms of silence, the other four.
  Latency from the end of the second group; ``cut`` counts replies heard before it.
- ``unknown length``: the agent asked "How can I help you today?" (no argument named); the
  caller says "My account number is four five six seven.".
- ``issue harness``: the same, read as issue 22's harness did: "My account number is", 700
  ms, "four five six seven.".

Latency: the caller's end of speech -> the first reply audio at the caller (p50 / p95).
``--code DIR`` runs the gateway from another checkout (``PYTHONPATH=DIR``): the bench prints
that checkout's rows ("before") beside this one's ("after").

    .venv/bin/python bench/expected_answers.py --code ../old   # before vs after (~4 min)
    .venv/bin/python bench/expected_answers.py --trials 3            # this checkout only
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
PAUSE_S = 0.7
GAP_S = 0.4
"""Quiet this long inside an upload separates two things the caller said."""
ASK_NUMBER, ASK_ANYTHING = "What is your account number?", "How can I help you today?"
FLOW = """
name: bench
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
    greeting: str
    said: tuple[tuple[str, str], ...]
    """(speech, its transcript) per part; a ``PAUSE_S`` silence between parts."""


CASES = (
    Case("complete", ASK_NUMBER,
         (("My account number is four five six seven eight nine zero one.",
           "my account number is 4567 8901"),)),
    Case("half, 700 ms, rest", ASK_NUMBER,
         (("My account number is four five six seven.", "my account number is 4567"),
          ("Eight nine zero one.", "8901"))),
    Case("unknown length", ASK_ANYTHING,
         (("My account number is four five six seven.", "my account number is 4567"),)),
    Case("issue harness", ASK_ANYTHING,
         (("My account number is", "my account number is"),
          ("Four five six seven.", "4567"))),
)  # fmt: skip


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
            redis_url="", flows_dir=str(flows), max_loop_lag_ms=0,
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
    fake.faults["transcriptions"] = Fault(delay=STT_S)
    fake.faults["speech"] = Fault(delay=TTS_S)
    fake.chat = lambda request: ChatScript(text="Thank you, one moment.", first_token_delay=LLM_S)
    steps: list[Any] = []
    for i, (speech, _) in enumerate(case.said):
        if i:
            steps.append({"silence": PAUSE_S})
        steps.append({"say": speech, "wait": i == 0})
    steps += [{"silence": 2.5}, {"hangup": None}]
    report = await place_call(
        server.base_url,
        script=script_from_data({"steps": steps, "max_wait": 10}),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        to="+15550100123",
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


async def measure(trials: int) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            flows = Path(tmp) / case.name.replace(" ", "_").replace(",", "")
            flows.mkdir()
            (flows / "bench.yaml").write_text(FLOW.replace("GREETING", case.greeting))
            (flows / "routes.yaml").write_text("default: bench\n")
            result = Result(case.name)
            async with gateway_at(flows) as (server, fake):
                for _ in range(trials):
                    try:
                        await run_trial(server, fake, case, result)
                    except Exception as exc:  # a broken trial is reported, not fatal
                        result.errors.append(repr(exc)[:200])
            results.append(result)
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(label: str, result: Result) -> str:
    lat = result.latencies
    if lat:
        cells = f"{1000 * statistics.median(lat):8.0f} {1000 * pct(lat, 0.95):6.0f}"
    else:
        cells = f"{'-':>8} {'-':>6}"
    n = len(lat) + len(result.errors)
    return f"{result.case:20} {label:7} {cells} {result.cut:>4}/{n:<3} {len(result.errors):>6}"


def run_elsewhere(code: str, trials: int) -> list[Result]:
    """This bench with the gateway's code from the checkout ``code`` (its results as JSON)."""
    env = {**os.environ, "PYTHONPATH": str(Path(code).resolve())}
    cmd = [sys.executable, __file__, "--trials", str(trials), "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [Result(**item) for item in json.loads(done.stdout.splitlines()[-1])]


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="calls per case")
    parser.add_argument("--code", help="another checkout to compare with (a path to its checkout)")
    parser.add_argument("--json", action="store_true", help="print only the results as JSON")
    args = parser.parse_args()
    if args.json:
        results = asyncio.run(measure(args.trials))
        print(json.dumps([asdict(r) for r in results]))
        return
    before = run_elsewhere(args.code, args.trials) if args.code else None
    after = asyncio.run(measure(args.trials))
    import ivr

    print(f"\nReply after a number read out ({args.trials} calls per case; STT {STT_S * 1000:.0f} "
          f"ms, LLM first token {LLM_S * 1000:.0f} ms, TTS first byte {TTS_S * 1000:.0f} ms, "
          f"300 ms endpoint, speculation at 60 ms)")  # fmt: skip
    print(f"before: {args.code or '-'}; after: {Path(ivr.__file__).parent.parent}")
    print(f"{'case':20} {'code':7} {'p50 ms':>8} {'p95':>6} {'cut':>8} {'errors':>6}")
    for i, result in enumerate(after):
        if before is not None:
            print(row("before", before[i]))
        print(row("after", result))
    print("latency: the caller's end of speech -> first reply audio at the caller; cut: replies")
    print("heard before the caller finished")
    for result in (before or []) + after:
        for error in result.errors[:2]:
            print(f"  error ({result.case}): {error[:160]}")


if __name__ == "__main__":
    main()
