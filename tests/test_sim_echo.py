"""The simulated line for echo (issue 22): Twilio's frame-clock playout, the echo path measured
on its output, the line STT finding the words that were on the line, and the scenario itself
through the real audio path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import soxr
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory

from ivr.audio.wav import pcm16_to_wav
from ivr.sim.echo import Background, LineEcho, LineFrame, LineRecord, level_dbfs
from ivr.sim.playout import LinkDelay, TwilioPlayout, ulaw_decode, ulaw_encode
from ivr.sim.report import CallReport
from ivr.testing.bot_speech import BotVoice, active_level_dbfs, caller_lines
from ivr.testing.echo_call import (
    FLOW,
    EchoCall,
    Voices,
    background_voices,
    echo_call,
    is_own_words,
)
from ivr.testing.line_stt import LineTranscriber
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.espeak_local import synthesize_pcm16

Pcm = npt.NDArray[np.float64]
RATE = 8000


def media(payload: bytes, sid: str = "MZ1") -> str:
    body = {"payload": base64.b64encode(payload).decode()}
    return json.dumps({"event": "media", "streamSid": sid, "media": body})


def played(signal: Pcm, at: int) -> TwilioPlayout:
    """A playout that played ``signal`` (int16 scale) from sample ``at``."""
    p = TwilioPlayout("MZ1", t0=0.0)
    ulaw = ulaw_encode(np.clip(np.rint(signal), -32768, 32767).astype("<i2").tobytes())
    p.receive(media(ulaw), now=at / RATE)
    return p


def line_output(echo: LineEcho, playout: TwilioPlayout, until: int) -> tuple[Pcm, list[LineFrame]]:
    """What a silent caller's line sends, frame by frame, up to sample ``until``."""
    silence = bytes([0xFF]) * 160
    frames = [echo.mix_frame(silence, playout, end) for end in range(160, until + 1, 160)]
    sent = np.frombuffer(ulaw_decode(b"".join(f.ulaw for f in frames)), dtype="<i2")
    return sent.astype(np.float64), frames


def speech_like(seconds: float, seed: int = 0) -> Pcm:
    """Noise shaped like speech (most energy under 1 kHz) in 120 ms syllables, ~-20 dBFS."""
    rng = np.random.default_rng(seed)
    n = round(seconds * RATE)
    spectrum = np.fft.rfft(rng.normal(0, 1, n))
    f = np.fft.rfftfreq(n, 1 / RATE)
    spectrum *= 1 / (1 + (f / 700) ** 2)
    x = np.fft.irfft(spectrum, n)
    envelope = 0.2 + 0.8 * (np.sin(np.pi * np.arange(n) / (0.12 * RATE)) ** 2)
    x = x * envelope
    return x * (3277 / np.sqrt(np.mean(x**2)))


def lag_of(echo: Pcm, source: Pcm) -> float:
    """Where ``echo`` best matches ``source``, in samples, to a fraction (parabolic peak)."""
    size = 1 << (echo.size + source.size).bit_length()
    corr = np.fft.irfft(np.fft.rfft(echo, size) * np.conj(np.fft.rfft(source, size)), size)
    k = int(np.argmax(corr[: echo.size]))
    a, b, c = corr[k - 1], corr[k], corr[k + 1]
    return k + 0.5 * (a - c) / (a - 2 * b + c)


def tone(freq: float, seconds: float, dbfs: float = -20.0) -> Pcm:
    t = np.arange(round(seconds * RATE)) / RATE
    return 32768 * 10 ** (dbfs / 20) * math.sqrt(2) * np.sin(2 * np.pi * freq * t)


# -- Twilio's frame clock ---------------------------------------------------------------------


