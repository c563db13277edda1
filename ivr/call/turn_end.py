"""Knowing when the caller's turn is over: how much silence to wait for, from more than silence.

Three signals, combined by ``silence_needed_ms``:

* the node's ``TurnPolicy``: what answer it waits for (``expect``) and the shortest and longest
  silence that may end the turn;
* the transcript so far (``text_completeness``): "my number is", "and", "uh" or four digits of
  an eight-digit account number say the caller is not done; "yes" to a yes/no question says
  they are; "yes, that is" or "and I have" may be either (an elliptical answer, or a clause
  about to go on), so it waits between the two;
* an audio end-of-turn model (``EndOfTurnDetector.audio_probability``, Smart Turn v3): the
  probability that the turn is complete, from its intonation and words.

A clearly complete turn ends after ``min_silence_ms``, a clearly unfinished one after
``max_silence_ms``, and with no signal at all (no transcript yet, model unavailable)
``fallback_silence_ms``: silence-based endpointing, as before the model. By default the model
only lengthens the wait (p < 0.5: ``max_silence_ms``); it shortens it only when the policy sets
``complete_above``, because on phone audio it calls many mid-sentence pauses complete.

The model is a help, not an oracle: it never blocks the event loop, a late or failed answer
counts as no answer (``ivr_turn_model_total{outcome}``, one warning), and after repeated
failures the detector stops asking for a while, so an overloaded or broken model costs nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import structlog

from ivr.call import answer_shapes as shapes
from ivr.callio.turn_policy import Expect, TurnPolicy
from ivr.errors import ProviderError, ProviderErrorKind
from ivr.obs import metrics

log = structlog.get_logger("ivr.turn_end")

Completeness = Literal["complete", "incomplete", "number", "unsure", "unknown"]
"""``number``: the words end in a number (or date) that may be whole or go on."""
Outcome = Literal["complete", "incomplete", "unavailable", "timeout", "error"]
PHONE_RATE: Final = 8000


# ---------------------------------------------------------------- the transcript

_WORD = re.compile(r"[a-z0-9']+")


def _words(*lines: str) -> frozenset[str]:
    return frozenset(" ".join(lines).split())


_DANGLING: Final = _words(
    # conjunctions and clause openers
    "and but or so because cause if then which when while although though unless than "
    "whether "
    # articles, determiners, possessives (not "that", "this", "some": they end sentences too)
    "the a an my your our their his its every "
    # prepositions that rarely end a sentence (not "in", "on", "about": "log in", "turn on")
    "to for of at with from into onto between as per via like "
    # auxiliaries and copulas: "my number is", "it's", "I was"; subject pronouns
    "is are was were am be been being have has had do does did will would can could should "
    "shall may might must it's that's i'm i'd i'll i've you're we're they're there's "
    "i we they he she "
    # hesitations
    "uh um er erm uhm ah hmm mm",
)
# Endings that look dangling but close a sentence: "I think so", "what is it for".
_CLOSING_PAIRS: Final = frozenset(
    {("think", "so"), ("hope", "so"), ("guess", "so"), ("believe", "so"), ("said", "so"),
     ("it", "for"), ("that", "for")}
)  # fmt: skip
# A subject and its auxiliary with nothing after them: an elliptical answer ("Yes, that is.",
# "No, I haven't... I have.") or a clause that goes on ("Yes, that is correct", "and I have a
# question"). Neither finished nor open: "unsure". After a question word the clause is an
# embedded one that is over ("that's what it is", "I know who it was").
_ELLIPTICAL_PAIRS: Final = frozenset(
    {("what", "is"), ("it", "is"), ("that", "is"), ("there", "is"), ("who", "is"),
     ("one", "is"), ("i", "am"), ("i", "was"), ("i", "do"), ("i", "did"), ("i", "have"),
     ("i", "can"), ("i", "will")}
)  # fmt: skip
_QUESTION_WORDS: Final = _words("what who where when how which why whatever")
# A determiner and one of these with no noun after it leaves the noun phrase open ("we moved
# to a new", "I need the old"). Only adjectives that hardly ever end a sentence after one ("the
# same", "the other", "the last", "a little" do, so they are not here).
_NOUN_OPENERS: Final = _words("a an the my your our their his her")
_ATTRIBUTIVE: Final = _words(
    "new old big small large different whole separate extra spare current previous"
)
UNSURE_LAST_WORD: Final = 0.8
"""An STT's probability for the last word below this makes words that settle nothing
"unsure": a small model "finishes" a dangling word ("the" -> "them.", "for" -> "for it.")
with p 0.4-0.7, where a sentence's real last word mostly has 0.9 or more."""
_YES_NO: Final = _words(
    "yes yeah yep yup yea no nope nah correct right sure okay ok absolutely definitely "
    "negative affirmative"
)
_CLOSERS: Final = (
    "thank you", "thanks", "bye", "goodbye", "that's all", "that is all",
    "that's everything", "never mind",
)  # fmt: skip


