"""The gated VAD: Silero's accuracy, but Silero only runs around possible speech."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from audio_fixtures import frames, noise_pcm16, speech_pcm16, trimmed

from ivr.audio.endpointer import Endpointer, SpeechEnded
from ivr.audio.gated_vad import GatedSileroVad, SileroPool
from ivr.audio.vad import WebRtcVad

SENTENCE = "I would like to check my account balance, please."
RATE = 8000


def seconds(pcm16: bytes) -> float:
    return len(pcm16) / 2 / RATE


def test_it_ends_an_utterance_in_white_noise_on_time_where_webrtc_alone_does_not() -> None:
    speech = trimmed(speech_pcm16(SENTENCE))
    lead = noise_pcm16(1.0, dbfs=-55, seed=15, color="white")
    timeline = lead + speech + noise_pcm16(2.0, dbfs=-55, seed=16, color="white")
    true_end = seconds(lead) + seconds(speech)
    endpointer = Endpointer(GatedSileroVad(SileroPool()))
    ended = [e for f, t in frames(timeline) if isinstance(e := endpointer.push(f, t), SpeechEnded)]
    assert len(ended) == 1
    print(f"\ngated vad in white noise: end of speech {ended[0].t_end_of_speech - true_end:+.3f} s")
    assert abs(ended[0].t_end_of_speech - true_end) <= 0.1


def test_silero_sleeps_through_silence_and_returns_to_the_pool() -> None:
    pool = SileroPool()
    vad = GatedSileroVad(pool, sleep_after_ms=400)
    quiet = noise_pcm16(5.0, dbfs=-60, seed=3, color="brown")
    for frame, _ in frames(quiet):
        assert vad.is_speech(frame) is False
    print(f"\nsilero ran on {vad.awake_frames} of {vad.frames} frames of line noise")
    assert vad.awake_frames <= vad.frames * 0.1, "line noise must leave Silero asleep"
    for frame, _ in frames(trimmed(speech_pcm16("Hello there.")) + quiet):
        vad.is_speech(frame)
    assert vad.wakes >= 1 and not vad.awake, "after speech and silence Silero sleeps again"
    # The next call reuses the instance instead of loading another model.
    other = GatedSileroVad(pool)
    for frame, _ in frames(trimmed(speech_pcm16("Hello there."))):
        other.is_speech(frame)
    other.close()
    assert pool.misses == 1, "the second call must find a loaded model in the pool"


def test_the_onset_is_not_lost_when_silero_wakes() -> None:
    speech = trimmed(speech_pcm16(SENTENCE))
    lead = noise_pcm16(0.5, dbfs=-60, seed=5, color="brown")
    endpointer = Endpointer(GatedSileroVad(SileroPool()))
    events = [e for f, t in frames(lead + speech + lead) if (e := endpointer.push(f, t))]
    ended = [e for e in events if isinstance(e, SpeechEnded)]
    assert len(ended) == 1
    # Pre-roll keeps the beginning: the utterance holds (nearly) all of the speech.
    assert seconds(ended[0].audio) >= seconds(speech) - 0.1


async def test_inside_an_event_loop_a_wake_never_waits_for_a_model_to_load() -> None:
    """Loading a model takes ~100 ms: on the loop that would stall every call. The gate decides
    until the background thread has one ready; then Silero takes over, primed with the onset."""
    pool = SileroPool(spare=1)
    vad = GatedSileroVad(pool)
    speech = trimmed(speech_pcm16(SENTENCE))
    slowest = 0.0
    decisions = []
    for frame, _ in frames(speech):
        started = time.perf_counter()
        decisions.append(vad.is_speech(frame))
        slowest = max(slowest, time.perf_counter() - started)
        await asyncio.sleep(0.02)  # real time, as frames arrive on a call
    vad.close()
    print(f"\nslowest frame {1000 * slowest:.1f} ms; gate alone on {vad.waited_frames} frames")
    assert pool.misses >= 1 and vad.waited_frames >= 1, "the first wake found no model loaded"
    assert vad.wakes == 1 and vad.awake_frames > len(decisions) // 2, "then Silero decided"
    assert slowest < 0.03, "no frame may wait for a model to load"
    assert sum(decisions) > len(decisions) // 2


def _quieter(pcm16: bytes, db: float) -> bytes:
    x = np.frombuffer(pcm16, "<i2").astype(np.float64) * 10 ** (db / 20)
    return np.rint(x).astype("<i2").tobytes()


def test_silero_sleeps_while_webrtc_hears_hiss_as_speech_after_an_utterance() -> None:
    """WebRTC calls white hiss speech for seconds after an utterance; Silero used to run
    through all of it (2.9-3.9 s at -66..-55 dBFS) because the gate kept it awake."""
    speech = trimmed(speech_pcm16(SENTENCE))
    for dbfs in (-66, -55, -45):
        lead = noise_pcm16(1.0, dbfs=dbfs, seed=8, color="white")
        tail = noise_pcm16(4.0, dbfs=dbfs, seed=7, color="white")
        vad = GatedSileroVad(SileroPool(), sleep_after_ms=400)
        gate = WebRtcVad(mode=1)  # what the gate alone hears, to show the case is the hard one
        speech_over = len(frames(lead + speech))
        awake_after = gate_after = 0
        for i, (frame, _) in enumerate(frames(lead + speech + tail)):
            speech_now = vad.is_speech(frame)
            heard = gate.is_speech(frame)
            if i >= speech_over:
                assert not speech_now or i < speech_over + 10, f"{dbfs} dBFS: hiss called speech"
                awake_after += vad.awake
                gate_after += heard
        vad.close()
        print(f"\n{dbfs} dBFS white hiss: the gate heard speech in {20 * gate_after} ms of it, "
              f"Silero ran on {20 * awake_after} ms")  # fmt: skip
        assert gate_after >= 50, f"{dbfs} dBFS: the gate let go of the hiss within 1 s"
        assert awake_after <= 50, f"{dbfs} dBFS: Silero ran on through the hiss"


@pytest.mark.parametrize("dbfs", [-66, -55, -45])
@pytest.mark.parametrize("gap_s", [0.6, 1.5])
def test_a_caller_who_goes_on_over_hiss_that_silenced_silero_is_heard(
    dbfs: int, gap_s: float
) -> None:
    """Asleep while the gate is stuck on hiss, Silero still wakes for a voice over it: here
    a second sentence 15 dB quieter than the first, after a pause of ``gap_s``."""
    first = trimmed(speech_pcm16(SENTENCE))
    second = _quieter(trimmed(speech_pcm16("And my savings account too.")), -15)
    hiss = [noise_pcm16(s, dbfs=dbfs, seed=i, color="white") for i, s in enumerate((1, gap_s, 2))]
    timeline = hiss[0] + first + hiss[1] + second + hiss[2]
    endpointer = Endpointer(GatedSileroVad(SileroPool()))
    ended = [e for f, t in frames(timeline) if isinstance(e := endpointer.push(f, t), SpeechEnded)]
    endpointer.close()
    assert len(ended) == 2, f"{dbfs} dBFS, {gap_s} s pause: {len(ended)} utterances heard"
    second_start = seconds(hiss[0] + first + hiss[1])
    assert ended[1].t_end_of_speech > second_start + seconds(second) - 0.15
