"""Silero windows of many calls judged in one run (``ivr.audio.silero_batch``): batching is
invisible in the decisions, saves runs when calls speak together, and never makes a lone
call wait. Real model, real event loop, real speech."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from audio_fixtures import frames, noise_pcm16, speech_pcm16, trimmed
from gateway_support import GatewayFactory, dial
from structlog.testing import capture_logs

from ivr.audio import vad as vad_module
from ivr.audio.endpointer import Endpointer, EndpointEvent
from ivr.audio.gated_vad import GatedSileroVad, SileroPool
from ivr.audio.vad import SileroModel, SileroVad
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

SENTENCES = (
    "I would like to check my account balance, please.",
    "Do you have parking nearby?",
    "What are your opening hours on Sunday?",
    "My card was declined at the store this morning.",
)


def caller_audio(index: int) -> bytes:
    """A different sentence and a different lead of line noise per caller."""
    lead = noise_pcm16(0.2 + 0.07 * index, dbfs=-60, seed=40 + index, color="brown")
    tail = noise_pcm16(0.8, dbfs=-60, seed=60 + index, color="brown")
    return lead + trimmed(speech_pcm16(SENTENCES[index % len(SENTENCES)])) + tail


def probabilities_alone(pcm16: bytes) -> list[float]:
    """Each window's speech probability, one stream run on its own (no batching)."""
    model = SileroModel.shared()
    vad = SileroVad(model=model)
    probs = []
    for frame, _ in frames(pcm16):
        window = vad._take(frame)
        if window is not None:
            prob, state = model.predict(window, vad._state)
            vad._judged(prob, state)
            probs.append(prob)
    return probs


async def probabilities_batched(pcm16: bytes, vad: SileroVad) -> list[float]:
    model = SileroModel.shared()
    probs = []
    for frame, _ in frames(pcm16):
        window = vad._take(frame)
        if window is not None:
            prob, state = await model.batcher().predict(vad, window, vad._state)
            vad._judged(prob, state)
            probs.append(prob)
        await asyncio.sleep(0)  # calls' frames interleave, as on a busy loop
    return probs


def test_the_model_is_given_the_callers_audio_in_windows_each_with_the_last_ones_end() -> None:
    """What ``_take`` hands the model: 256-sample windows of the frames' audio in order,
    scaled to [-1, 1), each led by the previous window's last 32 samples (silence before the
    first); after a reset, the next window starts from silence again."""
    audio = caller_audio(1)[: 320 * 41]  # 41 frames: 25 whole windows and half a frame
    vad = SileroVad()
    windows = [w for f, _ in frames(audio) if (w := vad._take(f)) is not None]
    samples = np.frombuffer(audio, dtype="<i2").astype(np.float32) / 32768
    padded = np.concatenate([np.zeros(32, dtype=np.float32), samples])
    assert len(windows) == len(samples) // 256 == 25
    for i, window in enumerate(windows):
        np.testing.assert_array_equal(window[0], padded[256 * i : 256 * i + 288])
    vad.reset()  # 160 samples were left over: dropped
    again = [w for f, _ in frames(audio[: 320 * 13]) if (w := vad._take(f)) is not None]
    np.testing.assert_array_equal(again[0][0], padded[:288])
    with pytest.raises(ValueError, match="320-byte frames, got 160 bytes"):
        vad._take(bytes(160))


async def test_batched_windows_get_exactly_what_each_stream_would_get_alone() -> None:
    audios = [caller_audio(i) for i in range(6)]
    alone = [probabilities_alone(a) for a in audios]
    batcher = SileroModel.shared().batcher()
    runs, windows = batcher.runs, batcher.windows
    together = await asyncio.gather(*(probabilities_batched(a, SileroVad()) for a in audios))
    for mine, reference in zip(together, alone, strict=True):
        # A row mixed up with another stream's (or a state handed to the wrong one) would be
        # off by far more than float noise on these different sentences.
        np.testing.assert_allclose(mine, reference, atol=1e-4)
    ran, judged = batcher.runs - runs, batcher.windows - windows
    print(f"\n6 streams: {judged} windows in {ran} runs ({judged / ran:.1f} a run)")
    assert judged == sum(len(a) for a in alone)
    assert judged / ran >= 3, "streams speaking together must share runs"


async def test_a_lone_stream_never_waits_for_company() -> None:
    batcher = SileroModel.shared().batcher()
    await asyncio.sleep(0.1)  # streams of an earlier test are no longer "recent"
    runs, windows = batcher.runs, batcher.windows
    audio = caller_audio(0)
    vad = SileroVad()
    loop = asyncio.get_running_loop()
    for frame, _ in frames(audio):
        window = vad._take(frame)
        if window is None:
            continue
        pending = asyncio.ensure_future(batcher.predict(vad, window, vad._state))
        await asyncio.sleep(0)
        # Sent at once (the only stream heard from lately): no wait timer armed for it.
        assert batcher._timer is None, "a lone stream's window must not wait for others"
        vad._judged(*await pending)
        await asyncio.sleep(0.001)
    assert batcher.windows - windows == batcher.runs - runs > 0
    assert loop.is_running()


