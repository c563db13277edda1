"""End of turn: the Smart Turn model on real speech, the transcript rules, the policy, the
fallbacks when the model is missing, broken, late or busy, and the per-node ``turn:`` block."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from turn_fixtures import (
    COMPLETE,
    PAIRS,
    PAUSED,
    espeak_clip,
    paused_text,
    silence,
)

from ivr.call.turn_end import (
    EndOfTurnDetector,
    judge_words,
    silence_needed_ms,
    text_completeness,
)
from ivr.callio.io import ListenSpec
from ivr.callio.turn_policy import DEFAULT_POLICIES, Expect, TurnPolicy, policy_for
from ivr.engines.smart_turn import (
    SAMPLE_RATE,
    SmartTurnModel,
    features,
    find_model_file,
    log_mel,
    model_input,
)
from ivr.errors import ProviderError
from ivr.flows.loader import check_flow_text, load_flow_text
from ivr.flows.nodes import AgentNode, AskNode, MenuNode
from ivr.flows.waits import listen_spec
from ivr.stt.whisper_local import last_word_probability

pytestmark = pytest.mark.engines


def turn_model_count(outcome: str) -> float:
    value = REGISTRY.get_sample_value("ivr_turn_model_total", {"outcome": outcome})
    return value or 0.0


@pytest.fixture(scope="module")
def shared_model() -> Iterator[SmartTurnModel]:
    model = SmartTurnModel(timeout_s=5.0)
    model.load_sync()
    yield model
    asyncio.run(model.aclose())


@pytest_asyncio.fixture
async def fresh_model() -> AsyncIterator[SmartTurnModel]:
    """A model of the test's own (its timeout or queue are changed by the test)."""
    model = SmartTurnModel(timeout_s=5.0)
    await model.load()
    yield model
    await model.aclose()  # waits for a prediction the test gave up on


# ---------------------------------------------------------------- the model and its features


def test_the_model_comes_from_the_installed_wheel_without_importing_pipecat(
    shared_model: SmartTurnModel,
) -> None:
    path = find_model_file()
    assert path.name == "smart-turn-v3.2-cpu.onnx" and path.stat().st_size > 8_000_000
    assert shared_model.loaded
    assert "pipecat" not in sys.modules


def test_a_short_turn_is_left_padded_to_eight_seconds_and_normalised() -> None:
    tone = (np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE) / SAMPLE_RATE) * 8000).astype("<i2")
    window = model_input(tone.tobytes())
    assert window.shape == (8 * SAMPLE_RATE,)
    assert abs(float(window.mean())) < 1e-3 and abs(float(window.std()) - 1.0) < 1e-3
    head = window[: 7 * SAMPLE_RATE]
    assert np.ptp(head) == 0.0  # the padding is one constant: zeros, shifted by the mean


def test_a_tone_lights_the_mel_band_of_its_frequency() -> None:
    def loudest_band(hz: float) -> int:
        t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
        pcm = (np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes()
        mel = log_mel(model_input(pcm))
        assert mel.shape == (80, 800) and mel.dtype == np.float32
        return int(mel[:, -100:].mean(axis=1).argmax())

    # Slaney mel scale over 0-8 kHz, 80 bands: linear to 1 kHz (band 26 is centred on it),
    # logarithmic above (3 kHz lands in band 55); 300 Hz in band 7.
    assert 25 <= loudest_band(1000) <= 27
    assert 54 <= loudest_band(3000) <= 56
    assert 6 <= loudest_band(300) <= 8


def test_phone_audio_is_resampled_to_the_models_rate() -> None:
    eight_k = espeak_clip("Please cancel my appointment for tomorrow morning.")
    feats = features(eight_k, 8000)
    assert feats.shape == (1, 80, 800)
    # Nothing above 4 kHz survives the phone line: the top bands sit at the floor.
    top = feats[0, 70:, -150:]
    assert float(top.max()) < float(feats[0, :40, -150:].max()) - 0.5


def test_finished_sentences_score_higher_than_the_same_sentences_paused_mid_clause(
    shared_model: SmartTurnModel,
) -> None:
    # espeak only: piper's voice is rendered with random noise, so its clips (and scores)
    # change with each render.
    finished = [shared_model.predict(espeak_clip(t), 8000) for t in COMPLETE]
    paused = [shared_model.predict(espeak_clip(paused_text(t)), 8000) for t in PAUSED]
    # Single clips are not asserted beyond the clearest one: the int8 model's scores move
    # with the CPU's int8 kernels (an AVX2-only EPYC scores "We moved to a new house last
    # month." 0.20 where a VNNI machine gave over 0.6, and separates the set by 0.08 on
    # average where that one did by more than 0.15).
    assert finished[0] > 0.6 and paused[0] < 0.3, (PAIRS[0], finished[0], paused[0])
    assert np.mean(finished) > np.mean(paused) + 0.05, (finished, paused)
    assert sum(p >= 0.5 for p in finished) > sum(p >= 0.5 for p in paused), (finished, paused)


async def test_a_prediction_runs_off_the_event_loop(fresh_model: SmartTurnModel) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.002)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        p = await fresh_model.probability(espeak_clip("Yes, that is correct."), 8000)
    finally:
        ticker.cancel()
    assert 0.0 <= p <= 1.0
    assert ticks >= 3  # the loop kept running while the model worked (tens of ms)


