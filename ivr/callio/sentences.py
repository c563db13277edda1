"""Cut a streamed LLM reply into pieces a TTS engine can speak as soon as they are complete.

A piece ends at a sentence end (``.`` ``!`` ``?`` then whitespace) or a line break. To lower
time-to-first-audio, the *first* piece may end at a clause (``,`` ``;`` ``:`` then whitespace)
once it is ``first_clause_chars`` long, or (``first_words``, for a voice that renders a piece
whole before any of it plays) after that many words; later pieces split at clauses only once a
sentence runs past ``clause_chars``. A boundary is decided only when the character after it has
arrived, so ``3.5``, ``$123.45``, ``1,000`` and ``9:30`` are never split however the deltas
fall. Abbreviations (``Mr.``, ``e.g.``, ``U.S.``, initials) and ellipses do not end a sentence.
Markdown that TTS would read out (``*``, ``#`` headings, backticks, bullets, links) is removed
from each piece.
"""

from __future__ import annotations

import re

_ABBREVIATION_WORDS = """mr mrs ms dr prof sr jr st mt ft vs approx dept apt ave blvd est fig
inc ltd corp jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun"""
ABBREVIATIONS = frozenset(_ABBREVIATION_WORDS.split())
"""Words whose trailing period is an abbreviation, not a sentence end (compared lower-case)."""

_SENTENCE_END = ".!?…"
_CLAUSE_END = ",;:"
_CLOSERS = "\"')]}”’»*_`~"  # closing quotes, brackets and markdown emphasis
_INITIALISM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]|[A-Z]")  # e.g / U.S / a.m / the F in John F.
_LAST_WORD = re.compile(r"[\w.]+$")

_MD_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MD_LINE_START = re.compile(r"(?m)^[ \t]*(?:#{1,6}[ \t]+|>[ \t]*|[-*+•][ \t]+)")
_MD_EMPHASIS = re.compile(r"\*+|`+|~~|(?<!\w)_+|_+(?!\w)")
_SPACES = re.compile(r"\s+")


def clean_for_speech(text: str) -> str:
    """Remove markdown a TTS engine would read out and collapse whitespace."""
    text = _MD_LINK.sub(r"\1", text)
    text = _MD_LINE_START.sub("", text)
    text = _MD_EMPHASIS.sub("", text)
    return _SPACES.sub(" ", text).strip()


def first_piece(text: str, *, first_words: int | None = None) -> str:
    """The first piece a reply of exactly ``text`` is cut into ("" when nothing in it is
    speakable): what its first TTS request will ask for."""
    chunker = SentenceChunker(first_words=first_words)
    pieces = chunker.push(text) or chunker.flush()
    return pieces[0] if pieces else ""


def _speakable(piece: str) -> bool:
    return any(ch.isalnum() for ch in piece)


class SentenceChunker:
    """Accumulates text deltas; ``push`` returns pieces that are ready, ``flush`` the rest.

    Not thread-safe; one per reply (``flush`` resets it for the next).
    """

    __slots__ = (
        "_buf",
        "_emitted",
        "clause_chars",
        "first_clause_chars",
        "first_words",
        "max_chars",
    )

    def __init__(
        self,
        *,
        first_clause_chars: int = 24,
        clause_chars: int = 120,
        max_chars: int = 300,
        first_words: int | None = None,
    ) -> None:
        if not 0 < first_clause_chars <= clause_chars < max_chars:
            raise ValueError(
                "need 0 < first_clause_chars <= clause_chars < max_chars, got "
                f"{first_clause_chars}, {clause_chars}, {max_chars}"
            )
        if first_words is not None and first_words < 1:
            raise ValueError(f"first_words must be >= 1 or None, got {first_words}")
        self.first_clause_chars = first_clause_chars
        self.first_words = first_words
        """The first piece may end after this many words when no clause or sentence ended
        sooner: a voice that renders a piece whole starts its audio after that piece only."""
        self.clause_chars = clause_chars
        self.max_chars = max_chars
        """A run-on text with no boundary is cut at the last space before this many chars."""
        self._buf = ""
        self._emitted = 0

    def push(self, delta: str) -> list[str]:
        self._buf += delta
        pieces: list[str] = []
        while (end := self._next_end()) is not None:
            raw, self._buf = self._buf[:end], self._buf[end:]
            if _speakable(piece := clean_for_speech(raw)):
                pieces.append(piece)
                self._emitted += 1
        return pieces

    def flush(self) -> list[str]:
        """Everything still held, as a final piece; resets for the next reply."""
        piece = clean_for_speech(self._buf)
        self._buf, self._emitted = "", 0
        return [piece] if _speakable(piece) else []

    def _next_end(self) -> int | None:
        """Where the first ready piece ends in the buffer, or None if none is ready yet."""
        end = self._find_boundary()
        if end is not None and end <= self.max_chars:
            return end
        if len(self._buf) <= self.max_chars:
            return None
        cut = self._buf.rfind(" ", 0, self.max_chars)
        return cut + 1 if cut > 0 else self.max_chars

    def _find_boundary(self) -> int | None:
        buf = self._buf
        first = self._emitted == 0
        clause_min = self.first_clause_chars if first else self.clause_chars
        words_left = self.first_words if first else None
        i = 0
        while i < len(buf):
            ch = buf[i]
            if words_left is not None and ch.isspace() and i and not buf[i - 1].isspace():
                words_left -= 1  # a word just ended
                if not words_left:
                    return i + 1
            if ch == "\n":
                if buf[:i].strip():
                    return i + 1
            elif ch in _SENTENCE_END:
                end = self._after_punctuation(i)
                if end is None:
                    return None  # undecided until the next character arrives
                if end and self._ends_sentence(i, end):
                    return end
                i = max(i, end - 1)
                while i + 1 < len(buf) and buf[i + 1] in _SENTENCE_END:
                    i += 1  # skip the rest of the run ("...", "?!")
            elif ch in _CLAUSE_END and i + 1 >= clause_min:
                if i + 1 == len(buf):
                    return None
                if buf[i + 1].isspace() and len(buf[: i + 1].strip()) >= clause_min:
                    return i + 1
            i += 1
        return None

    def _after_punctuation(self, i: int) -> int | None:
        """End of the punctuation run at ``i`` (with closing quotes) if whitespace follows;
        0 if something else follows; None if the buffer ends first."""
        buf, j = self._buf, i + 1
        while j < len(buf) and (buf[j] in _SENTENCE_END or buf[j] in _CLOSERS):
            j += 1
        if j == len(buf):
            return None
        return j if buf[j].isspace() else 0

    def _ends_sentence(self, i: int, end: int) -> bool:
        run = self._buf[i:end].rstrip(_CLOSERS)
        if run.startswith("…") or run.startswith(".."):
            return False  # an ellipsis trails off; the sentence goes on
        if run != ".":
            return True  # ! ? and combinations like ?! always end a sentence
        before = self._buf[:i]
        match = _LAST_WORD.search(before)
        word = match.group(0) if match else ""
        if word.isdigit() and not before[: len(before) - len(word)].rpartition("\n")[2].strip():
            return False  # "1." opening a line is a list number, not a sentence
        return word.lower() not in ABBREVIATIONS and not _INITIALISM.fullmatch(word)
