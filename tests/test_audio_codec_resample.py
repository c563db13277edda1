"""Quality of the mu-law codec and the three resamplers, measured on test tones.

Run with ``-s`` to see the measured numbers.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import numpy.typing as npt
import pytest

from ivr.audio.codec import (
    FRAME_BYTES_ULAW,
    ULAW_SILENCE,
    pcm16_to_ulaw,
    ulaw_silence,
    ulaw_to_pcm16,
)
from ivr.audio.resample import LowDelayUpsampler, StreamResampler, resample

AMP = 16384.0  # -6 dBFS test tones: headroom for filter ripple, well above the int16 noise floor

Samples = npt.NDArray[np.float64]


def tone(freq: float, rate: int, seconds: float, amp: float = AMP) -> bytes:
    t = np.arange(round(rate * seconds)) / rate
    return np.rint(amp * np.sin(2 * np.pi * freq * t)).astype("<i2").tobytes()


def samples(pcm16: bytes) -> Samples:
    return np.frombuffer(pcm16, dtype="<i2").astype(np.float64)


def level_db(x: Samples, rate: int, freq: float, ref: float = AMP) -> float:
    """Level of ``freq`` in a one-second slice of ``x`` (1 Hz bins), dB relative to ``ref``."""
    seg = x[:rate]
    assert seg.size == rate, "need one full second of settled signal"
    win = np.hanning(rate)
    spectrum = np.abs(np.fft.rfft(seg * win)) * 2 / win.sum()
    return float(20 * np.log10(spectrum[round(freq)] / ref + 1e-15))


def stream(resampler: StreamResampler | LowDelayUpsampler, pcm16: bytes, chunk: int) -> bytes:
    parts = [resampler.push(pcm16[i : i + chunk]) for i in range(0, len(pcm16), chunk)]
    return b"".join(parts) + resampler.flush()


def max_jump(x: Samples) -> float:
    return float(np.max(np.abs(np.diff(x))))


def tone_jump_bound(freq: float, rate: int, amp: float = AMP) -> float:
    # Largest step a clean sine can take between samples, plus ripple/rounding slack.
    return 1.02 * amp * 2 * np.sin(np.pi * freq / rate) + 4


# --- mu-law codec ---------------------------------------------------------------------------


def test_mu_law_decodes_known_codes_and_a_frame_doubles_in_size() -> None:
    pcm = samples(ulaw_to_pcm16(bytes([0xFF, 0x7F, 0x00, 0x80])))
    assert pcm.tolist() == [0, 0, -32124, 32124]
    assert len(ulaw_to_pcm16(b"\x00" * FRAME_BYTES_ULAW)) == 2 * FRAME_BYTES_ULAW
    assert ulaw_to_pcm16(ULAW_SILENCE * 3) == bytes(6)
    assert ulaw_silence(20) == ULAW_SILENCE * 160


def test_mu_law_round_trip_error_stays_within_the_companding_step() -> None:
    x = np.arange(-32768, 32768, 7, dtype=np.int64)
    back = samples(ulaw_to_pcm16(pcm16_to_ulaw(x.astype("<i2").tobytes())))
    err = np.abs(back - x)
    # G.711 keeps 4 mantissa bits per segment: at worst one step, ~6.5 % just above a boundary.
    assert np.all(err <= np.maximum(8, np.abs(x) * 0.07))
    snr = 10 * np.log10(np.sum(x.astype(float) ** 2) / np.sum(err**2))
    print(f"\nmu-law round trip SNR on a full-scale ramp: {snr:.1f} dB")
    assert snr > 30


def test_mu_law_encoding_of_every_sample_value_is_audioops_in_long_and_short_buffers() -> None:
    """Long buffers are encoded by a lookup table, short ones by audioop: both give audioop's
    bytes for every one of the 65536 sample values, at either side of the size that decides."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    every = np.arange(-32768, 32768, dtype="<i2")
    rng = np.random.default_rng(7)
    for buffer in (every, rng.permutation(every), every[::-1]):
        pcm = buffer.tobytes()
        assert pcm16_to_ulaw(pcm) == audioop.lin2ulaw(pcm, 2)
        for size in (2046, 2048, 320):
            piece = pcm[4000 : 4000 + size]
            assert pcm16_to_ulaw(piece) == audioop.lin2ulaw(piece, 2), size


def test_pcm16_with_a_half_sample_is_rejected_with_its_length() -> None:
    with pytest.raises(ValueError, match="odd length \\(3 bytes\\)"):
        pcm16_to_ulaw(b"\x00\x01\x02")


