"""Is the caller's sound their own, or the bot's voice coming back down the line?

A speakerphone or a 2-wire hybrid feeds what the caller hears back into what they send,
typically 10-30 dB down and 50-300 ms late. A VAD calls that echo speech, so without a check
the bot interrupts itself. The check here correlates the caller's last ~200 ms with what the
bot played over the preceding ``max_delay`` seconds (the ``FarEndReference`` the player fills
as it sends): echo is a delayed, scaled copy of that audio, so the normalised correlation peaks
near 1; the caller's own speech does not correlate with the bot's at all. With both at once
(double talk) the peak is ``1 / sqrt(1 + near/echo energy)``: 0.3 when the caller is 10 dB
above their echo, so a threshold of 0.5 keeps anyone louder than ~2 dB over the echo.

Levels (per 20 ms frame) are kept too: ``audible`` says whether any bot audio played within
the echo window, the only time the check is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ivr.audio.far_end import FRAME, RATE, SILENT_DB, FarEndReference
from ivr.audio.levels import level_db


@dataclass(frozen=True, slots=True)
class EchoCheck:
    correlation: float
    """Peak normalised cross-correlation with the far end over the delay range (0..1), of
    both whitened: what says echo or not."""
    delay_s: float
    near_db: float
    far_db: float
    raw_correlation: float = 0.0
    """The same of both as they are: line noise, which whitening lifts into the band a voice
    is quiet in, costs it little, but unrelated voices reach 0.7 now and then (their pitch),
    so it only teaches the echo path (``EchoPath``), never decides alone."""
    raw_delay_s: float = 0.0

    def is_echo(self, threshold: float) -> bool:
        return self.correlation >= threshold


def check_echo(
    near: npt.NDArray[np.float64],
    near_end: float,
    reference: FarEndReference,
    *,
    min_delay: float = 0.0,
    max_delay: float = 0.6,
) -> EchoCheck:
    """Correlate ``near`` (caller audio ending at ``near_end`` on the playout clock) with the
    far end played ``min_delay`` to ``max_delay`` earlier: one FFT over the delay range (the
    whole 0.6 s: ~0.5 ms; +-20 ms around a delay already found: ~0.1 ms), then each
    ``PIECE_S`` of ``near`` on its own within ``PIECE_SLACK_S`` of that delay.

    The pieces are why the copy need not be exact: Twilio plays on a 20 ms frame clock, so
    audio that reaches an idle queue (a TTS slower than real time, the start of a reply) starts
    at the next frame, up to 20 ms later than we placed it. The echo is then piecewise shifted
    against the reference, and whitened speech decorrelates within a sample or two: the whole
    window scored 0.25-0.55 on such an echo, its pieces ~0.85."""
    n = near.size
    lo = near_end - n / RATE - max_delay
    far = reference.samples(lo - 1 / RATE, near_end - min_delay)
    near_db, far_db = level_db(near), level_db(far)
    if n < FRAME or far.size <= n or far_db < SILENT_DB or near_db <= -120.0:
        return EchoCheck(0.0, 0.0, near_db, far_db)
    # Pre-emphasis (first difference) on both: speech is dominated by low frequencies and a
    # voice's pitch, which make two unrelated voices correlate by chance at some delay;
    # whitened, only a real copy lines up (a caller alone: <= 0.25 at the 95th percentile).
    raw = _normalised_correlation(near - near.mean(), far[1:])
    k_raw = int(np.argmax(raw))
    far = np.diff(far)
    x = np.diff(near, prepend=near[0])
    x = x - x.mean()
    whole = _normalised_correlation(x, far)
    k = int(np.argmax(whole))
    pieced = _pieced_correlation(x, far, k)
    return EchoCheck(
        max(float(whole[k]), pieced),
        max_delay - k / RATE,  # lag 0: the far window that starts max_delay early
        near_db,
        far_db,
        float(raw[k_raw]),
        max_delay - k_raw / RATE,
    )


PIECE_S = 0.08
"""Pieces of the caller's window correlated on their own (see ``check_echo``)."""
PIECE_SLACK_S = 0.025
"""How far each piece's delay may stray from the whole window's."""


