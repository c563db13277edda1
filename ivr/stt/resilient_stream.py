"""``ResilientStreamingStt``: a call's streaming STT that survives its provider. The session
keeps the audio no final words have settled yet (at most ``REPLAY_SECONDS``); when the
provider's session fails it reconnects to the same provider (a retryable error, at most
``RECONNECTS`` times a call) or fails over to the next, of any kind: another streaming
provider, or a batch one (``BatchSttStream``: the OpenAI-compatible upload, the offline
whisper) that transcribes, at each ``finalize()``, the audio since the last one less what the
gateway ruled out (``forget_through``: a sound that was no turn, what came before the turn).
The replay makes the new session hear the unsettled utterance again, so what is lost is time
(the handshake, and the provider hearing it again), plus any audio older than
``REPLAY_SECONDS`` not yet final.
Times stay in the call's clock: the new session's are shifted by where its replay starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Sequence

import structlog

from ivr.audio.codec import ulaw_to_pcm16
from ivr.audio.resample import resample
from ivr.audio.timed_audio import TimedAudio
from ivr.errors import ProviderError
from ivr.obs.metrics import count_provider_error
from ivr.providers.resilience import RetryPolicy, WarmChain, aclose_stream, first_output
from ivr.providers.streaming import PHONE_AUDIO, AudioFormat, TimedWord
from ivr.stt.base import (
    FinalWords,
    InterimWords,
    SpeechToText,
    SpeechToTextSession,
    StreamingSpeechToText,
    SttStreamEvent,
    TurnHint,
)

log = structlog.get_logger("ivr.stt")

REPLAY_SECONDS = 30.0
RECONNECTS = 3


class ResilientStreamingStt(WarmChain[StreamingSpeechToText]):
    """``StreamingSpeechToText`` over a primary and its fallbacks (see the module docstring)."""

    accepts: tuple[AudioFormat, ...] = (PHONE_AUDIO,)

    def __init__(self, providers: Sequence[StreamingSpeechToText], policy: RetryPolicy) -> None:
        if not providers or any(PHONE_AUDIO not in p.accepts for p in providers):
            raise ValueError("every streaming STT provider must take the phone's mu-law")
        super().__init__(providers, policy)

    async def open(
        self, audio: AudioFormat, *, first_output_limit: float | None = None
    ) -> ResilientSttSession:
        session = ResilientSttSession(self)
        await session.connect(0, self.policy.limited(first_output_limit))
        return session


class ResilientSttSession:
    """``SpeechToTextSession`` over whichever provider is serving the call now."""

    def __init__(self, owner: ResilientStreamingStt) -> None:
        self._owner = owner
        self._index = 0
        self._session: SpeechToTextSession | None = None
        self._replay = TimedAudio(REPLAY_SECONDS)
        """The unsettled audio; where it starts, a new session's clock starts."""
        self._offset = 0.0
        self._finalizing = False
        self._ended = False
        self.reconnects = 0

    async def connect(self, start: int, policy: RetryPolicy) -> None:
        """The first provider from ``start`` that opens within the policy, replay pushed."""

        async def attempt(provider: StreamingSpeechToText, limit: float) -> AsyncIterator[int]:
            self._session = await provider.open(PHONE_AUDIO, first_output_limit=limit)
            yield self._owner.providers.index(provider)

        opened = first_output("stt", self._owner.providers[start:], attempt, policy)
        try:
            self._index = await anext(opened)
        finally:
            await aclose_stream(opened)
        assert self._session is not None
        self._offset = self._replay.start
        if self._replay:
            self._session.push(self._replay.audio())
        if self._ended:
            self._session.end_input()
        elif self._finalizing:
            self._session.finalize()

    @property
    def provider(self) -> str:
        return self._owner.providers[self._index].name

    def push(self, audio: bytes) -> None:
        self._replay.extend(audio)
        if self._session is not None:
            self._session.push(audio)

    def finalize(self) -> None:
        self._finalizing = True
        if self._session is not None:
            self._session.finalize()

    def end_input(self) -> None:
        self._ended = True
        if self._session is not None:
            self._session.end_input()

    def forget_through(self, seconds: float) -> None:
        """Also from the replay: a new provider need not hear a sound that was no turn."""
        self._replay.drop_through(seconds)
        if self._session is not None and seconds > self._offset:
            self._session.forget_through(seconds - self._offset)

    async def __aiter__(self) -> AsyncIterator[SttStreamEvent]:
        while True:
            assert self._session is not None
            try:
                async for event in self._session:
                    yield self._settle(event)
                return
            except ProviderError as error:
                await self._recover(error)

    def _settle(self, event: SttStreamEvent) -> SttStreamEvent:
        """``event`` in the call's clock; a final drops the audio it settles from the replay."""
        offset = self._offset
        if isinstance(event, TurnHint):
            return dataclasses.replace(event, at=event.at + offset)
        words = tuple(TimedWord(w.text, w.start + offset, w.end + offset, w.confidence)
                      for w in event.words)  # fmt: skip
        if isinstance(event, InterimWords):
            return InterimWords(event.text, words)
        end = None if event.audio_end is None else event.audio_end + offset
        if event.flushed:
            self._finalizing = False
            end = self._replay.end if end is None else end
        if end is not None:
            self._replay.drop_through(end)
        return dataclasses.replace(event, words=words, audio_end=end)

    async def _recover(self, error: ProviderError) -> None:
        count_provider_error("stt", error.provider, error)
        same = error.retryable and self.reconnects < RECONNECTS
        start = self._index if same else self._index + 1
        if start >= len(self._owner.providers):
            raise error
        self.reconnects += same
        old, self._session = self._session, None
        if old is not None:
            await old.aclose()
        log.warning(
            "provider.reconnect" if same else "provider.fallback", stage="stt",
            provider=error.provider, kind=error.kind.value, error=str(error),
            next_provider=self._owner.providers[start].name,
            replayed_s=round(self._replay.seconds, 2),
        )  # fmt: skip
        await self.connect(start, self._owner.policy)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.aclose()


