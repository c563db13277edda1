"""Interruptions that are real: backchannels, noise and the bot's own echo do not stop it; real
speech still does, at once. The checks on real audio first (espeak speech through the mu-law
channel, synthetic coughs, a delayed copy of the bot), then the player's pause and resume, then
whole calls through a real gateway and the simulated caller over a real WebSocket.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import soxr
from audio_fixtures import speech_pcm16, trimmed
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from prometheus_client import REGISTRY
from redis_server import LOCAL_REDIS_URL

from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.echo import check_echo
from ivr.audio.far_end import FarEndReference
from ivr.audio.voicing import voiced_frames
from ivr.audio.wav import pcm16_to_wav
from ivr.call.interruptions import BackchannelHabit
from ivr.call.player import AudioPlayer, phrase_start
from ivr.callio.interruption_policy import DEFAULT_POLICY, InterruptionPolicy
from ivr.callio.timeline import backchannel_spans
from ivr.flows.loader import load_flow_text
from ivr.flows.problems import FlowLoadError
from ivr.flows.runner import FlowRunner
from ivr.flowtools.textio import TextCallIO, said
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer
from ivr.sim.caller import LineEcho, place_call
from ivr.sim.noises import NOISE_KINDS, noise_burst
from ivr.sim.report import CallReport
from ivr.sim.script import script_from_data
from ivr.testing.audio import KnownSpeech, voiced_seconds
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault
from ivr.tts.espeak_local import synthesize_pcm16


def phone(pcm16: bytes) -> np.ndarray:
    """PCM16 through the mu-law channel, as float samples."""
    return np.frombuffer(ulaw_to_pcm16(pcm16_to_ulaw(pcm16)), dtype="<i2").astype(np.float64)


# -- what a transcript means ---------------------------------------------------------------


@pytest.mark.parametrize("text", ["Uh-huh.", "Okay.", "yeah", "Mm-hmm.", "Mhm", "okay, yeah", ""])
def test_backchannels_and_silence_are_not_a_turn(text: str) -> None:
    assert not DEFAULT_POLICY.is_real_turn(text)


@pytest.mark.parametrize("text", ["Stop.", "Okay, stop.", "Yeah I want an agent", "no"])
def test_words_beyond_backchannel_are_a_turn(text: str) -> None:
    assert DEFAULT_POLICY.is_real_turn(text)


def test_min_words_and_an_empty_backchannel_list_change_what_interrupts() -> None:
    strict = InterruptionPolicy(min_words=3)
    assert not strict.is_real_turn("stop please")
    assert strict.is_real_turn("okay stop it now")  # "okay" does not count, three others do
    every_word = InterruptionPolicy(backchannels=())
    assert every_word.is_real_turn("okay")


def test_after_a_callers_first_backchannel_the_bot_holds_on_for_the_nodes_whole_hold() -> None:
    habit = BackchannelHabit()
    assert habit.hold_ms(DEFAULT_POLICY) == DEFAULT_POLICY.min_speech_ms, "none heard yet"
    habit.heard(300)  # a short "mm": the next, "uh-huh, okay", may run much longer
    assert habit.hold_ms(DEFAULT_POLICY) == DEFAULT_POLICY.backchannel_hold_ms
    habit.heard(1500)
    assert habit.hold_ms(DEFAULT_POLICY) == DEFAULT_POLICY.backchannel_hold_ms


def test_the_habit_is_kept_on_the_timeline_as_spans_and_bad_entries_are_skipped() -> None:
    habit = BackchannelHabit()
    assert habit.heard(450) and not habit.heard(300) and habit.heard(500)
    events = [
        {"kind": "backchannel", "span_ms": 450, "paused": True},
        {"kind": "barge_in", "span_ms": 900},  # not a backchannel
        {"kind": "backchannel", "span_ms": "600"},  # the record is JSON from any version
        {"kind": "backchannel", "span_ms": True},
        {"kind": "backchannel", "span_ms": -5},
        {"kind": "backchannel"},
        {"kind": "backchannel", "span_ms": 520, "paused": False},
    ]
    assert backchannel_spans(events) == [450, 520]


@pytest.mark.parametrize(
    "policy",
    [
        InterruptionPolicy(backchannel_hold_ms=0),
        InterruptionPolicy(backchannels=()),  # "yeah" is an answer here, not a backchannel
        InterruptionPolicy(min_speech_ms=1200),  # already above what the habit would ask
    ],
    ids=["hold-off", "no-backchannels", "higher-minimum"],
)
def test_a_node_can_keep_its_own_minimum_whatever_the_caller_does(
    policy: InterruptionPolicy,
) -> None:
    habit = BackchannelHabit()
    habit.heard(450)
    assert habit.hold_ms(policy) == policy.min_speech_ms


# -- echo and noise on real audio ----------------------------------------------------------

BOT_LINE = "Thank you for calling Acme support. Our opening hours are nine to five on weekdays."


def _reference(bot: np.ndarray, t0: float) -> FarEndReference:
    ulaw = pcm16_to_ulaw(bot.astype("<i2").tobytes())
    ref = FarEndReference(history_s=60)
    for i in range(0, len(ulaw) - 800, 800):  # the player sends 100 ms chunks
        ref.played(t0 + i / 8000, ulaw[i : i + 800])
    return ref


def _near(bot: np.ndarray, now: float, *, echo_gain: float, caller: np.ndarray | None) -> bytes:
    """240 ms of what the caller sends at ``now``: the bot 100 ms late, plus their voice."""
    n, end = 1920, round((now - 0.1) * 8000)
    x = bot[end - n : end] * echo_gain
    if caller is not None:
        x = x + caller[:n]
    return np.clip(x, -32768, 32767).astype("<i2").tobytes()


def test_the_bot_coming_back_20_db_down_100_ms_late_is_echo() -> None:
    bot = phone(speech_pcm16(BOT_LINE))
    ref = _reference(bot, 100.0)
    for now in (1.0, 1.7, 2.9, 4.1):
        check = check_echo(phone(_near(bot, now, echo_gain=0.1, caller=None)), 100.0 + now, ref)
        assert check.is_echo(DEFAULT_POLICY.echo_threshold), (now, check)
        assert abs(check.delay_s - 0.1) < 0.01


def test_a_caller_talking_is_not_echo_with_or_without_the_echo_under_them() -> None:
    bot = phone(speech_pcm16(BOT_LINE))
    caller = phone(trimmed(speech_pcm16("Sorry, can I talk to someone about my bill?")))
    ref = _reference(bot, 100.0)
    for gain in (0.0, 0.1):
        for now in (1.0, 1.7, 2.9, 4.1):
            near = phone(_near(bot, now, echo_gain=gain, caller=caller))
            check = check_echo(near, 100.0 + now, ref)
            assert not check.is_echo(DEFAULT_POLICY.echo_threshold), (gain, now, check)


def test_coughs_and_static_have_no_voice_and_speech_does() -> None:
    for kind in ("cough", "static"):
        for seed in range(5):
            assert voiced_frames(phone(noise_burst(kind, seed))) == 0, (kind, seed)
    for text in ("uh-huh", "okay", "mm-hmm", "wait a moment"):
        assert voiced_frames(phone(trimmed(speech_pcm16(text)))[:1600]) > 0, text


def test_an_unknown_noise_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown noise kind 'bell'"):
        noise_burst("bell")  # type: ignore[arg-type]


# -- the player: pause keeps, resume replays the cut sentence, interrupt drops --------------


class Wire:
    """The player's side of the socket; marks echo at once (the audio before them was sent)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.player: AudioPlayer | None = None

    async def media(self, ulaw: bytes) -> None:
        self.sent.append(("media", ulaw))

    async def mark(self, name: str) -> None:
        self.sent.append(("mark", name))
        if self.player is not None and not name.endswith("h"):
            self.player.on_mark(name)

    async def clear(self) -> None:
        self.sent.append(("clear", None))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.sent]

    def audio_after_last_clear(self) -> bytes:
        i = max(i for i, (k, _) in enumerate(self.sent) if k == "clear")
        return b"".join(a for k, a in self.sent[i:] if k == "media" and isinstance(a, bytes))


