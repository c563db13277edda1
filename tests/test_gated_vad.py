"""The gated VAD: Silero's accuracy, but Silero only runs around possible speech."""

from __future__ import annotations

import asyncio
import time

from audio_fixtures import frames, noise_pcm16, speech_pcm16, trimmed

from ivr.audio.endpointer import Endpointer, SpeechEnded
from ivr.audio.gated_vad import GatedSileroVad, SileroPool

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