async def test_a_call_that_ends_while_its_window_waits_for_company_is_left_out() -> None:
    model = SileroModel.shared()
    batcher = model.batcher()
    first, second = SileroVad(), SileroVad()
    windows: list[tuple[np.ndarray, np.ndarray]] = []
    for frame, _ in frames(caller_audio(1)):
        window_a, window_b = first._take(frame), second._take(frame)
        if window_a is not None and window_b is not None:
            windows.append((window_a, window_b))
        if len(windows) == 2:
            break
    (a1, b1), (a2, b2) = windows
    # A round together: both detectors are now expected in every batch.
    await asyncio.gather(
        batcher.predict(first, a1, first._state), batcher.predict(second, b1, second._state)
    )
    reference, _ = model.predict(b2.copy(), second._state)
    runs, judged = batcher.runs, batcher.windows
    gone = asyncio.ensure_future(batcher.predict(first, a2, first._state))
    await asyncio.sleep(0)  # its window waits for the second detector's
    gone.cancel()  # its call hung up meanwhile
    with pytest.raises(asyncio.CancelledError):
        await gone
    prob, state = await batcher.predict(second, b2, second._state)
    assert prob == pytest.approx(reference, abs=1e-5)
    assert state.shape == (2, 1, 128)
    assert (batcher.runs - runs, batcher.windows - judged) == (1, 1)  # the gone one never ran


def described(event: EndpointEvent) -> tuple[str, float]:
    return type(event).__name__, round(getattr(event, "t_detected", getattr(event, "t", 0.0)), 2)


async def test_the_endpointer_finds_the_same_turns_with_batching_as_without() -> None:
    pool = SileroPool()
    audios = [caller_audio(i) for i in range(4)]

    def events_sync(audio: bytes) -> list[tuple[str, float]]:
        endpointer = Endpointer(GatedSileroVad(pool))
        out = [described(e) for f, t in frames(audio) if (e := endpointer.push(f, t))]
        endpointer.close()
        return out

    async def events_async(audio: bytes) -> list[tuple[str, float]]:
        endpointer = Endpointer(GatedSileroVad(pool))
        out = []
        for f, t in frames(audio):
            if (e := await endpointer.push_async(f, t)) is not None:
                out.append(described(e))
            await asyncio.sleep(0)
        endpointer.close()
        return out

    # A model for each stream idle in the pool first: inside a loop a wake never waits for
    # one to load (the gate decides meanwhile), which would differ from the offline run.
    held = await asyncio.to_thread(lambda: [pool.acquire() for _ in audios])
    for vad in held:
        assert vad is not None
        pool.release(vad)
    expected = [await asyncio.to_thread(events_sync, a) for a in audios]
    got = await asyncio.gather(*(events_async(a) for a in audios))
    assert all(any(kind == "SpeechEnded" for kind, _ in e) for e in expected), expected
    assert got == expected


# -- the model failing -------------------------------------------------------------------------


class FailingEngine:
    """The model's run (numpy's or onnxruntime's), raising while ``failing``: the engine
    boundary, as a provider's is its server."""

    def __init__(self, real: Any) -> None:
        self.real, self.failing, self.failed = real, True, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failing:
            self.failed += 1
            raise RuntimeError("engine failure injected")
        return self.real(*args, **kwargs)


@pytest.fixture
def failing_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[FailingEngine]:
    # The warning is once per 10 s for the process: each test starts as a fresh process would.
    monkeypatch.setattr(vad_module, "_warned_at", -vad_module._WARN_EVERY_S)
    model = SileroModel.shared()
    real = model._run
    engine = FailingEngine(real)
    model._run = engine
    try:
        yield engine
    finally:
        model._run = real


async def test_a_failing_model_leaves_the_gate_to_find_the_turn(
    failing_model: FailingEngine,
) -> None:
    audio = caller_audio(2)
    pool = SileroPool()
    ready = await asyncio.to_thread(pool.acquire)  # loaded: a wake inside the loop gets it
    assert ready is not None
    pool.release(ready)
    endpointer = Endpointer(GatedSileroVad(pool))
    events = []
    with capture_logs() as logs:
        for frame, t in frames(audio):
            if (event := await endpointer.push_async(frame, t)) is not None:
                events.append(described(event))
    endpointer.close()
    # Every Silero run failed, and the call still heard the caller start and stop: WebRTC's
    # verdict stood in for each window, as while a model loads. One warning, not one a window.
    assert failing_model.failed > 10
    kinds = [kind for kind, _ in events]
    assert "SpeechStarted" in kinds and "SpeechEnded" in kinds, events
    warnings = [entry for entry in logs if entry["event"] == "vad.model_failed"]
    assert len(warnings) == 1 and "injected" in warnings[0]["error"], warnings


async def test_silero_alone_keeps_its_last_verdict_through_a_failure_and_recovers(
    failing_model: FailingEngine,
) -> None:
    audio = caller_audio(3)
    vad = SileroVad()
    verdicts = []
    for i, (frame, _) in enumerate(frames(audio)):
        failing_model.failing = 20 <= i < 30  # 200 ms of failed runs in the middle of speech
        verdicts.append(await vad.is_speech_async(frame))
    assert vad.failed_windows == failing_model.failed > 0
    assert any(verdicts[40:]) and not verdicts[-1], "after the failure: the speech, its end"


async def test_a_call_whose_silero_runs_all_fail_is_still_heard_and_answered(
    failing_model: FailingEngine,
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
) -> None:
    # The whole path: a gateway with the default VAD (Silero gated by WebRTC), a simulated
    # Twilio call, and every Silero run in the process failing. The caller's turn is still
    # found (WebRTC decides each window), transcribed and answered; the call ends normally.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = lambda request: ChatScript(text="We open at nine.")
    with capture_logs() as logs:
        async with gateway_factory(vad="silero") as server:
            report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    assert failing_model.failed > 10
    [turn] = [t for t in report.turns if t.caller_text is not None]
    assert turn.bot_audio_seconds > 0 and turn.latency_s is not None, report.format_transcript()
    assert turn.latency_s < 1.5, turn.latency_s
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 1 and chats[0].json is not None
    assert chats[0].json["messages"][-1]["content"] == "what are your opening hours"
    warnings = [entry for entry in logs if entry["event"] == "vad.model_failed"]
    assert 1 <= len(warnings) <= 2, warnings  # once per 10 s for the process, not per window
