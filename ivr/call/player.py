"""Outbound audio: paced sending, marks, the playout clock and barge-in.

Bot speech is a sequence of *segments* (one per sentence). Each segment's mu-law audio is sent
in 20 ms multiples, paced so that ``lead`` to ``lead + refill`` seconds are queued at Twilio
ahead of its playout clock (so a ``clear`` discards little and costs nothing): the sender wakes
when only ``lead`` is left and tops the queue up by ``refill`` in one go, 100 ms messages back
to back, instead of waking for every message (each wake-up is a timer, a task switch and a
pass of the event loop); 400 ms messages were measured no cheaper (``bench/README.md``, stop
46). Each segment is followed by a mark named ``g<generation>:<seq>``.
Twilio echoes a mark once the audio before it has played, and echoes *every* pending mark at
once on ``clear``, possibly after new speech has begun. An interrupt starts a new generation
and numbers its segments from 1 again, so the generation in a mark's name is the one thing
that tells a stale echo from real playback of new speech.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ivr.audio.codec import ulaw_to_pcm16
from ivr.audio.far_end import FarEndReference

FRAME_BYTES = 160  # 20 ms of 8 kHz mu-law
BYTES_PER_SECOND = 8000
ULAW_SILENCE = b"\xff"
SPOKEN_S_PER_CHAR = 0.06  # ~16 characters a second, typical of TTS voices

_MARK_NAME = re.compile(r"g(\d+):(\d+)(h?)")
FRAME_SECONDS = FRAME_BYTES / BYTES_PER_SECOND
WAKE_SLACK_S = 0.01
"""The sender tops up once it is within this of ``lead``: the loop's timers fire up to a few
ms early by our clock (millisecond ticks, a cached loop time), and waiting out the rest in
sub-millisecond sleeps cost ~8 extra wake-ups a top-up at 100 calls."""


@dataclass(slots=True, eq=False)
class Segment:
    """One sentence of bot speech and what became of it."""

    text: str
    generation: int
    seq: int
    total_bytes: int = 0
    closed: bool = False
    first_sent_at: float | None = None
    play_start: float | None = None
    """Estimated time Twilio starts playing this segment (from our playout clock)."""
    played: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False
    on_first_heard: Callable[[float], None] | None = None
    """When set, the first frame goes out alone, followed by a probe mark; its echo (Twilio
    played that frame) calls this with the echo's arrival time less one frame."""
    audio: bytearray = field(default_factory=bytearray)
    """Every whole frame queued so far: a pause can send the sentence again from its start."""
    heard_before: float = 0.0
    """Fraction heard before a pause cut it (it then plays again from ``replay_from``)."""
    replay_from: int = 0
    """Byte where the current playing of the audio starts (after a pause: its last phrase)."""
    heard_seconds_before: float = 0.0
    """Seconds of its audio heard before a pause cut it (``heard_seconds``)."""

    @property
    def duration(self) -> float:
        return self.total_bytes / BYTES_PER_SECOND

    def heard_fraction(self, now: float) -> float:
        if self.total_bytes == 0:  # TTS failed or produced nothing: its mark proves nothing
            return 0.0
        if self.played.is_set() and not self.dropped:
            return 1.0
        if self.play_start is None or now <= self.play_start:
            return self.heard_before
        # While TTS is still producing this sentence, its length is not known yet: measure
        # against what speaking the whole text takes, not against the audio received so far.
        length = (
            self.duration if self.closed else max(self.duration, len(self.text) * SPOKEN_S_PER_CHAR)
        )
        played = now - self.play_start + self.replay_from / BYTES_PER_SECOND
        return max(self.heard_before, min(1.0, played / length))

    def heard_seconds(self, now: float) -> float:
        """How far into its audio (seconds from its first byte) the caller has heard: with the
        provider's word times, which words they heard."""
        if self.played.is_set() and not self.dropped:
            return self.duration
        if self.play_start is None or now <= self.play_start:
            return self.heard_seconds_before
        played = now - self.play_start + self.replay_from / BYTES_PER_SECOND
        return max(self.heard_seconds_before, min(self.duration, played))