def test_audio_on_an_idle_queue_waits_for_the_next_20_ms_tick() -> None:
    p = TwilioPlayout("MZ1", t0=0.0, frame_clock=True)
    p.receive(media(b"\x7f" * 320), now=98.4 / RATE)  # mid-frame: waits for sample 160
    p.receive(media(b"\x7f" * 160), now=170 / RATE)  # queued: back to back
    p.receive(media(b"\x7f" * 160), now=1000.2 / RATE)  # idle again: the tick at 1120
    p.receive(media(b"\x7f" * 160), now=1280 / RATE)  # on a tick: plays at once
    assert [s.start for s in p.segments] == [160, 480, 1120, 1280]


def test_the_tick_phase_moves_the_ticks_and_the_default_plays_at_arrival() -> None:
    ticked = TwilioPlayout("MZ1", t0=0.0, frame_clock=True, tick_phase=40)
    ticked.receive(media(b"\x7f" * 160), now=30 / RATE)
    ticked.receive(media(b"\x7f" * 160), now=1000 / RATE)
    assert [s.start for s in ticked.segments] == [40, 1000]
    plain = TwilioPlayout("MZ1", t0=0.0)
    plain.receive(media(b"\x7f" * 160), now=98.4 / RATE)
    assert [s.start for s in plain.segments] == [98]
    with pytest.raises(ValueError, match="tick_phase"):
        TwilioPlayout("MZ1", t0=0.0, frame_clock=True, tick_phase=160)


def test_the_link_delays_every_message_in_order_within_its_jitter() -> None:
    arrive = LinkDelay(base_s=0.02, jitter_s=0.004, seed=1).arrivals()
    sent = [0.0, 0.0, 0.001, 0.05, 0.0501]
    got = [arrive(t) for t in sent]
    assert got == sorted(got)  # one TCP stream: never overtakes
    assert all(0.02 <= g - t <= 0.024 for g, t in zip(got, sent, strict=True))
    assert list(map(LinkDelay(0.02, 0.004, seed=1).arrivals(), sent)) == got  # seeded
    assert list(map(LinkDelay(0.02, 0.004, seed=2).arrivals(), sent)) != got
    with pytest.raises(ValueError, match="LinkDelay"):
        LinkDelay(jitter_s=-0.001)


# -- the echo path, measured on what the line sends -------------------------------------------


@pytest.mark.parametrize("delay_ms", [20, 100, 250, 500, 100.0625])
@pytest.mark.parametrize("gain_db", [-6.0, -20.0, -40.0])
def test_the_echo_comes_back_at_its_delay_and_its_return_loss(
    delay_ms: float, gain_db: float
) -> None:
    bot = speech_like(1.0)
    playout = played(bot, at=800)
    sent, _ = line_output(LineEcho(delay_ms / 1000, gain_db), playout, until=800 + 13600)
    heard = np.frombuffer(ulaw_decode(playout.render(sent.size)), dtype="<i2").astype(float)
    assert lag_of(sent, heard) == pytest.approx(delay_ms * 8, abs=0.1)
    echo = sent[800 + round(delay_ms * 8) :][: bot.size]
    assert level_dbfs(echo) - level_dbfs(heard[800 : 800 + bot.size]) == pytest.approx(
        gain_db, abs=0.3
    )


def test_the_band_limit_keeps_300_to_3400_hz_and_cuts_what_is_outside() -> None:
    def through(freq: float) -> float:
        playout = played(tone(freq, 1.0), at=0)
        sent, _ = line_output(LineEcho(0.02, -10.0, band_limit=True), playout, until=8000)
        return level_dbfs(sent[2000:7000]) - (-20.0 - 10.0)

    assert through(1000) == pytest.approx(0.0, abs=0.5)
    assert through(500) == pytest.approx(0.0, abs=0.5)
    assert through(3000) == pytest.approx(0.0, abs=0.5)
    assert through(100) < -30
    assert through(3800) < -30


