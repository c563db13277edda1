"""The seam between what a call *does* (the flow runner) and how it sounds (the audio session).

The flow runner only ever talks to a ``CallIO``. The audio call session implements it over
Twilio Media Streams; the text-mode runner used by ``ivr flows test`` implements it over plain
strings. Both give the runner the same guarantees:

* ``say`` / ``say_stream`` return only when the audio has been *played* to the caller (or the
  caller interrupted it), and report exactly the text the caller heard.
* Caller input that arrives while the bot is talking (barge-in speech, DTMF) is not lost: the
  next ``listen`` returns it first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ivr.callio.interruption_policy import InterruptionPolicy
from ivr.callio.speculation import Speculation
from ivr.callio.timeline import CallTimeline
from ivr.callio.turn_policy import TurnPolicy
from ivr.control.transfers import WarmTransfer


@dataclass(frozen=True, slots=True)
class Spoken:
    text_heard: str
    """The part of the prompt the caller actually heard (all of it unless interrupted)."""
    interrupted: bool = False
    text_unheard: str = ""
    """After a barge-in, the rest of what the bot was saying: written, never heard."""


@dataclass(frozen=True, slots=True)
class ListenSpec:
    """What kind of answer the flow waits for, and how long."""

    speech: bool = True
    dtmf: bool = True
    no_input_timeout: float = 6.0
    """Seconds of silence (no speech start, no key) before ``NoInput``."""
    num_digits: int | None = None
    """Finish DTMF collection after this many digits."""
    finish_on_key: str = "#"
    """Key that ends DTMF collection early (not included in the digits); "" for none."""
    inter_digit_timeout: float = 3.0
    """Seconds after a key press before the collected digits are returned."""
    turn: TurnPolicy = field(default_factory=TurnPolicy)
    """How long a pause ends the caller's spoken turn (``ivr.call.turn_end``)."""


@dataclass(frozen=True, slots=True)
class Utterance:
    text: str
    """What the caller said; may be "" when STT heard nothing usable."""
    latency: dict[str, float] = field(default_factory=dict)
    """Per-stage timings (seconds) of this turn so far, e.g. {"stt": 0.21}."""


@dataclass(frozen=True, slots=True)
class Digits:
    digits: str


@dataclass(frozen=True, slots=True)
class NoInput:
    pass


@dataclass(frozen=True, slots=True)
class HungUp:
    pass


CallerInput = Utterance | Digits | NoInput | HungUp


class InterruptionControl(Protocol):
    def set_interruption_policy(self, policy: InterruptionPolicy | None) -> None:
        """For the prompts that follow; None = the default."""
        ...


class TurnLog(Protocol):
    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        ...


class CallerAudio(Protocol):
    def add_audio_tap(self, tap: Callable[[bytes], None]) -> None:
        """``tap`` gets every inbound payload as PCM16 8 kHz (answering machine detection)."""
        ...

    async def forget_caller_input(self, limit: float = 3.0, until_quiet: bool = False) -> None:
        """Drop what the caller said so far (an outbound callee's "Hello?")."""
        ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a ``CallIO`` does besides speaking, listening and leaving, declared by each
    implementation (None: it cannot). The flow runner reads these; it never asks what class
    the ``CallIO`` is."""

    interruptions: InterruptionControl | None = None
    """Its prompts can be told how readily to give way (the audio session; text has none)."""
    speculation: Speculation | None = None
    """It tells the flow about a turn before it is over, and prefetches speech."""
    timeline: CallTimeline | None = None
    """Key presses, barge-ins, backchannels and nodes, saved with the call's steps."""
    turn_log: TurnLog | None = None
    """The latency of each answered turn, saved with the call's steps."""
    caller_audio: CallerAudio | None = None
    """The caller's audio, for answering machine detection, and their greeting to forget."""


class CallIO(Protocol):
    @property
    def capabilities(self) -> Capabilities:
        """What this call offers beyond the methods below."""
        ...

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        """Speak ``text`` and wait until it has played (or was interrupted)."""
        ...

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        """Speak text as it streams in (LLM deltas): each sentence goes to TTS once complete."""
        ...

    async def listen(self, spec: ListenSpec) -> CallerInput:
        """Wait for the caller's next answer under ``spec``."""
        ...

    async def transfer(self, number: str, warm: WarmTransfer | None = None) -> None:
        """Hand the call to ``number`` (``warm``: through a conference, the agent briefed
        first); the stream ends afterwards."""
        ...

    async def hangup(self) -> None:
        """End the call (after anything already said has played)."""
        ...
