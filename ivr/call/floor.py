"""Who has the floor, as one state machine: the caller's sound, and what it did to the bot.

``FloorState`` is the whole state: what the caller is doing (``Caller``) and what their sound
did to the prompt playing (``Bot``). Its methods are the transitions, each named for what
happened; a transition that cannot happen in the current state raises ``IllegalTransition``.
The state is a frozen value: ``Floor`` (``ivr.call.barge_in``) holds the current one and does
what each transition calls for (pause, resume or interrupt the prompt, transcribe early).

    caller:  QUIET --sound_started--> SOUND --speech_confirmed--> SPEECH
                                        |                            ^
                                        +--words_take_floor--> WORDS-+
             any --sound_ended--> QUIET

    bot:     ON --paused--> PAUSED --resumed / interrupted--> ON
                               |
                               +--went_on_early--> WENT_ON --caller_went_on / sound_ended--> ON

    both:    SPEECH/PAUSED --held_on--> SOUND/ON   (the first pause's bound: see ``held_on``)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Caller(StrEnum):
    QUIET = "quiet"
    """No sound from the caller."""
    SOUND = "sound"
    """A sound not judged yet: speech needs ``min_speech_ms``, or the judge's word over the bot."""
    WORDS = "words"
    """A sound the bot holds on over, whose words so far take the floor: speech at once."""
    SPEECH = "speech"
    """The caller's speech: they have the floor."""


class Bot(StrEnum):
    ON = "on"
    """The prompt (if any) plays on: the caller's sound did nothing to it."""
    PAUSED = "paused"
    """Paused for the caller's speech: their words decide (interrupt, or resume)."""
    WENT_ON = "went_on"
    """Paused, but the caller's words at a pause in their sound were a backchannel: resumed
    while that sound goes on (it pauses again if they go on talking)."""


_SOUNDING = (Caller.SOUND, Caller.WORDS, Caller.SPEECH)


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class FloorState:
    caller: Caller = Caller.QUIET
    bot: Bot = Bot.ON

    @property
    def caller_sounding(self) -> bool:
        return self.caller is not Caller.QUIET

    @property
    def caller_confirmed(self) -> bool:
        """The caller's sound is speech: they have the floor."""
        return self.caller is Caller.SPEECH

    @property
    def bot_paused(self) -> bool:
        return self.bot is Bot.PAUSED

    # -- the caller's sound ---------------------------------------------------------------

    def sound_started(self) -> FloorState:
        self._expect("sound_started", caller=(Caller.QUIET,))
        return replace(self, caller=Caller.SOUND)

    def words_take_floor(self) -> FloorState:
        """The words so far of a held sound are more than backchannel."""
        self._expect("words_take_floor", caller=(Caller.SOUND,))
        return replace(self, caller=Caller.WORDS)

    def speech_confirmed(self) -> FloorState:
        self._expect("speech_confirmed", caller=(Caller.SOUND, Caller.WORDS))
        return replace(self, caller=Caller.SPEECH)

    def caller_went_on(self) -> FloorState:
        """They spoke again after a pause in their sound: a backchannel verdict no longer holds."""
        bot = Bot.ON if self.bot is Bot.WENT_ON else self.bot
        return replace(self, bot=bot)

    def sound_ended(self) -> FloorState:
        """Their sound is over (an utterance, or a sound too short to be one)."""
        bot = Bot.ON if self.bot is Bot.WENT_ON else self.bot
        return FloorState(Caller.QUIET, bot)

    # -- the bot's prompt -----------------------------------------------------------------

    def paused(self) -> FloorState:
        """The prompt paused for the caller's speech (again, if it was paused already)."""
        self._expect("paused", caller=_SOUNDING)
        return replace(self, bot=Bot.PAUSED)

    def resumed(self) -> FloorState:
        """The caller's sound did not take the floor: a paused prompt goes on."""
        return replace(self, bot=Bot.ON if self.bot is Bot.PAUSED else self.bot)

    def went_on_early(self) -> FloorState:
        """Their words at a pause were a backchannel: the prompt went on mid-sound."""
        self._expect("went_on_early", caller=_SOUNDING, bot=(Bot.ON,))
        return replace(self, bot=Bot.WENT_ON)

    def held_on(self) -> FloorState:
        """The sound that paused the prompt is still going on, and its words so far are only
        backchannel (or did not come within the pause's bound): the prompt goes on, and the
        rest of the sound is judged again, held as a known backchanneler's would be."""
        self._expect("held_on", caller=(Caller.SPEECH,), bot=(Bot.PAUSED,))
        return FloorState(Caller.SOUND, Bot.ON)

    def interrupted(self) -> FloorState:
        """Their words took the floor: the paused prompt is over."""
        self._expect("interrupted", bot=(Bot.PAUSED,))
        return replace(self, bot=Bot.ON)

    def _expect(
        self,
        name: str,
        *,
        caller: tuple[Caller, ...] = tuple(Caller),
        bot: tuple[Bot, ...] = tuple(Bot),
    ) -> None:
        if self.caller not in caller or self.bot not in bot:
            raise IllegalTransition(
                f"{name} in {self.caller.value}/{self.bot.value}: expected caller in "
                f"{[c.value for c in caller]}, bot in {[b.value for b in bot]}"
            )