async def test_a_paused_sentence_plays_again_from_its_start_on_resume() -> None:
    wire = Wire()
    player = AudioPlayer(wire.media, wire.mark, wire.clear, lead_seconds=0.2, chunk_frames=5)
    sender = asyncio.create_task(player.run_sender())
    try:
        first = player.open_segment("first sentence")
        await player.write(first, b"")  # no echo for the marks of the first playing ...
        await player.write(first, bytes(range(256)) * 25)  # 0.8 s, recognisable bytes
        player.close_segment(first)
        await asyncio.sleep(0.3)  # part of it went out and is "playing"
        await player.pause()
        assert wire.kinds()[-1] == "clear" and player.paused
        await asyncio.sleep(0.3)
        assert wire.kinds()[-1] == "clear", "nothing is sent while paused"
        assert 0 < first.heard_fraction(time.monotonic()) < 1  # what was heard is kept
        wire.player = player  # ... those of the replay echo
        player.resume()
        await asyncio.wait_for(first.played.wait(), 3)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert wire.audio_after_last_clear() == bytes(range(256)) * 25, "not replayed whole"
    marks = [n for k, n in wire.sent if k == "mark"]
    assert marks[-1] == "g1:1", "the replay is a new generation: old marks prove nothing"


async def test_an_interrupt_after_a_pause_drops_everything_without_a_second_clear() -> None:
    wire = Wire()
    player = AudioPlayer(wire.media, wire.mark, wire.clear, lead_seconds=0.2, chunk_frames=5)
    sender = asyncio.create_task(player.run_sender())
    try:
        seg = player.open_segment("one two three four")
        await player.write(seg, b"\x00" * 8000)
        player.close_segment(seg)
        await asyncio.sleep(0.25)
        await player.pause()
        heard = seg.heard_fraction(time.monotonic())
        await player.interrupt()
        await asyncio.sleep(0.2)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    assert wire.kinds().count("clear") == 1
    assert wire.kinds()[-1] == "clear"
    assert seg.dropped and seg.heard_fraction(time.monotonic()) == pytest.approx(heard)


