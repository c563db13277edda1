"""One call's streaming STT: one session from the stream's ``start`` to its end.

``Hearing`` (``ivr.call.hearing``) hands it every inbound payload as it arrives (``push``: the
phone's 8 kHz mu-law, as Twilio sends it, no resampling) and the endpointer's verdicts: a
sound that ends a turn (``turn_ended``) or one that was no turn (``no_turn``). ``run`` (the
call's STT task, in the stream's task set) owns the session: it opens it, reads its events
(words into ``LiveWords``, the provider's turn hints to ``TurnHints``) and, at each turn's end,
asks for the final words (``finalize``) and hands the utterance to the floor as the batch STT
worker does: timed from the endpoint, ``NotUnderstood`` (the re-ask) when the provider fails or
misses the turn deadline. The session reconnects and fails over by itself
(``ivr.stt.resilient_stream``); one that fails for good is reopened for the turns after.
``aclose`` ends the input, lets the last words come (briefly) and closes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ivr.audio.endpointer import Endpointer
from ivr.audio.timed_audio import BYTES_PER_SECOND, TimedAudio
from ivr.call.barge_in import Floor
from ivr.call.heard import TurnsToHear, not_understood, words_heard
from ivr.call.inputs import NotUnderstood
from ivr.call.live_words import LiveWords, same_words
from ivr.call.pause_turns import TurnSpeculation
from ivr.call.speaking import Speaker
from ivr.call.speech import heard_deadline
from ivr.call.turn_hints import TurnHints
from ivr.call.turns import TurnTimings
from ivr.callio.io import Utterance
from ivr.errors import ProviderError, ProviderTimeout
from ivr.obs import metrics
from ivr.providers.streaming import PHONE_AUDIO
from ivr.stt.base import (
    FinalWords,
    SpeechToTextSession,
    StreamingSpeechToText,
    SttStreamEvent,
    TurnHint,
)

log = structlog.get_logger("ivr.call")

TURN_QUEUE_SIZE = 4
FINAL_WORDS_LIMIT = 3.0
"""Seconds a turn waits for its final words when no turn deadline is set (``heard_within``)."""
REOPEN_AFTER = 1.0
"""Seconds between attempts to open a session when no provider would (the turns meanwhile
are re-asked at once)."""
BACKLOG_SECONDS = 5.0
"""Audio kept while no session is open (connecting): pushed to it when it opens."""
END_GRACE = 0.5
"""Seconds the call's end waits for the provider to close the session cleanly."""


@dataclass(slots=True)
class _LiveTurn:
    timings: TurnTimings
    start: float
    """Stream seconds where the utterance's audio (pre-roll included) starts."""
    end: float
    """Stream seconds (from the first audio pushed) where the caller stopped."""
    speculative: asyncio.Task[str] | None
    """The words taken at the caller's last pause (``TurnSpeculation``), if no speech since."""