# ---------------------------------------------------------------- falling back


async def test_a_missing_model_file_leaves_the_detector_on_silence(tmp_path: Path) -> None:
    detector = EndOfTurnDetector(SmartTurnModel(tmp_path / "nowhere.onnx"))
    before = turn_model_count("unavailable")
    with capture_logs() as logs:
        await detector.start()
        decision = await detector.decide(TurnPolicy(), espeak_clip("Hello there."))
    assert not detector.available
    assert decision.p_audio is None and decision.silence_ms == TurnPolicy().fallback_silence_ms
    assert turn_model_count("unavailable") == before + 1
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["turn_model.fallback"]
    assert "nowhere.onnx" in warnings[0]["error"]


async def test_a_corrupt_model_file_is_refused_with_its_path(tmp_path: Path) -> None:
    garbage = tmp_path / "smart-turn.onnx"
    garbage.write_bytes(b"\x08\x07not an onnx model" * 1000)
    with pytest.raises(ProviderError, match=r"cannot load .*smart-turn\.onnx"):
        await SmartTurnModel(garbage).load()
    detector = EndOfTurnDetector(SmartTurnModel(garbage))
    await detector.start()
    assert await detector.audio_probability(espeak_clip("Hello there.")) is None


async def test_a_late_answer_is_no_answer_and_repeated_ones_pause_the_model(
    fresh_model: SmartTurnModel,
) -> None:
    fresh_model.timeout_s = 0.001
    detector = EndOfTurnDetector(fresh_model, max_failures=3, cooldown_s=60)
    clip = espeak_clip("I lost my card yesterday and I need a new one.")
    before = turn_model_count("timeout")
    with capture_logs() as logs:
        answers = [await detector.audio_probability(clip) for _ in range(3)]
        assert not detector.available  # paused after 3 in a row: no more CPU spent on it
        paused = await detector.audio_probability(clip)
    assert answers == [None, None, None] and paused is None
    assert turn_model_count("timeout") == before + 3
    events = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert events == ["turn_model.fallback", "turn_model.paused"]  # one warning, not three


async def test_a_busy_model_refuses_at_once_instead_of_queueing() -> None:
    model = SmartTurnModel(timeout_s=5.0, workers=1, max_pending=1)
    await model.load()
    detector = EndOfTurnDetector(model)
    clip = espeak_clip("Can you tell me when you are open on Saturday?")
    before = turn_model_count("timeout")
    first = asyncio.create_task(detector.audio_probability(clip))
    await asyncio.sleep(0)  # the first is now pending
    second = await detector.audio_probability(clip)
    assert second is None and turn_model_count("timeout") == before + 1
    assert isinstance(await first, float)
    assert model.pending == 0
    await model.aclose()


async def test_a_failing_prediction_counts_as_an_error_and_never_raises(
    shared_model: SmartTurnModel,
) -> None:
    detector = EndOfTurnDetector(shared_model)
    before = turn_model_count("error")
    assert await detector.audio_probability(b"\x00\x01\x02") is None  # odd length: not PCM16
    assert turn_model_count("error") == before + 1
    assert await detector.audio_probability(espeak_clip("Yes.")) is not None  # still usable


async def test_the_model_answer_is_counted_as_complete_or_incomplete(
    shared_model: SmartTurnModel,
) -> None:
    detector = EndOfTurnDetector(shared_model)
    complete, incomplete = turn_model_count("complete"), turn_model_count("incomplete")
    p_done = await detector.audio_probability(espeak_clip(COMPLETE[0]))
    p_open = await detector.audio_probability(espeak_clip(paused_text(PAUSED[0])))
    assert p_done is not None and p_open is not None and p_done > 0.5 > p_open
    assert turn_model_count("complete") == complete + 1
    assert turn_model_count("incomplete") == incomplete + 1


