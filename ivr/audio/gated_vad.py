"""Silero's judgement at close to WebRTC's price: WebRTC wakes Silero only around possible speech.

Silero (neural) ignores the hiss and comfort noise that WebRTC's GMM hears as speech, but costs
~80 us a frame and ~11 MiB per model instance; a call spends most of its time listening to
silence. So a permissive WebRTC detector watches every frame, and only when it hears something
does a Silero instance wake, primed with the last ``history_ms`` of audio so the onset is not
lost. Silero decides until both have heard nothing for ``sleep_after_ms``; then the instance goes
back to a process-wide pool. Instances are reset on every wake, so any call can use any of them:
memory grows with the number of callers speaking at once, not with the number of calls.
"""

from __future__ import annotations

import threading
from collections import deque

from ivr.audio.vad import SileroVad, WebRtcVad


class SileroPool:
    """Idle Silero instances, shared by every call in the process."""

    def __init__(self, threshold: float = 0.5, max_idle: int = 64) -> None:
        self._threshold = threshold
        self._max_idle = max_idle
        self._idle: list[SileroVad] = []
        self._lock = threading.Lock()  # calls run on one loop, but tests and benches may not
        self.created = 0

    def acquire(self) -> SileroVad:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
        return SileroVad(threshold=self._threshold)

    def release(self, vad: SileroVad) -> None:
        vad.reset()
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(vad)


_POOLS: dict[float, SileroPool] = {}


def shared_pool(threshold: float) -> SileroPool:
    pool = _POOLS.get(threshold)
    if pool is None:
        pool = _POOLS[threshold] = SileroPool(threshold)
    return pool


class GatedSileroVad:
    """A ``VoiceActivityDetector`` (8 kHz, 20 ms frames): WebRTC gate, Silero decision."""

    def __init__(
        self,
        pool: SileroPool,
        *,
        gate_mode: int = 1,
        history_ms: int = 100,
        sleep_after_ms: int = 400,
    ) -> None:
        self._gate = WebRtcVad(mode=gate_mode)
        self._pool = pool
        self._history: deque[bytes] = deque(maxlen=max(1, history_ms // 20))
        self._sleep_after = max(1, sleep_after_ms // 20)
        self._quiet_frames = 0
        self._silero: SileroVad | None = None
        self.wakes = 0
        self.frames = 0
        self.awake_frames = 0
        """Frames Silero ran on: its share of ``frames`` is what this detector saves."""

    @property
    def sample_rate(self) -> int:
        return 8000

    @property
    def frame_ms(self) -> int:
        return 20

    @property
    def hangover_ms(self) -> int:
        return 100  # Silero's measured tail (SileroVad); the gate's own tail is shorter

    @property
    def awake(self) -> bool:
        return self._silero is not None

    def is_speech(self, frame: bytes) -> bool:
        self.frames += 1
        gate = self._gate.is_speech(frame)
        silero = self._silero
        if silero is None:
            if not gate:
                self._history.append(frame)
                return False
            silero = self._wake()
        self.awake_frames += 1
        speech = silero.is_speech(frame)
        self._quiet_frames = 0 if (speech or gate) else self._quiet_frames + 1
        if self._quiet_frames >= self._sleep_after:
            self.close()
        return speech

    def _wake(self) -> SileroVad:
        silero = self._silero = self._pool.acquire()
        self.wakes += 1
        self._quiet_frames = 0
        for past in self._history:  # prime the model's state with the onset
            silero.is_speech(past)
        self._history.clear()
        return silero

    def close(self) -> None:
        """Hand the Silero instance back (also called when the call ends)."""
        if self._silero is not None:
            self._pool.release(self._silero)
            self._silero = None
            self._quiet_frames = 0