def heard_prefix(text: str, fraction: float) -> str:
    """The words of ``text`` a caller heard when ``fraction`` of its audio played."""
    if fraction >= 0.999:
        return text
    if fraction <= 0.0:
        return ""
    words = text.split()
    # Speech time is roughly proportional to characters; keep only words fully heard.
    budget = fraction * len(text)
    kept: list[str] = []
    used = 0
    for word in words:
        if used + len(word) > budget:
            break
        kept.append(word)
        used += len(word) + 1
    return " ".join(kept)


SAID_KEPT = 16
"""Sentences remembered for ``said_since`` (a reply is a few)."""

PHRASE_GAP_FRAMES = 8
"""A pause of 160 ms or more in the bot's audio: a sentence or clause boundary."""
SILENT_POWER = (32768 * 10 ** (-45 / 20)) ** 2


def phrase_start(ulaw: bytes | bytearray, upto: int) -> int:
    """Where the phrase being spoken at byte ``upto`` of ``ulaw`` starts: just before the end
    of the last pause in the audio before it (a sentence's start when the segment is a whole
    cached prompt), or 0. Whole frames, so the replay stays frame-aligned."""
    frames = min(upto, len(ulaw)) // FRAME_BYTES
    if frames == 0:
        return 0
    pcm = np.frombuffer(ulaw_to_pcm16(bytes(ulaw[: frames * FRAME_BYTES])), dtype="<i2")
    power = np.mean(pcm.astype(np.float64).reshape(frames, FRAME_BYTES) ** 2, axis=1)
    run = 0
    for i in range(frames - 1, -1, -1):
        run = run + 1 if power[i] < SILENT_POWER else 0
        if run >= PHRASE_GAP_FRAMES:  # the gap spans i .. i+run-1; keep 40 ms of it
            gap_end = i + run
            while gap_end < frames and power[gap_end] < SILENT_POWER:
                gap_end += 1
            return max(0, gap_end - 2) * FRAME_BYTES
    return 0