async def test_the_model_is_not_asked_when_the_transcript_decides(
    shared_model: SmartTurnModel,
) -> None:
    detector = EndOfTurnDetector(shared_model)
    asked = turn_model_count("complete") + turn_model_count("incomplete")
    clip = espeak_clip("My account number is four five six,")
    open_clause = await detector.decide(policy_for("any"), clip, "My account number is")
    assert open_clause.silence_ms == 1500 and open_clause.p_audio is None
    yes = await detector.decide(policy_for("yes_no"), espeak_clip("Yes."), "Yes.")
    assert yes.silence_ms == 200 and yes.text == "complete"
    assert turn_model_count("complete") + turn_model_count("incomplete") == asked
    unsure = await detector.decide(policy_for("any"), espeak_clip(COMPLETE[0]), None)
    assert unsure.p_audio is not None and unsure.p_audio > 0.5 and unsure.silence_ms == 300
    trusting = replace(policy_for("any"), complete_above=0.7)
    sure = await detector.decide(trusting, espeak_clip(COMPLETE[0]), "I would like to check")
    assert sure.p_audio is not None and sure.silence_ms == 250
    paused = await detector.decide(policy_for("any"), espeak_clip(paused_text(PAUSED[0])))
    assert paused.p_audio is not None and paused.silence_ms == 1500


def test_no_engine_at_all_is_silence_endpointing() -> None:
    detector = EndOfTurnDetector(None)
    assert not detector.available
    decision = asyncio.run(detector.decide(policy_for("digits"), silence(1.0), "let me see"))
    assert decision.silence_ms == DEFAULT_POLICIES["digits"].fallback_silence_ms


# ---------------------------------------------------------------- the transcript


@pytest.mark.parametrize(
    ("transcript", "expect", "digits", "verdict"),
    [
        ("I would like to check the balance on my", "any", None, "incomplete"),
        ("I'd like to pay my bill and", "any", None, "incomplete"),
        ("So, my number is", "any", None, "incomplete"),
        ("Can you tell me, uh", "any", None, "incomplete"),
        ("I think it was...", "any", None, "incomplete"),
        ("I want to pay my bill.", "any", None, "unknown"),
        ("My account number is four five six", "any", None, "number"),  # of unknown length
        ("My account number is 4, 5, 6.", "any", None, "number"),
        ("I'd like two tickets", "any", None, "unknown"),
        ("I was born in 1985", "any", None, "unknown"),
        ("Room 12", "any", None, "unknown"),
        ("We moved to a new", "any", None, "incomplete"),
        ("I want a refund", "any", None, "unknown"),
        ("It's the same", "any", None, "unknown"),
        ("I think so.", "any", None, "unknown"),
        ("That's what it is.", "any", None, "unknown"),  # an embedded clause, over
        ("I know what I have", "any", None, "unknown"),
        ("Yes, that is", "any", None, "unsure"),  # "Yes, that is." or "that is correct"
        ("I lost my card and I have", "any", None, "unsure"),
        ("Yes, it is", "yes_no", None, "complete"),  # the "yes" is what a yes/no node needs
        ("No, that's all. Thank you.", "any", None, "complete"),
        ("Yes.", "yes_no", None, "complete"),
        ("No", "yes_no", None, "complete"),
        ("Yeah, that's right.", "yes_no", None, "complete"),
        ("Yes, but", "yes_no", None, "incomplete"),
        ("No, I want to", "yes_no", None, "incomplete"),
        ("Hmm, let me think", "yes_no", None, "unknown"),
        ("4 5 6", "digits", 8, "incomplete"),
        ("four five six seven, eight", "digits", 8, "incomplete"),
        ("4567 8901", "digits", 8, "complete"),
        ("It's 1, 2, 3, 4, 5.", "digits", 5, "complete"),
        ("four five six", "digits", None, "number"),
        ("It's", "digits", 5, "incomplete"),
        ("", "any", None, "unknown"),
        (None, "yes_no", None, "unknown"),
    ],
)
def test_the_transcript_says_whether_the_answer_is_finished(
    transcript: str | None, expect: str, digits: int | None, verdict: str
) -> None:
    assert text_completeness(transcript, expect, digits) == verdict  # type: ignore[arg-type]


