"""Twilio's outbound side of one bidirectional Media Stream: validate, queue, play, mark, clear.

What the gateway sends is checked as strictly as Twilio does (exact fields, right ``streamSid``)
and queued; playout runs at 8000 bytes/s by the clock, not by arrival: from the moment audio
arrives on an idle queue or, with ``frame_clock``, from the next tick of the 20 ms frame clock
Twilio plays on (audio arriving mid-frame waits for it). Every played byte is kept on a
sample-indexed timeline, so the call's audio can be saved and the first played sample of each
bot turn measured.

The mu-law codec here is a separate numpy G.711 implementation on purpose: the gateway uses
``audioop``, and a test peer sharing its codec would share its bugs.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
import wave
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

SAMPLE_RATE = 8000
FRAME_BYTES = 160
"""20 ms of mu-law at 8 kHz: what Twilio sends, and the granularity we expect back."""
ULAW_SILENCE = 0xFF

_BIAS = 0x84
_CLIP = 32635


def ulaw_encode(pcm16: bytes) -> bytes:
    """Little-endian signed 16-bit PCM -> G.711 mu-law bytes."""
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.int32)
    sign = (x < 0).astype(np.int32) << 7
    mag = np.minimum(np.abs(x), _CLIP) + _BIAS
    exponent = np.floor(np.log2(mag)).astype(np.int32) - 7
    mantissa = (mag >> (exponent + 3)) & 0x0F
    coded = ~(sign | (exponent << 4) | mantissa) & 0xFF
    return bytes(coded.astype(np.uint8).tobytes())


def ulaw_decode(ulaw: bytes) -> bytes:
    """G.711 mu-law bytes -> little-endian signed 16-bit PCM."""
    u = ~np.frombuffer(ulaw, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    mag = (((u & 0x0F) << 3) + _BIAS) << exponent
    x = np.where(u & 0x80, _BIAS - mag, mag - _BIAS)
    return x.astype("<i2").tobytes()


@dataclass(frozen=True, slots=True)
class LinkDelay:
    """The network between the gateway and Twilio's media server: each outbound message
    arrives ``base_s`` plus up to ``jitter_s`` (uniform, seeded) after the caller's side got
    it, never before the one sent ahead of it (one TCP stream)."""

    base_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.base_s <= 1.0 and 0.0 <= self.jitter_s <= 1.0):
            raise ValueError(
                f"LinkDelay needs 0 <= base_s, jitter_s <= 1 s, got {self.base_s}, {self.jitter_s}"
            )

    def arrivals(self) -> Callable[[float], float]:
        """For one stream: received time -> the time Twilio acts on the message."""
        rng = np.random.default_rng(self.seed)
        last = -math.inf

        def arrive(received: float) -> float:
            nonlocal last
            last = max(last, received + self.base_s + float(rng.uniform(0.0, self.jitter_s)))
            return last

        return arrive


@dataclass(frozen=True, slots=True)
class Violation:
    """An outbound message Twilio would reject (31950/31951) or we flag (``frame-size``)."""

    t: float
    code: str
    reason: str
    excerpt: str


@dataclass(frozen=True, slots=True)
class Segment:
    """Bot audio placed on the timeline: ``audio`` plays from sample ``start``."""

    arrived_t: float
    start: int
    audio: bytes

    @property
    def end(self) -> int:
        return self.start + len(self.audio)


@dataclass(frozen=True, slots=True)
class MarkEcho:
    name: str
    received_t: float
    echo_t: float
    cleared: bool
    """True when the echo came from a ``clear``, not from the audio finishing."""


@dataclass(slots=True)
class _PendingMark:
    name: str
    received_t: float
    due: int
    cleared: bool = False


class TwilioPlayout:
    """The outbound buffer of one stream. Times are seconds on ``clock``; ``t0`` is sample 0.

    ``frame_clock``: audio that finds the queue idle starts at the next 20 ms tick (ticks at
    ``tick_phase + k * 160`` samples), as Twilio's media server plays it; otherwise at its
    exact arrival sample.
    """

    def __init__(
        self,
        stream_sid: str,
        *,
        t0: float,
        clock: Callable[[], float] = time.monotonic,
        frame_clock: bool = False,
        tick_phase: int = 0,
    ) -> None:
        if not 0 <= tick_phase < FRAME_BYTES:
            raise ValueError(f"tick_phase must be within 0..{FRAME_BYTES - 1}, got {tick_phase}")
        self.stream_sid = stream_sid
        self.t0 = t0
        self._clock = clock
        self._frame_clock = frame_clock
        self._tick_phase = tick_phase
        self.segments: list[Segment] = []
        self.violations: list[Violation] = []
        self.clears: list[float] = []
        self.echoes: list[MarkEcho] = []
        self._marks: list[_PendingMark] = []
        self._end = 0  # sample where queued audio runs out
        self._closed = False

    # -- input ---------------------------------------------------------------------------------

    def receive(self, frame: str | bytes, now: float | None = None) -> None:
        """Apply one WebSocket message from the gateway (invalid ones are counted and ignored)."""
        now = self._clock() if now is None else now
        if self._closed:
            return
        if isinstance(frame, bytes):
            self._violate(now, "31950", "binary frame (Twilio accepts JSON text only)", frame)
            return
        msg = self._parse(frame, now)
        if msg is None:
            return
        event = msg["event"]
        if event == "media":
            self._media(msg["media"]["payload"], frame, now)
        elif event == "mark":
            self._mark(msg["mark"]["name"], now)
        else:
            self._clear(now)

    def close(self, now: float | None = None) -> None:
        """The stream ended: audio still queued is never played and marks never echo."""
        now = self._clock() if now is None else now
        self._truncate(self._sample(now))
        self._marks.clear()
        self._closed = True

    # -- mark echoes ---------------------------------------------------------------------------

    def next_mark_time(self) -> float | None:
        """When the oldest pending mark is due to be echoed, or None."""
        if not self._marks:
            return None
        return self.t0 + self._marks[0].due / SAMPLE_RATE

    def due_marks(self, now: float | None = None) -> list[MarkEcho]:
        """Pop the marks whose audio has finished playing (or was cleared), oldest first."""
        now = self._clock() if now is None else now
        cut = self._sample(now)
        due: list[MarkEcho] = []
        while self._marks and self._marks[0].due <= cut:
            m = self._marks.pop(0)
            due.append(MarkEcho(m.name, m.received_t, now, m.cleared))
        self.echoes.extend(due)
        return due

    # -- queries -------------------------------------------------------------------------------

    def queued_until(self) -> float:
        """Time at which everything queued so far will have played."""
        return self.t0 + self._end / SAMPLE_RATE

    def last_played_t(self, now: float) -> float | None:
        """End of the latest bot audio played by ``now`` (``now`` itself while playing)."""
        if not self.segments or self.segments[0].start >= self._sample(now):
            return None
        return min(now, self.queued_until())

    def played_audio(self, start: int, n: int) -> bytes:
        """Mu-law of what played in samples ``[start, start + n)`` (silence where nothing did):
        what a speakerphone or a hybrid would feed back into the caller's line."""
        out = bytearray([ULAW_SILENCE]) * n
        end = start + n
        for seg in reversed(self.segments):  # sorted by start; the recent ones matter
            if seg.end <= start:
                break
            lo, hi = max(seg.start, start), min(seg.end, end)
            if lo < hi:
                out[lo - start : hi - start] = seg.audio[lo - seg.start : hi - seg.start]
        return bytes(out)

    def render(self, n_samples: int) -> bytes:
        """Played audio as mu-law from sample 0, silence where nothing played."""
        return render_track(self.segments, n_samples)

    def save_wav(self, path: str | Path, n_samples: int) -> None:
        write_wav(path, [ulaw_decode(self.render(n_samples))])

    # -- internals -----------------------------------------------------------------------------

    def _sample(self, t: float) -> int:
        return max(0, round((t - self.t0) * SAMPLE_RATE))

    def _play_from(self, now: float) -> int:
        """Sample where audio arriving at ``now`` starts playing."""
        if not self._frame_clock:
            return max(self._sample(now), self._end)
        exact = max(0.0, (now - self.t0) * SAMPLE_RATE) - self._tick_phase
        tick = self._tick_phase + math.ceil(round(exact, 6) / FRAME_BYTES) * FRAME_BYTES
        return max(tick, self._end)

    def _violate(self, now: float, code: str, reason: str, frame: str | bytes) -> None:
        text = frame if isinstance(frame, str) else repr(frame)
        self.violations.append(Violation(now, code, reason, text[:160]))

    def _parse(self, frame: str, now: float) -> dict[str, Any] | None:
        try:
            msg = json.loads(frame)
        except ValueError:
            self._violate(now, "31951", "not JSON", frame)
            return None
        problem = _shape_problem(msg, self.stream_sid)
        if problem:
            self._violate(now, "31951", problem, frame)
            return None
        assert isinstance(msg, dict)
        return msg

    def _media(self, payload: object, frame: str, now: float) -> None:
        assert isinstance(payload, str)
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            self._violate(now, "31951", "media.payload is not valid base64", frame)
            return
        if not audio:
            self._violate(now, "31951", "media.payload is empty", frame)
            return
        if len(audio) % FRAME_BYTES:
            # Twilio plays it anyway; flagged because partial frames are a known stutter cause.
            reason = f"payload of {len(audio)} bytes is not a multiple of {FRAME_BYTES} (20 ms)"
            self._violate(now, "frame-size", reason, frame)
        start = self._play_from(now)
        self.segments.append(Segment(now, start, audio))
        self._end = start + len(audio)

    def _mark(self, name: object, now: float) -> None:
        assert isinstance(name, str)
        self._marks.append(_PendingMark(name, now, max(self._sample(now), self._end)))

    def _clear(self, now: float) -> None:
        cut = self._sample(now)
        self.clears.append(now)
        self._truncate(cut)
        for m in self._marks:
            m.due, m.cleared = cut, True

    def _truncate(self, cut: int) -> None:
        kept: list[Segment] = []
        for seg in self.segments:
            if seg.start >= cut:
                continue
            if seg.end > cut:
                seg = Segment(seg.arrived_t, seg.start, seg.audio[: cut - seg.start])
            kept.append(seg)
        self.segments = kept
        self._end = min(self._end, cut)


