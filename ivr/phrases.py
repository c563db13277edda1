"""What the gateway itself says to callers, as opposed to what a flow's author wrote.

Kept in one place so they can be pre-synthesised, reviewed and translated together.
"""

from __future__ import annotations

from typing import Final

LLM_FAILURE: Final = "Sorry, I'm having trouble answering right now."
"""Said when the reply cannot be produced (the model or the voice failed before any of it
was heard). Pre-synthesised at startup, so it plays even when TTS is down."""

NOT_UNDERSTOOD: Final = "Sorry, I didn't catch that. Could you say it again?"
"""Said when speech recognition fails on what the caller said; the question stays open."""

CACHED_AT_START: Final = (LLM_FAILURE, NOT_UNDERSTOOD)
"""The gateway's own phrases that must not depend on a provider working mid-call."""

TRANSFER_FAILED: Final = "Sorry, I can't transfer your call right now. Please call back later."
"""Said instead of dialling a transfer number that may not be dialled."""

WARM_TRANSFER_SUMMARY: Final = "You have a call transferred by the voice assistant."
"""What the agent of a warm transfer hears when its node sets no summary."""

NOT_IN_SERVICE: Final = "Sorry, this number is not in service."
"""The webhook's answer when no flow answers the called number."""

TECHNICAL_PROBLEM: Final = "Sorry, we are having technical problems. Please call back later."
"""The webhook's answer when the call cannot go on (no record, too many resumes)."""
