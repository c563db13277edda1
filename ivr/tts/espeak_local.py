"""Offline formant TTS: the libespeak-ng bundled in espeakng-loader, called through ctypes.

Robotic but nearly free (about 1 ms to first audio), so tests and the simulated caller use it.
libespeak-ng keeps global state and is not thread-safe: one process-wide instance behind a lock.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from ivr.errors import ProviderError
from ivr.providers.resilience import first_within

_NAME = "espeak_local"
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_BUFFER_MS = 200
_PARAM_RATE = 1
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_EE_OK = 0

# int callback(short *wav, int numsamples, espeak_EVENT *events); non-zero aborts synthesis.
_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class _Espeak:
    """The one libespeak-ng in this process; every method must be called under ``lock``."""

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise ProviderError(_NAME, f"missing package ({exc}); install ivr[local]") from exc
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        # The library appends "/espeak-ng-data" to the path it is given.
        parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, _BUFFER_MS, parent, 0)
        if rate <= 0:
            raise ProviderError(_NAME, f"espeak_Initialize failed with data under {parent!r}")
        self.lib = lib
        self.sample_rate = int(rate)
        self.lock = threading.Lock()
        self._chunks: list[bytes] = []
        # Keep a reference: ctypes frees the trampoline if the Python object dies.
        self._callback = _SynthCallback(self._collect)
        lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav: ctypes._Pointer[ctypes.c_short], count: int, _events: int) -> int:
        if wav and count > 0:
            self._chunks.append(ctypes.string_at(wav, count * 2))
        return 0

    def synth(self, text: str, voice: str, rate_wpm: int) -> bytes:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
            raise ProviderError(_NAME, f"unknown espeak voice {voice!r}")
        self.lib.espeak_SetParameter(_PARAM_RATE, rate_wpm, 0)
        data = text.encode()
        self._chunks = []
        err = self.lib.espeak_Synth(
            data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None
        )
        if err != _EE_OK:
            raise ProviderError(_NAME, f"espeak_Synth returned error {err}")
        pcm = b"".join(self._chunks)
        self._chunks = []
        return pcm


_instance: _Espeak | None = None
_instance_lock = threading.Lock()


def _espeak() -> _Espeak:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = _Espeak()
        return _instance


def synthesize_pcm16(text: str, *, voice: str = "en-us", rate_wpm: int = 140) -> tuple[bytes, int]:
    """Speak ``text`` synchronously; returns (mono PCM16 little-endian, sample rate).

    140 wpm rather than espeak's 175: whisper hears it through a phone line far more reliably.
    """
    engine = _espeak()
    with engine.lock:
        return engine.synth(text, voice, rate_wpm), engine.sample_rate


class LocalEspeakTts:
    """``TextToSpeech`` backed by espeak-ng: the whole text in one chunk (it takes milliseconds)."""

    name = _NAME

    def __init__(self, *, voice: str = "en-us", rate_wpm: int = 140) -> None:
        if not 80 <= rate_wpm <= 450:
            raise ValueError(f"rate_wpm must be within 80..450, got {rate_wpm}")
        self.voice = voice
        self.first_piece_words: int | None = None  # its first audio takes a few ms
        self._rate_wpm = rate_wpm
        self.sample_rate = 22050  # replaced by the library's own rate in warm()

    async def warm(self) -> None:
        engine = await asyncio.to_thread(_espeak)
        self.sample_rate = engine.sample_rate

    def synthesize(
        self, text: str, *, first_output_limit: float | None = None
    ) -> AsyncIterator[bytes]:
        """The whole text in one chunk, within ``first_output_limit`` when given."""
        return first_within(_NAME, first_output_limit, self._synthesize(text))

    async def _synthesize(self, text: str) -> AsyncIterator[bytes]:
        if not text.strip():
            return
        pcm, rate = await asyncio.to_thread(
            synthesize_pcm16, text, voice=self.voice, rate_wpm=self._rate_wpm
        )
        self.sample_rate = rate
        if pcm:
            yield pcm

    async def aclose(self) -> None:
        """Nothing to release: the library instance is shared by the whole process."""
