"""What the agent of a warm transfer hears before the caller is put through.

The flow's rendered template always exists; with ``summarize: true`` and a conversation to
summarise, the LLM writes two short sentences from it instead, bounded in time: on a timeout,
an error or an empty answer the agent hears the template. The caller holds meanwhile, so the
bound is short.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import structlog

from ivr.control.transfers import WarmTransfer
from ivr.errors import ProviderError
from ivr.llm.base import ChatMessage, LanguageModel, TextDelta
from ivr.obs.metrics import count_provider_error

log = structlog.get_logger("ivr.warm_transfer")

SUMMARY_TIMEOUT = 4.0
"""Seconds the LLM has for the whole summary before the template is used."""
SUMMARY_MAX_TOKENS = 90
MAX_SUMMARY_CHARS = 400
"""A briefing, not a transcript: about 25 seconds of speech at most."""
MAX_TRANSCRIPT_CHARS = 6000
"""The conversation's newest part given to the LLM (older turns matter least for a hand-off)."""

INSTRUCTIONS = (
    "A phone caller is being handed from a voice assistant to a human agent. Write what the "
    "agent hears just before being connected: at most two short sentences, in plain spoken "
    "English, saying what the caller wants and what has been done or found so far. No "
    "greeting, no lists, no markdown, no phone or card numbers."
)


@dataclass(frozen=True, slots=True)
class Summary:
    text: str
    source: Literal["llm", "template"]
    seconds: float
    """Time spent writing it (the caller was holding)."""


async def write_summary(
    warm: WarmTransfer, llm: LanguageModel | None, *, limit: float = SUMMARY_TIMEOUT
) -> Summary:
    started = time.monotonic()
    if not (warm.summarize and warm.conversation and llm is not None):
        return Summary(_clip(warm.summary), "template", 0.0)
    try:
        async with asyncio.timeout(limit):
            text = await _ask(llm, warm)
    except TimeoutError:
        log.warning("warm_transfer.summary_timeout", seconds=limit, fallback="template")
        text = ""
    except ProviderError as exc:
        count_provider_error("llm", exc.provider, exc)
        log.warning("warm_transfer.summary_failed", error=str(exc), fallback="template")
        text = ""
    seconds = time.monotonic() - started
    if not text.strip():
        return Summary(_clip(warm.summary), "template", seconds)
    return Summary(_clip(text), "llm", seconds)


async def _ask(llm: LanguageModel, warm: WarmTransfer) -> str:
    parts: list[str] = []
    stream = llm.stream_chat(summary_messages(warm), max_tokens=SUMMARY_MAX_TOKENS)
    try:
        async for item in stream:
            if isinstance(item, TextDelta):
                parts.append(item.text)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()  # a timed-out summary stops generating on the server
    return "".join(parts)


def summary_messages(warm: WarmTransfer) -> list[ChatMessage]:
    speaker = {"user": "Caller", "assistant": "Assistant"}
    lines = [f"{speaker.get(role, role)}: {text}" for role, text in warm.conversation]
    transcript = "\n".join(lines)[-MAX_TRANSCRIPT_CHARS:]
    facts = f"\n\nWhat the flow knows: {warm.summary}" if warm.summary else ""
    return [
        ChatMessage("system", INSTRUCTIONS),
        ChatMessage("user", f"Conversation:\n{transcript}{facts}"),
    ]


def _clip(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_SUMMARY_CHARS:
        return text
    cut = text[:MAX_SUMMARY_CHARS]
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[: end + 1] if end > MAX_SUMMARY_CHARS // 2 else cut.rstrip() + "..."
