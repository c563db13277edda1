"""Turn-end fixtures: finished sentences and the same sentences stopped at a mid-sentence pause.

Each pair is a caller's sentence and the words they had said when they paused in it. The
paused half is rendered with a trailing comma: both TTS engines then end it on the level or
rising pitch of a clause that goes on, as a speaker pausing mid-sentence does. Clips are
8 kHz PCM16 through the mu-law phone channel, with ``TAIL_S`` of silence after the last word
(what the model sees when the endpointer asks it, a moment into the pause).

espeak clips come from ``audio_fixtures.speech_pcm16`` (cached); piper clips (the gateway's
neural voice, closer to a human's prosody) are rendered here and cached the same way.
"""

from __future__ import annotations

import asyncio
import hashlib

from audio_fixtures import CACHE_DIR, RATE, _phone_channel, speech_pcm16, trimmed

TAIL_S = 0.2
LEAD_S = 0.3

# (finished sentence, what was said when the caller paused in it); the pause is mid-clause.
PAIRS: tuple[tuple[str, str], ...] = (
    ("I would like to check the balance on my savings account.",
     "I would like to check the balance on my"),
    ("My account number is four five six seven eight.", "My account number is four five six"),
    ("I want to speak to someone about the bill I got last week.",
     "I want to speak to someone about the"),
    ("Can you tell me when you are open on Saturday?", "Can you tell me when you are"),
    ("I lost my card yesterday and I need a new one.", "I lost my card yesterday and"),
    ("Please cancel my appointment for tomorrow morning.", "Please cancel my appointment for"),
    ("I'm calling because my internet has been down since Monday.", "I'm calling because my"),
    ("So what I was wondering is whether you deliver on weekends.",
     "So what I was wondering is whether"),
    ("I need to change the address on my account.", "I need to change the"),
    ("The package was supposed to arrive on Tuesday but it never came.",
     "The package was supposed to arrive on Tuesday but"),
    ("Could you send me a copy of my last invoice?", "Could you send me a copy of"),
    ("I was charged twice for the same order.", "I was charged twice for the"),
    ("We moved to a new house last month.", "We moved to a new"),
    ("I'd like to book a table for four people.", "I'd like to book a table for"),
    ("My name is John Smith and I have a question.", "My name is John Smith and"),
    ("Yes, that is correct.", "Yes, that is"),
)  # fmt: skip
COMPLETE: tuple[str, ...] = tuple(full for full, _ in PAIRS)
PAUSED: tuple[str, ...] = tuple(cut for _, cut in PAIRS)

_PIPER_VERSION = "piper-1"


def silence(seconds: float) -> bytes:
    return bytes(2 * round(RATE * seconds))


def _framed(speech: bytes) -> bytes:
    return silence(LEAD_S) + trimmed(speech) + silence(TAIL_S)


def espeak_clip(text: str) -> bytes:
    """``text`` by espeak-ng as a turn ending ``TAIL_S`` into the pause (8 kHz PCM16)."""
    return _framed(speech_pcm16(text))


def piper_clips(texts: list[str]) -> list[bytes]:
    """``texts`` by piper (en_US-joe-medium), framed like ``espeak_clip``; cached on disk, the
    missing ones rendered with one engine."""
    paths = [CACHE_DIR / f"{_piper_key(t)}.piper8k" for t in texts]
    missing = [t for t, p in zip(texts, paths, strict=True) if not p.exists()]
    if missing:
        CACHE_DIR.mkdir(exist_ok=True)
        (CACHE_DIR / ".gitignore").write_text("*\n")
        for text, pcm in zip(missing, asyncio.run(_piper_22k(missing)), strict=True):
            (CACHE_DIR / f"{_piper_key(text)}.piper8k").write_bytes(_phone_channel(pcm))
    return [_framed(p.read_bytes()) for p in paths]


def _piper_key(text: str) -> str:
    return hashlib.sha256(f"{_PIPER_VERSION}|{text}".encode()).hexdigest()[:16]


async def _piper_22k(texts: list[str]) -> list[bytes]:
    from ivr.tts.piper_local import LocalPiperTts

    tts = LocalPiperTts()
    try:
        return [b"".join([chunk async for chunk in tts.synthesize(t)]) for t in texts]
    finally:
        await tts.aclose()


def paused_text(cut: str) -> str:
    """How a paused clip is rendered: a comma gives it the pitch of a clause that goes on."""
    return cut + ","
