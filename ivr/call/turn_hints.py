"""A streaming STT's own word on the turn (``TurnHint``), weighed against the gateway's
endpointer before it moves anything.

Every hint is counted (``ivr_stt_turn_hints_total{provider,kind,verdict}``) and logged at debug,
with the endpointer's view at that moment as its verdict:

* ``agreed``: the endpointer hears the caller paused (``SpeechPaused``, not resumed);
* ``early``: the endpointer still hears speech: the provider is ahead of the audio or wrong;
* ``idle``: no speech in progress: the endpointer ended (or discarded) it first;
* ``used``: an ``END_OF_TURN`` that agreed and moved the end of the turn.

Only an agreeing ``END_OF_TURN``, while the flow listens for speech and the bot is silent,
moves anything, and only sooner: the pause then ends at the node's shortest silence
(``min_silence_ms``) unless the words so far leave the turn open (an open clause, digits
missing, a number that may go on, an unsure last word), which the words' judge decides as
ever. ``EAGER_END_OF_TURN`` (Flux) and the rest are measured only: the gateway speculates at
its own pauses already, and an eager end that the endpointer does not hear is not a turn.
"""

from __future__ import annotations

import structlog

from ivr.audio.endpointer import (
    Endpointer,
    EndpointEvent,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
)
from ivr.call.live_words import LiveWords
from ivr.call.pause_turns import TurnSpeculation
from ivr.call.turn_end import judge_words
from ivr.obs import metrics
from ivr.stt.base import TurnHint, TurnHintKind

log = structlog.get_logger("ivr.call")

_OPEN = ("incomplete", "number", "unsure")


class TurnHints:
    def __init__(
        self,
        provider: str,
        *,
        endpointer: Endpointer,
        speculation: TurnSpeculation,
        words: LiveWords,
    ) -> None:
        self._provider = provider
        self._endpointer = endpointer
        self._speculation = speculation
        self._words = words
        self._sounding = False
        self._paused = False
        self.pause: SpeechPaused | None = None
        """The pause in progress (the caller silent, the turn not over yet)."""

    def saw(self, event: EndpointEvent) -> None:
        """The endpointer's events, as they happen: its view of the caller."""
        self._paused = isinstance(event, SpeechPaused)
        self.pause = event if isinstance(event, SpeechPaused) else None
        if isinstance(event, SpeechStarted | SpeechResumed | SpeechPaused):
            self._sounding = True
        else:
            self._sounding = False

    def on_hint(self, hint: TurnHint) -> str:
        verdict = "agreed" if self._paused else "early" if self._sounding else "idle"
        if verdict == "agreed" and hint.kind is TurnHintKind.END_OF_TURN and self._end_sooner():
            verdict = "used"
            # The words' own judge may still be running on this pause: it sets the silence
            # when done; the agreed end applies after it (the words can still keep it open).
            task, pause = self._speculation.words_task, self.pause
            if task is not None and not task.done():
                task.add_done_callback(lambda _: self.pause is pause and self._end_sooner())
        metrics.STT_TURN_HINTS.labels(self._provider, hint.kind.value, verdict).inc()
        log.debug("stt.turn_hint", kind=hint.kind.value, verdict=verdict, at=round(hint.at, 3))
        return verdict

    def _end_sooner(self) -> bool:
        spec = self._speculation.spec
        if not self._speculation.speculating() or spec is None:
            return False
        policy = spec.turn
        words = self._words.so_far()
        if not words or judge_words(policy, words) in _OPEN:
            return False
        if policy.min_silence_ms >= self._endpointer.silence_ms:
            return False
        self._endpointer.set_silence_ms(policy.min_silence_ms)
        return True