class AudioPlayer:
    """Owns the outbound half of one stream. Run ``run_sender()`` in the call's task group."""

    def __init__(
        self,
        send_media: Callable[[bytes], Awaitable[None]],
        send_mark: Callable[[str], Awaitable[None]],
        send_clear: Callable[[], Awaitable[None]],
        *,
        lead_seconds: float = 0.6,
        refill_seconds: float = 0.4,
        chunk_frames: int = 5,
        max_buffered_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_first_media: Callable[[float], None] | None = None,
    ) -> None:
        self._on_first_media = on_first_media
        self._send_media = send_media
        self._send_mark = send_mark
        self._send_clear = send_clear
        self._lead = lead_seconds
        self._refill = refill_seconds
        self._chunk_bytes = chunk_frames * FRAME_BYTES
        self._max_buffered = int(max_buffered_seconds * BYTES_PER_SECOND)
        self._clock = clock
        self._queue: deque[tuple[Segment, bytes | None]] = deque()  # None = the segment's mark
        self._queued_bytes = 0
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._send_lock = asyncio.Lock()
        self._generation = 0
        self._seq = 0
        self._segments: dict[int, Segment] = {}
        """This generation's segments whose mark has not echoed yet, by seq."""
        self._pending_tail: dict[int, bytearray] = {}
        self._playout_end = 0.0
        self._paused = False
        self.far_end = FarEndReference()
        """What the caller heard, on the playout clock: the reference for echo checks."""
        self._said: deque[Segment] = deque(maxlen=SAID_KEPT)

    # -- producer side --------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    def open_segment(self, text: str) -> Segment:
        self._seq += 1
        segment = Segment(text=text, generation=self._generation, seq=self._seq)
        self._segments[segment.seq] = segment
        self._said.append(segment)
        return segment

    def said_since(self, since: float) -> str:
        """The text of what began playing to the caller at or after ``since`` (playout clock),
        or was still playing then: what their line could be echoing."""
        return " ".join(
            s.text
            for s in self._said
            if s.play_start is not None and s.play_start + s.duration + 1.0 >= since
        )

    async def write(self, segment: Segment, ulaw: bytes) -> None:
        """Queue audio for ``segment``; waits while too much audio is already buffered."""
        if segment.generation != self._generation:
            return
        tail = self._pending_tail.setdefault(id(segment), bytearray())
        tail += ulaw
        whole = len(tail) - len(tail) % FRAME_BYTES
        if whole:
            self._enqueue(segment, bytes(tail[:whole]))
            del tail[:whole]
        while self._queued_bytes > self._max_buffered and segment.generation == self._generation:
            self._space.clear()
            await self._space.wait()

    def close_segment(self, segment: Segment) -> None:
        """No more audio for ``segment``: pad its last frame and queue its mark."""
        tail = self._pending_tail.pop(id(segment), bytearray())
        if segment.generation != self._generation:
            return
        if tail:
            self._enqueue(segment, bytes(tail) + ULAW_SILENCE * (FRAME_BYTES - len(tail)))
        segment.closed = True
        self._queue.append((segment, None))
        self._wakeup.set()

    def _enqueue(self, segment: Segment, ulaw: bytes) -> None:
        segment.total_bytes += len(ulaw)
        segment.audio += ulaw
        self._queue.append((segment, ulaw))
        self._queued_bytes += len(ulaw)
        self._wakeup.set()

    async def wait_played(self, segment: Segment) -> None:
        """Until the segment's mark echoes (or it is dropped by an interrupt).

        If the peer never echoes marks, the playout clock plus a grace period decides.
        """
        while not segment.played.is_set():
            deadline = self._estimated_end(segment) + 2.0
            timeout = max(0.05, deadline - self._clock())
            try:
                await asyncio.wait_for(segment.played.wait(), timeout)
            except TimeoutError:
                if segment.closed and not self._has_queued(segment):
                    segment.played.set()

    def _estimated_end(self, segment: Segment) -> float:
        if segment.play_start is None:
            return self._clock() + segment.duration + self._lead
        return segment.play_start + segment.duration

    def _has_queued(self, segment: Segment) -> bool:
        return any(s is segment for s, _ in self._queue)

    # -- barge-in -------------------------------------------------------------------------

    async def interrupt(self) -> None:
        """Drop everything not yet played: local queue and Twilio's buffer."""
        now = self._clock()
        self._generation += 1
        self._seq = 0
        for segment in self._segments.values():
            if not segment.played.is_set():
                segment.dropped = segment.heard_fraction(now) < 1.0
                segment.played.set()
        self._queue.clear()
        self._queued_bytes = 0
        self._pending_tail.clear()
        self._segments.clear()
        self._space.set()
        self._playout_end = now
        self.far_end.cut(now)
        if self._paused:  # nothing was sent since the pause's clear
            self._paused = False
            return
        async with self._send_lock:
            await self._send_clear()

    async def pause(self) -> None:
        """Stop playback now (``clear``) but keep what the caller has not heard: on ``resume()``
        the sentence that was cut plays again from the start of its phrase (the last pause in
        its audio before the cut); ``interrupt()`` drops it all."""
        if self._paused:
            return
        now = self._clock()
        self._paused = True
        self._generation += 1  # marks already sent echo on the clear: they prove nothing
        self._seq = 0
        kept: dict[int, Segment] = {}
        for segment in sorted(self._segments.values(), key=lambda s: s.seq):
            fraction = segment.heard_fraction(now)
            if segment.closed and fraction >= 1.0:  # played out; only its mark was pending
                segment.played.set()
                continue
            segment.heard_before = fraction
            segment.heard_seconds_before = segment.heard_seconds(now)
            if segment.play_start is not None:  # cut while playing: go back to its phrase
                heard = segment.replay_from + (now - segment.play_start) * BYTES_PER_SECOND
                segment.replay_from = phrase_start(segment.audio, int(heard))
            self._seq += 1
            segment.generation, segment.seq = self._generation, self._seq
            segment.first_sent_at = segment.play_start = None
            kept[segment.seq] = segment
        self._segments = kept
        self._queue.clear()
        for segment in kept.values():
            if len(segment.audio) > segment.replay_from:
                self._queue.append((segment, bytes(segment.audio[segment.replay_from :])))
            if segment.closed:
                self._queue.append((segment, None))
        self._queued_bytes = sum(len(a) for _, a in self._queue if a is not None)
        self._playout_end = now
        self.far_end.cut(now)
        async with self._send_lock:
            await self._send_clear()

    def resume(self) -> None:
        """After ``pause()``: play on, from the start of the phrase that was cut."""
        self._paused = False
        self._wakeup.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def on_mark(self, name: str) -> None:
        match = _MARK_NAME.fullmatch(name)
        if match is None:
            return  # not one of ours
        # Marks of a cleared generation echo on `clear`: they prove nothing was heard, and
        # their seq may equal that of a segment of the new generation.
        if int(match[1]) != self._generation:
            return
        seq = int(match[2])
        if match[3]:  # the probe after the first frame: the caller started hearing it
            probed = self._segments.get(seq)
            if probed is not None and probed.on_first_heard is not None:
                probed.on_first_heard(self._clock() - FRAME_SECONDS)
                probed.on_first_heard = None  # a resumed sentence is not heard "first" again
            return
        segment = self._segments.pop(seq, None)
        if segment is not None:
            segment.played.set()

    def ahead(self) -> float:
        """Seconds of bot audio the caller has yet to hear: queued here, or sent and not
        played yet."""
        return max(0.0, self._playout_end - self._clock()) + self._queued_bytes / BYTES_PER_SECOND

    @property
    def speaking(self) -> bool:
        """True while bot audio is queued here or still playing at Twilio."""
        return bool(self._queue) or self._clock() < self._playout_end

    # -- sender task ----------------------------------------------------------------------

    async def run_sender(self) -> None:
        while True:
            if not self._queue or self._paused:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            ahead = self._playout_end - self._clock()
            if ahead > self._lead + WAKE_SLACK_S:
                await asyncio.sleep(ahead - self._lead)
                continue
            await self._send_next()
            # Top up to lead + refill while this wake-up lasts (see the module docstring).
            full = self._lead + self._refill
            while self._queue and not self._paused and self._playout_end - self._clock() < full:
                await self._send_next()

    async def _send_next(self) -> None:
        segment, audio = self._queue[0]
        if audio is None:
            self._queue.popleft()
            generation = segment.generation
            async with self._send_lock:
                if generation == self._generation and not self._paused:
                    await self._send_mark(self._mark_name(segment))
            return
        probe = segment.on_first_heard is not None and segment.first_sent_at is None
        chunk = self._take_audio(segment, FRAME_BYTES if probe else self._chunk_bytes)
        self._queued_bytes -= len(chunk)
        if self._queued_bytes <= self._max_buffered:
            self._space.set()
        generation = segment.generation  # a pause re-homes the segment: compare with this
        async with self._send_lock:
            if generation != self._generation or self._paused:
                return
            now = self._clock()
            start = max(now, self._playout_end)
            if segment.first_sent_at is None:
                segment.first_sent_at = now
                segment.play_start = start
            if self._on_first_media is not None:
                self._on_first_media(now)
                self._on_first_media = None
            self._playout_end = start + len(chunk) / BYTES_PER_SECOND
            self.far_end.played(start, chunk)
            await self._send_media(chunk)
            if probe:
                await self._send_mark(self._mark_name(segment) + "h")

    def _take_audio(self, segment: Segment, size: int) -> bytes:
        """Up to ``size`` bytes of ``segment``'s audio from the head of the queue, across the
        pieces it was written in (TTS chunks are often smaller than a message)."""
        parts: list[bytes] = []
        taken = 0
        while self._queue and taken < size:
            head, audio = self._queue[0]
            if head is not segment or audio is None:
                break
            part = audio[: size - taken]
            if len(part) < len(audio):
                self._queue[0] = (segment, audio[len(part) :])
            else:
                self._queue.popleft()
            parts.append(part)
            taken += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @staticmethod
    def _mark_name(segment: Segment) -> str:
        return f"g{segment.generation}:{segment.seq}"
