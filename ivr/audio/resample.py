"""Sample-rate conversion for PCM16 (little-endian, mono) audio.

Three tools for three jobs (see engines.md section 5 for the measurements behind them):

- ``resample``: whole-buffer soxr HQ. For a finished utterance (8 kHz -> STT rate) or a whole
  TTS sentence. Clean (images/aliases below -90 dB) and adds no delay.
- ``StreamResampler``: soxr HQ in streaming mode, for outbound TTS audio arriving in chunks.
  It holds back tens of ms until ``flush()``, which is fine at sentence granularity.
- ``LowDelayUpsampler``: 8 kHz -> 16 kHz half-band FIR with 2.4 ms delay, for the inbound path
  where every held-back ms lands on end-of-turn latency.

``audioop.ratecv`` is deliberately not used: it is an unfiltered linear interpolator whose images
and aliases sit only 6-10 dB below the signal.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
import soxr

_I16_MIN: Final = -32768
_I16_MAX: Final = 32767


def _as_int16(pcm16: bytes, what: str) -> npt.NDArray[np.int16]:
    if len(pcm16) % 2:
        raise ValueError(f"{what}: PCM16 buffer has an odd length ({len(pcm16)} bytes)")
    return np.frombuffer(pcm16, dtype="<i2")


def _check_rates(src_rate: int, dst_rate: int) -> None:
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")


def _to_pcm16(x: npt.NDArray[np.floating] | npt.NDArray[np.int16]) -> bytes:
    if x.dtype != np.int16:
        x = np.clip(np.rint(x), _I16_MIN, _I16_MAX).astype("<i2")
    return x.astype("<i2", copy=False).tobytes()


def resample(pcm16: bytes, src_rate: int, dst_rate: int) -> bytes:
    """Resample a whole buffer with soxr HQ; output is delay-compensated and time-aligned."""
    _check_rates(src_rate, dst_rate)
    x = _as_int16(pcm16, "resample")
    if src_rate == dst_rate or x.size == 0:
        return pcm16 if src_rate == dst_rate else b""
    # float in, our own rounding out: soxr's int16 output path adds random dither.
    y = soxr.resample(x.astype(np.float32), src_rate, dst_rate, quality="HQ")
    return _to_pcm16(y)


class StreamResampler:
    """Stateful soxr HQ resampler for audio that arrives in chunks (outbound TTS).

    ``push`` returns whatever soxr has ready (it holds back a few tens of ms);
    ``flush`` drains the rest at the end of an utterance and resets for the next one.
    A trailing odd byte is carried to the next ``push``.
    """

    __slots__ = ("_carry", "_dst_rate", "_src_rate", "_stream")

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        _check_rates(src_rate, dst_rate)
        self._src_rate = src_rate
        self._dst_rate = dst_rate
        self._carry = b""
        # Made at the first audio: a soxr HQ stream designs its filter when made (~30 us), and
        # a reply's resampler is flushed once, at its sentence's end, and never used again.
        self._stream: soxr.ResampleStream | None = None

    def push(self, pcm16: bytes) -> bytes:
        data = self._carry + pcm16 if self._carry else pcm16
        whole = len(data) & ~1
        self._carry = data[whole:]
        if self._src_rate == self._dst_rate:
            return data[:whole]
        if whole == 0:
            return b""
        if self._stream is None:
            self._stream = soxr.ResampleStream(
                self._src_rate, self._dst_rate, 1, dtype="float32", quality="HQ"
            )
        x = np.frombuffer(data, dtype="<i2", count=whole // 2).astype(np.float32)
        return _to_pcm16(self._stream.resample_chunk(x))

    def flush(self) -> bytes:
        """Return the held-back tail and reset; a dangling half sample is dropped."""
        self._carry = b""
        stream, self._stream = self._stream, None
        if stream is None:
            return b""
        return _to_pcm16(stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))


def _halfband_taps(num_taps: int, beta: float) -> npt.NDArray[np.float64]:
    # Kaiser-windowed sinc with cutoff at fs/4 of the 16 kHz output: every other tap is zero,
    # so one polyphase branch is a pure delay.
    n = np.arange(num_taps) - (num_taps - 1) / 2
    taps: npt.NDArray[np.float64] = np.sinc(n / 2) * np.kaiser(num_taps, beta)
    return taps


class LowDelayUpsampler:
    """8 kHz -> 16 kHz for streaming use: 79-tap linear-phase half-band FIR, polyphase.

    Delay is (79 - 1) / 2 = 39 output samples = 2.44 ms. Passband flat within 0.001 dB up to
    3.4 kHz; images above 4.6 kHz are attenuated by more than 84 dB.
    """

    SRC_RATE: Final = 8000
    DST_RATE: Final = 16000
    NUM_TAPS: Final = 79  # 4k+3 so the centre tap lands in the delay-only branch
    DELAY_SAMPLES: Final = (NUM_TAPS - 1) // 2  # at 16 kHz

    __slots__ = ("_carry", "_hist", "_odd_branch_offset", "_taps_even")

    def __init__(self) -> None:
        taps = _halfband_taps(self.NUM_TAPS, beta=9.0)
        self._taps_even = taps[0::2].copy()  # 40 taps -> even output samples
        # Odd output samples: only the centre tap (value 1) is non-zero -> x[n - 19].
        self._hist = np.zeros(self._taps_even.size - 1, dtype=np.float64)
        self._odd_branch_offset = self._hist.size - (self.NUM_TAPS - 1) // 4
        self._carry = b""

    @property
    def delay_ms(self) -> float:
        return 1000 * self.DELAY_SAMPLES / self.DST_RATE

    def push(self, pcm16: bytes) -> bytes:
        """Upsample a chunk (normally one 20 ms frame); returns exactly twice as many samples."""
        data = self._carry + pcm16 if self._carry else pcm16
        whole = len(data) & ~1
        self._carry = data[whole:]
        if whole == 0:
            return b""
        x = np.frombuffer(data, dtype="<i2", count=whole // 2)
        ext = np.concatenate((self._hist, x))
        out = np.empty(2 * x.size, dtype=np.float64)
        out[0::2] = np.convolve(ext, self._taps_even, mode="valid")
        start = self._odd_branch_offset
        out[1::2] = ext[start : start + x.size]
        self._hist = ext[-self._hist.size :]
        return _to_pcm16(out)

    def flush(self) -> bytes:
        """Drain the filter's delay line (zeros in) and reset for the next stream."""
        tail_in = (self._hist.size + 1) // 2  # input samples covering the 39-sample delay
        tail = self.push(bytes(2 * tail_in))
        self.reset()
        return tail[: 2 * self.DELAY_SAMPLES]

    def reset(self) -> None:
        self._hist[:] = 0.0
        self._carry = b""