def test_a_number_named_and_an_unsure_last_word_leave_the_turn_open_longer() -> None:
    # An STT writes "four five six" as "456": after "number" the digits may go on.
    assert text_completeness("My account number is 456.") == "number"
    assert text_completeness("My number is 4567 8.") == "number"
    assert text_completeness("My phone number is 555 123 4567.") == "unknown"  # all ten
    assert text_completeness("I was born in 1985.") == "unknown"
    # A last word the STT doubts: small models "finish" a dangling word ("for" -> "for it.").
    assert text_completeness("I'd like a table for it.", last_word_probability=0.64) == "unsure"
    assert text_completeness("I'd like a table for it.", last_word_probability=0.97) == "unknown"
    assert text_completeness("I'd like a table for", last_word_probability=0.99) == "incomplete"
    assert text_completeness("Yes.", "yes_no", last_word_probability=0.5) == "complete"


def test_the_last_word_is_its_tokens_and_trailing_punctuation_averaged() -> None:
    pieces = [" I", " need", " the", " cam", "era", "."]
    probabilities = [0.9, 0.9, 0.9, 0.2, 0.6, 0.7]
    # " cam" + "era" + "." is the last word: (0.2 + 0.6 + 0.7) / 3.
    assert last_word_probability(probabilities, pieces) == pytest.approx(0.5)
    assert last_word_probability(probabilities[:3], pieces[:3]) == pytest.approx(0.9)
    assert last_word_probability([0.7], ["."]) is None  # punctuation only
    assert last_word_probability([0.4, 0.8], ["Yes", "."]) == pytest.approx(0.6)  # one word


def test_whisper_s_words_at_a_mid_sentence_pause_never_end_the_turn_early() -> None:
    # The offline STT 60 ms into each of the 16 pauses (as speculation transcribes them): it
    # drops or rewrites the dangling word ("the" -> "them.", "four five six" -> "456.",
    # "yesterday and" -> "yesterday."), and the rules still hold every turn open past a
    # 700 ms pause with its words and the last word's probability. Without the probability
    # 10 of these 16 end at 300 ms. The engine as the gateway builds it (beam search).
    # espeak, not piper: piper renders with random noise, so its clips (and whisper's words)
    # change with every render.
    from ivr.audio.resample import resample
    from ivr.config import Settings
    from ivr.stt.build import build_stt

    tail = 2 * round(8000 * 0.14)  # the clips' 200 ms of pause -> 60 ms
    clips = [espeak_clip(paused_text(cut))[:-tail] for cut in PAUSED]

    async def transcribe_all() -> list[tuple[str, float | None]]:
        stt = build_stt(Settings(_env_file=None, stt_provider="local"))  # type: ignore[call-arg]
        try:
            heard = [await stt.transcribe(resample(c, 8000, stt.sample_rate)) for c in clips]
        finally:
            await stt.aclose()
        return [(t.text, t.last_word_probability) for t in heard]

    heard = asyncio.run(transcribe_all())
    policy = policy_for("any")
    waits = {
        text: silence_needed_ms(policy, None, text_completeness(text, last_word_probability=p))
        for text, p in heard
    }
    # Under 700 ms: a number read out ("four five six" -> "456.") waits exactly 700 ms, the
    # longest issue 22 lets a number of unknown length hold the turn.
    early = {text: ms for text, ms in waits.items() if ms < 700}
    assert len(early) <= 1, (early, heard)  # a mishearing that looks finished may slip through
    assert all(p is not None and 0.0 <= p <= 1.0 for _, p in heard), heard


# ---------------------------------------------------------------- the policy


def test_silence_needed_follows_the_text_then_the_model_then_the_fallback() -> None:
    policy = TurnPolicy(min_silence_ms=250, max_silence_ms=1500, fallback_silence_ms=800)
    assert silence_needed_ms(policy, 0.99, "incomplete") == 1500  # the words win
    assert silence_needed_ms(policy, 0.01, "complete") == 250
    assert silence_needed_ms(policy, None, "unknown") == 800
    assert silence_needed_ms(policy, 0.01, "unsure") == 1150  # halfway to the longest pause
    assert silence_needed_ms(policy, 0.2, "unknown") == 1500  # the model lengthens...
    assert silence_needed_ms(policy, 0.999, "unknown") == 800  # ...but by default never shortens
    trusting = replace(policy, complete_above=0.9)
    assert silence_needed_ms(trusting, 0.95, "unknown") == 250
    assert silence_needed_ms(trusting, 0.7, "unknown") == 800
    assert silence_needed_ms(trusting, 0.3, "unknown") == 1500
    with pytest.raises(ValueError, match="incomplete_below <= complete_above"):
        replace(policy, complete_above=0.3)