_SHAPES: dict[str, dict[str, set[str]]] = {
    "media": {"media": {"payload"}},
    "mark": {"mark": {"name"}},
    "clear": {},
}


def _shape_problem(msg: object, stream_sid: str) -> str:
    """Why Twilio would reject this outbound message ("" if it is fine)."""
    if not isinstance(msg, dict):
        return "message is not a JSON object"
    event = msg.get("event")
    if event not in _SHAPES:
        return f"event {event!r} is not one of media, mark, clear"
    body = _SHAPES[event]
    expected = {"event", "streamSid", *body}
    if set(msg) != expected:
        return f"{event}: fields {sorted(msg)} != {sorted(expected)}"
    if msg["streamSid"] != stream_sid:
        return f"streamSid {msg['streamSid']!r} is not this stream's {stream_sid!r}"
    for key, fields in body.items():
        inner = msg[key]
        if not isinstance(inner, dict) or set(inner) != fields:
            return f"{event}.{key} must be an object with exactly {sorted(fields)}"
        if not all(isinstance(inner[f], str) for f in inner):
            return f"{event}.{key} values must be strings"
    return ""


def render_track(segments: Sequence[Segment], n_samples: int) -> bytes:
    """Overlay segments on mu-law silence of ``n_samples`` (later ones win on overlap)."""
    out = bytearray([ULAW_SILENCE]) * n_samples
    for seg in segments:
        if seg.start >= n_samples:
            continue
        chunk = seg.audio[: n_samples - seg.start]
        out[seg.start : seg.start + len(chunk)] = chunk
    return bytes(out)


def write_wav(path: str | Path, channels_pcm16: Sequence[bytes]) -> None:
    """Write equal-length PCM16 channels as one 8 kHz WAV (interleaved)."""
    arrays: list[npt.NDArray[np.int16]] = [np.frombuffer(c, dtype="<i2") for c in channels_pcm16]
    frames = np.stack(arrays, axis=1).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(len(arrays))
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(frames)
