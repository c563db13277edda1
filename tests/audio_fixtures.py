"""Real speech for audio tests: espeak-ng (bundled by espeakng-loader) through the phone channel.

webrtcvad does not reliably accept synthetic "speech-like" signals, so tests use synthesized
speech: espeak-ng at 22.05 kHz -> soxr to 8 kHz -> mu-law round trip -> PCM16 8 kHz.
Synthesis runs in a child process (espeak-ng keeps global state) and is cached on disk under
tests/.cache, so only the first run pays for it.

Run as a script (``python tests/audio_fixtures.py TEXT OUT.raw``) it writes 22.05 kHz PCM16.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

CACHE_DIR = Path(__file__).parent / ".cache"
_VERSION = "espeak-1"  # bump to invalidate cached clips when the recipe changes
RATE = 8000


def speech_pcm16(text: str, *, wpm: int = 160) -> bytes:
    """``text`` spoken by espeak-ng en-us, as 8 kHz PCM16 after a mu-law round trip."""
    key = hashlib.sha256(f"{_VERSION}|{wpm}|{text}".encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{key}.pcm8k"
    if not path.exists():
        CACHE_DIR.mkdir(exist_ok=True)
        (CACHE_DIR / ".gitignore").write_text("*\n")
        path.write_bytes(_phone_channel(_synthesize_in_child(text, wpm)))
    return path.read_bytes()


def active_span(pcm16: bytes, threshold_db: float = -35.0) -> tuple[float, float]:
    """Seconds (start, end) where 10 ms energy is within ``threshold_db`` of the peak."""
    x = np.frombuffer(pcm16, dtype="<i2").astype(np.float64)
    hop = RATE // 100
    n = x.size // hop
    energy = (x[: n * hop].reshape(n, hop) ** 2).mean(axis=1)
    loud = np.nonzero(energy > energy.max() * 10 ** (threshold_db / 10))[0]
    return loud[0] * hop / RATE, (loud[-1] + 1) * hop / RATE


def noise_pcm16(seconds: float, dbfs: float = -50.0, seed: int = 0, color: str = "brown") -> bytes:
    """Noise at ``dbfs`` RMS through the mu-law round trip.

    "brown" (1/f^2, most energy at low frequencies) is like line and room noise; "white" is
    the hard case for WebRTC VAD, which keeps calling it speech for seconds after speech.
    """
    rng = np.random.default_rng(seed)
    n = round(RATE * seconds)
    x = rng.standard_normal(n)
    if color == "brown":
        spectrum = np.fft.rfft(x)
        f = np.fft.rfftfreq(n, 1 / RATE)
        spectrum[1:] /= f[1:]  # 1/f amplitude = 1/f^2 power
        spectrum[0] = 0
        x = np.fft.irfft(spectrum, n)
    elif color != "white":
        raise ValueError(f"unknown noise color {color!r}")
    x *= 32768 * 10 ** (dbfs / 20) / np.sqrt(np.mean(x**2))
    return _phone_channel_pcm(x)


def trimmed(pcm16: bytes) -> bytes:
    """Just the active span of a clip (see ``active_span``)."""
    start, end = active_span(pcm16)
    return pcm16[2 * round(start * RATE) : 2 * round(end * RATE)]


def mix_timeline(parts: list[bytes]) -> bytes:
    """Concatenate clips; each must hold whole samples."""
    assert all(len(p) % 2 == 0 for p in parts)
    return b"".join(parts)


def frames(pcm16: bytes, frame_bytes: int = 320) -> list[tuple[bytes, float]]:
    """Split into whole frames with their start times (a trailing partial frame is dropped)."""
    n = len(pcm16) // frame_bytes
    step = frame_bytes / 2 / RATE
    return [(pcm16[i * frame_bytes : (i + 1) * frame_bytes], i * step) for i in range(n)]


def _phone_channel_pcm(x: npt.NDArray[np.float64]) -> bytes:
    from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16

    pcm = np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes()
    return ulaw_to_pcm16(pcm16_to_ulaw(pcm))


def _phone_channel(pcm22k: bytes) -> bytes:
    from ivr.audio.resample import resample

    pcm8k = resample(pcm22k, 22050, RATE)
    return _phone_channel_pcm(np.frombuffer(pcm8k, dtype="<i2").astype(np.float64))


def _synthesize_in_child(text: str, wpm: int) -> bytes:
    done = subprocess.run(
        [sys.executable, __file__, text, str(wpm)],
        capture_output=True,
        check=False,
        timeout=60,
    )
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"espeak-ng synthesis failed: {done.stderr.decode(errors='replace')}")
    return done.stdout


def _espeak_synthesize(text: str, wpm: int) -> bytes:
    """espeak-ng's C API through ctypes: synchronous mode, samples collected by a callback."""
    import espeakng_loader

    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    synchronous, chars_utf8, pos_character, espeak_rate = 2, 1, 1, 1
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    rate = lib.espeak_Initialize(synchronous, 0, espeakng_loader.get_data_path().encode(), 0)
    if rate != 22050:
        raise RuntimeError(f"espeak_Initialize returned {rate}, expected 22050 Hz")
    chunks: list[bytes] = []
    callback_type = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
    )

    def on_audio(wav: ctypes._Pointer[ctypes.c_short], n: int, _events: int) -> int:
        if wav and n > 0:
            chunks.append(ctypes.string_at(wav, 2 * n))
        return 0  # 0 = continue

    cb = callback_type(on_audio)
    lib.espeak_SetSynthCallback(cb)
    lib.espeak_SetVoiceByName(b"en-us")
    lib.espeak_SetParameter(espeak_rate, wpm, 0)
    data = text.encode()
    lib.espeak_Synth.argtypes = [
        ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
        ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    err = lib.espeak_Synth(data, len(data) + 1, 0, pos_character, 0, chars_utf8, None, None)
    if err != 0:
        raise RuntimeError(f"espeak_Synth failed with code {err}")
    lib.espeak_Synchronize()
    return b"".join(chunks)


if __name__ == "__main__":
    sys.stdout.buffer.write(_espeak_synthesize(sys.argv[1], int(sys.argv[2])))