def _normalised_correlation(
    x: npt.NDArray[np.float64], far: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """|corr| of ``x`` with each window of ``far`` of its length, normalised by both energies
    (windows of near silence on the far end score 0: their ratio means nothing)."""
    n = x.size
    size = 1 << (far.size + n).bit_length()
    # corr[k] = sum_i x[i] * far[k + i]: x aligned with the far end starting at sample k.
    corr = np.fft.irfft(np.fft.rfft(far, size) * np.conj(np.fft.rfft(x, size)), size)
    lags = far.size - n + 1
    csum = np.concatenate([[0.0], np.cumsum(far * far)])
    window_energy = csum[n : n + lags] - csum[:lags]
    denominator = np.sqrt(np.maximum(window_energy, 1e-9) * float(np.dot(x, x)))
    ncc: npt.NDArray[np.float64] = np.abs(corr[:lags]) / denominator
    ncc[window_energy < n * _QUIET_WINDOW_POWER] = 0.0
    return ncc


_QUIET_WINDOW_POWER = (32768 * 10 ** ((SILENT_DB - 10) / 20)) ** 2


def _pieced_correlation(x: npt.NDArray[np.float64], far: npt.NDArray[np.float64], k: int) -> float:
    """Each ``PIECE_S`` of ``x`` at its own best lag near ``k``, weighted by its energy."""
    piece, slack = round(PIECE_S * RATE), round(PIECE_SLACK_S * RATE)
    total = weight = 0.0
    for start in range(0, x.size - piece + 1, piece):
        part = x[start : start + piece]
        energy = float(np.dot(part, part))
        lo, hi = max(0, k + start - slack), min(far.size, k + start + piece + slack)
        if energy <= 0.0 or hi - lo < piece:
            continue
        total += energy * float(np.max(_normalised_correlation(part, far[lo:hi])))
        weight += energy
    return total / weight if weight else 0.0


@dataclass(slots=True)
class EchoPath:
    """This call's echo path, once heard for sure: how late and how much quieter the bot's
    voice comes back. Then caller sound no louder than that echo would be is the echo, however
    poorly it correlates (a jittery line, a clipped speakerphone); a caller talking over it is
    louder than their own echo by more than ``MARGIN_DB``."""

    CONFIDENT = 0.75
    """A check this sure is an observation of the path."""
    RAW_CONFIDENT = 0.75
    AGREEING = 3
    """Observations within ``AGREE_S`` of each other's delay before the path is trusted: one
    sure match can be a fluke (a caller's vowel that happens to match one of the bot's)."""
    AGREE_S = 0.015
    KEPT = 8
    MIN_LOSS_DB = 3.0
    """A line returns the bot quieter than it played; a "path" that does not is no echo."""
    MARGIN_DB = 6.0
    """Caller sound up to this much above the echo's predicted level is still the echo."""
    SLACK_S = 0.03
    """Jitter allowed around the learned delay when predicting the echo's level."""

    delay_s: float | None = None
    return_loss_db: float | None = None
    _seen: list[tuple[float, float]] = field(default_factory=list)
    """(delay, loss) of the last sure checks."""

    def sure_delay(self, check: EchoCheck) -> float | None:
        """The delay ``check`` is sure of, if any: its whitened match, or its raw one (which
        noise spares) at ``RAW_CONFIDENT``; one of many that must agree (``observe``)."""
        if check.correlation >= self.CONFIDENT:
            return check.delay_s
        if check.raw_correlation >= self.RAW_CONFIDENT:
            return check.raw_delay_s
        return None

    def learn(self, check: EchoCheck, n: int, near_end: float, reference: FarEndReference) -> None:
        """``check`` of the ``n`` samples ending at ``near_end``: if sure, an observation."""
        delay = self.sure_delay(check)
        if delay is not None:
            self.observe(delay, check.near_db, self.far_level_at(delay, n, near_end, reference))

    def observe(self, delay_s: float, near_db: float, far_at_delay_db: float) -> None:
        """A sure check: an observation. Once ``AGREEING`` of the last few agree on the delay,
        the path is theirs (the median loss, so a clipped moment moves it little)."""
        if far_at_delay_db <= SILENT_DB:
            return
        self._seen = [*self._seen[-(self.KEPT - 1) :], (delay_s, far_at_delay_db - near_db)]
        delay = float(np.median([d for d, _ in self._seen]))
        agreeing = [loss for d, loss in self._seen if abs(d - delay) <= self.AGREE_S]
        if len(agreeing) >= self.AGREEING and np.median(agreeing) >= self.MIN_LOSS_DB:
            self.delay_s, self.return_loss_db = delay, float(np.median(agreeing))

    def explains(
        self,
        near: npt.NDArray[np.float64],
        near_end: float,
        reference: FarEndReference,
        noise_power: float = 0.0,
    ) -> bool:
        """``near`` is no louder than the echo of what played ``delay_s`` before it, over the
        line's own noise (``noise_power``: its mean square when nobody talks)."""
        if self.delay_s is None or self.return_loss_db is None:
            return False
        n = near.size
        end = near_end - self.delay_s
        far = reference.samples(end - n / RATE - self.SLACK_S, end + self.SLACK_S)
        echo = _power(_loudest_window_db(far, n) - self.return_loss_db)
        predicted_db = 10 * math.log10((echo + noise_power) / _FULL_SCALE + 1e-12)
        return level_db(near) <= predicted_db + self.MARGIN_DB

    @staticmethod
    def far_level_at(delay_s: float, n: int, near_end: float, reference: FarEndReference) -> float:
        """The far end's level over the ``n`` samples that played ``delay_s`` before the window
        ending at ``near_end``."""
        end = near_end - delay_s
        return level_db(reference.samples(end - n / RATE, end))


_FULL_SCALE = 32768.0 * 32768.0


def _power(db: float) -> float:
    """Mean square (int16 scale) of a ``db`` dBFS level."""
    return _FULL_SCALE * 10 ** (db / 10)


def _loudest_window_db(x: npt.NDArray[np.float64], n: int) -> float:
    """Level of the loudest ``n``-sample window of ``x`` (in steps of 10 ms)."""
    if x.size <= n:
        return level_db(x)
    csum = np.concatenate([[0.0], np.cumsum(x * x)])
    step = RATE // 100
    starts = np.arange(0, x.size - n + 1, step)
    power = float(np.max(csum[starts + n] - csum[starts])) / n
    return 10 * math.log10(power / (32768.0 * 32768.0)) if power > 0 else -120.0
