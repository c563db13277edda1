"""Speculation at the caller's pauses: their words so far, transcribed while the flow listens.

At a pause in the caller's speech (``SpeechPaused``) while the flow waits for speech and the
bot is silent, the audio so far goes to STT at once. The tentative transcript goes to the flow
runner (``TentativeListener``: it may prefetch its reply) and moves the end of the turn: an
open clause waits the node's longest pause, a finished answer its shortest, and words that
say nothing either way ask the audio turn model (``ivr.call.turn_end``). If the caller goes on
talking, all of it is dropped; if the turn ends on these words, the STT worker adopts the
transcript (``take``).
"""

from __future__ import annotations

import asyncio

import structlog

from ivr.audio.endpointer import Endpointer, SpeechPaused
from ivr.audio.resample import resample
from ivr.call.speaking import Speaker
from ivr.call.speech import HEARD_MARGIN
from ivr.call.turn_end import Completeness, TurnModel, judge_words, silence_needed_ms
from ivr.callio.io import ListenSpec
from ivr.callio.sentences import SentenceChunker
from ivr.callio.speculation import TentativeListener
from ivr.callio.turn_policy import TurnPolicy
from ivr.errors import ProviderError
from ivr.obs import metrics
from ivr.stt.base import SpeechToText

log = structlog.get_logger("ivr.call")

TURN_MODEL_GRACE_MS = 250
"""How much longer an unsure turn stays open while the audio turn model runs (~60 ms here):
a later answer no longer moves the end."""
WORDS_WAIT_SLACK_MS = 150
"""A pause waiting for its words ends this long before the STT deadline: the turn's end, the
STT worker and the re-ask's first frame all fit in it (a few ms each)."""


