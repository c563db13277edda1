"""Who answered an outbound call, a person or a machine, and when a machine's beep has passed.

An ``AnswerWatch`` per outbound call takes the callee's audio from the call session's tap and
runs ``ivr.audio.amd`` on it a batch at a time (``BATCH_S``). On the event loop, deliberately:
the analysis costs about 8 us per 20 ms frame (40 us per batch, ``bench/amd.py``), and a worker
thread hop costs 70-350 us of CPU, more than the work it would move. It runs only until the
call is classified (a machine: until its beep), a few seconds per outbound call.

Twilio's async AMD result, when enabled and delivered to this instance (``AnswerBoard.report``),
is the other source: whichever decides first wins. A flow starts once the call is classified;
a voicemail waits for ``greeting_ended``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final

import structlog

from ivr.audio.amd import AmdDecision, AnsweredBy, AnsweringMachineDetector, GreetingEnd

log = structlog.get_logger("ivr.answer")

BATCH_S: Final = 0.1
_BATCH_BYTES: Final = int(8000 * 2 * BATCH_S)


def from_twilio(answered_by: str) -> AnsweredBy:
    """Twilio's ``AnsweredBy`` as a flow sees it."""
    if answered_by == "human":
        return "human"
    if answered_by.startswith("machine") or answered_by == "fax":
        return "machine"
    return "unknown"


class AnswerWatch:
    """One outbound call's detection. ``feed`` is the session's audio tap."""

    def __init__(self, detector: AnsweringMachineDetector | None = None) -> None:
        self._detector = detector or AnsweringMachineDetector()
        self._pending = bytearray()
        self._decided: asyncio.Future[AnsweredBy] = asyncio.get_running_loop().create_future()
        self._greeting_over = asyncio.Event()
        self.source = ""
        """``audio``, ``twilio`` or ``timeout``: what decided."""
        self.decision: AmdDecision | None = None
        self.greeting_end: GreetingEnd | None = None

    # -- inputs ----------------------------------------------------------------------------

    def feed(self, pcm16: bytes) -> None:
        """The callee's audio (PCM16 8 kHz), as it arrives; analysed every ``BATCH_S``."""
        detector = self._detector
        if detector.done:
            return
        self._pending += pcm16
        if len(self._pending) < _BATCH_BYTES:
            return
        detector.push(bytes(self._pending))
        self._pending.clear()
        if detector.decision is not None and self.decision is None:
            self.decision = detector.decision
            self._decide(detector.decision.answered_by, "audio")
        if detector.greeting_end is not None and self.greeting_end is None:
            self.greeting_end = detector.greeting_end
            self._greeting_over.set()
        if detector.done:
            self._log_done()

    def twilio_result(self, answered_by: str) -> None:
        """Twilio's async AMD answer (``AnsweredBy``). ``machine_end_*`` means the greeting
        (and its beep) is over: a voicemail may start."""
        self._decide(from_twilio(answered_by), "twilio")
        if answered_by.startswith("machine_end") or answered_by == "fax":
            self._greeting_over.set()

    def _decide(self, answered_by: AnsweredBy, source: str) -> None:
        if not self._decided.done():
            self._decided.set_result(answered_by)
            self.source = source
            log.info("amd.decided", answered_by=answered_by, source=source)

    def _log_done(self) -> None:
        decision, end = self.decision, self.greeting_end
        log.info(
            "amd.audio_done",
            answered_by=decision.answered_by if decision else None,
            reason=decision.reason if decision else None,
            at_s=round(decision.at_s, 2) if decision else None,
            beep_hz=end.beep_hz if end else None,
            frames=self._detector.frames,
        )

    # -- what the flow waits for -----------------------------------------------------------

    async def answered_by(self, within: float) -> AnsweredBy:
        """Human, machine or unknown; ``unknown`` when nothing decided ``within`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                return await asyncio.shield(self._decided)
        self._decide("unknown", "timeout")
        return "unknown"

    async def greeting_ended(self, within: float) -> bool:
        """Until a machine's greeting is over (its beep, or silence); False after ``within``
        seconds without."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self._greeting_over.wait()
                return True
        return False


class AnswerBoard:
    """The outbound calls this instance carries that are being classified, by CallSid, so an
    AMD callback landing here reaches its call."""

    def __init__(self) -> None:
        self._watches: dict[str, AnswerWatch] = {}

    def add(self, call_sid: str, watch: AnswerWatch) -> None:
        self._watches[call_sid] = watch

    def remove(self, call_sid: str) -> None:
        self._watches.pop(call_sid, None)

    def report(self, call_sid: str, answered_by: str) -> bool:
        """Hand Twilio's result to the call if it is here; False when it is not."""
        watch = self._watches.get(call_sid)
        if watch is None:
            return False
        watch.twilio_result(answered_by)
        return True


ANSWER_TIMEOUT: Final = 8.0
"""Longest an outbound call waits to be classified before its flow starts (``unknown``)."""
BEEP_TIMEOUT: Final = 30.0
"""Longest a voicemail waits for a machine's greeting to end before it is said anyway."""


@contextlib.asynccontextmanager
async def watching_answer(
    session: object, call_sid: str, board: AnswerBoard, twilio_answered_by: str = ""
) -> AsyncIterator[AnswerWatch]:
    """Classify an outbound call while the block runs: the session's audio feeds a watch
    (a ``CallSession``; any other ``CallIO``, e.g. text tests, gets no audio: ``unknown``),
    the board routes Twilio's AMD callback to it."""
    watch = AnswerWatch()
    if twilio_answered_by:  # Twilio's callback came before the stream
        watch.twilio_result(twilio_answered_by)
    add_tap = getattr(session, "add_audio_tap", None)
    if add_tap is not None:
        add_tap(watch.feed)
    board.add(call_sid, watch)
    try:
        yield watch
    finally:
        board.remove(call_sid)