class BatchSttStream:
    """A batch ``SpeechToText`` as a streaming provider, for a fallback: each ``finalize()``
    uploads the audio since the last one (no interim words, no turn hints)."""

    accepts: tuple[AudioFormat, ...] = (PHONE_AUDIO,)

    def __init__(self, stt: SpeechToText) -> None:
        self.stt = stt
        self.name = stt.name

    async def open(
        self, audio: AudioFormat, *, first_output_limit: float | None = None
    ) -> BatchSttSession:
        return BatchSttSession(self.stt)

    async def warm(self) -> None:
        await self.stt.warm()

    async def aclose(self) -> None:
        await self.stt.aclose()


class BatchSttSession:
    """Each ``finalize()`` takes the audio kept since the last one and uploads it; the audio
    kept is at most ``REPLAY_SECONDS``, and none that ``forget_through`` ruled out (a sound
    that was no turn, the silence before the utterance): a batch STT hears only the turn,
    where a streaming one hears everything and times its words."""

    def __init__(self, stt: SpeechToText) -> None:
        self._stt = stt
        self._audio = TimedAudio(REPLAY_SECONDS)
        """The next upload, in session seconds; its ``end``: all audio pushed so far."""
        self._asks: deque[tuple[bytes, float] | None] = deque()
        """Each finalize's audio and where it ends, in order; None: the input ended."""
        self._asked = asyncio.Event()

    def push(self, audio: bytes) -> None:
        self._audio.extend(audio)

    def finalize(self) -> None:
        # Taken now: audio pushed after this belongs to the next utterance.
        end = self._audio.end
        self._asks.append((self._audio.take(), end))
        self._asked.set()

    def end_input(self) -> None:
        self._asks.append(None)
        self._asked.set()

    def forget_through(self, seconds: float) -> None:
        self._audio.drop_through(seconds)

    async def __aiter__(self) -> AsyncIterator[SttStreamEvent]:
        while True:
            await self._asked.wait()
            self._asked.clear()
            while self._asks:
                ask = self._asks.popleft()
                if ask is None:  # the call is over: nobody waits for words, no upload
                    yield FinalWords("", audio_end=self._audio.end, flushed=True)
                    return
                audio, end = ask
                text = await self._transcribe(audio) if audio else ""
                yield FinalWords(text, audio_end=end, flushed=True)

    async def _transcribe(self, ulaw: bytes) -> str:
        pcm = resample(ulaw_to_pcm16(ulaw), 8000, self._stt.sample_rate)
        return (await self._stt.transcribe(pcm)).text

    async def aclose(self) -> None:
        self._audio.take()
        self._asks.clear()