def test_the_band_limit_shifts_phase_so_the_echo_is_no_plain_delayed_copy() -> None:
    bot = speech_like(1.0)
    playout = played(bot, at=0)
    sent, _ = line_output(LineEcho(0.1, -10.0, band_limit=True), playout, until=9600)
    heard = np.frombuffer(ulaw_decode(playout.render(sent.size)), dtype="<i2").astype(float)
    lag = round(lag_of(sent, heard))
    a, b = sent[lag : lag + 6000], heard[:6000]
    assert float(a @ b / np.sqrt((a @ a) * (b @ b))) < 0.95


def test_clipping_caps_the_loudspeaker_and_noise_sits_at_its_level() -> None:
    loud = tone(440, 0.5, dbfs=-6.0)
    playout = played(loud, at=0)
    echo = LineEcho(0.02, -10.0, clip_dbfs=-15.0)
    _, frames = line_output(echo, playout, until=4000)
    peak = max(float(np.abs(f.echo).max()) for f in frames)
    assert peak == pytest.approx(32768 * 10 ** (-25 / 20), rel=0.01)
    quiet = LineEcho(0.02, -10.0, noise_dbfs=-55.0, seed=3)
    sent, _ = line_output(quiet, TwilioPlayout("MZ1", t0=0.0), until=16000)
    assert level_dbfs(sent) == pytest.approx(-55.0, abs=0.5)


def test_the_echo_path_is_sample_continuous_and_the_same_for_the_same_seed() -> None:
    bot = speech_like(1.0, seed=2)
    playout = played(bot, at=400)
    echo = LineEcho(0.1000625, -20.0, band_limit=True, clip_dbfs=-18.0, noise_dbfs=-60.0, seed=5)
    _, frames = line_output(echo, playout, until=9600)
    whole = echo.mix_frame(bytes([0xFF]) * 9600, playout, 9600)
    framed = np.concatenate([f.echo for f in frames])
    assert np.allclose(framed, whole.echo)
    assert b"".join(f.ulaw for f in frames) == b"".join(
        f.ulaw for f in line_output(echo, playout, until=9600)[1]
    )
    other = LineEcho(0.1000625, -20.0, band_limit=True, clip_dbfs=-18.0, noise_dbfs=-60.0, seed=6)
    assert line_output(other, playout, until=9600)[0].tolist() != framed.tolist()


def test_the_line_record_gives_back_any_stretch_with_its_parts() -> None:
    bot = speech_like(0.5)
    playout = played(bot, at=0)
    echo = LineEcho(0.02, -20.0, noise_dbfs=-60.0)
    record = LineRecord()
    said = ulaw_encode((np.ones(160) * 1000).astype("<i2").tobytes())
    for end in (160, 320, 640):  # the frame ending at 480 never went out (a new stream)
        record.add(end - 160, echo.mix_frame(said, playout, end), speech=end == 640)
    span = record.span(100, 700)
    assert record.end == 640 and span.sent.size == 600
    assert not span.sent[220:380].any() and not span.sent[540:].any()  # nothing sent there
    assert span.speech[380:540].all() and not span.speech[:380].any()
    assert np.allclose(span.near[380:540], 1000, atol=40)  # mu-law's step at that level
    assert span.echo[60:220].any() and span.noise[:220].any() and span.source[60:220].any()
    with pytest.raises(ValueError, match="older than the last"):
        record.add(320, LineFrame.plain(said), speech=False)


def test_a_bad_echo_path_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"gain_db must be within -80..0 dB, got 6"):
        LineEcho(0.1, 6.0)
    with pytest.raises(ValueError, match="delay_s"):
        LineEcho(-0.1)
    with pytest.raises(ValueError, match="noise_dbfs"):
        LineEcho(noise_dbfs=-10.0)


# -- the line STT -------------------------------------------------------------------------------

BOT = [
    "Our shop opens at nine in the morning.",
    "We close at six on weekdays and four on Saturday.",
]
CALLER = "Can I book a repair for my bike please?"


@pytest.fixture(scope="module")
def bot_voice() -> BotVoice:
    return BotVoice({t: synthesize_pcm16(t) for t in BOT})


