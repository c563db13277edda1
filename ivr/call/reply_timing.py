"""The latency record of one reply: each stage's first moment stamped on the caller turn it
answers (``TurnTimings``), the record closed once the reply's first audio is queued, and the
moment the caller first hears it.

A ``SpeechHandle`` keeps one; the stages (LLM, sentence split, TTS, player) call it as they go.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from ivr.call.turns import TurnTimings
from ivr.obs import metrics
from ivr.providers.resilience import turn_deadline

log = structlog.get_logger("ivr.call")

TurnRecorder = Callable[[dict[str, float]], None]


class ReplyTiming:
    """Stamps ``turn`` (None: a reply to no timed turn, nothing to stamp but the metrics)."""

    def __init__(
        self,
        turn: TurnTimings | None,
        *,
        on_turn: TurnRecorder | None,
        clock: Callable[[], float],
        llm_name: str,
        tts_name: str,
    ) -> None:
        self.turn = turn
        self._on_turn = on_turn
        self._clock = clock
        self._llm_name = llm_name
        self._tts_name = tts_name
        self._parts: dict[str, float] | None = None

    def first_token(self, turn: TurnTimings | None) -> None:
        if turn is None or turn.llm_first_token is not None or turn.llm_start is None:
            return
        turn.llm_first_token = self._clock()
        metrics.LLM_TTFT.labels(self._llm_name).observe(turn.llm_first_token - turn.llm_start)

    def first_clause(self, turn: TurnTimings | None) -> None:
        if turn is not None and turn.first_clause is None:
            turn.first_clause = self._clock()

    def tts_started(self) -> float:
        """Now, which is when this sentence's synthesis started."""
        started = self._clock()
        if self.turn is not None and self.turn.tts_start is None:
            self.turn.tts_start = started
        return started

    def first_byte(self, started: float) -> None:
        now = self._clock()
        metrics.TTS_TTFB.labels(self._tts_name).observe(now - started)
        if self.turn is not None and self.turn.tts_first_byte is None:
            self.turn.tts_first_byte = now

    def first_audio(self, *, cached: bool) -> None:
        """Close the turn's latency record once its first audio is queued for sending."""
        turn_deadline.set(None)  # heard in time: later sentences get their stages' own limits
        turn = self.turn
        if turn is None or turn.first_audio is not None:
            return
        turn.first_audio = self._clock()
        turn.cached_prompt = cached
        parts = self._parts = turn.observe()
        if self._on_turn is not None:
            self._on_turn(parts)
        log.info("turn.latency", **{k: round(v, 4) for k, v in parts.items()})

    def first_heard(self, at: float) -> None:
        if self.turn is not None and self._parts is not None:
            self.turn.heard(at, self._parts)
