"""The rate of the WAV a call uploads to an OpenAI-compatible STT (``IVR_STT_SAMPLE_RATE``):
the line's own 8 kHz by default, 16 kHz for servers that take nothing else. The real gateway,
a simulated Twilio caller and the local OpenAI-compatible server, which records each upload."""

from __future__ import annotations

import pytest
from conftest import provider_settings
from pydantic import ValidationError
from stream_calls import SAID, call, user_said

from ivr.audio.wav import wav_to_pcm16
from ivr.testing.openai_server import FakeOpenAIServer

pytestmark = pytest.mark.slow


async def uploads(fake: FakeOpenAIServer, **settings: object) -> list[tuple[int, float]]:
    """(rate, seconds) of each transcription upload of a one-line call."""
    fake.transcripts.append(SAID)
    batch = {"stt_provider": "openai", "stt_base_url": fake.base_url, "stt_api_key": "sk-test"}
    report = await call(fake, {**batch, **settings})
    assert not report.errors, report.format_transcript()
    assert user_said(fake) == [SAID]
    out = []
    for request in fake.requests_for("transcriptions"):
        wav = wav_to_pcm16(request.files["file"])
        out.append((wav.sample_rate, wav.seconds))
    return out


async def test_a_turn_is_uploaded_at_the_lines_rate_or_at_the_rate_asked(
    fake_openai: FakeOpenAIServer,
) -> None:
    ((rate, seconds),) = await uploads(fake_openai)
    assert rate == 8000, "the line's 8 kHz as it came: no resampling by the gateway"
    fake_openai.requests.clear()
    ((rate_16k, seconds_16k),) = await uploads(fake_openai, stt_sample_rate=16000)
    assert rate_16k == 16000
    print(f"\nthe turn's upload: {seconds:.3f} s at 8 kHz, {seconds_16k:.3f} s at 16 kHz")
    assert 1.0 < seconds < 4.0
    assert abs(seconds - seconds_16k) < 0.05, "the same utterance, only its rate differs"


def test_a_rate_below_the_lines_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="stt_sample_rate"):
        provider_settings(stt_sample_rate=4000)