# -- the flow option -------------------------------------------------------------------------


def test_a_node_interruptions_block_overrides_the_flow_defaults() -> None:
    flow = load_flow_text(FLOW_WITH_POLICY, "t.yaml")
    assert flow.interruptions("welcome").min_words == 3
    assert flow.interruptions("welcome").backchannels == ("okay",)
    assert flow.interruptions("bye").min_speech_ms == 150  # the flow's defaults
    assert flow.interruptions("bye").min_words == 1


def test_a_bad_interruptions_block_is_refused_with_where_and_why() -> None:
    bad = FLOW_WITH_POLICY.replace("min_words: 3", "min_words: -1")
    with pytest.raises(FlowLoadError) as caught:
        load_flow_text(bad, "t.yaml")
    assert "t.yaml:11:18:" in str(caught.value) and "min_words" in str(caught.value)


FLOW_WITH_POLICY = """
name: t
start: welcome
defaults:
  interruptions: {min_speech_ms: 150}
nodes:
  welcome:
    kind: say
    text: Hello.
    interruptions:
      min_words: 3
      backchannels: [okay]
    next: bye
  bye: {kind: hangup, say: Bye.}
"""


# -- whole calls -----------------------------------------------------------------------------

ANNOUNCEMENT = (
    "Thank you for calling Acme support. Our opening hours are nine to five on weekdays. "
    "On Saturdays we open at ten and close at two. We are closed on Sundays."
)


def announcement_flow(policy: str = "") -> str:
    return f"""
name: t
start: announce
nodes:
  announce:
    kind: say
    text: "{ANNOUNCEMENT}"{policy}
    next: bye
  bye: {{kind: hangup}}
"""


def speak_24k(text: str) -> bytes:
    """The fake TTS speaks (espeak): the bot's echo must be speech to a VAD."""
    pcm, rate = synthesize_pcm16(text)
    x = soxr.resample(np.frombuffer(pcm, dtype="<i2"), rate, 24000)
    return bytes(x.astype("<i2").tobytes())


async def announce_call(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    steps: list[object],
    *,
    transcript: str | Callable[[bytes, dict[str, str]], str] = "",
    echo: LineEcho | None = None,
    policy: str = "",
    speculate_after_ms: int = 0,
) -> tuple[CallReport, dict[str, float]]:
    """One call whose bot reads ANNOUNCEMENT (~10 s) then hangs up; the caller does ``steps``.
    Returns the report and the barge-in counters this call added, by outcome.
    ``speculate_after_ms``: the pause at which words over a paused prompt are transcribed
    early (0: only when the caller's utterance ends)."""
    fake.speak = speak_24k
    fake.transcribe = transcript if callable(transcript) else lambda wav, form: transcript
    (tmp_path / "routes.yaml").write_text("default: t\n")
    (tmp_path / "t.yaml").write_text(announcement_flow(policy))
    script = script_from_data({"steps": [*steps, {"silence": 20}], "wait_for_greeting": False})
    settings = {"flows_dir": str(tmp_path), "speculate_after_ms": speculate_after_ms}
    async with gateway_factory(**settings) as server:
        before = await barge_ins(server.base_url)
        report = await place_call(
            server.base_url,
            script=script,
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
            echo=echo,
        )
        after = await barge_ins(server.base_url)
    assert not report.errors and not report.violations, report.format_transcript()
    return report, {k: after.get(k, 0) - before.get(k, 0) for k in after}


