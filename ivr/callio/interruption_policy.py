"""How readily a prompt gives way to the caller: the ``InterruptionPolicy`` a flow sets per
node (``interruptions:`` in YAML), and the words it counts (``words_of``).

The call's barge-in rules (``ivr.call.interruptions``, ``ivr.call.barge_in``) obey it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_BACKCHANNELS: tuple[str, ...] = (
    "uh-huh", "uh huh", "mm-hmm", "mm-hm", "mhm", "mm", "hmm", "um", "uh", "ah", "oh",
    "okay", "ok", "yeah", "yep", "yup", "right", "sure", "i see", "got it", "alright",
    "all right", "cool", "great",
)  # fmt: skip
"""Said to show the caller is listening, not to take the floor (English)."""

BACKCHANNEL_HOLD_MS = 900
"""Longer than any "uh-huh" (espeak's "mm-hmm" spans ~0.7 s)."""

_WORD = re.compile(r"[a-z0-9']+(?:-[a-z0-9']+)*")


def words_of(text: str) -> list[str]:
    """Lower-case words, punctuation dropped ("Mm-hmm." -> ["mm-hmm"])."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True, slots=True)
class InterruptionPolicy:
    """How readily a prompt gives way to the caller (per node; see flows/README.md)."""

    min_speech_ms: int = 100
    """Voiced caller audio before the bot pauses (the endpointer's own minimum applies too)."""
    min_words: int = 1
    """Words (not counting backchannel) for an interruption to stand once transcribed."""
    backchannels: tuple[str, ...] = DEFAULT_BACKCHANNELS
    echo_threshold: float = 0.6
    """Correlation with the bot's audio above which caller sound is taken for echo."""
    noise_hold_ms: int = 200
    """Unvoiced sound is not an interruption until it has lasted this long from its onset."""
    backchannel_hold_ms: int = BACKCHANNEL_HOLD_MS
    """Most that a caller's backchannel habit may raise ``min_speech_ms`` to (0: never)."""

    @property
    def backchannel_span_ms(self) -> int:
        """Speech that pauses the bot before it spans this may be a backchannel: the pause is
        bounded, and once its words so far are only backchannel the rest of it is held this
        long (``ivr.call.barge_in``). A node with no habit (``backchannel_hold_ms: 0``) still
        holds the rest of the one sound: that is the same backchannel, not a habit."""
        return max(self.min_speech_ms, self.backchannel_hold_ms or BACKCHANNEL_HOLD_MS)

    def is_real_turn(self, text: str) -> bool:
        """Enough words that are not backchannel to take the floor."""
        words = words_of(text)
        if not words:
            return False
        rest = " ".join(words)
        for phrase in sorted(self.backchannels, key=len, reverse=True):  # "i see" before "i"
            rest = re.sub(rf"(?<![\w'-]){re.escape(phrase.lower())}(?![\w'-])", " ", rest)
        return len(rest.split()) >= self.min_words


DEFAULT_POLICY = InterruptionPolicy()
