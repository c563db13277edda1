"""Barge-in, in process: the real ``CallSession`` / ``SpeechHandle`` / ``AudioPlayer`` and the real
OpenAI-compatible STT and TTS clients (against ``FakeOpenAIServer``), with no gateway and no
socket. Twilio is replaced where the player's messages leave, by ``TwilioLine``: it records
what would be sent and plays it out in real time like Twilio's media servers do (a mark echoes
once the audio before it has played; ``clear`` drops the rest and echoes every pending mark).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from audio_fixtures import frames, noise_pcm16, speech_pcm16, trimmed

from ivr import phrases
from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.endpointer import EndpointConfig, Endpointer
from ivr.audio.vad import WebRtcVad
from ivr.call import barge_in as barge_in_module
from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.session import CallEnd, CallSession
from ivr.callio.io import Digits, ListenSpec, Spoken, Utterance
from ivr.errors import ProviderError, ProviderErrorKind
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.hold import Hold
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.testing.openai_wire import SECONDS_PER_CHAR, Fault
from ivr.tts.openai_http import OpenAIHttpTts

LONG_PROMPT = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima"
FRAME_S = 0.02


@dataclass
class TwilioLine:
    """Twilio's side of the media stream, at the point where the player's messages leave."""

    hold_clear: asyncio.Event | None = None
    """When set, sending ``clear`` suspends until it is set (a backed-up socket)."""
    hold_stale_echoes: bool = False
    """Keep the marks a ``clear`` echoes in ``stale`` instead of echoing them at once."""
    on_mark: Callable[[str], None] = lambda name: None
    sent: list[tuple[float, str, object]] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    clear_started: asyncio.Event = field(default_factory=asyncio.Event)
    _playout_end: float = 0.0
    _pending: dict[str, asyncio.TimerHandle] = field(default_factory=dict)

    async def media(self, ulaw: bytes) -> None:
        now = time.monotonic()
        self.sent.append((now, "media", len(ulaw)))
        self._playout_end = max(now, self._playout_end) + len(ulaw) / 8000

    async def mark(self, name: str) -> None:
        self.sent.append((time.monotonic(), "mark", name))
        delay = max(0.0, self._playout_end - time.monotonic())
        self._pending[name] = asyncio.get_running_loop().call_later(delay, self._echo, name)

    async def clear(self) -> None:
        self.clear_started.set()
        if self.hold_clear is not None:
            await self.hold_clear.wait()
        self.sent.append((time.monotonic(), "clear", None))
        self._playout_end = time.monotonic()
        cleared = list(self._pending)
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
        if self.hold_stale_echoes:
            self.stale.extend(cleared)
        else:
            for name in cleared:
                self.on_mark(name)

    def _echo(self, name: str) -> None:
        self._pending.pop(name, None)
        self.on_mark(name)

    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.sent]

    def first_media_at(self, after: float = 0.0) -> float | None:
        return next((t for t, kind, _ in self.sent if kind == "media" and t >= after), None)

    def media_after_clear(self) -> int:
        kinds = self.kinds()
        if "clear" not in kinds:
            return 0
        return kinds[kinds.index("clear") :].count("media")


@dataclass
class Call:
    session: CallSession
    line: TwilioLine
    ends: list[CallEnd]

    async def say_soon(self, text: str) -> asyncio.Task[Spoken]:
        """Start saying ``text`` and return once its first audio has gone out."""
        since = time.monotonic()
        task = asyncio.create_task(self.session.say(text))
        await until(lambda: self.line.first_media_at(since) is not None)
        return task

    async def speak(self, pcm16: bytes) -> None:
        """The caller's audio, in real time, as 20 ms mu-law frames with Twilio timestamps."""
        start = self.stream_time
        for frame, t in frames(pcm16):
            await self.session.on_media(pcm16_to_ulaw(frame), start + t)
            await asyncio.sleep(FRAME_S)
        self.stream_time = start + len(pcm16) / 2 / 8000

    stream_time: float = 0.0


