"""A ``CallIO`` over plain text: the bot's prompts are recorded, the caller follows a script.

Used by ``ivr flows test`` and unit tests. A scripted caller turn may barge in: with
``barge_in_after_words=N`` the bot's next interruptible prompt is cut after N words (reported
as interrupted, with only those words heard), and the turn is what the next ``listen`` returns,
just as the audio session delivers speech that arrived while the bot was talking.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from ivr.callio.interruption_policy import DEFAULT_POLICY, InterruptionPolicy
from ivr.callio.io import (
    CallerInput,
    Capabilities,
    Digits,
    HungUp,
    ListenSpec,
    NoInput,
    Spoken,
    Utterance,
)
from ivr.control.transfers import WarmTransfer


@dataclass(frozen=True, slots=True)
class CallerTurn:
    kind: Literal["say", "press", "silent", "hangup"]
    text: str = ""
    """What is said, or the keys pressed."""
    barge_in_after_words: int | None = None


def said(text: str, *, barge_in_after_words: int | None = None) -> CallerTurn:
    return CallerTurn("say", text, barge_in_after_words)


def pressed(digits: str) -> CallerTurn:
    return CallerTurn("press", digits)


def silent() -> CallerTurn:
    return CallerTurn("silent")


def hangs_up() -> CallerTurn:
    return CallerTurn("hangup")


@dataclass(slots=True)
class TextCallIO:
    script: collections.deque[CallerTurn] = field(default_factory=collections.deque)
    on_listen: Callable[[ListenSpec], None] | None = None
    """Called when the flow starts waiting for the caller (test checkpoints)."""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    """("bot" | "caller" | "call", text) in order."""
    listens: list[ListenSpec] = field(default_factory=list)
    transferred_to: str | None = None
    hung_up: bool = False
    policy: InterruptionPolicy = DEFAULT_POLICY
    """What interrupts the prompts (the flow node's ``interruptions``)."""

    @classmethod
    def scripted(cls, turns: Iterable[CallerTurn]) -> TextCallIO:
        return cls(script=collections.deque(turns))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(interruptions=self)  # no audio: nothing to speculate on or time

    @property
    def bot_lines(self) -> list[str]:
        return [text for who, text in self.transcript if who == "bot"]

    def set_interruption_policy(self, policy: InterruptionPolicy | None) -> None:
        self.policy = policy or DEFAULT_POLICY

    def _cut_after(self, interruptible: bool) -> int | None:
        nxt = self.script[0] if self.script else None
        if interruptible and nxt is not None and nxt.barge_in_after_words is not None:
            if not self.policy.is_real_turn(nxt.text):  # backchannel: swallowed, as on a call
                self.script.popleft()
                self.transcript.append(("caller", f"{nxt.text!r} over the bot (not a turn)"))
                return None
            # It cuts this prompt only; the words wait for the next listen.
            self.script[0] = dataclasses.replace(nxt, barge_in_after_words=None)
            return nxt.barge_in_after_words
        return None

    async def say(self, text: str, *, interruptible: bool = True) -> Spoken:
        cut = self._cut_after(interruptible)
        words = text.split()
        if cut is not None and cut < len(words):
            heard = " ".join(words[:cut])
            self.transcript.append(("bot", heard + " --"))
            return Spoken(heard, interrupted=True)
        self.transcript.append(("bot", text))
        return Spoken(text)

    async def say_stream(self, chunks: AsyncIterator[str], *, interruptible: bool = True) -> Spoken:
        cut = self._cut_after(interruptible)
        text = ""
        async for chunk in chunks:
            text += chunk
            if cut is not None and len(text.split()) > cut:
                heard = " ".join(text.split()[:cut])
                self.transcript.append(("bot", heard + " --"))
                return Spoken(heard, interrupted=True)
        if text.strip():
            self.transcript.append(("bot", text.strip()))
        return Spoken(text.strip())

    async def listen(self, spec: ListenSpec) -> CallerInput:
        self.listens.append(spec)
        if self.on_listen is not None:
            self.on_listen(spec)
        if not self.script:
            self.transcript.append(("call", "script ended: caller hangs up"))
            return HungUp()
        turn = self.script.popleft()
        self.transcript.append(("caller", _describe(turn)))
        if turn.kind == "hangup":
            return HungUp()
        if turn.kind == "say" and spec.speech:
            return Utterance(turn.text)
        if turn.kind == "press" and spec.dtmf:
            return Digits(turn.text)
        return NoInput()  # silence, or input of a kind this prompt does not listen for

    async def transfer(self, number: str, warm: WarmTransfer | None = None) -> None:
        self.transferred_to = number
        kind = "warm transfer" if warm is not None else "transfer"
        self.transcript.append(("call", f"{kind} to {number}"))

    async def hangup(self) -> None:
        self.hung_up = True
        self.transcript.append(("call", "hangup"))


def _describe(turn: CallerTurn) -> str:
    if turn.kind == "say":
        return turn.text
    if turn.kind == "press":
        return f"[presses {turn.text}]"
    return f"[{turn.kind}]"
