"""The floor as a state machine: ``FloorState`` transitions, and the ``Floor`` keeper driven by
frames and endpoint events (a real endpointer and VAD, a fake clock, no socket, no STT call)."""

from __future__ import annotations

import asyncio

import pytest
from audio_fixtures import frames, noise_pcm16, speech_pcm16, trimmed

from ivr.audio.endpointer import (
    EndpointConfig,
    Endpointer,
    SpeechDiscarded,
    SpeechEnded,
    SpeechStarted,
)
from ivr.audio.vad import WebRtcVad
from ivr.call.barge_in import Floor
from ivr.call.floor import Bot, Caller, FloorState, IllegalTransition
from ivr.call.inputs import CallerInputs
from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.speaking import Speaker
from ivr.callio.io import Utterance
from ivr.callio.timeline import CallTimeline
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.tts.openai_http import OpenAIHttpTts

# -- FloorState: the transitions alone ------------------------------------------------------


def test_a_caller_sound_becomes_speech_and_ends_quiet() -> None:
    state = FloorState().sound_started()
    assert state == FloorState(Caller.SOUND, Bot.ON) and not state.caller_confirmed
    state = state.speech_confirmed()
    assert state.caller_confirmed and state.caller_sounding
    assert state.sound_ended() == FloorState()


def test_speech_over_the_bot_pauses_it_and_its_words_interrupt_it() -> None:
    state = FloorState().sound_started().speech_confirmed().paused()
    assert state.bot_paused
    waiting = state.sound_ended()
    assert waiting == FloorState(Caller.QUIET, Bot.PAUSED)  # the words decide
    assert waiting.interrupted() == FloorState()


def test_a_backchannel_at_a_pause_lets_the_bot_go_on_until_the_caller_goes_on() -> None:
    state = FloorState().sound_started().speech_confirmed().paused()
    went_on = state.resumed().went_on_early()
    assert went_on.bot is Bot.WENT_ON and went_on.caller is Caller.SPEECH
    assert went_on.caller_went_on().bot is Bot.ON  # then it pauses again for the words
    assert went_on.sound_ended() == FloorState()  # its words were judged at its pause


def test_held_words_that_take_the_floor_make_the_sound_speech() -> None:
    state = FloorState().sound_started().words_take_floor()
    assert state.caller is Caller.WORDS and not state.caller_confirmed
    assert state.speech_confirmed().caller_confirmed


def test_a_resume_leaves_a_backchannel_verdict_alone() -> None:
    went_on = FloorState(Caller.SPEECH, Bot.WENT_ON)
    assert went_on.resumed() == went_on  # only a paused prompt resumes


@pytest.mark.parametrize(
    ("state", "move"),
    [
        (FloorState(), FloorState.speech_confirmed),  # no sound to confirm
        (FloorState(), FloorState.paused),  # nobody to pause for
        (FloorState(), FloorState.interrupted),  # nothing paused
        (FloorState(Caller.SPEECH), FloorState.sound_started),  # one sound at a time
        (FloorState(Caller.SPEECH), FloorState.words_take_floor),  # speech already
        (FloorState(Caller.QUIET, Bot.PAUSED), FloorState.went_on_early),  # no sound going on
    ],
)
def test_a_transition_that_cannot_happen_raises(state: FloorState, move: object) -> None:
    with pytest.raises(IllegalTransition):
        move(state)  # type: ignore[operator]


# -- Floor: frames in, the floor's state out ------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Wire:
    """Where the player's messages would leave for Twilio: kept here, nothing is sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def media(self, ulaw: bytes) -> None:
        self.sent.append("media")

    async def mark(self, name: str) -> None:
        self.sent.append("mark")

    async def clear(self) -> None:
        self.sent.append("clear")


def floor_of(clock: FakeClock, inputs: CallerInputs) -> tuple[Floor, Endpointer]:
    wire = Wire()
    player = AudioPlayer(wire.media, wire.mark, wire.clear, clock=clock)
    unused = "http://127.0.0.1:9"  # never asked: no pause events, no prompt to hold on over
    speaker = Speaker(
        player=player,
        tts=OpenAIHttpTts(base_url=unused, api_key="k"),
        prompts=PromptCache(),
        clock=clock,
    )
    endpointer = Endpointer(WebRtcVad(2), EndpointConfig(silence_ms=300, min_speech_ms=100))
    floor = Floor(
        speaker=speaker,
        endpointer=endpointer,
        stt=OpenAIHttpStt(base_url=unused, api_key="k"),
        inputs=inputs,
        timeline=CallTimeline(),
        clock=clock,
    )
    return floor, endpointer


async def feed(
    floor: Floor, endpointer: Endpointer, clock: FakeClock, pcm16: bytes, seen: list[Caller]
) -> list[bool]:
    """The receive loop's part, frame by frame; returns, per sound that ended, whether it
    goes to STT."""
    ended = []
    for frame, t in frames(pcm16):
        clock.now += 0.02
        floor.push(frame, t + 0.02, clock.now)
        event = endpointer.push(frame, t)
        if isinstance(event, SpeechStarted):
            await floor.sound_started(event.t)
        elif isinstance(event, SpeechEnded | SpeechDiscarded):
            ended.append(floor.sound_ended(event))
        elif event is None and floor.judging:
            await floor.judge_sound()
        if not seen or seen[-1] is not floor.state.caller:
            seen.append(floor.state.caller)
    return ended


async def test_caller_speech_with_the_bot_silent_takes_the_floor_then_goes_to_stt() -> None:
    clock, inputs = FakeClock(), CallerInputs()
    floor, endpointer = floor_of(clock, inputs)
    seen: list[Caller] = []
    speech = trimmed(speech_pcm16("I want to pay my bill"))
    ended = await feed(floor, endpointer, clock, noise_pcm16(0.3, -60) + speech, seen)
    ended += await feed(floor, endpointer, clock, noise_pcm16(0.6, -60), seen)
    assert seen == [Caller.QUIET, Caller.SOUND, Caller.SPEECH, Caller.QUIET]
    assert ended == [True]
    assert floor.state == FloorState()


async def test_a_click_too_short_for_speech_never_takes_the_floor() -> None:
    clock, inputs = FakeClock(), CallerInputs()
    floor, endpointer = floor_of(clock, inputs)
    seen: list[Caller] = []
    click = trimmed(speech_pcm16("a"))[: 2 * 8000 * 60 // 1000]  # 60 ms, under min_speech_ms
    ended = await feed(floor, endpointer, clock, noise_pcm16(0.3, -60) + click, seen)
    ended += await feed(floor, endpointer, clock, noise_pcm16(0.6, -60), seen)
    assert Caller.SPEECH not in seen
    assert ended in ([], [False])  # dropped by the endpointer, or discarded: no STT
    assert floor.state == FloorState()


async def test_words_with_the_bot_silent_go_to_the_flow() -> None:
    clock, inputs = FakeClock(), CallerInputs()
    floor, _ = floor_of(clock, inputs)
    await floor.deliver(Utterance("two tickets please"))
    assert await inputs.next(0) == Utterance("two tickets please")
    assert floor.state == FloorState()


async def test_nothing_runs_after_close() -> None:
    clock, inputs = FakeClock(), CallerInputs()
    floor, _ = floor_of(clock, inputs)
    await floor.aclose()
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
