"""One live call's audio session: the ``CallIO`` the flow runner drives, over Twilio audio.

``CallSession`` is the front; the work is done by its parts, one job each:

* hearing (``ivr.call.hearing``): inbound audio, endpointing, the STT worker, and speculation
  at the caller's pauses (``ivr.call.pause_turns``);
* the floor (``ivr.call.floor`` states, kept by ``ivr.call.barge_in``): who has it: barge-in,
  echo, backchannel, a prompt paused and resumed;
* speaking (``ivr.call.speaking``): one ``SpeechHandle`` at a time over the ``AudioPlayer``.

``listen()`` reads what the floor let through (``ivr.call.inputs``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from ivr import phrases
from ivr.audio.endpointer import Endpointer
from ivr.call.barge_in import Floor
from ivr.call.hearing import Hearing
from ivr.call.inputs import CallerInputs, Key, NotUnderstood
from ivr.call.live_hearing import LiveHearing
from ivr.call.live_words import LiveWords
from ivr.call.pause_turns import TurnSpeculation
from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.speaking import Speaker
from ivr.call.speech import SpeechHandle
from ivr.call.turn_end import TurnModel
from ivr.call.turns import CallStats
from ivr.callio.interruption_policy import InterruptionPolicy
from ivr.callio.io import CallerInput, Capabilities, Digits, HungUp, ListenSpec, NoInput, Spoken
from ivr.callio.timeline import CallTimeline
from ivr.callio.turn_policy import DEFAULT_POLICIES
from ivr.control.transfers import WarmTransfer
from ivr.obs import metrics
from ivr.obs.backlog import InboundBacklog
from ivr.stt.base import SpeechToText, StreamingSpeechToText
from ivr.tts.base import TextToSpeech


class EndAction(StrEnum):
    HANGUP = "hangup"
    TRANSFER = "transfer"


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How the call should leave the stream: consumed by the ``<Connect action>`` handler."""

    action: EndAction
    number: str = ""
    """The number to dial, for a transfer (checked by the flow engine)."""
    warm: WarmTransfer | None = None
    """A warm transfer: the caller is held in a conference while the agent is briefed."""