def text_completeness(
    transcript: str | None,
    expect: Expect = "any",
    digits: int | None = None,
    *,
    max_digits: int | None = None,
    answers: tuple[str, ...] = (),
    last_word_probability: float | None = None,
) -> Completeness:
    """Whether the words so far finish an answer of the kind ``expect``.

    "incomplete": the last word leaves a clause open ("and", "the", "my number is", "uh") or a
    noun phrase ("a new"), the transcript trails off ("..."), or an answer of known shape is
    not whole yet (fewer than ``digits`` digits, a ZIP+4 half read, a date's year begun).
    "number": it ends in a number (or date) that may be whole or go on: digits of unknown
    length, or within ``digits``..``max_digits``. "complete": the expected value is whole
    (``ivr.call.answer_shapes``), a yes/no answer to a yes/no question, an answer that ends
    with one of ``answers``, or a closing phrase ("thank you", "that's all"). "unsure": a
    subject and its auxiliary end it ("yes, that is", "and I have"), which may be a whole
    answer or go on, or the STT was not sure of the last word (``last_word_probability``
    below ``UNSURE_LAST_WORD``). Otherwise "unknown": the audio model and silence decide.
    """
    if transcript is None or not transcript.strip():
        return "unknown"
    text = transcript.strip().lower().replace("’", "'")
    words = _WORD.findall(text)
    if not words:
        return "unknown"
    if text.endswith(("...", "…", "-", "—")):
        return "incomplete"
    last = words[-1]
    shaped = _shape_verdict(words, text, expect, digits, max_digits)
    if shaped is not None:
        return "incomplete" if shaped == "number" and last in _DANGLING else shaped
    pair = (words[-2], last) if len(words) >= 2 else None
    elliptical = pair in _ELLIPTICAL_PAIRS and (len(words) < 3 or words[-3] not in _QUESTION_WORDS)
    closing = pair in _CLOSING_PAIRS or pair in _ELLIPTICAL_PAIRS
    if text.rstrip(".!?, ").endswith(_CLOSERS):
        return "complete"
    if last in _DANGLING and not closing:
        return "incomplete"
    if len(words) >= 2 and words[-2] in _NOUN_OPENERS and last in _ATTRIBUTIVE:
        return "incomplete"
    if expect in ("any", "yes_no") and shapes.reading_a_number(words):
        return "number"
    if expect == "yes_no" and (words[0] in _YES_NO or last in _YES_NO):
        return "complete"
    if answers and _ends_with_answer(words, answers):
        return "complete"
    if elliptical:
        return "unsure"
    if last_word_probability is not None and last_word_probability < UNSURE_LAST_WORD:
        return "unsure"
    return "unknown"


def judge_words(
    policy: TurnPolicy, transcript: str | None, last_word_probability: float | None = None
) -> Completeness:
    """``text_completeness`` of ``transcript`` for what ``policy`` expects."""
    return text_completeness(
        transcript,
        policy.expect,
        policy.digits,
        max_digits=policy.max_digits,
        answers=policy.answers,
        last_word_probability=last_word_probability,
    )


def _shape_verdict(
    words: list[str], text: str, expect: Expect, digits: int | None, max_digits: int | None
) -> shapes.ShapeVerdict | None:
    if expect == "digits":
        return shapes.digits_verdict(words, digits, max_digits)
    if expect == "zip":
        return shapes.zip_verdict(words)
    if expect == "date":
        return shapes.date_verdict(words, text)
    return None


def _ends_with_answer(words: list[str], answers: tuple[str, ...]) -> bool:
    """The words end with one of ``answers``, give or take one word after it ("a mountain
    bike" for "mountain", "booking please"): what comes after an answer is not a new clause."""
    for answer in answers:
        want = _WORD.findall(answer.lower())
        n = len(want)
        if n and (words[-n:] == want or words[-n - 1 : -1] == want):
            return True
    return False


# ---------------------------------------------------------------- the decision


def silence_needed_ms(
    policy: TurnPolicy, p_audio: float | None, text: Completeness = "unknown"
) -> int:
    """Milliseconds of silence after the last speech that end the turn.

    The transcript decides when it can: an open clause or missing digits wait the longest
    (``max_silence_ms``), a finished yes/no or digit answer the shortest (``min_silence_ms``),
    words that may go on or not ``unsure_silence_ms``, a number that may go on
    ``number_silence_ms`` (never past the longest pause). Otherwise the model: below
    ``incomplete_below`` the longest wait, at or above ``complete_above`` (when set) the
    shortest, else ``fallback_silence_ms``, which is also the answer with neither signal.
    """
    if text == "incomplete":
        return policy.max_silence_ms
    if text == "complete":
        return policy.min_silence_ms
    if text == "unsure":
        return policy.unsure_silence_ms
    if text == "number":
        return max(policy.min_silence_ms, min(policy.number_silence_ms, policy.max_silence_ms))
    if p_audio is None:
        return policy.fallback_silence_ms
    if policy.complete_above is not None and p_audio >= policy.complete_above:
        return policy.min_silence_ms
    if p_audio < policy.incomplete_below:
        return policy.max_silence_ms
    return policy.fallback_silence_ms


