"""One stream's two-channel recording, assembled as the call goes: cheap hooks, no I/O.

Left is the caller, placed by Twilio's media timestamps (stream time). Right is the bot as the
caller heard it: each chunk sent to Twilio plays from when it is sent or when the audio queued
before it runs out (Twilio's playout, the same model as ``ivr.call.player``), and a ``clear``
discards everything not yet played at that moment, so an interrupted sentence stops where the
caller cut in. Stream time 0 on our clock is the earliest ``arrival - timestamp`` of any inbound
frame (the least delayed one), or when ``start`` arrived if that is earlier.

Both channels are kept as mu-law (8 kB/s each) up to ``max_seconds``; decoding and encoding
happen later, off the event loop (``render`` is meant for a worker thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ivr.audio.codec import SAMPLE_RATE, ULAW_SILENCE, ulaw_to_pcm16

PcmArray = npt.NDArray[np.int16]


@dataclass(slots=True)
class _BotChunk:
    play_at: float
    """When the caller starts hearing it, on the recorder's clock."""
    ulaw: bytearray

    @property
    def ends_at(self) -> float:
        return self.play_at + len(self.ulaw) / SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class RenderedCall:
    """The finished recording: PCM16 at 8 kHz, one column per channel (caller, bot)."""

    stereo: PcmArray
    truncated: bool
    """The call outlasted ``max_seconds``: what came after is not in the recording."""

    @property
    def seconds(self) -> float:
        return int(self.stereo.shape[0]) / SAMPLE_RATE


class CallRecorder:
    """Feed it from the stream: ``caller_audio`` per inbound frame, ``bot_audio`` per chunk
    sent, ``bot_cleared`` on ``clear``, ``stop`` when the stream ends. Never raises on input."""

    def __init__(
        self,
        call_sid: str,
        stream_sid: str,
        *,
        max_seconds: float,
        started_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.call_sid = call_sid
        self.stream_sid = stream_sid
        self._clock = clock
        self._max_bytes = int(max_seconds * SAMPLE_RATE)
        self._origin = clock() if started_at is None else started_at
        self._caller = bytearray()
        self._bot: list[_BotChunk] = []
        self._bot_bytes = 0
        self._bot_end = 0.0
        self._stopped = False
        self.truncated = False

    # -- hooks (event loop; each is a few list/bytearray operations) -----------------------

    def caller_audio(self, ulaw: bytes, stream_time: float) -> None:
        """One inbound payload and Twilio's timestamp for it (seconds since stream start)."""
        if self._stopped:
            return
        self._origin = min(self._origin, self._clock() - stream_time)
        at = max(0, round(stream_time * SAMPLE_RATE))
        if at + len(ulaw) > self._max_bytes:
            self.truncated = True
            return
        if at > len(self._caller):  # a gap (lost frames): silence where nothing arrived
            self._caller += ULAW_SILENCE * (at - len(self._caller))
        self._caller[at : at + len(ulaw)] = ulaw

    def bot_audio(self, ulaw: bytes) -> None:
        """A chunk of bot audio just sent to Twilio: it plays after what is queued there."""
        if self._stopped:
            return
        if self._bot_bytes + len(ulaw) > self._max_bytes:
            self.truncated = True
            return
        now = self._clock()
        play_at = max(now, self._bot_end)
        last = self._bot[-1] if self._bot else None
        if last is not None and abs(last.ends_at - play_at) < 1e-9:
            last.ulaw += ulaw  # back to back: one chunk per stretch of speech, not per send
        else:
            self._bot.append(_BotChunk(play_at, bytearray(ulaw)))
        self._bot_bytes += len(ulaw)
        self._bot_end = play_at + len(ulaw) / SAMPLE_RATE

    def bot_cleared(self) -> None:
        """Twilio is told to ``clear``: what it had not played yet is never heard."""
        self._cut(self._clock())

    def stop(self) -> None:
        """The stream is over: audio still queued at Twilio is never played."""
        if not self._stopped:
            self._cut(self._clock())
            self._stopped = True

    def _cut(self, at: float) -> None:
        while self._bot and self._bot[-1].ends_at > at:
            chunk = self._bot[-1]
            keep = max(0, round((at - chunk.play_at) * SAMPLE_RATE))
            self._bot_bytes -= len(chunk.ulaw) - keep
            if keep:
                del chunk.ulaw[keep:]
                break
            self._bot.pop()
        self._bot_end = min(self._bot_end, at)

    # -- after the call (worker thread) ----------------------------------------------------

    @property
    def empty(self) -> bool:
        return not self._caller and not self._bot

    def render(self) -> RenderedCall:
        """Both channels on one timeline, decoded to PCM16. CPU work: call it in a thread
        once ``stop`` has been called (nothing may feed the recorder meanwhile)."""
        placed = [(round((c.play_at - self._origin) * SAMPLE_RATE), c.ulaw) for c in self._bot]
        length = max([len(self._caller), *(max(0, at) + len(u) for at, u in placed)])
        length = min(length, self._max_bytes)
        bot = bytearray(ULAW_SILENCE * length)
        for at, ulaw in placed:
            skip = max(0, -at)  # sent before the earliest inbound frame said time 0 was
            piece = ulaw[skip : skip + max(0, length - max(0, at))]
            bot[max(0, at) : max(0, at) + len(piece)] = piece
        caller = bytes(self._caller[:length]) + ULAW_SILENCE * (length - len(self._caller))
        stereo = np.empty((length, 2), dtype=np.int16)
        stereo[:, 0] = np.frombuffer(ulaw_to_pcm16(caller), dtype="<i2")
        stereo[:, 1] = np.frombuffer(ulaw_to_pcm16(bytes(bot)), dtype="<i2")
        return RenderedCall(stereo, self.truncated)