class CallSession:
    """Implements ``ivr.callio.io.CallIO`` for one Media Stream."""

    # Slots: every inbound frame reads this object, most often with it out of the CPU's caches
    # (bench/frame_cost.py); slotted, its attributes are in the object, not an array apart.
    __slots__ = (
        "_clock",
        "_endpointer",
        "_floor",
        "_hearing",
        "_inputs",
        "_on_end",
        "_speaker",
        "_speculation",
        "capabilities",
        "timeline",
    )

    def __init__(
        self,
        *,
        player: AudioPlayer,
        endpointer: Endpointer,
        stt: SpeechToText,
        tts: TextToSpeech,
        prompts: PromptCache,
        on_end: Callable[[CallEnd], None],
        llm_name: str = "llm",
        heard_within: float | None = None,
        turn_model: TurnModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        streaming_stt: StreamingSpeechToText | None = None,  # hears the call (one session)
        backlog: InboundBacklog | None = None,  # the process's: how late it hears its calls
        on_speech_start: Callable[[], None] | None = None,  # the caller began to speak
    ) -> None:
        """``heard_within``: when a provider fails, the caller hears the cached apology (or
        the not-understood prompt) within this many seconds of their speech's end (None:
        each stage keeps its own limit)."""
        self._on_end = on_end
        self._clock = clock
        self.timeline = CallTimeline()  # key presses, barge-ins, nodes: saved with turns
        self._inputs = CallerInputs()
        self._speaker = Speaker(
            player=player, tts=tts, prompts=prompts, llm_name=llm_name,
            heard_within=heard_within, clock=clock,
        )  # fmt: skip
        words = None if streaming_stt is None else LiveWords(streaming_stt.name)
        stt = words or stt
        self._floor = Floor(
            speaker=self._speaker,
            endpointer=endpointer,
            stt=stt,
            inputs=self._inputs,
            timeline=self.timeline,
            clock=clock,
        )
        self._speculation = TurnSpeculation(
            endpointer=endpointer,
            stt=stt,
            speaker=self._speaker,
            turn_model=turn_model,
            heard_within=heard_within,
        )
        self._hearing = Hearing(
            endpointer=endpointer,
            stt=stt,
            floor=self._floor,
            speaker=self._speaker,
            speculation=self._speculation,
            heard_within=heard_within,
            clock=clock,
            live=_live_hearing(self, streaming_stt, words, endpointer, heard_within),
            backlog=backlog,
            on_speech_start=on_speech_start,
        )
        self._endpointer = endpointer
        # interruptions, speculation (the pauses' own), timeline, turn log, caller audio
        self.capabilities = Capabilities(self, self._speculation, self.timeline, self, self)

    @property
    def stats(self) -> CallStats:
        return self._speaker.stats

    # -- inbound (called by the stream's receive loop) ------------------------------------

    def add_audio_tap(self, tap: Callable[[bytes], None]) -> None:
        """``tap`` gets every inbound payload as PCM16 8 kHz (e.g. answering machine
        detection); it runs on the receive loop, so it must only hand the audio on."""
        self._hearing.add_audio_tap(tap)

    async def on_media(self, ulaw: bytes, stream_time: float) -> None:
        """One inbound payload (normally 20 ms); ``stream_time`` is Twilio's timestamp (s)."""
        await self._hearing.on_media(ulaw, stream_time)

    async def on_dtmf(self, digit: str) -> None:
        # Queue the key before the barge-in awaits `clear`, so the flow, woken by the
        # interruption, finds it instead of starting its next prompt.
        self._inputs.put(Key(digit))
        await self._speaker.interrupt("dtmf")

    def on_mark(self, name: str) -> None:
        self._speaker.player.on_mark(name)

    def on_hangup(self) -> None:
        self._inputs.put(HungUp())

    async def run_stt(self) -> None:
        """The STT worker: run it in the call's task group."""
        await self._hearing.run_stt()

    async def aclose(self) -> None:
        """The stream is over: cancel what speculation still runs."""
        await self._speculation.aclose()
        await self._hearing.aclose()
        await self._floor.aclose()
        await self._speaker.aclose()

    # -- barge-in -------------------------------------------------------------------------

    def recall_backchannels(self, spans_ms: Iterable[int]) -> None:
        """A resumed call: the caller's backchannels on its earlier streams (from its record's
        timeline, ``backchannel_spans``) teach this one their habit, as if heard here."""
        self._floor.recall_backchannels(spans_ms)

    def set_interruption_policy(self, policy: InterruptionPolicy | None) -> None:
        """What interrupts the prompts that follow (``Capabilities.interruptions``)."""
        self._floor.set_policy(policy)

    # -- who is answering -------------------------------------------------------------------

    def _caller_answering(self) -> bool:
        """Speech in progress or being transcribed: an answer is on its way."""
        return self._floor.state.caller_sounding or self._hearing.stt_pending()

    def _caller_has_the_floor(self) -> bool:
        """The caller is talking, or has said or pressed something not yet acted on."""
        return (
            self._floor.state.caller_confirmed
            or self._hearing.stt_pending()
            or not self._inputs.empty()
        )

    async def wait_for_turn_boundary(self, poll: float = 0.02) -> None:
        """Until the flow waits for the caller, the bot is silent and the caller has neither
        started talking nor said or pressed anything not yet acted on: nobody would notice a
        pause (polled: this is for rare events such as a drain)."""
        while True:  # the conditions change in many places; a 20 ms poll costs nothing here
            if (
                self._speculation.listening
                and self._speaker.current is None
                and not self._caller_answering()
                and not self._caller_has_the_floor()
            ):
                return
            await asyncio.sleep(poll)

    async def forget_caller_input(self, limit: float = 3.0, until_quiet: bool = False) -> None:
        """Drop what the caller said so far, once transcribed (waits ``limit`` s at most): an
        outbound callee's "Hello?" greets us, it answers no prompt. ``until_quiet``: first let
        them finish it (a verdict can come mid-word), so the bot does not start over a person
        and take their "Hello?" for a barge-in. Polled, once a call."""
        waited = 0.0
        busy = self._caller_answering if until_quiet else self._hearing.stt_pending
        while busy() and waited < limit:
            await asyncio.sleep(0.02)
            waited += 0.02
        self._inputs.clear()

    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        return self._speaker.unsaved_turns()

    # -- CallIO: listening ----------------------------------------------------------------

    async def listen(self, spec: ListenSpec) -> CallerInput:
        speculation = self._speculation
        speculation.listening = True
        speculation.spec = spec
        self._speaker.prefetch.discard()  # a new turn: what the last one did not use is stale
        # The node's pause before a turn counts as over (an account number waits longer);
        # a node that sets nothing keeps the gateway's configured endpoint silence.
        custom = spec.turn != DEFAULT_POLICIES["any"]
        self._endpointer.use_default_silence_ms(spec.turn.fallback_silence_ms if custom else None)
        try:
            return await self._listen(spec)
        finally:
            speculation.listening = False
            self._endpointer.use_default_silence_ms(None)

    async def _listen(self, spec: ListenSpec) -> CallerInput:
        deadline = self._clock() + spec.no_input_timeout
        digits = ""
        digit_deadline = deadline
        while True:
            now = self._clock()
            if digits:
                wait = digit_deadline - now
            elif self._caller_answering():
                wait = 0.25  # the caller is mid-answer: never time out on them
                deadline = max(deadline, now + 0.25)
            else:
                wait = deadline - now
            item = await self._inputs.next(wait)
            if item is None:  # timed out, and nothing is queued
                if digits:
                    return Digits(digits)
                if self._clock() >= deadline and not self._caller_answering():
                    return NoInput()
                continue
            if isinstance(item, HungUp):
                return item
            if isinstance(item, Key):
                if not spec.dtmf:
                    continue
                if spec.finish_on_key and item.digit == spec.finish_on_key:
                    return Digits(digits)
                digits += item.digit
                if spec.num_digits is not None and len(digits) >= spec.num_digits:
                    return Digits(digits)
                digit_deadline = self._clock() + spec.inter_digit_timeout
                continue
            if isinstance(item, NotUnderstood):
                if spec.speech and not digits:
                    # Ask again at once, from the prompt cache (it does not need the STT that
                    # just failed, nor the TTS), and give the caller the full time to answer.
                    await self.say(phrases.NOT_UNDERSTOOD)
                    deadline = self._clock() + spec.no_input_timeout
                continue
            if spec.speech and not digits:
                return item

    # -- CallIO: speaking -----------------------------------------------------------------

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        speaker = self._speaker
        handle = speaker.new_speech(interruptible)
        cached = speaker.cached(text)
        return await self._play(handle, lambda: speaker.start_text(handle, text, cached))

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        handle = self._speaker.new_speech(interruptible)
        return await self._play(handle, lambda: handle.play_text(chunks, from_llm=True))

    async def _play(self, handle: SpeechHandle, start: Callable[[], None]) -> Spoken:
        state = self._floor.state
        if handle.interruptible and state.caller_sounding and not state.caller_confirmed:
            await self._floor.until_sound_judged()
        if handle.interruptible and self._caller_has_the_floor():
            # The caller is talking (they went on after a pause, or barged into the previous
            # prompt) or has answered already: speaking now would talk over them or answer
            # half a sentence. Their input comes through listen().
            metrics.BARGE_INS.labels("before_start", "interrupted").inc()
            return Spoken(text_heard="", interrupted=True)
        return await self._speaker.play(handle, start)

    # -- CallIO: leaving ------------------------------------------------------------------

    async def transfer(self, number: str, warm: WarmTransfer | None = None) -> None:
        self._on_end(CallEnd(EndAction.TRANSFER, number, warm))

    async def hangup(self) -> None:
        self._on_end(CallEnd(EndAction.HANGUP))


def _live_hearing(
    session: CallSession,
    stt: StreamingSpeechToText | None,
    words: LiveWords | None,
    endpointer: Endpointer,
    heard_within: float | None,
) -> LiveHearing | None:
    """A streaming STT hears the call in place of the batch one (``ivr.call.live_hearing``),
    and its words so far answer the floor's and the speculation's questions, no request."""
    if stt is None or words is None:
        return None
    return LiveHearing(
        stt, words=words, endpointer=endpointer, speculation=session._speculation,
        floor=session._floor, speaker=session._speaker, heard_within=heard_within,
        clock=session._clock,
    )  # fmt: skip
