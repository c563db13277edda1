"""Answering machine detection from audio (``ivr.audio.amd``) on the labelled callee fixtures:
people who say a short greeting and wait, machines that talk on and beep (or do not)."""

from __future__ import annotations

import pytest
from amd_fixtures import CALLEES, Callee, callee_audio, silence_pcm16, tone_pcm16
from audio_fixtures import noise_pcm16

from ivr.audio.amd import AnsweringMachineDetector

BATCH = 320 * 5  # what the call's watch hands over: 100 ms at a time


def run(pcm16: bytes) -> AnsweringMachineDetector:
    detector = AnsweringMachineDetector()
    for i in range(0, len(pcm16), BATCH):
        detector.push(pcm16[i : i + BATCH])
        if detector.done:
            break
    return detector


@pytest.mark.parametrize("callee", CALLEES, ids=lambda c: c.name)
def test_each_fixture_is_classified_as_what_it_is(callee: Callee) -> None:
    audio = callee_audio(callee)
    detector = run(audio.pcm16)
    assert detector.decision is not None
    assert detector.decision.answered_by == callee.kind, detector.decision
    if callee.kind == "human":  # decided once they paused for us, not later
        assert detector.decision.at_s - audio.speech_end_s < 1.2, detector.decision
        return
    assert detector.decision.at_s < 3.2  # the greeting gives it away within its first seconds
    end = detector.greeting_end
    assert end is not None
    if audio.beep_end_s is None:  # no beep: the greeting's end is its silence
        assert end.beep_hz is None and end.at_s - audio.speech_end_s < 2.0
    else:
        assert end.beep_hz == pytest.approx(callee.beep_hz, abs=60)
        assert 0 <= end.at_s - audio.beep_end_s < 0.1, (end, audio.beep_end_s)


def test_silence_is_unknown_and_a_lone_beep_is_a_machine() -> None:
    quiet = run(silence_pcm16(6.0))
    assert quiet.decision is not None and quiet.decision.answered_by == "unknown"
    beep = run(silence_pcm16(0.5) + tone_pcm16(1000, 0.4) + silence_pcm16(1.0))
    assert beep.decision is not None and beep.decision.answered_by == "machine"
    assert beep.decision.reason == "beep" and beep.greeting_end is not None


def test_a_click_is_not_a_greeting() -> None:
    click = tone_pcm16(300, 0.04, dbfs=-6) + silence_pcm16(6.0)
    detector = run(silence_pcm16(0.3) + click)
    assert detector.decision is not None and detector.decision.answered_by == "unknown"


def test_it_stops_listening_to_a_machine_that_never_stops() -> None:
    burst = noise_pcm16(0.3, -20.0, color="white") + silence_pcm16(0.1)
    endless = burst * 200  # 80 s of noisy talk, pauses too short for a reply, no beep
    detector = run(endless)
    assert detector.done and detector.greeting_end is None
    assert detector.now_s == pytest.approx(detector.config.max_listen_s, abs=0.1)