async def barge_ins(base: str) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{base}/metrics")).text
    out: dict[str, float] = {}
    for m in re.finditer(r'ivr_barge_ins_total\{outcome="(\w+)",trigger="(\w+)"\} (\S+)', text):
        out[f"{m[2]}/{m[1]}"] = out.get(f"{m[2]}/{m[1]}", 0) + float(m[3])
    return out


FULL_S = 9.0
"""The announcement lasts ~10 s: heard in full means at least this much bot audio."""


LONG_MIN_SPEECH = "\n    interruptions: {min_speech_ms: 900}"
"""Longer than a backchannel (~0.5 s): the bot pauses only for speech that lasts 0.9 s."""


STT_FAULTS = pytest.mark.parametrize(
    "fault",
    [Fault(hang=True, times=1), Fault(status=500, times=1), Fault(drop=True, times=1)],
    ids=["stalls", "500", "reset"],
)
"""An STT request that stalls, fails or is reset (once)."""
NO_HABIT = "\n    interruptions: {backchannel_hold_ms: 0}"
"""Every backchannel pauses the bot, however many the caller has said."""
ONE = ("uh-huh",)
THREE = ("mm-hmm", "uh-huh", "okay")
"""The longest first (espeak's "mm-hmm" 0.68 s, "uh-huh" 0.48 s, "okay" shorter): after it,
the other two are well inside what the caller's habit allows."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "words", "speculate_after_ms", "clears"),
    [("", ONE, 0, 1), (LONG_MIN_SPEECH, ONE, 0, 0), ("", THREE, 60, 1), (NO_HABIT, THREE, 60, 3)],
    ids=["default", "min_speech_900", "habit", "backchannel_hold_0"],
)
async def test_backchannels_pause_the_bot_at_most_once_and_it_always_resumes(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    policy: str,
    words: tuple[str, ...],
    speculate_after_ms: int,
    clears: int,
) -> None:
    # By default the first backchannel pauses the bot (one clear) and it resumes; later
    # ones play through, the caller's habit being known; a long min_speech_ms lets even the
    # first through, and backchannel_hold_ms: 0 makes every one pause it.
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": word, "after": 1.2}} for word in words],
        transcript="Uh-huh.",
        policy=policy,
        speculate_after_ms=speculate_after_ms,
    )
    assert len(report.clears) == clears, report.format_transcript()
    assert report.bot_audio_s > FULL_S, "the announcement is heard to its end"
    assert counted.get("speech/backchannel") == len(words)
    assert not counted.get("speech/interrupted")


def test_the_stand_in_stt_tells_which_utterance_and_how_much_of_it_was_said() -> None:
    # The local STT of the tests below answers a request made mid-sentence with the words
    # said so far, as a real one would, so a test can see what the gateway does with them.
    sentence = "I would like to speak to an agent please."
    stt = KnownSpeech({"uh-huh": "Uh-huh.", "okay": "Okay.", sentence: sentence}, synthesize_pcm16)

    def request(text: str, seconds: float) -> bytes:
        pcm, rate = synthesize_pcm16(text)  # another synthesis: espeak varies a little
        x = np.frombuffer(pcm, dtype="<i2")[: round(seconds * rate)]
        lead = np.zeros(rate // 5, dtype="<i2")  # the endpointer's pre-roll
        return pcm16_to_wav(np.concatenate((lead, x)).tobytes(), rate)

    assert stt(request("uh-huh", 0.3)) == "Uh-huh."
    assert stt(request("okay", 5.0)) == "Okay."
    assert stt(request(sentence, 0.35)) == "I"
    assert stt(request(sentence, 1.0)) == "I would like to"
    assert stt(request(sentence, 5.0)) == sentence


MENU_FLOW = f"""
name: t
start: menu
nodes:
  menu:
    kind: ask
    prompt: "{ANNOUNCEMENT} Press 1 to hear this again."
    routes:
      - {{key: "1", next: menu}}