def bot_at_8k(voice: BotVoice, text: str) -> Pcm:
    pcm = np.frombuffer(voice.speak(text), dtype="<i2").astype(np.float64)
    out: Pcm = soxr.resample(pcm, 24000, RATE)
    return out


def record_call(
    voice: BotVoice, echo: LineEcho, caller_at: int | None = None
) -> tuple[LineRecord, Pcm, int]:
    """The bot says BOT's two sentences from sample 8000, 0.3 s apart; the caller's line
    carries them back (and says CALLER from ``caller_at``). (record, what played, where the
    second sentence starts)."""
    first, second = (bot_at_8k(voice, t) for t in BOT)
    bot = np.concatenate([first, np.zeros(2400), second])
    playout = played(bot, at=8000)
    _, speak = caller_lines([CALLER], synthesize_pcm16)
    mic = np.zeros(8000 + bot.size + 16000)
    if caller_at is not None:
        pcm, rate = speak(CALLER)
        said = soxr.resample(np.frombuffer(pcm, dtype="<i2").astype(np.float64), rate, RATE)
        mic[caller_at : caller_at + said.size] = said[: mic.size - caller_at]
    mic_ulaw = ulaw_encode(np.clip(np.rint(mic), -32768, 32767).astype("<i2").tobytes())
    record = LineRecord()
    for end in range(160, mic.size + 1, 160):
        frame = mic_ulaw[end - 160 : end]
        speech = caller_at is not None and np.abs(mic[end - 160 : end]).max() > 100
        record.add(end - 160, echo.mix_frame(frame, playout, end), bool(speech))
    return record, bot, 8000 + first.size + 2400


def upload(record: LineRecord, lo: int, hi: int) -> bytes:
    """What the gateway would send the STT: that stretch of the line, at 16 kHz."""
    x = soxr.resample(record.span(lo, hi).sent, RATE, 16000)
    return pcm16_to_wav(np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes(), 16000)


def test_bot_voice_serves_24_khz_speech_at_minus_23_dbfs(bot_voice: BotVoice) -> None:
    for text in BOT:
        assert active_level_dbfs(bot_at_8k(bot_voice, text)) == pytest.approx(-23.0, abs=0.5)


def test_an_echo_is_heard_as_the_bots_words_that_were_echoing_there(bot_voice: BotVoice) -> None:
    echo = LineEcho(0.1, -20.0, noise_dbfs=-65.0)
    record, _, second = record_call(bot_voice, echo)
    stt = LineTranscriber(record, bot_voice.catalogue, caller_lines([CALLER], synthesize_pcm16)[0])
    echoed = second + 800  # 100 ms after it played
    length = bot_at_8k(bot_voice, BOT[1]).size
    whole = stt(upload(record, echoed - 1600, echoed + length + 1600))
    assert whole == BOT[1]
    assert "nine" not in whole
    # Half a second of it: the first words only.
    start = stt(upload(record, echoed - 800, echoed + 4800))
    assert start.startswith("We") and "Saturday." not in start and start in whole
    assert [h.source for h in stt.heard] == ["echo", "echo"]
    assert is_own_words("Of course. We are open from nine")


def test_a_speculation_talked_past_is_no_turn_but_a_second_line_is() -> None:
    def taken(*requests: str) -> list[str]:
        return EchoCall(CallReport("CA1", "AC1"), list(requests), [], [], None, None).turns_taken

    whole = "Hi, can you tell me your opening hours and what a service costs?"
    assert taken("Hi, can you tell me your opening hours", whole) == [whole]
    assert taken(whole, whole) == [whole, whole]  # the same line twice is two turns
    assert taken(whole, "Hello?") == [whole, "Hello?"]
    assert taken("Hi can", "Hi, cannot") == ["Hi can", "Hi, cannot"]  # words, not letters


