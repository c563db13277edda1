"""Streaming voices in real calls: the gateway built with ``IVR_TTS_PROVIDER=cartesia`` or
``elevenlabs`` against the local server speaking that provider's protocol, the simulated Twilio
caller on the line (real HTTP and WebSockets), STT and the LLM on the OpenAI-compatible fake.

One session per reply, its mu-law straight to the caller; after a barge-in the history holds
the words whose audio the caller heard; the provider's failures (an error message, a close
code, a stall, a drop mid-reply) end in what the resilience rules promise, within the turn
deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
from conftest import provider_settings
from fault_calls import TONE_HZ, TurnHeard, caller_turns, heard_bursts
from gateway_support import AUTH_TOKEN, PUBLIC_URL, dial
from streaming_fixtures import VOICE_SERVERS

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer, running_server
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport, TurnReport
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.cartesia_server import FakeCartesiaServer
from ivr.testing.elevenlabs_server import FakeElevenLabsServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.tts_script import Speaker, TtsScript
from ivr.testing.ws_server import WsFault
from ivr.tts.voice import StreamingVoice

pytestmark = pytest.mark.slow

KEY = "voice-key"
VOICE = "voice-1"
REPLY = "We are open nine to five on weekdays and ten to four on Saturdays."
LONG_REPLY = (
    "Our opening hours are nine to five on weekdays. On Saturdays we open at ten. "
    "We are closed on Sundays and public holidays. You can also reach us online at any time."
)
CALL_VOICE = TtsScript(
    first_audio=0.12, speed=4, seconds_per_char=0.04, gap_seconds=0.2, hz=TONE_HZ["reply"]
)
"""Each reply: first audio in 120 ms, then 4x real time; words not in proportion to their
letters (short words take 0.3 s), so guessing what was heard by characters is wrong by words."""
PROMPT_VOICE = TtsScript(first_audio=0.01, speed=0, hz=TONE_HZ["apology"])
"""The prompts synthesised at startup (the greeting, the apology): at once, in their own tone."""
Voice = FakeCartesiaServer | FakeElevenLabsServer


@pytest.fixture(params=["cartesia", "elevenlabs"])
async def voice(request: pytest.FixtureRequest) -> AsyncIterator[Voice]:
    async with VOICE_SERVERS[request.param](api_key=KEY) as server:
        yield server  # type: ignore[misc]


def voice_settings(server: Voice) -> dict[str, Any]:
    name = server.name
    return {
        "tts_provider": name,
        f"{name}_api_key": KEY,
        f"{name}_voice": VOICE,
        f"{name}_url": server.url,
        "stt_provider": "openai",
        "tts_first_byte_timeout": 0.6,
        "tts_stall_timeout": 0.5,
        "heard_within_ms": 1500,
    }


@asynccontextmanager
async def gateway(
    fake: FakeOpenAIServer, server: Voice, **overrides: Any
) -> AsyncIterator[RunningServer]:
    """A gateway whose voice is built from the settings, as ``ivr serve`` builds it."""
    settings = provider_settings(**(voice_settings(server) | overrides))
    base = fake.base_url
    built = build_gateway(
        settings,
        stt=OpenAIHttpStt(base_url=base, api_key="sk-test"),
        llm=OpenAICompatLlm(base_url=base, api_key="sk-test", model="m", first_token_timeout=3),
    )
    server.script = PROMPT_VOICE
    async with running_server(built) as running:
        server.script = CALL_VOICE
        yield running


def assistant_lines(fake: FakeOpenAIServer) -> list[str]:
    """The assistant lines of the last chat request: the history the LLM saw last."""
    request = fake.requests_for("chat")[-1]
    assert request.json is not None
    return [m["content"] for m in request.json["messages"] if m["role"] == "assistant"]


def reply_turns(report: CallReport) -> list[TurnReport]:
    return [t for t in report.turns if t.caller_text is not None and t.bot_audio_seconds > 0]


async def test_a_call_speaks_each_reply_through_one_session(
    fake_openai: FakeOpenAIServer, voice: Voice
) -> None:
    fake_openai.transcripts.extend(["what are your opening hours", "thanks"])
    fake_openai.chat = [ChatScript(text=REPLY), ChatScript(text="You are welcome.")]
    async with gateway(fake_openai, voice) as server:
        assert isinstance(server.gateway.tts, StreamingVoice)
        report = await dial(server, ["What are your opening hours?", "Thanks."])
    assert not report.errors and not report.violations, report.format_transcript()
    replies = reply_turns(report)
    assert len(replies) == 2, report.format_transcript()
    spoken, _ = Speaker(CALL_VOICE).add(REPLY + " ", final=True)  # the whole reply heard
    assert replies[0].bot_audio_seconds == pytest.approx(len(spoken) / 8000, abs=0.1)
    assert replies[0].latency_s is not None and replies[0].latency_s < 1.5
    assert assistant_lines(fake_openai)[-1] == REPLY  # all of it heard, all of it kept
    # One session (a Cartesia context, an ElevenLabs socket) carried the whole reply.
    sessions = ["".join(texts).split() for texts in voice_texts(voice)]
    assert sessions.count(REPLY.split()) == 1, sessions


def voice_texts(server: Voice) -> list[list[str]]:
    """The text each reply's session got, piece by piece (Cartesia: per context id)."""
    if isinstance(server, FakeCartesiaServer):
        contexts: dict[str, list[str]] = {}
        for connection in server.connections:
            for message in connection.json_received():
                if "transcript" in message:
                    contexts.setdefault(message["context_id"], []).append(message["transcript"])
        return list(contexts.values())
    sessions = []
    for connection in server.connections:
        texts = [m.get("text", "") for m in connection.json_received()][1:]  # after BOS
        sessions.append(texts)
    return sessions