"""
"""ANNOUNCEMENT as a menu's prompt: the call still waits on it when its stream drops, and the
resumed call reads it again."""


async def backchannels_counted(server: RunningServer, more_than: float) -> None:
    for _ in range(200):
        if (await barge_ins(server.base_url)).get("speech/backchannel", 0) > more_than:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no backchannel counted past {more_than} in 10 s")


@pytest.mark.slow
async def test_a_resumed_call_keeps_the_callers_backchannel_habit(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, prefix: str
) -> None:
    # "mm-hmm" pauses the bot once and teaches the call the caller's habit; then the stream
    # drops (our end closes it, as when an instance dies) and the call resumes on a new one,
    # whose session knows the caller only from the record in Redis: their "uh-huh" over the
    # menu, read again, plays through.
    fake_openai.speak = speak_24k
    said = {"mm-hmm": "Mm-hmm.", "uh-huh": "Uh-huh."}
    fake_openai.transcribe = KnownSpeech(said, synthesize_pcm16)
    (tmp_path / "routes.yaml").write_text("default: t\n")
    (tmp_path / "t.yaml").write_text(MENU_FLOW)
    steps = [
        {"barge_in": {"say": "mm-hmm", "after": 1.2}},
        {"silence": 3.0},  # the stream drops meanwhile; the bot reads on the new one
        {"barge_in": {"say": "uh-huh", "after": 0.5}},
        {"silence": 4.0},
        {"hangup": None},
    ]
    script = script_from_data({"steps": steps, "wait_for_greeting": False})
    settings = {
        "flows_dir": str(tmp_path), "speculate_after_ms": 60, "resume_prompt": "",
        "redis_url": LOCAL_REDIS_URL, "redis_prefix": prefix,
    }  # fmt: skip
    async with gateway_factory(**settings) as server:
        before = (await barge_ins(server.base_url)).get("speech/backchannel", 0)
        call = asyncio.create_task(
            place_call(
                server.base_url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL
            )
        )
        try:
            await backchannels_counted(server, before)
            (live,) = server.gateway.services.live.calls()
            await live.close_stream()
            report = await asyncio.wait_for(asyncio.shield(call), 60)
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        counted = (await barge_ins(server.base_url)).get("speech/backchannel", 0) - before
        record = await server.gateway.store.get(report.call_sid)
    assert not report.errors and not report.violations, report.format_transcript()
    assert len(report.streams) == 2 and report.streams[0].ended_by == "gateway", report.streams
    assert counted == 2
    assert len(report.clears) == 1, report.format_transcript()  # "mm-hmm" only
    assert record is not None and record.stream_count == 2
    kept = [e for e in record.timeline if e["kind"] == "backchannel"]
    assert [e["paused"] for e in kept] == [True], kept  # "uh-huh" taught nothing new


SENTENCE = "I would like to speak to an agent please."


async def uh_huh_then_a_sentence(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    transcript: Callable[[bytes, dict[str, str]], str],
    speculate_after_ms: int,
) -> tuple[CallReport, dict[str, float], float]:
    """ "uh-huh" over the announcement, then SENTENCE: the report, the barge-in counts, and
    how long after the sentence's onset the last ``clear`` came."""
    report, counted = await announce_call(
        gateway_factory,
        fake,
        tmp_path,
        [
            {"barge_in": {"say": "uh-huh", "after": 1.2}},
            {"barge_in": {"say": SENTENCE, "after": 1.2}},
        ],
        transcript=transcript,
        speculate_after_ms=speculate_after_ms,
    )
    said_at = next(t.caller_start_t for t in report.turns if t.caller_text == SENTENCE)
    return report, counted, report.clears[-1] - said_at


@pytest.mark.slow
@pytest.mark.parametrize(
    ("speculate_after_ms", "within"),
    [(60, (0.25, 0.7)), (0, (0.6, 1.2))],
    ids=["words-so-far", "hold-only"],
)
async def test_a_backchanneling_caller_can_still_interrupt(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    speculate_after_ms: int,
    within: tuple[float, float],
) -> None:
    # After "uh-huh" the bot holds on longer for this caller, but a real sentence still stops
    # it: at once when its words so far ("I would") are transcribed 300 ms in, or, with
    # speculation off, once it has run past the caller's backchannel (~0.9 s).
    known = KnownSpeech({"uh-huh": "Uh-huh.", SENTENCE: SENTENCE}, synthesize_pcm16)
    report, counted, stop = await uh_huh_then_a_sentence(
        gateway_factory, fake_openai, tmp_path, known, speculate_after_ms
    )
    assert counted.get("speech/backchannel") == 1 and counted.get("speech/interrupted") == 1
    assert len(report.clears) == 2, report.format_transcript()
    assert within[0] < stop < within[1], f"the sentence stopped the bot {stop:.2f} s in"
    assert report.bot_audio_s < FULL_S - 3, "the announcement went on after the interruption"