class AudioTurnEngine(Protocol):
    """An audio end-of-turn model (``ivr.engines.smart_turn.SmartTurnModel``)."""

    name: str

    async def load(self) -> None:
        """Load the model; raises ``ProviderError`` when it cannot."""
        ...

    async def probability(self, pcm16: bytes, sample_rate: int) -> float:
        """P(turn complete) for the turn ending ``pcm16``; raises ``ProviderError``
        (``ProviderTimeout`` when late)."""
        ...


class TurnModel(Protocol):
    """What a call asks at a pause. None: no answer (no model, late, failed): fall back."""

    async def audio_probability(self, pcm16_8k: bytes) -> float | None: ...


@dataclass(frozen=True, slots=True)
class TurnDecision:
    """Why a turn waits as long as it does (for logs and tests)."""

    silence_ms: int
    text: Completeness
    p_audio: float | None
    """None when the model was not asked (the transcript decided) or gave no answer."""


class EndOfTurnDetector:
    """The process's end-of-turn judge: the audio model (if any) plus the transcript rules.

    One per process, shared by every call. Built with ``engine=None`` (or after ``start()``
    failed to load it), it answers from the transcript and silence alone. After
    ``max_failures`` timeouts or errors in a row it stops asking the model for
    ``cooldown_s`` seconds, then tries again.
    """

    def __init__(
        self,
        engine: AudioTurnEngine | None,
        *,
        max_failures: int = 5,
        cooldown_s: float = 30.0,
    ) -> None:
        self._engine = engine
        self._max_failures = max_failures
        self._cooldown_s = cooldown_s
        self._failures = 0
        self._paused_until = 0.0
        self._warned: set[str] = set()

    @property
    def available(self) -> bool:
        """True while the model is loaded and not paused after failures."""
        return self._engine is not None and time.monotonic() >= self._paused_until

    async def start(self) -> None:
        """Load the model; if it cannot be loaded, log a warning and carry on without it."""
        if self._engine is None:
            return
        try:
            await self._engine.load()
        except ProviderError as exc:
            self._warn("unavailable", str(exc))
            self._engine = None

    async def aclose(self) -> None:
        """Release the model (its worker threads)."""
        engine, self._engine = self._engine, None
        aclose = getattr(engine, "aclose", None)
        if aclose is not None:
            await aclose()

    async def audio_probability(self, pcm16_8k: bytes) -> float | None:
        """P(turn complete) for the turn so far (8 kHz PCM16, up to now, silence included);
        None when there is no answer in time. Never raises (but cancellation)."""
        if not self.available:
            self._count("unavailable")
            return None
        assert self._engine is not None
        try:
            p = await self._engine.probability(pcm16_8k, PHONE_RATE)
        except ProviderError as exc:
            # Late, or refused because too many are pending (retryable): both are "timeout",
            # the model was too slow for this pause. Anything else is an "error".
            timeout = exc.kind is ProviderErrorKind.TIMEOUT or exc.retryable
            self._failed("timeout" if timeout else "error", str(exc))
            return None
        except Exception as exc:  # an engine bug must not end the caller's call
            self._failed("error", repr(exc))
            return None
        self._failures = 0
        self._count("complete" if p >= 0.5 else "incomplete")
        return p

    async def decide(
        self, policy: TurnPolicy, pcm16_8k: bytes, transcript: str | None = None
    ) -> TurnDecision:
        """How much silence ends this turn. The model is asked only when the transcript
        leaves it open and the policy has a range to choose from (saves its CPU)."""
        text = judge_words(policy, transcript)
        p_audio = None
        if text == "unknown" and policy.min_silence_ms < policy.max_silence_ms:
            p_audio = await self.audio_probability(pcm16_8k)
        return TurnDecision(silence_needed_ms(policy, p_audio, text), text, p_audio)

    def _failed(self, outcome: Outcome, detail: str) -> None:
        self._count(outcome)
        self._warn(outcome, detail)
        self._failures += 1
        if self._failures >= self._max_failures:
            self._failures = 0
            self._paused_until = time.monotonic() + self._cooldown_s
            log.warning("turn_model.paused", failures=self._max_failures, seconds=self._cooldown_s)

    def _count(self, outcome: Outcome) -> None:
        metrics.TURN_MODEL.labels(outcome).inc()

    def _warn(self, outcome: str, detail: str) -> None:
        # Once per kind of failure per process: the metric counts every one.
        if outcome not in self._warned:
            self._warned.add(outcome)
            log.warning("turn_model.fallback", outcome=outcome, error=detail)