class TurnSpeculation:
    def __init__(
        self,
        *,
        endpointer: Endpointer,
        stt: SpeechToText,
        speaker: Speaker,
        turn_model: TurnModel | None = None,
        heard_within: float | None = None,
    ) -> None:
        self._endpointer = endpointer
        self._stt = stt
        self._speaker = speaker
        self._turn_model = turn_model
        self._heard_within = heard_within
        self.listening = False
        """The flow is inside ``listen()``: waiting for the caller."""
        self.spec: ListenSpec | None = None
        """What the flow listens for (now, or last)."""
        self.listener: TentativeListener | None = None
        self._pause: int | None = None
        """The pause whose transcript ``_task`` is (1, 2, ... within the utterance)."""
        self._task: asyncio.Task[str] | None = None
        self._turn_judge: asyncio.Task[None] | None = None

    def speculating(self) -> bool:
        """Worth transcribing at a pause: the flow waits for speech and the bot is silent
        (speech over the bot is a barge-in, judged on its own)."""
        spec = self.spec
        return self.listening and self._speaker.current is None and spec is not None and spec.speech

    def at_pause(self, event: SpeechPaused) -> None:
        if not self.speculating():
            return
        log.debug("speculation.pause", pause=event.pause, speech_ms=event.speech_ms)
        self._task = asyncio.create_task(
            self._transcribe_pause(event.audio, event.pause), name="speculative-stt"
        )
        self._pause = event.pause
        spec = self.spec
        if spec is not None:
            # Until the words are in, they cannot keep an unfinished sentence open: with an STT
            # slower than the endpoint silence (offline whisper: ~0.4 s) the short silence
            # would end it first. Hold the turn as long as an unfinished one may wait; a
            # finished one loses nothing, its reply needs these very words.
            self._endpointer.set_silence_ms(self._words_wait_ms(spec.turn))

    @property
    def words_task(self) -> asyncio.Task[str] | None:
        """The words of the pause in progress being transcribed and judged, if any."""
        return self._task

    def words_changed(self, event: SpeechPaused) -> None:
        """New words for the pause in progress (a streaming STT's final words came in after
        the pause began): what was started on the old words is stale, start again on these."""
        if self._task is not None and self._pause == event.pause:
            self.drop()
            self.at_pause(event)

    def _current(self, pause: int) -> bool:
        return self._task is not None and self._pause == pause

    def take(self) -> asyncio.Task[str] | None:
        """The transcript of the utterance's last pause, for the STT worker (handed out once)."""
        task, self._task, self._pause = self._task, None, None
        return task

    def _words_wait_ms(self, policy: TurnPolicy) -> int:
        """How long a pause may run while its words are still coming: the node's longest
        pause, but with a turn deadline (cloud providers) never so long that an STT which
        never answers would push the re-ask past it: the turn must end before the deadline."""
        if self._heard_within is None:
            return policy.max_silence_ms
        budget_ms = round((self._heard_within - HEARD_MARGIN) * 1000) - WORDS_WAIT_SLACK_MS
        return max(policy.fallback_silence_ms, min(policy.max_silence_ms, budget_ms))

    async def _transcribe_pause(self, pcm16_8k: bytes, pause: int) -> str:
        audio = resample(pcm16_8k, 8000, self._stt.sample_rate)
        try:
            transcript = await self._stt.transcribe(audio)
        except ProviderError as exc:  # the turn asks again; counted like any provider failure
            metrics.count_provider_error("stt", exc.provider, exc)
            spec = self.spec
            if self._current(pause) and spec is not None:
                # No words to judge by: silence decides, as without speculation.
                self._endpointer.set_silence_ms(spec.turn.fallback_silence_ms)
            raise
        text = transcript.text.strip()
        listener = self.listener
        # Still the caller's latest words and the turn not committed yet: let the flow start
        # on the reply (once committed, the STT worker delivers the text the normal way).
        if not self._current(pause):
            return text
        verdict = self._judge_turn(text, pcm16_8k, pause, transcript.last_word_probability)
        # Words that leave a clause open will be followed by more: a reply to them is waste.
        if listener is not None and text and verdict != "incomplete":
            log.debug("speculation.transcript", pause=pause)
            listener(text)
        return text

    def _judge_turn(
        self, text: str, pcm16_8k: bytes, pause: int, last_word_probability: float | None
    ) -> Completeness | None:
        """Move the end of this turn by what the words so far say, and when they say nothing
        either way, by the audio turn model: an open clause ("my number is", "and") or digits
        still missing wait the node's longest pause, a finished answer its shortest, words
        that may go on (or whose last word the STT doubts) halfway."""
        spec = self.spec
        if spec is None:
            return None
        policy = spec.turn
        verdict = judge_words(policy, text, last_word_probability)
        if verdict != "unknown" or self._turn_model is None:
            silence = silence_needed_ms(policy, None, verdict)
            self._endpointer.set_silence_ms(silence)
            log.debug("turn.judged", text=verdict, silence_ms=silence)
            return verdict
        # Hold the turn open while the model thinks (off the loop), a bounded moment.
        self._endpointer.set_silence_ms(policy.fallback_silence_ms + TURN_MODEL_GRACE_MS)
        if self._turn_judge is not None:
            self._turn_judge.cancel()
        # The audio up to now: the silence since the pause is part of what the model judges
        # (it was trained on turns that end ~200 ms into the pause).
        audio = self._endpointer.utterance_audio() or pcm16_8k
        self._turn_judge = asyncio.create_task(
            self._judge_by_model(self._turn_model, policy, audio, pause), name="turn-model"
        )
        return verdict

    async def _judge_by_model(
        self, model: TurnModel, policy: TurnPolicy, pcm16_8k: bytes, pause: int
    ) -> None:
        p_audio = await model.audio_probability(pcm16_8k)  # never raises: None = no answer
        if not self._current(pause):
            return  # the turn ended meanwhile (or went on): nothing to move
        silence = silence_needed_ms(policy, p_audio, "unknown")
        self._endpointer.set_silence_ms(silence)
        log.debug("turn.judged", text="unknown", p_audio=p_audio, silence_ms=silence)

    # -- the flow's side (``Capabilities.speculation``) -----------------------------------

    def on_tentative_input(self, listener: TentativeListener | None) -> None:
        self.listener = listener

    def prefetch_speech(self, text: str) -> None:
        self._speaker.prefetch_speech(text)

    def reply_chunker(self) -> SentenceChunker:
        return self._speaker.reply_chunker()

    def drop(self) -> None:
        """The caller went on talking: what was started on their pause is stale."""
        task = self.take()
        if task is not None:
            if not task.done():
                task.cancel()
            metrics.SPECULATION.labels("stt", "wasted").inc()
            task.add_done_callback(_consume_result)
            if self.listener is not None:
                self.listener(None)
        # Prefetched speech stays: the next pause may bring the same words (then the reply,
        # and its first sentence, are the same). A new listen() drops what is left.

    async def aclose(self) -> None:
        """The stream is over: cancel what speculation still runs."""
        judge, self._turn_judge = self._turn_judge, None
        if judge is not None and not judge.done():
            judge.cancel()
            await asyncio.gather(judge, return_exceptions=True)
        task = self.take()
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _consume_result(task: asyncio.Task[str]) -> None:
    """Retrieve a dropped speculation's outcome, so a failure is not logged as unhandled."""
    if not task.cancelled():
        task.exception()