async def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll what the line recorded (the test's view of the wire) until ``condition`` holds."""
    for _ in range(int(within_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not within {within_s} s")


@pytest.fixture
def providers() -> AsyncIterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="sk-test") as server:
        yield server


@asynccontextmanager
async def live_call(fake: FakeOpenAIServer, line: TwilioLine) -> AsyncIterator[Call]:
    player = AudioPlayer(line.media, line.mark, line.clear, lead_seconds=0.3)
    stt = OpenAIHttpStt(base_url=fake.base_url, api_key="sk-test")
    tts = OpenAIHttpTts(base_url=fake.base_url, api_key="sk-test", first_byte_timeout=1.0)
    prompts = PromptCache()
    await prompts.warm(tts, phrases.CACHED_AT_START)  # as the gateway does at startup
    fake.requests.clear()
    endpointer = Endpointer(WebRtcVad(2), EndpointConfig(silence_ms=300, min_speech_ms=100))
    ends: list[CallEnd] = []
    session = CallSession(
        player=player,
        endpointer=endpointer,
        stt=stt,
        tts=tts,
        prompts=prompts,
        on_end=ends.append,
    )
    line.on_mark = session.on_mark
    tasks = [
        asyncio.create_task(player.run_sender(), name="sender"),
        asyncio.create_task(session.run_stt(), name="stt"),
    ]
    try:
        yield Call(session, line, ends)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await stt.aclose()
        await tts.aclose()


def heard_bounds(text: str, elapsed: float, slack: float = 0.12) -> tuple[int, int]:
    """How many characters of ``text`` can have played in ``elapsed`` s, give or take."""
    low = int((elapsed - slack) / SECONDS_PER_CHAR)
    high = int((elapsed + slack) / SECONDS_PER_CHAR) + 1
    return max(0, low), min(len(text), high)


# -- barge-in by speech and by key ------------------------------------------------------------


async def test_caller_speech_interrupts_the_bot_and_becomes_the_next_answer(
    providers: FakeOpenAIServer,
) -> None:
    providers.transcripts.append("I want to talk to someone")
    async with live_call(providers, TwilioLine()) as call:
        saying = await call.say_soon(LONG_PROMPT)
        await call.speak(noise_pcm16(0.3, -60))
        await call.speak(trimmed(speech_pcm16("I want to talk to someone")))
        # The bot paused at once; the interruption stands when the words are transcribed.
        assert "clear" in call.line.kinds() and not saying.done()
        await call.speak(noise_pcm16(0.5, -60))  # the endpoint silence
        spoken = await asyncio.wait_for(saying, 2)
        answer = await call.session.listen(ListenSpec(no_input_timeout=3))
    assert spoken.interrupted
    assert LONG_PROMPT.startswith(spoken.text_heard)
    assert len(spoken.text_heard) < len(LONG_PROMPT) / 2
    assert "clear" in call.line.kinds()
    assert call.line.media_after_clear() == 0
    assert answer == Utterance(text="I want to talk to someone", latency=answer.latency)


async def test_a_key_interrupts_the_bot_and_is_the_next_answer(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:
        saying = await call.say_soon(LONG_PROMPT)
        await asyncio.sleep(0.3)
        await call.session.on_dtmf("5")
        spoken = await asyncio.wait_for(saying, 2)
        answer = await call.session.listen(ListenSpec(num_digits=1, no_input_timeout=1))
    assert spoken.interrupted
    assert call.line.kinds().count("clear") == 1
    assert call.line.media_after_clear() == 0
    assert answer == Digits("5")


async def test_an_uninterruptible_prompt_plays_to_the_end_over_a_key(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:
        since = time.monotonic()
        saying = asyncio.create_task(call.session.say("short notice", interruptible=False))
        await until(lambda: call.line.first_media_at(since) is not None)
        await call.session.on_dtmf("1")
        spoken = await asyncio.wait_for(saying, 3)
        answer = await call.session.listen(ListenSpec(num_digits=1, no_input_timeout=1))
    assert spoken == Spoken(text_heard="short notice")
    assert "clear" not in call.line.kinds()
    assert answer == Digits("1")  # the key is kept for the next question


async def test_an_answer_already_queued_is_never_reported_as_no_input(
    providers: FakeOpenAIServer,
) -> None:
    """The key lands as the no-input timeout expires (here: a timeout already past)."""
    async with live_call(providers, TwilioLine()) as call:
        await call.session.on_dtmf("7")
        answer = await call.session.listen(ListenSpec(num_digits=1, no_input_timeout=0))
    assert answer == Digits("7")


# -- what was heard ---------------------------------------------------------------------------


async def test_the_text_heard_stops_at_the_word_the_caller_interrupted(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:
        saying = await call.say_soon(LONG_PROMPT)
        started = call.line.first_media_at()
        assert started is not None
        await asyncio.sleep(1.5)
        interrupted_at = time.monotonic()
        await call.session.on_dtmf("0")
        spoken = await asyncio.wait_for(saying, 2)
    low, high = heard_bounds(LONG_PROMPT, interrupted_at - started)
    heard = spoken.text_heard
    assert spoken.interrupted
    assert LONG_PROMPT.startswith(heard) and (heard == "" or LONG_PROMPT[len(heard)] == " ")
    # Only whole words, and only those that had finished playing when the key was pressed.
    assert len(heard) <= high
    next_word_end = LONG_PROMPT.find(" ", len(heard) + 1)
    assert next_word_end == -1 or next_word_end > low, (heard, low, high)
    assert heard.split()[:2] == ["alpha", "bravo"]


# -- the interrupt race: a `clear` that waits on the socket -----------------------------------


async def test_no_audio_follows_a_clear_that_was_slow_to_send(
    providers: FakeOpenAIServer,
) -> None:
    """While `clear` waits on a backed-up socket, the reply's next sentence arrives from the
    LLM. It must not be synthesised into the new generation and sent after the clear."""
    release = asyncio.Event()
    line = TwilioLine(hold_clear=release)
    async with live_call(providers, line) as call:

        async def reply() -> AsyncIterator[str]:
            yield "First sentence is here. "
            await line.clear_started.wait()  # the second sentence lands mid-clear
            yield "Second sentence follows right after it."

        since = time.monotonic()
        saying = asyncio.create_task(call.session.say_stream(reply()))
        await until(lambda: line.first_media_at(since) is not None)
        barge = asyncio.create_task(call.session.on_dtmf("9"))
        await line.clear_started.wait()
        await asyncio.sleep(0.4)  # long enough for TTS of the second sentence to stream
        release.set()
        await barge
        spoken = await asyncio.wait_for(saying, 2)
        await asyncio.sleep(0.3)  # anything queued behind the clear would go out now
    assert spoken.interrupted
    assert "Second" not in spoken.text_heard
    assert line.media_after_clear() == 0, line.kinds()
    speech_inputs = [r.json["input"] for r in providers.requests_for("speech") if r.json]
    assert speech_inputs == ["First sentence is here."]


# -- echoes of cleared marks ------------------------------------------------------------------


async def test_echoes_of_cleared_marks_are_not_playback_of_the_next_utterance(
    providers: FakeOpenAIServer,
) -> None:
    """Twilio echoes every pending mark on `clear`, and those echoes may arrive after the next
    utterance has started. They must not count as that utterance having played."""
    line = TwilioLine(hold_stale_echoes=True)
    async with live_call(providers, line) as call:
        saying = await call.say_soon("Hello there. " + LONG_PROMPT)
        await until(lambda: "mark" in line.kinds())  # the first sentence's mark is at Twilio
        await call.session.on_dtmf("1")
        assert (await asyncio.wait_for(saying, 2)).interrupted
        assert line.stale == ["g0:1"], "the clear should have echoed the pending mark"
        assert await call.session.listen(ListenSpec(num_digits=1)) == Digits("1")

        next_prompt = "please hold the line"
        cleared_at = time.monotonic()
        following = await call.say_soon(next_prompt)
        started = line.first_media_at(cleared_at)
        assert started is not None
        for name in line.stale:  # late echoes of the cleared generation
            call.session.on_mark(name)
        spoken = await asyncio.wait_for(following, 5)
        finished = time.monotonic()
    assert spoken == Spoken(text_heard=next_prompt)
    duration = len(next_prompt) * SECONDS_PER_CHAR
    assert finished - started >= duration * 0.9, "a stale echo ended the next utterance early"


# -- provider failures: what the caller hears ------------------------------------------------


async def test_a_dead_tts_still_answers_with_the_cached_apology(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:
        providers.faults["speech"] = Fault(status=500)  # after startup synthesised the apology

        async def reply() -> AsyncIterator[str]:
            yield "Our opening hours are nine to five. "
            yield "Is there anything else?"

        since = time.monotonic()
        spoken = await asyncio.wait_for(call.session.say_stream(reply()), 10)
        first_audio = call.line.first_media_at(since)
    assert spoken == Spoken(text_heard=phrases.LLM_FAILURE)
    assert first_audio is not None and first_audio - since < 1.0  # no TTS wait: 500 is instant
    assert providers.requests_for("speech"), "the reply's sentences were tried first"


async def test_a_model_that_fails_before_a_word_gets_the_cached_apology(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:

        async def failing() -> AsyncIterator[str]:
            raise ProviderError("llm", "stream closed", kind=ProviderErrorKind.RESET)
            yield ""  # pragma: no cover - makes this an async generator

        spoken = await asyncio.wait_for(call.session.say_stream(failing()), 5)
    assert spoken == Spoken(text_heard=phrases.LLM_FAILURE)
    assert providers.requests_for("speech") == [], "the apology is played from the cache"


async def test_a_tts_reset_mid_reply_keeps_the_call_going(providers: FakeOpenAIServer) -> None:
    async with live_call(providers, TwilioLine()) as call:
        providers.faults["speech"] = Fault(after_chunks=2, then="reset", times=1)
        spoken = await asyncio.wait_for(call.session.say("one sentence. And a second one."), 10)
        again = await asyncio.wait_for(call.session.say("Still here."), 10)
    assert "And a second one." in spoken.text_heard
    assert phrases.LLM_FAILURE not in spoken.text_heard, "the reply went on: no apology"
    assert again == Spoken(text_heard="Still here.")


async def test_a_reply_cut_off_by_a_tts_reset_ends_with_the_apology(
    providers: FakeOpenAIServer,
) -> None:
    async with live_call(providers, TwilioLine()) as call:
        providers.faults["speech"] = Fault(after_chunks=2, then="reset", times=1)
        spoken = await asyncio.wait_for(call.session.say("Only one sentence here."), 10)
    # The caller heard the start of the sentence, then the cached apology, not silence.
    assert spoken.text_heard.endswith(phrases.LLM_FAILURE), spoken
    assert len(providers.requests_for("speech")) == 1, "the apology is played from the cache"


async def test_a_failed_transcription_asks_again_and_keeps_listening(
    providers: FakeOpenAIServer,
) -> None:
    providers.faults["transcriptions"] = Fault(status=503, times=1)
    providers.transcripts.append("the second try")
    async with live_call(providers, TwilioLine()) as call:
        listening = asyncio.create_task(call.session.listen(ListenSpec(no_input_timeout=8)))
        words = trimmed(speech_pcm16("what are your opening hours"))
        await call.speak(words + noise_pcm16(0.6, -60))
        await until(lambda: "mark" in call.line.kinds())  # the bot asked again
        await asyncio.sleep(len(phrases.NOT_UNDERSTOOD) * SECONDS_PER_CHAR)
        await call.speak(words + noise_pcm16(0.6, -60))
        answer = await asyncio.wait_for(listening, 8)
    assert isinstance(answer, Utterance) and answer.text == "the second try"
    assert len(providers.requests_for("transcriptions")) == 2


# -- a pause whose transcript fails or never comes --------------------------------------------


async def test_when_stt_fails_on_the_speech_that_paused_the_bot_the_interruption_stands(
    providers: FakeOpenAIServer,
) -> None:
    providers.faults["transcriptions"] = Fault(status=500, times=10)
    async with live_call(providers, TwilioLine()) as call:
        saying = await call.say_soon(LONG_PROMPT)
        await call.speak(noise_pcm16(0.3, -60))
        await call.speak(trimmed(speech_pcm16("I want to talk to someone")))
        assert "clear" in call.line.kinds() and not saying.done()  # paused
        await call.speak(noise_pcm16(0.5, -60))  # the endpoint silence; STT then fails
        spoken = await asyncio.wait_for(saying, 5)
    assert spoken.interrupted, "the caller said something: the bot must not talk on over it"
    assert call.line.kinds().count("clear") == 1
    assert call.line.media_after_clear() == 0


async def test_a_paused_prompt_whose_transcript_never_comes_goes_on(
    providers: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(barge_in_module, "PAUSE_VERDICT_LIMIT_S", 0.3)
    providers.faults["transcriptions"] = Fault(hang=True, times=10)
    async with live_call(providers, TwilioLine()) as call:
        saying = await call.say_soon(LONG_PROMPT)
        await call.speak(noise_pcm16(0.3, -60))
        await call.speak(trimmed(speech_pcm16("I want to talk to someone")))
        assert "clear" in call.line.kinds() and not saying.done()  # paused
        await call.speak(noise_pcm16(0.8, -60))  # the endpoint silence and the deadline
        spoken = await asyncio.wait_for(saying, 10)
    assert not spoken.interrupted and spoken.text_heard == LONG_PROMPT
    assert call.line.media_after_clear() > 0, "the prompt did not resume"


async def test_static_prompts_warm_several_at_once(fake_openai: FakeOpenAIServer) -> None:
    """Startup synthesises the flows' prompts a few at a time (counted at the server: four
    requests wait together), not one whole prompt after another."""
    hold = fake_openai.holds["speech"] = Hold(4, give_up_s=1.0)
    tts = OpenAIHttpTts(base_url=fake_openai.base_url, api_key="sk-test")
    cache = PromptCache()
    added = await cache.warm(tts, [f"Prompt number {i}." for i in range(6)] + ["Prompt number 0."])
    await tts.aclose()
    assert added == 6 and len(cache) == 6
    assert hold.peak == 4, hold