class LiveHearing:
    def __init__(
        self,
        stt: StreamingSpeechToText,
        *,
        words: LiveWords,
        endpointer: Endpointer,
        speculation: TurnSpeculation,
        floor: Floor,
        speaker: Speaker,
        heard_within: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stt = stt
        self.words = words
        self._speculation = speculation
        self.hints = TurnHints(
            stt.name, endpointer=endpointer, speculation=speculation, words=words
        )
        self._floor = floor
        self._speaker = speaker
        self._heard_within = heard_within
        self._clock = clock
        self._session: SpeechToTextSession | None = None
        self._ready = asyncio.Event()
        self._origin: float | None = None
        """Twilio's stream time of the first payload: stream second 0."""
        self._pushed = 0.0
        self._backlog = TimedAudio(BACKLOG_SECONDS)
        """What was heard while no session was open, for the next one."""
        self._offset = 0.0
        """Stream second where the open session's own clock starts."""
        self._turns: TurnsToHear[_LiveTurn] = TurnsToHear(TURN_QUEUE_SIZE)
        self._unfinalised: deque[float] = deque()
        """Where each turn not finalised yet starts (stream seconds), oldest first: no audio
        from there on may be forgotten."""
        self._flush: asyncio.Future[None] | None = None

    # -- from Hearing (the receive loop; never blocks) -------------------------------------

    def push(self, ulaw: bytes, stream_time: float) -> None:
        if self._origin is None:
            self._origin = stream_time
        session = self._session
        if session is not None:
            session.push(ulaw)
        else:
            self._backlog.push(ulaw, self._pushed)
        self._pushed += len(ulaw) / BYTES_PER_SECOND

    def second(self, stream_time: float) -> float:
        """Twilio's stream time as seconds of the call's audio pushed (the words' clock)."""
        return stream_time - (self._origin if self._origin is not None else stream_time)

    def turn_ended(
        self,
        timings: TurnTimings,
        start: float,
        end_of_speech: float,
        speculative: asyncio.Task[str] | None,
    ) -> None:
        """The caller's turn: its audio from stream time ``start`` to ``end_of_speech``."""
        turn = _LiveTurn(timings, self.second(start), self.second(end_of_speech), speculative)
        if (dropped := self._turns.put(turn)) is not None:
            self._unfinalised.remove(dropped.start)
        self._unfinalised.append(turn.start)

    def no_turn(self, end: float) -> None:
        """The sound the endpointer closed at stream time ``end`` is no turn (echo, noise, too
        short): words about audio up to there are dropped, and so is the audio itself where
        the session keeps it for an upload (a batch fallback)."""
        self.words.drop_through(self.second(end))
        self._forget_through(self.second(end))

    def _forget_through(self, t: float) -> None:
        """The audio before stream second ``t`` holds no words to wait for (never a turn's
        that is not finalised yet)."""
        if self._unfinalised:
            t = min(t, self._unfinalised[0])
        session = self._session
        if session is not None:
            session.forget_through(t - self._offset)
            return
        self._backlog.drop_through(t)

    def pending(self) -> bool:
        """A turn's words are being, or wait to be, finalised."""
        return self._turns.pending()

    # -- the call's STT task ----------------------------------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._run_turns(), name="live-stt-turns")
            await self._keep_open()

    async def _keep_open(self) -> None:
        while True:
            try:
                session = await self._stt.open(PHONE_AUDIO)
            except ProviderError as exc:
                metrics.count_provider_error("stt", exc.provider, exc)
                log.warning("stt.stream_open_failed", error=str(exc), kind=exc.kind.value)
                await asyncio.sleep(REOPEN_AFTER)
                continue
            self._offset = self._backlog.start if self._backlog else self._pushed
            if self._backlog:
                session.push(self._backlog.take())
            self._session = session
            self._ready.set()
            try:
                await self._consume(session)
                return  # the input ended: no more audio this call
            except ProviderError as exc:
                metrics.count_provider_error("stt", exc.provider, exc)
                log.warning("stt.stream_failed", error=str(exc), kind=exc.kind.value)
                self._fail_flush(exc)
            self._ready.clear()
            self._session = None
            await session.aclose()

    async def _consume(self, session: SpeechToTextSession) -> None:
        async for event in session:
            event = _shifted(event, self._offset)
            if isinstance(event, TurnHint):
                self.hints.on_hint(event)
                continue
            self.words.heard(event, self._pushed)
            if isinstance(event, FinalWords) and event.text and self.hints.pause is not None:
                # The caller's pause began before these words were final: speculate on them
                # (the interim words at the pause lack the word still being spoken).
                self._speculation.words_changed(self.hints.pause)
            flush = self._flush
            if isinstance(event, FinalWords) and event.flushed and flush and not flush.done():
                flush.set_result(None)

    def _fail_flush(self, error: ProviderError) -> None:
        flush = self._flush
        if flush is not None and not flush.done():
            flush.set_exception(error)
            flush.exception()  # retrieved here: the turn may have given up on it already

    async def _run_turns(self) -> None:
        await self._turns.serve(
            self._transcribe, self._floor.deliver, lambda turn: self._unfinalised.remove(turn.start)
        )

    async def _transcribe(self, turn: _LiveTurn) -> Utterance | NotUnderstood:
        timings = turn.timings
        timings.stt_start = self._clock()
        try:
            text, _ = await self._final_words(turn)
        except ProviderError as exc:
            _drop_speculation(turn.speculative)
            self.words.take(turn.end)  # late words about this turn are not the next one's
            return not_understood(self._speaker, exc)
        text = _adopt(turn.speculative, text)
        return words_heard(self._stt.name, self._speaker, timings, text, self._clock())

    async def _final_words(self, turn: _LiveTurn) -> tuple[str, float | None]:
        """Every word of the turn final: ``finalize()`` and its flushed answer, within the
        turn's deadline (raises ``ProviderTimeout`` past it, ``ProviderError`` when the
        session fails meanwhile)."""
        deadline = heard_deadline(turn.timings, self._heard_within)
        limit = FINAL_WORDS_LIMIT if deadline is None else max(0.0, deadline - self._clock())
        if self.words.settled_through(turn.end):
            return self.words.take(turn.end)  # the provider's own end came first: no wait
        try:
            async with asyncio.timeout(limit):
                await self._ready.wait()
                session = self._session
                assert session is not None
                self._flush = asyncio.get_running_loop().create_future()
                self._forget_through(turn.start)  # a batch fallback uploads the turn alone
                session.finalize()
                await self._flush
        except TimeoutError:
            raise ProviderTimeout(self._stt.name, limit, phase="final words") from None
        finally:
            self._flush = None
        return self.words.take(turn.end)

    async def aclose(self) -> None:
        """The call is over: no more input; the provider's last words are let in (briefly),
        then the session is closed whatever happened."""
        session, self._session = self._session, None
        if session is None:
            return
        try:
            session.end_input()
            async with asyncio.timeout(END_GRACE):
                async for _ in session:
                    pass
        except (TimeoutError, ProviderError):
            pass
        finally:
            await session.aclose()


def _shifted(event: SttStreamEvent, offset: float) -> SttStreamEvent:
    """``event`` in the call's stream seconds (a reopened session counts from its start)."""
    if not offset:
        return event
    if isinstance(event, TurnHint):
        return dataclasses.replace(event, at=event.at + offset)
    words = tuple(dataclasses.replace(w, start=w.start + offset, end=w.end + offset)
                  for w in event.words)  # fmt: skip
    if isinstance(event, FinalWords) and event.audio_end is not None:
        return dataclasses.replace(event, words=words, audio_end=event.audio_end + offset)
    return dataclasses.replace(event, words=words)


def _adopt(speculative: asyncio.Task[str] | None, text: str) -> str:
    """The words taken at the caller's last pause, when the final words say the same: the
    flow then adopts the reply it started on them (matched by the exact words)."""
    if speculative is None:
        return text
    if speculative.done() and not speculative.cancelled() and speculative.exception() is None:
        guess = speculative.result()
        if guess and same_words(guess, text):
            metrics.SPECULATION.labels("stt", "used").inc()
            return guess
    _drop_speculation(speculative)
    return text


def _drop_speculation(task: asyncio.Task[str] | None) -> None:
    if task is None:
        return
    if not task.done():
        task.cancel()
    metrics.SPECULATION.labels("stt", "wasted").inc()
    task.add_done_callback(_consume_result)


def _consume_result(task: asyncio.Task[str]) -> None:
    if not task.cancelled():
        task.exception()
