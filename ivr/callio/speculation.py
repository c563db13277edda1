"""Speculative turns, the seam: the call tells the flow about a turn before it is over.

The call transcribes the caller's audio as soon as they pause and hands the tentative
transcript to the ``TentativeListener`` the flow registered (it may prefetch its reply); the
flow may ask the call to synthesise the first piece of that reply ahead (``prefetch_speech``),
cut as the call's voice will cut it (``reply_chunker``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ivr.callio.sentences import SentenceChunker

TentativeListener = Callable[[str | None], None]
"""Called with a tentative transcript while the caller pauses, and with None when that
transcript went stale (the caller went on talking). Must not block."""


class Speculation(Protocol):
    """What a ``CallIO`` that speculates on turns offers its flow runner."""

    def on_tentative_input(self, listener: TentativeListener | None) -> None:
        """Register (or clear) the listener for tentative transcripts."""
        ...

    def prefetch_speech(self, text: str) -> None:
        """Start synthesising what a reply of ``text`` (a say node's text, an LLM reply's
        first piece) will ask the voice for first, for a reply that may soon say it."""
        ...

    def reply_chunker(self) -> SentenceChunker:
        """A chunker that cuts a reply into pieces exactly as this call's voice will."""
        ...