@pytest.mark.slow
@STT_FAULTS
async def test_when_the_words_so_far_cannot_be_had_the_hold_still_ends(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, fault: Fault
) -> None:
    # The STT request for the sentence's words so far stalls, fails or is reset: the caller
    # notices only that the bot stops later, when the hold runs out (~0.9 s), and the
    # sentence's own transcript still interrupts; a stalled request is cancelled, not left.
    known = KnownSpeech({"uh-huh": "Uh-huh.", SENTENCE: SENTENCE}, synthesize_pcm16)

    def transcribe(wav: bytes, form: dict[str, str]) -> str:
        text = known(wav)
        # The next request after the whole "uh-huh" (not its words so far, asked while it
        # paused the bot) is the one made while the hold is on.
        if text == "Uh-huh." and voiced_seconds(wav) > 0.4:
            fake_openai.faults["transcriptions"] = fault
        return text

    report, counted, stop = await uh_huh_then_a_sentence(
        gateway_factory, fake_openai, tmp_path, transcribe, 60
    )
    assert counted.get("speech/interrupted") == 1, report.format_transcript()
    assert 0.6 < stop < 1.2, f"the sentence stopped the bot {stop:.2f} s in"
    assert "transcriptions" not in fake_openai.faults, "the request held over was not made"


async def uh_huh_with_early_verdicts(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    said: tuple[str, str] = ("uh-huh", "Uh-huh."),
) -> tuple[CallReport, dict[str, float]]:
    """ "uh-huh" (or ``said``: what the caller says, its transcript) 1.5 s into the
    announcement, with speculation (the early verdict) on."""
    return await announce_call(
        gateway_factory,
        fake,
        tmp_path,
        [{"barge_in": {"say": said[0], "after": 1.5}}],
        transcript=said[1],
        speculate_after_ms=60,
    )