def test_codec_import_emits_no_deprecation_warning() -> None:
    code = "import ivr.audio.codec"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


# --- whole-buffer soxr ------------------------------------------------------------------------


def test_whole_buffer_upsampling_rejects_the_image_of_a_3khz_tone() -> None:
    y = samples(resample(tone(3000, 8000, 2.0), 8000, 16000))
    assert y.size == 32000
    image = level_db(y[8000:], 16000, 5000)
    print(f"\nsoxr whole-buffer 8k->16k: image of 3 kHz at 5 kHz = {image:.1f} dB")
    assert image < -90


@pytest.mark.parametrize(("src", "dst"), [(8000, 16000), (22050, 8000), (24000, 8000)])
def test_whole_buffer_resampling_is_flat_at_1_and_3_khz(src: int, dst: int) -> None:
    for freq in (1000, 3000):
        y = samples(resample(tone(freq, src, 2.0), src, dst))
        gain = level_db(y[dst // 2 :], dst, freq)
        print(f"\nsoxr whole-buffer {src}->{dst}: gain at {freq} Hz = {gain:+.3f} dB")
        assert abs(gain) < 0.1


def test_whole_buffer_resampling_rejects_odd_buffers_and_bad_rates() -> None:
    with pytest.raises(ValueError, match="odd length"):
        resample(b"\x00" * 5, 8000, 16000)
    with pytest.raises(ValueError, match="positive"):
        resample(b"", 0, 16000)
    assert resample(b"\x01\x02", 8000, 8000) == b"\x01\x02"


# --- streaming soxr (outbound TTS) ------------------------------------------------------------


@pytest.mark.parametrize("src", [22050, 24000])
def test_stream_resampler_keeps_aliases_of_a_5khz_tone_below_minus_80_db(src: int) -> None:
    # A companion tone keeps rounding noise present and (being off-harmonic) spread out.
    mix = samples(tone(5000, src, 2.0, AMP / 2)) + samples(tone(1013, src, 2.0, AMP / 2))
    pcm = np.rint(mix).astype("<i2").tobytes()
    y = samples(stream(StreamResampler(src, 8000), pcm, src // 50 * 2))
    alias = level_db(y[4000:], 8000, 3000, ref=AMP / 2)
    kept = level_db(y[4000:], 8000, 1013, ref=AMP / 2)
    print(f"\nsoxr stream {src}->8k: 5 kHz tone aliased to 3 kHz = {alias:.1f} dB")
    assert alias < -80
    assert abs(kept) < 0.1


@pytest.mark.parametrize("src", [22050, 24000])
def test_stream_resampler_is_flat_at_1_and_3_khz(src: int) -> None:
    for freq in (1000, 3000):
        y = samples(stream(StreamResampler(src, 8000), tone(freq, src, 2.0), src // 50 * 2))
        gain = level_db(y[4000:], 8000, freq)
        print(f"\nsoxr stream {src}->8k: gain at {freq} Hz = {gain:+.3f} dB")
        assert abs(gain) < 0.1


def test_stream_resampler_in_20ms_chunks_matches_the_whole_buffer_without_edge_clicks() -> None:
    src = tone(2500, 22050, 1.0)
    streamed = samples(stream(StreamResampler(22050, 8000), src, 882))
    whole = samples(resample(src, 22050, 8000))
    lag = int(np.argmax(np.correlate(streamed[1000:3000], whole[1000 + 0 : 3000 - 0], "full")))
    lag -= 1999
    n = min(streamed.size, whole.size)
    diff = float(np.max(np.abs(streamed[100 : n - 100] - whole[100 : n - 100])))
    jump = max_jump(streamed[100:-100])
    bound = tone_jump_bound(2500, 8000)
    print(
        f"\nsoxr stream vs whole 22.05k->8k: lag {lag} samples, length {streamed.size} vs "
        f"{whole.size}, max diff {diff:.0f} LSB, max step {jump:.0f} (clean sine {bound:.0f})"
    )
    assert lag == 0
    assert abs(streamed.size - whole.size) <= 2
    assert diff < 0.002 * AMP
    assert jump <= bound


def test_stream_resampler_carries_a_half_sample_across_odd_sized_chunks() -> None:
    src = tone(1000, 24000, 0.5)
    even = stream(StreamResampler(24000, 8000), src, 960)
    odd = stream(StreamResampler(24000, 8000), src, 961)
    assert len(odd) == len(even)
    # soxr's block processing may move an LSB with other chunking; a lost byte would be garbage.
    assert float(np.max(np.abs(samples(odd) - samples(even)))) <= 1


def test_stream_resampler_hold_back_is_measured_and_flush_releases_all_of_it() -> None:
    src_rate, chunk = 22050, 441 * 2
    src = tone(1000, src_rate, 1.0)
    rs = StreamResampler(src_rate, 8000)
    got, held_ms = 0, []
    for i in range(0, len(src), chunk):
        got += len(rs.push(src[i : i + chunk])) // 2
        due = (i + chunk) // 2 * 8000 / src_rate
        held_ms.append((due - got) / 8)
    got += len(rs.flush()) // 2
    steady = held_ms[10:]
    print(
        f"\nsoxr stream 22.05k->8k in 20 ms chunks: first output after chunk "
        f"{next(i for i, h in enumerate(held_ms) if h < (i + 1) * 20) + 1}, hold-back "
        f"mean {np.mean(steady):.1f} ms, max {max(held_ms):.1f} ms"
    )
    assert abs(got - 8000) <= 1
    assert max(held_ms) < 150


def test_stream_resampler_flush_resets_so_the_next_utterance_comes_out_the_same() -> None:
    rs = StreamResampler(22050, 8000)
    src = tone(700, 22050, 0.3)
    first = stream(rs, src, 882)
    second = stream(rs, src, 882)
    assert first == second
    assert len(first) > 0


# --- low-delay FIR upsampler (inbound streaming STT) -----------------------------------------


def test_low_delay_upsampler_rejects_the_image_of_a_3khz_tone() -> None:
    y = samples(stream(LowDelayUpsampler(), tone(3000, 8000, 2.0), 320))
    image = level_db(y[8000:], 16000, 5000)
    print(f"\nLowDelayUpsampler 8k->16k: image of 3 kHz at 5 kHz = {image:.1f} dB")
    assert image < -70


def test_low_delay_upsampler_is_flat_at_1_and_3_khz() -> None:
    for freq in (1000, 3000, 3400):
        y = samples(stream(LowDelayUpsampler(), tone(freq, 8000, 2.0), 320))
        gain = level_db(y[8000:], 16000, freq)
        print(f"\nLowDelayUpsampler: gain at {freq} Hz = {gain:+.4f} dB")
        assert abs(gain) < 0.05


def test_low_delay_upsampler_delay_measured_on_a_chirp_is_under_5ms() -> None:
    def chirp(rate: int) -> Samples:
        t = np.arange(round(rate * 0.5)) / rate
        phase = 2 * np.pi * (200 * t + (3200 / 0.5) / 2 * t**2)  # 200 -> 3400 Hz
        return AMP * np.sin(phase) * np.hanning(t.size)

    x8 = np.rint(chirp(8000)).astype("<i2").tobytes()
    y = samples(stream(LowDelayUpsampler(), x8, 320))
    ref = chirp(16000)
    corr = np.correlate(y, ref, "full")[ref.size - 1 :]  # non-negative lags only
    k = int(np.argmax(corr))
    a, b, c = corr[k - 1], corr[k], corr[k + 1]
    lag = k + 0.5 * (a - c) / (a - 2 * b + c)  # parabolic peak
    delay_ms = 1000 * lag / 16000
    print(f"\nLowDelayUpsampler delay by chirp cross-correlation: {delay_ms:.3f} ms")
    assert delay_ms <= 5.0
    assert delay_ms == pytest.approx(LowDelayUpsampler().delay_ms, abs=0.1)


def test_low_delay_upsampler_in_20ms_frames_equals_one_push_and_tracks_soxr() -> None:
    src = tone(2900, 8000, 1.0)
    framed = samples(stream(LowDelayUpsampler(), src, 320))
    whole = samples(LowDelayUpsampler().push(src))
    assert np.array_equal(framed[: whole.size], whole)
    d = LowDelayUpsampler.DELAY_SAMPLES
    ref = samples(resample(src, 8000, 16000))
    diff = float(np.max(np.abs(framed[d + 200 : d + 15800] - ref[200:15800])))
    jump = max_jump(framed[200:-200])
    bound = tone_jump_bound(2900, 16000)
    print(
        f"\nLowDelayUpsampler vs soxr (delay removed): max diff {diff:.0f} LSB, "
        f"max step {jump:.0f} (clean sine {bound:.0f})"
    )
    assert diff < 0.002 * AMP
    assert jump <= bound


def test_low_delay_upsampler_doubles_every_frame_and_carries_half_samples() -> None:
    up = LowDelayUpsampler()
    assert len(up.push(bytes(320))) == 640
    assert up.push(b"\x01") == b""
    assert len(up.push(b"\x00" + bytes(318))) == 320 * 2