def test_the_callers_own_words_win_over_the_echo_and_noise_is_no_words(
    bot_voice: BotVoice,
) -> None:
    echo = LineEcho(0.1, -20.0, noise_dbfs=-50.0)
    talk = second_start(bot_voice)  # over the echo of the bot's second sentence
    record, _, _ = record_call(bot_voice, echo, caller_at=talk)
    stt = LineTranscriber(record, bot_voice.catalogue, caller_lines([CALLER], synthesize_pcm16)[0])
    assert stt(upload(record, talk - 1600, talk + 3 * RATE)) == CALLER
    assert stt(upload(record, 1000, 6000)) == ""  # before the bot spoke: line noise alone
    rng = np.random.default_rng(9)
    stranger = pcm16_to_wav(rng.normal(0, 3000, 16000).astype("<i2").tobytes(), 16000)
    assert stt(stranger) == ""
    assert [h.source for h in stt.heard] == ["caller", "noise", "lost"]


def second_start(voice: BotVoice) -> int:
    return 8000 + bot_at_8k(voice, BOT[0]).size + 2400


# -- the scenario, through the real audio path ---------------------------------------------------


@pytest.fixture(scope="module")
def espeak_voices() -> Voices:
    return asyncio.run(Voices.render("espeak"))


@pytest.mark.slow
async def test_a_speakerphone_echo_at_minus_43_dbfs_never_makes_the_bot_answer_itself(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    espeak_voices: Voices,
) -> None:
    """The issue's line: the bot's own voice 20 dB down (-43 dBFS), 100 ms after the caller
    heard it, mu-law both ways, the caller otherwise silent; the line band-limited and with
    -55 dBFS of line noise, as a real one is. The STT transcribes what the line carries."""
    (tmp_path / "routes.yaml").write_text("default: echo\n")
    (tmp_path / "echo.yaml").write_text(FLOW)
    echo = LineEcho(0.1, -20.0, band_limit=True, noise_dbfs=-55.0, seed=1)
    settings = {"flows_dir": str(tmp_path), "vad": "silero", "speculate_after_ms": 60}
    async with gateway_factory(**settings) as server:
        call = await echo_call(
            server.base_url, fake_openai, espeak_voices, auth_token=AUTH_TOKEN,
            public_url=PUBLIC_URL, echo=echo, listen_s=10.0,
        )  # fmt: skip
    assert not call.report.errors and not call.report.violations, call.report.errors
    assert call.requests, "the bot was never asked anything: the caller's line got lost"
    own = [text for text in call.requests if is_own_words(text)]
    assert not own, f"the bot answered its own words {len(own)} times: {own[:3]}"
    assert not call.false_clears, f"the bot paused at its own echo at {call.false_clears}"


@pytest.mark.slow
async def test_babble_10_db_under_the_caller_never_takes_the_floor_from_the_bot(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    espeak_voices: Voices,
) -> None:
    """Eight talkers 10 dB under the caller's own level (known from their line) fill the
    room for 3 s while the bot answers: no ``clear``, no turn. The line carries no echo."""
    (tmp_path / "routes.yaml").write_text("default: echo\n")
    (tmp_path / "echo.yaml").write_text(FLOW)
    level = espeak_voices.caller_level_dbfs() - 10.0
    babble = Background(background_voices(8), level, ((7.0, 10.0),))
    echo = LineEcho(0.1, -80.0, noise_dbfs=-65.0, seed=2, background=babble)
    settings = {"flows_dir": str(tmp_path), "vad": "silero", "speculate_after_ms": 60}
    async with gateway_factory(**settings) as server:
        call = await echo_call(
            server.base_url, fake_openai, espeak_voices, auth_token=AUTH_TOKEN,
            public_url=PUBLIC_URL, echo=echo, listen_s=12.0,
        )  # fmt: skip
    assert not call.report.errors and not call.report.violations, call.report.errors
    assert call.requests, "the bot was never asked anything: the caller's line got lost"
    assert not call.false_clears, f"the babble paused the bot at {call.false_clears}"
    assert len(call.turns_taken) == 1, f"the babble was taken for a turn: {call.requests}"