@pytest.mark.slow
async def test_a_backchannel_is_judged_by_its_words_so_far_not_after_the_endpoint(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    # With speculation on, "uh-huh" is transcribed 300 ms in, while it has the bot paused, and
    # the bot goes on from there instead of when the caller's utterance has ended; the rest of
    # it is held, and its whole transcript (asked for once, at its pause) says what it was.
    early = {"stage": "stt", "outcome": "used"}
    before = REGISTRY.get_sample_value("ivr_speculations_total", early) or 0.0
    report, counted = await uh_huh_with_early_verdicts(gateway_factory, fake_openai, tmp_path)
    assert len(report.clears) == 1 and report.bot_audio_s > FULL_S
    assert counted.get("speech/backchannel") == 1 and not counted.get("speech/interrupted")
    assert counted.get("speech/resumed", 0) == 0
    assert len(fake_openai.requests_for("transcriptions")) == 2
    assert (REGISTRY.get_sample_value("ivr_speculations_total", early) or 0.0) >= before + 1


@pytest.mark.slow
@STT_FAULTS
async def test_an_early_verdict_whose_stt_fails_leaves_the_utterance_to_decide(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, fault: Fault
) -> None:
    # The STT request made at the backchannel's pause stalls, fails or is reset: the caller
    # hears no difference but a wait, the bot pauses and then goes on once the utterance's
    # own words (or the client's retry) say "uh-huh", and the announcement is heard whole.
    fake_openai.faults["transcriptions"] = fault
    report, counted = await uh_huh_with_early_verdicts(gateway_factory, fake_openai, tmp_path)
    assert len(report.clears) == 1 and report.bot_audio_s > FULL_S, report.format_transcript()
    assert counted.get("speech/backchannel") == 1 and not counted.get("speech/interrupted")
    assert len(fake_openai.requests_for("transcriptions")) >= 2  # the failed one, and another
    silent = silent_in_bot_audio(report)
    assert silent < 1.5, f"the bot stayed silent {silent:.2f} s in all"


def silent_in_bot_audio(report: CallReport) -> float:
    """The silence inside the bot's audio as the caller heard it (first audio to last, less
    the audio): the gaps pauses put into the announcement (espeak's sentences join up)."""
    spans = [(t.bot_first_audio_t, t.bot_audio_end_t) for t in report.turns]
    heard = [(a, b) for a, b in spans if a is not None and b is not None]
    return max(b for _, b in heard) - min(a for a, _ in heard) - report.bot_audio_s


FIRST_BACKCHANNEL_GAP_S = 0.7
"""The team's bound on the gap a caller's first backchannel may put into the bot's speech."""


@pytest.mark.slow
@pytest.mark.parametrize("stt_s", [0.15, 0.6], ids=["stt-150ms", "stt-600ms"])
async def test_a_first_backchannel_pauses_the_bot_for_at_most_the_bound(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, stt_s: float
) -> None:
    # "mm-hmm" (0.7 s) pauses the bot ~0.15 s in. Its words so far, asked for 300 ms in, say
    # backchannel and the bot goes on while the caller finishes it; with an STT too slow for
    # that, the pause's bound resumes it. Waiting for the word's end and its transcript kept
    # the bot silent 0.84 s (1.52 s with the slow STT). The word's own transcript still counts
    # it as a backchannel, and nothing interrupts the announcement.
    fake_openai.faults["transcriptions"] = Fault(delay=stt_s)
    report, counted = await uh_huh_with_early_verdicts(
        gateway_factory, fake_openai, tmp_path, ("mm-hmm", "Mm-hmm.")
    )
    assert len(report.clears) == 1 and report.bot_audio_s > FULL_S, report.format_transcript()
    assert counted.get("speech/backchannel") == 1 and not counted.get("speech/interrupted")
    silent = silent_in_bot_audio(report)
    assert silent <= FIRST_BACKCHANNEL_GAP_S, f"the first backchannel paused the bot {silent:.2f} s"


@pytest.mark.slow
async def test_a_backchannel_that_goes_on_into_a_sentence_still_interrupts(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    # "Okay," alone is a backchannel and the bot goes on at its pause; then the caller goes
    # on talking: the bot pauses again, and the whole utterance's words take the floor.
    said = "Okay, so what about my bill then?"
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": said, "after": 1.5}}],
        transcript=lambda wav, form: "Okay." if voiced_seconds(wav) < 0.9 else said,
        speculate_after_ms=60,
    )
    assert counted.get("speech/interrupted") == 1, counted
    assert report.bot_audio_s < 4.0, "the announcement went on after the interruption"
    if counted.get("speech/backchannel"):  # espeak's comma made a pause: resumed, then paused
        assert len(report.clears) == 2, report.format_transcript()


@pytest.mark.slow
async def test_a_pause_for_a_sound_with_no_words_resumes(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": "hmm well", "after": 1.5}}],
        transcript="",  # STT heard no words
    )
    assert len(report.clears) == 1 and report.bot_audio_s > FULL_S
    assert counted.get("speech/resumed") == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", NOISE_KINDS)
async def test_a_noise_burst_does_not_stop_the_bot(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, kind: str
) -> None:
    wav = tmp_path / f"{kind}.wav"
    _write_wav(wav, noise_burst(kind, seed=3))  # type: ignore[arg-type]
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"wav": str(wav), "after": 1.5}}],
    )
    assert report.bot_audio_s > FULL_S and not counted.get("speech/interrupted")
    # Ignored or paused and resumed at once (no voice: nothing for STT to make words of), or,
    # for a thud with a pitch, paused until STT found no words in it.
    if counted.get("speech/resumed"):
        assert len(fake_openai.requests_for("transcriptions")) == 1
    else:
        assert counted.get("speech/noise", 0) >= 1
        assert not fake_openai.requests_for("transcriptions")


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    # A long minimum: echo between the bot's words is judged from its onset all the same.
    ["", LONG_MIN_SPEECH],
    ids=["default", "min_speech_900"],
)
async def test_the_bots_own_echo_does_not_stop_it(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, policy: str
) -> None:
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [],
        transcript=ANNOUNCEMENT,  # what STT would make of the echo, were it asked
        echo=LineEcho(delay_s=0.1, gain_db=-20),
        policy=policy,
    )
    assert not report.clears, "the bot interrupted itself on its own echo"
    assert report.bot_audio_s > FULL_S
    assert not fake_openai.requests_for("transcriptions"), "echo went to STT"
    assert counted.get("speech/echo", 0) >= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("echo", "speculate_after_ms"),
    [(None, 0), (LineEcho(delay_s=0.1, gain_db=-20), 0), (None, 60)],
    ids=["", "echo", "words-so-far"],
)
async def test_a_real_interruption_still_stops_the_bot(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    echo: LineEcho | None,
    speculate_after_ms: int,
) -> None:
    # With speculation on, the pause for a sound that may be a backchannel is bounded (see
    # the first backchannel's test above), but the sentence's words so far make it stand.
    sentence = "Sorry, can I talk to someone about my bill?"
    said = KnownSpeech({sentence: sentence}, synthesize_pcm16) if speculate_after_ms else sentence
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": sentence, "after": 1.5}}],
        transcript=said,
        echo=echo,
        speculate_after_ms=speculate_after_ms,
    )
    assert len(report.clears) == 1, report.format_transcript()
    assert report.bot_audio_s < 3.0, "the announcement went on after the interruption"
    assert counted.get("speech/interrupted") == 1 and not counted.get("speech/backchannel")


@pytest.mark.slow
async def test_a_nodes_min_words_lets_a_short_phrase_through_without_stopping(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    policy = "\n    interruptions: {min_words: 3}"
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": "I see why", "after": 1.5}}],
        transcript="Oh, right.",  # two words, neither counts: "oh" and "right" are backchannel
        policy=policy,
    )
    assert report.bot_audio_s > FULL_S and counted.get("speech/backchannel") == 1


