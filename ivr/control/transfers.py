"""Handing a caller to a person: what a flow asks for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WarmTransfer:
    """How to hand the caller to a person: held in a conference while the agent is dialled and
    hears ``summary`` (or one the LLM writes from ``conversation``), then joined."""

    summary: str
    """The rendered summary template: what the agent hears if no LLM summary is asked for or
    it fails."""
    summarize: bool = False
    conversation: tuple[tuple[str, str], ...] = ()
    """(role, text) of the conversation as the caller heard it, for the LLM summary."""
    hold_music: str | None = None
    """The conference ``waitUrl``: None is Twilio's default music, "" silence."""
    ring_timeout: int = 20