def test_a_700_ms_mid_sentence_pause_is_never_cut_when_the_words_are_open() -> None:
    expects: tuple[Expect, ...] = ("any", "digits", "yes_no")
    for expect in expects:
        policy = policy_for(expect, digits=8 if expect == "digits" else None)
        verdicts = [judge_words(policy, cut) for cut in PAUSED]
        said = list(zip(PAUSED, verdicts, strict=True))
        # All but "Yes, that is" (which may be a whole answer) and the account number end on
        # an open word; that one waits halfway (but on a yes/no node, where its "yes" is the
        # answer). Three digits of an eight-digit number wait as long as an open clause; of a
        # number of unknown length, "number" waits 700 ms, no longer (issue 22).
        assert verdicts.count("incomplete") >= 14, said
        for cut, verdict in said:
            if expect == "yes_no" and cut.startswith("Yes"):
                continue
            if expect != "digits" and "four five six" in cut:
                assert verdict == "number", (cut, verdict)
                assert silence_needed_ms(policy, 0.99, verdict) == 700
                continue
            assert verdict in ("incomplete", "unsure"), (cut, verdict)
            assert silence_needed_ms(policy, 0.99, verdict) > 700  # whatever the model says


def test_defaults_by_what_the_node_expects() -> None:
    digits, anything, yes_no = policy_for("digits"), policy_for("any"), policy_for("yes_no")
    assert digits.min_silence_ms > anything.min_silence_ms > yes_no.min_silence_ms
    assert digits.max_silence_ms > anything.max_silence_ms > yes_no.max_silence_ms
    assert policy_for("any", max_silence_ms=250).fallback_silence_ms == 250  # pulled down
    assert policy_for("any", min_silence_ms=700).fallback_silence_ms == 700  # pulled up
    assert policy_for("yes_no", min_silence_ms=1200).max_silence_ms == 1200
    with pytest.raises(ValueError, match="min_silence_ms <= fallback_silence_ms"):
        TurnPolicy(min_silence_ms=900, max_silence_ms=500)


# ---------------------------------------------------------------- per node, from YAML

FLOW = """\
name: t
start: account
nodes:
  account:
    kind: ask
    prompt: Say your account number.
    digits: {num_digits: 8}
    store: account
    turn: {expect: digits, max_silence_ms: 2000}
    next: sure
  sure:
    kind: menu
    prompt: Is that right? Press 1 for yes.
    options: [{key: "1", say: ["yes"], next: talk}]
    turn: {expect: yes_no}
  talk:
    kind: agent
    system: You help.
    turn: {min_silence_ms: 300}
    on_no_input: hangup
"""


def test_a_turn_block_reaches_the_listen_spec() -> None:
    flow = load_flow_text(FLOW, "t.yaml")
    account, sure, talk = (flow.nodes[n] for n in ("account", "sure", "talk"))
    assert isinstance(account, AskNode) and isinstance(sure, MenuNode)
    assert isinstance(talk, AgentNode)
    spec = listen_spec(flow, account)
    assert spec.turn.expect == "digits" and spec.turn.digits == 8  # from digits.num_digits
    assert (spec.turn.min_silence_ms, spec.turn.max_silence_ms) == (300, 2000)
    assert listen_spec(flow, sure).turn == policy_for("yes_no")
    assert listen_spec(flow, talk).turn == policy_for("any", min_silence_ms=300)
    assert ListenSpec().turn == TurnPolicy()  # the text-mode runner's default


def test_a_node_without_a_turn_block_gets_the_default_policy() -> None:
    flow = load_flow_text(FLOW.replace("    turn: {expect: yes_no}\n", ""), "t.yaml")
    sure = flow.nodes["sure"]
    assert isinstance(sure, MenuNode)
    assert listen_spec(flow, sure).turn == DEFAULT_POLICIES["any"]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("{min_silence_ms: 1800, max_silence_ms: 900}", "min_silence_ms (1800) is above"),
        ("{expect: sentence}", "'any', 'digits', 'yes_no', 'zip' or 'date'"),
        ("{expect: any, digits: 5}", "only applies with 'expect: digits'"),
        ("{max_silence_ms: 60000}", "less than or equal to 5000"),
        ("{min_silence_ms: 200, fallback_silence_ms: 150}", "must lie between"),
        ("{pause: 300}", "pause"),
    ],
)
def test_a_bad_turn_block_is_an_error_at_its_line(block: str, message: str) -> None:
    text = FLOW.replace("turn: {expect: digits, max_silence_ms: 2000}", f"turn: {block}")
    flow, problems = check_flow_text(textwrap.dedent(text), "t.yaml")
    assert flow is None
    hits = [p for p in problems if message in p.message]
    assert len(hits) == 1, problems
    assert (hits[0].file, hits[0].line) == ("t.yaml", 9)
    assert "turn" in str(hits[0])