@pytest.mark.slow
@pytest.mark.parametrize("words", ["Stop.", "Hang on."])
async def test_a_word_shorter_than_min_speech_still_interrupts_once_transcribed(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, words: str
) -> None:
    """ "Stop." (~0.4 s) is over before min_speech_ms: the bot cannot pause for the sound, so
    its words decide when they come, as they do after a pause. "Hang on." (~0.65 s) too,
    though the endpoint silence after it runs past min_speech_ms (the quiet is no verdict)."""
    report, counted = await announce_call(
        gateway_factory,
        fake_openai,
        tmp_path,
        [{"barge_in": {"say": words, "after": 1.5}}],
        transcript=words,
        policy=LONG_MIN_SPEECH,
    )
    assert len(report.clears) == 1, report.format_transcript()
    # Interrupted once the words are in: end of "Stop." + endpoint + STT, well under 2 s.
    assert report.bot_audio_s < 1.5 + 2.0, "the announcement went on over the caller's word"
    assert counted.get("speech/interrupted") == 1


# -- an agent reply: what the history says after a resume ----------------------------------

AGENT_FLOW = """
name: t
start: assistant
nodes:
  assistant:
    kind: agent
    greeting: Hello.
    system: Be brief.
    max_turns: 5
    on_max_turns: bye
    on_no_input: bye
  bye: {kind: hangup, say: Bye.}
"""
REPLY = "We open at nine. We close at five on weekdays. On Saturdays we open at ten."


@pytest.mark.slow
async def test_after_a_backchannel_the_llm_sees_the_whole_reply_and_no_okay(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    fake_openai.speak = speak_24k
    fake_openai.transcripts.extend(["when are you open", "Okay.", "thanks"])
    fake_openai.chat = [ChatScript(text=REPLY), ChatScript(text="You're welcome.")]
    (tmp_path / "routes.yaml").write_text("default: t\n")
    (tmp_path / "t.yaml").write_text(AGENT_FLOW)
    steps = [
        "When are you open?",
        {"barge_in": {"say": "okay", "after": 1.2}},
        {"say": "Thanks."},
    ]
    async with gateway_factory(flows_dir=str(tmp_path)) as server:
        report = await place_call(
            server.base_url,
            script=script_from_data(steps),
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
        )
    assert not report.errors, report.format_transcript()
    assert len(report.clears) == 1, "the backchannel paused the reply once"
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 2, "the backchannel must not reach the LLM as a turn"
    second = chats[1].json
    assert second is not None
    said = [(m["role"], m["content"]) for m in second["messages"] if m["role"] != "system"]
    assert ("assistant", REPLY) in said, said
    assert all("okay" not in str(c).lower() for r, c in said if r == "user"), said


def _write_wav(path: Path, pcm16: bytes) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(pcm16)


# -- the text-mode runner (ivr flows test) follows the same rules -----------------------------

TERMS_FLOW = """
name: t
start: terms
nodes:
  terms:
    kind: say
    text: Please listen to these terms and conditions very carefully.{policy}
    next: agree
  agree:
    kind: ask
    prompt: Do you agree?
    store: answer
    next: bye
  bye: {{kind: hangup}}
"""


@pytest.mark.parametrize(
    ("policy", "cut", "answer"),
    [("", False, "yes"), ("\n    interruptions: {backchannels: []}", True, "okay")],
    ids=["backchannel-swallowed", "every-word-counts"],
)
async def test_text_mode_swallows_backchannel_over_the_bot_unless_the_node_says_not(
    policy: str, cut: bool, answer: str
) -> None:
    flow = load_flow_text(TERMS_FLOW.format(policy=policy), "t.yaml")
    io = TextCallIO.scripted([said("okay", barge_in_after_words=3), said("yes")])
    llm = OpenAICompatLlm(base_url="http://127.0.0.1:9/v1", api_key="k", model="m")  # unused
    async with httpx.AsyncClient() as http:
        final = await FlowRunner(flow, io, llm, http).run()
    await llm.aclose()
    assert ("Please listen to --" in io.bot_lines) is cut, io.transcript
    assert final.vars["answer"] == answer, io.transcript


def test_a_resume_goes_back_to_the_last_pause_in_the_audio_before_the_cut() -> None:
    phrase = pcm16_to_ulaw(speech_pcm16("our opening hours are nine to five"))
    gap = b"\xff" * 160 * 15  # 300 ms of silence between the two sentences
    audio = phrase + gap + phrase
    second = len(phrase) + len(gap)
    start = phrase_start(audio, second + 4000)  # half a second into the second sentence
    assert second - 3 * 160 <= start <= second, (start, second)  # 40 ms lead-in, frame-aligned
    assert phrase_start(audio, 4000) == 0  # cut in the first phrase: from the start
