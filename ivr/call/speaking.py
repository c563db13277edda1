"""The bot's side of the call: one ``SpeechHandle`` at a time, over the call's ``AudioPlayer``.

``Speaker`` starts each utterance (cached prompt, or text through TTS with this call's
speculative prefetches), knows which one plays now (the floor pauses and interrupts it), and
keeps the latency of each answered turn for the call record.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.speculation import SpeculativeSpeech
from ivr.call.speech import SpeechHandle
from ivr.call.turns import CallStats, TurnTimings
from ivr.callio.io import Spoken
from ivr.callio.sentences import SentenceChunker, first_piece
from ivr.tts.base import TextToSpeech
from ivr.tts.voice import StreamingVoice


class Speaker:
    def __init__(
        self,
        *,
        player: AudioPlayer,
        tts: TextToSpeech,
        prompts: PromptCache,
        llm_name: str = "llm",
        heard_within: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.player = player
        self.prefetch = SpeculativeSpeech(tts)
        # A streaming voice speaks each reply in one session, its text pushed as the LLM
        # writes it: a sentence prefetched apart could not join that session (see README).
        self._voice = tts.streaming if isinstance(tts, StreamingVoice) else None
        self._prompts = prompts
        self._llm_name = llm_name
        self._heard_within = heard_within
        self._clock = clock
        self.stats = CallStats()
        self.turns: list[dict[str, float]] = []
        self._turns_saved = 0
        self.current: SpeechHandle | None = None
        """The utterance playing (or paused) now; None while the bot is silent."""
        self.answering: TurnTimings | None = None
        """The caller turn just heard: the next utterance answers it."""

    def cached(self, text: str) -> bytes | None:
        return self._prompts.get(self.prefetch.voice, text)

    def prefetch_speech(self, text: str) -> None:
        """The first TTS request a reply of ``text`` will make, started now. A say node's
        whole text was prefetched here once: its live reply asked for the first sentence
        only, so the prefetch went unused and held piper's one worker in front of it."""
        if self._voice is not None or self.cached(text) is not None:  # cached: no TTS
            return
        piece = first_piece(text, first_words=self.prefetch.first_piece_words)
        if piece and self.cached(piece) is None:
            self.prefetch.prefetch(piece)

    def reply_chunker(self) -> SentenceChunker:
        return SentenceChunker(first_words=self.prefetch.first_piece_words)

    def new_speech(self, interruptible: bool) -> SpeechHandle:
        turn, self.answering = self.answering, None
        return SpeechHandle(
            player=self.player,
            tts=self.prefetch,
            prompts=self._prompts,
            stats=self.stats,
            interruptible=interruptible,
            turn=turn,
            on_turn=self.turns.append,
            llm_name=self._llm_name,
            heard_within=self._heard_within,
            clock=self._clock,
            voice=self._voice,
        )

    @staticmethod
    def start_text(handle: SpeechHandle, text: str, cached: bytes | None) -> None:
        if cached is not None:
            handle.play_cached(text, cached)
            return

        async def one() -> AsyncIterator[str]:
            yield text

        handle.play_text(one(), from_llm=False)

    async def play(self, handle: SpeechHandle, start: Callable[[], None]) -> Spoken:
        """Start ``handle`` and wait until it has played (or was interrupted)."""
        start()
        self.current = handle
        try:
            return await handle.wait_for_playout()
        finally:
            self.current = None

    async def interrupt(self, trigger: str) -> None:
        """A barge-in: stop what plays now, if it may be stopped."""
        speech = self.current
        if speech is not None and speech.can_be_interrupted:
            await speech.interrupt(trigger)

    def unsaved_turns(self) -> list[dict[str, float]]:
        """Turn latencies not yet handed to the call store (each is handed out once)."""
        fresh = self.turns[self._turns_saved :]
        self._turns_saved = len(self.turns)
        return fresh

    async def aclose(self) -> None:
        await self.prefetch.aclose()