def words_heard(text: str, seconds: float) -> list[str]:
    """The words of ``text`` whose audio (the fake voice's) ended within ``seconds``."""
    _, words = Speaker(CALL_VOICE).add(text + " ", final=True)
    return [w.text for w in words if w.end <= seconds]


@pytest.mark.parametrize("after", [0.9, 2.3])
async def test_after_a_barge_in_the_history_keeps_the_words_heard(
    fake_openai: FakeOpenAIServer, voice: Voice, after: float
) -> None:
    fake_openai.transcripts.extend(["opening hours", "thanks"])
    fake_openai.chat = [ChatScript(text=LONG_REPLY), ChatScript(text="You're welcome.")]
    script = [
        "When are you open?",
        {"barge_in": {"say": "Thanks, bye.", "after": after}},
        {"silence": 2.0},
        {"hangup": None},
    ]
    async with gateway(fake_openai, voice) as server:
        report = await dial(server, script)
    assert report.clears, report.format_transcript()
    cut = next(t for t in report.turns if t.interrupted)
    print(report.format_transcript())
    kept = assistant_lines(fake_openai)[-1]
    heard = words_heard(LONG_REPLY, cut.bot_audio_seconds)
    assert kept.split() == heard, (kept, heard, cut.bot_audio_seconds)


async def test_a_barge_in_cancels_the_session_at_once(
    fake_openai: FakeOpenAIServer, voice: Voice
) -> None:
    fake_openai.transcripts.extend(["opening hours", "thanks"])
    fake_openai.chat = [ChatScript(text=LONG_REPLY * 3), ChatScript(text="You're welcome.")]
    script = [
        "When are you open?",
        {"barge_in": {"say": "Thanks, bye.", "after": 1.0}},
        {"silence": 2.0},
        {"hangup": None},
    ]
    async with gateway(fake_openai, voice) as server:
        report = await dial(server, script)
    cut = next(t for t in report.turns if t.interrupted)
    assert cut.bot_audio_seconds < 2.0, report.format_transcript()
    if isinstance(voice, FakeCartesiaServer):
        assert len(voice.cancelled) == 1  # the reply's context, cancelled
    else:  # stream-input has no cancel: the reply's socket is closed, long before its end
        reply = next(c for c in voice.connections if any("opening" in str(m) for m in c.received))
        assert reply.closed is not None and reply.closed - reply.opened < 4.0


# -- the provider fails ---------------------------------------------------------------------


FAULTS = {
    "error message mid-reply": WsFault(after=6, then="error"),
    "close 1011 mid-reply": WsFault(after=6, then="close", code=1011, reason="overloaded"),
    "drop mid-reply": WsFault(after=6, then="drop"),
    "stall mid-reply": WsFault(after=6, then="stall"),
    "error before any audio": WsFault(after=0, then="error"),
    "stall before any audio": WsFault(after=0, then="stall"),
}
HEARD_WITHIN_S = 1.5


async def heard_turns(server: RunningServer, tmp_path: Path, lines: list[str]) -> list[TurnHeard]:
    wav = tmp_path / "call.wav"
    report = await place_call(
        server.base_url, script=lines, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
        record_path=wav,
    )  # fmt: skip
    assert not report.errors and not report.violations, report.format_transcript()
    return caller_turns(report, heard_bursts(wav))


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
async def test_a_failing_voice_still_answers_within_the_turn_deadline(
    fake_openai: FakeOpenAIServer, voice: Voice, fault: str, tmp_path: Path
) -> None:
    fake_openai.transcripts.append("opening hours")
    fake_openai.chat = [ChatScript(text=REPLY)]
    async with gateway(fake_openai, voice) as server:
        if isinstance(voice, FakeCartesiaServer):
            voice.arm(FAULTS[fault])  # its one socket, opened at startup, fails mid-call
        else:
            voice.faults = [FAULTS[fault]]  # the reply's own socket
        (turn,) = await heard_turns(server, tmp_path, ["When are you open?"])
    # Each word is a burst; a frame where a word starts or stops may read as the other tone.
    kinds = [kind for kind, _ in groupby(b.kind for b in turn.bursts if b.seconds > 0.04)]
    reply_s = sum(b.seconds for b in turn.bursts if b.kind == "reply")
    whole_s = sum(w.end - w.start for w in Speaker(CALL_VOICE).add(REPLY + " ", final=True)[1])
    assert turn.first_audio_s is not None and turn.first_audio_s < HEARD_WITHIN_S, kinds
    assert turn.dead_air_s < 1.0, turn.describe()
    retried = isinstance(voice, FakeCartesiaServer)  # its error says 500; ElevenLabs' no code
    if fault == "error before any audio" and retried:  # a new socket: the whole reply
        assert kinds == ["reply"] and reply_s > 0.95 * whole_s  # (a burst ends a frame late)
    elif fault.endswith("before any audio"):  # nothing voiced in time: the apology, in time
        assert kinds == ["apology"]
    else:  # what was voiced, then the apology
        assert kinds == ["reply", "apology"] and 0.2 < reply_s < 0.8 * whole_s, turn.describe()
