"""``TimedAudio``: a tail of phone audio that knows the call second it starts at."""

from __future__ import annotations

import pytest

from ivr.audio.timed_audio import BYTES_PER_SECOND, TimedAudio


def ramp(seconds: float, first: int = 0) -> bytes:
    """Audio whose every byte says where it is (mod 256), so a cut in the wrong place shows."""
    return bytes((first + i) % 256 for i in range(int(seconds * BYTES_PER_SECOND)))


def test_pushes_in_a_row_are_one_stretch_from_the_first_push() -> None:
    kept = TimedAudio(keep_seconds=10)
    kept.push(ramp(0.5), at=2.0)
    kept.push(ramp(0.25, first=4000), at=2.5)
    assert kept.start == 2.0
    assert kept.end == pytest.approx(2.75)
    assert kept.audio() == ramp(0.75)


def test_only_the_last_seconds_are_kept() -> None:
    kept = TimedAudio(keep_seconds=1)
    kept.push(ramp(1.5), at=0.0)
    assert kept.seconds == 1.0
    assert kept.start == pytest.approx(0.5)
    assert kept.audio() == ramp(1.5)[4000:]


def test_drop_through_forgets_what_came_before_a_second() -> None:
    kept = TimedAudio(keep_seconds=10)
    kept.push(ramp(1.0), at=3.0)
    kept.drop_through(3.25)
    assert kept.start == pytest.approx(3.25)
    assert kept.audio() == ramp(1.0)[2000:]
    kept.drop_through(3.0)  # already gone: nothing changes
    assert kept.start == pytest.approx(3.25)
    kept.drop_through(9.0)  # past the end: everything goes, the start stops at its end
    assert len(kept) == 0
    assert kept.start == pytest.approx(4.0)


def test_take_hands_over_the_audio_and_the_next_push_starts_where_it_says() -> None:
    kept = TimedAudio(keep_seconds=10)
    kept.push(ramp(0.5), at=1.0)
    assert kept.take() == ramp(0.5)
    assert len(kept) == 0
    assert kept.start == pytest.approx(1.5)
    kept.push(ramp(0.1), at=7.0)  # the audio between went elsewhere (a session took it)
    assert kept.start == 7.0
    assert kept.end == pytest.approx(7.1)


def test_extended_audio_ends_where_everything_pushed_ends_whatever_was_dropped() -> None:
    kept = TimedAudio(keep_seconds=0.5)
    for _ in range(10):
        kept.extend(b"\xff" * 800)  # 100 ms each: 1 s in all, 0.5 s kept
    assert (kept.start, kept.end) == (0.5, 1.0)
    kept.drop_through(0.8)
    assert kept.end == 1.0
    assert kept.take() == b"\xff" * 1600 and kept.end == 1.0
    kept.extend(b"\xff" * 400)  # after a take, the next piece still follows on
    assert (kept.start, kept.end) == (1.0, 1.05)
