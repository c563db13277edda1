"""The offline engines end to end: TTS speech sent through a phone channel, heard by STT."""

from __future__ import annotations

import asyncio
import audioop
import re
import threading
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
import soxr

from ivr.call.turn_end import UNSURE_LAST_WORD
from ivr.errors import ProviderError, ProviderTimeout
from ivr.stt.whisper_local import LocalWhisperStt
from ivr.tts.espeak_local import LocalEspeakTts, synthesize_pcm16
from ivr.tts.piper_local import LocalPiperTts, split_clauses

pytestmark = [pytest.mark.engines, pytest.mark.asyncio(loop_scope="module")]

THREE_CLAUSES = (
    "Thanks for calling the bank, I can check your balance for you, "
    "or connect you to an agent if you prefer."
)


def phone_channel(pcm16: bytes, rate: int) -> bytes:
    """What a caller's audio goes through: down to 8 kHz mu-law and back up to 16 kHz PCM16."""
    samples = np.frombuffer(pcm16, dtype="<i2")
    narrow = soxr.resample(samples, rate, 8000).astype("<i2").tobytes()
    decoded = audioop.ulaw2lin(audioop.lin2ulaw(narrow, 2), 2)
    wide = soxr.resample(np.frombuffer(decoded, dtype="<i2"), 8000, 16000)
    return bytes(np.clip(wide, -32768, 32767).astype("<i2").tobytes())


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


async def collect(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stt() -> AsyncIterator[LocalWhisperStt]:
    engine = LocalWhisperStt(beam_size=5)
    await engine.warm()
    yield engine
    await engine.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def piper() -> AsyncIterator[LocalPiperTts]:
    engine = LocalPiperTts()
    await engine.warm()
    yield engine
    await engine.aclose()


async def espeak_on_the_line(text: str) -> tuple[bytes, int]:
    """``text`` by espeak through the phone channel (16 kHz PCM16), and espeak's own rate.
    espeak is hard for whisper tiny ("balance" -> "Madeline"); "Please connect me to an
    agent." is a phrase it hears reliably."""
    tts = LocalEspeakTts()
    await tts.warm()
    pcm = await collect(tts.synthesize(text))
    return phone_channel(pcm, tts.sample_rate), tts.sample_rate


async def test_espeak_speech_through_the_phone_channel_is_understood_by_whisper(
    stt: LocalWhisperStt,
) -> None:
    audio, rate = await espeak_on_the_line("Please connect me to an agent.")
    heard = await stt.transcribe(audio)
    assert rate == 22050
    assert {"connect", "agent"} <= words(heard.text), heard.text


async def test_piper_speech_through_the_phone_channel_is_understood_by_whisper(
    stt: LocalWhisperStt, piper: LocalPiperTts
) -> None:
    pcm = await collect(piper.synthesize("Your current balance is forty dollars."))
    heard = await stt.transcribe(phone_channel(pcm, piper.sample_rate))
    assert piper.sample_rate == 22050
    heard_words = words(heard.text)
    assert "balance" in heard_words, heard.text
    assert heard_words & {"forty", "40"}, heard.text
    assert heard.seconds > 0


async def test_whisper_is_sure_of_the_last_word_of_a_sentence_it_heard_well(
    stt: LocalWhisperStt,
) -> None:
    # espeak (repeatable, unlike piper's noisy renders) on the phrase whisper hears reliably,
    # with the gateway's beam search (ivr/providers.py) and greedy decoding alike.
    audio, _rate = await espeak_on_the_line("Please connect me to an agent.")
    greedy = LocalWhisperStt(beam_size=1)
    try:
        heard = [await stt.transcribe(audio), await greedy.transcribe(audio)]
    finally:
        await greedy.aclose()
    for transcript in heard:
        assert "agent" in words(transcript.text), transcript.text
        # The decoder's own probability of "agent." given the audio: ~0.9 here.
        assert transcript.last_word_probability is not None, transcript
        assert transcript.last_word_probability >= UNSURE_LAST_WORD, transcript


async def test_whisper_doubts_a_last_word_it_made_up_at_a_pause(stt: LocalWhisperStt) -> None:
    # Stopped at "...the balance on my," whisper tiny "finishes" the sentence ("on my
    # favorite", "on my..."): the probability of that last word is what holds the turn open.
    audio, _rate = await espeak_on_the_line("I would like to check the balance on my,")
    heard = await stt.transcribe(audio)
    assert heard.last_word_probability is not None, heard
    assert heard.last_word_probability < UNSURE_LAST_WORD, heard


async def test_whisper_keeps_its_words_when_scoring_them_fails(stt: LocalWhisperStt) -> None:
    # The scoring pass runs the decoder over prompt + words, which must fit its 448
    # positions; a repetition loop after a long prompt does not, and CTranslate2 refuses.
    # Driven at the model wrapper with a real 434-token prompt: whisper tiny loops on it
    # ("hello there hello there ..."), which audio alone does not make it do repeatably.
    import ctranslate2

    from ivr.stt.whisper_local import _ScoresItsWords

    scored = stt._model.model  # the engine's own wrapped model, loaded by the fixture
    assert isinstance(scored, _ScoresItsWords)
    tokenizer = stt._model.hf_tokenizer
    features = stt._model.feature_extractor(np.zeros(16000, dtype=np.float32))[None, :, :3000]
    encoded = scored.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)))
    special = ["<|startofprev|>", "<|startoftranscript|>", "<|notimestamps|>"]
    prev, start, no_times = (tokenizer.token_to_id(t) for t in special)
    words = tokenizer.encode(" hello there" * 300).ids[:430]
    results = scored.generate(
        encoded, [[prev, *words, start, no_times]], beam_size=5, max_length=448
    )
    assert len(results[0].sequences_ids[0]) > 14, "whisper looped past the decoder's length"
    assert scored.tokens and scored.probabilities is None


async def test_piper_yields_its_first_chunk_before_the_rest_of_a_three_clause_text(
    piper: LocalPiperTts,
) -> None:
    before = piper.rendered_pieces
    stream = piper.synthesize(THREE_CLAUSES)
    first = await anext(stream)
    # Only the first piece (plus at most the queue's look-ahead) can be done at this point.
    assert len(first) > 0 and len(first) % 2 == 0
    rest = await collect(stream)
    assert len(rest) > len(first)
    assert piper.rendered_pieces - before == 3


async def test_clause_split_cuts_after_commas_and_folds_a_short_tail_back() -> None:
    # async only so the module-wide event-loop mark applies cleanly; nothing here awaits.
    assert split_clauses(list("abcdef, ghijkl, m."), 6) == [list("abcdef,"), list("ghijkl, m.")]
    assert split_clauses(list("ab, cdefgh."), 6) == [list("ab, cdefgh.")]


async def test_cancelling_a_piper_stream_stops_the_work_and_leaves_no_extra_thread(
    piper: LocalPiperTts,
) -> None:
    long_text = " ".join([THREE_CLAUSES] * 4)  # 12 pieces, seconds of work
    threads_before = {t.name for t in threading.enumerate()}
    before = piper.rendered_pieces

    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in piper.synthesize(long_text):
            got_first.set()
            await asyncio.sleep(10)  # a slow consumer: the producer fills the queue and waits

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(150):
        if not piper.rendering:
            break
        await asyncio.sleep(0.02)
    settled = piper.rendered_pieces
    await asyncio.sleep(0.3)
    assert not piper.rendering
    assert piper.rendered_pieces == settled  # nothing keeps rendering in the background
    assert settled - before < 12
    assert {t.name for t in threading.enumerate()} <= threads_before
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "piper-producer"]


async def test_concurrent_transcriptions_queue_and_each_caller_gets_its_own_text(
    stt: LocalWhisperStt,
) -> None:
    agent, rate = await asyncio.to_thread(synthesize_pcm16, "Please connect me to an agent.")
    bill, _ = await asyncio.to_thread(synthesize_pcm16, "I want to pay my bill.")
    first, second = await asyncio.gather(
        stt.transcribe(phone_channel(agent, rate)), stt.transcribe(phone_channel(bill, rate))
    )
    assert "agent" in words(first.text), first.text
    assert "pay" in words(second.text), second.text


async def test_whisper_on_one_second_of_line_noise_returns_little_or_no_text(
    stt: LocalWhisperStt,
) -> None:
    noise = np.random.default_rng(7).normal(0, 100, 16000)  # about -50 dBFS
    heard = await stt.transcribe(noise.astype("<i2").tobytes())
    assert len(heard.text) <= 15, heard.text


async def test_whisper_returns_empty_text_for_empty_audio(stt: LocalWhisperStt) -> None:
    heard = await stt.transcribe(b"")
    assert heard.text == ""


async def test_whisper_rejects_a_half_sample_with_a_clear_error(stt: LocalWhisperStt) -> None:
    with pytest.raises(ValueError, match="whole 16-bit samples, got 3 bytes"):
        await stt.transcribe(b"\x00\x01\x02")


async def test_whisper_raises_provider_timeout_when_decoding_outlasts_the_timeout() -> None:
    engine = LocalWhisperStt(timeout_s=0.001)
    await engine.warm()
    pcm, rate = synthesize_pcm16("Agent please.")
    try:
        with pytest.raises(ProviderTimeout) as caught:
            await engine.transcribe(phone_channel(pcm, rate))
        assert caught.value.retryable
        assert caught.value.provider == "whisper_local"
    finally:
        await engine.aclose()


async def test_espeak_sync_helper_returns_pcm16_at_its_sample_rate() -> None:
    pcm, rate = await asyncio.to_thread(synthesize_pcm16, "One two three.")
    samples = np.frombuffer(pcm, dtype="<i2")
    assert rate == 22050
    assert 0.5 < samples.size / rate < 3.0
    assert np.abs(samples).max() > 3000


async def test_espeak_rejects_an_unknown_voice_by_name() -> None:
    tts = LocalEspeakTts(voice="no-such-voice")
    with pytest.raises(ProviderError, match="unknown espeak voice 'no-such-voice'"):
        await collect(tts.synthesize("hello"))


async def test_a_first_output_limit_bounds_each_offline_engine_for_one_call(
    stt: LocalWhisperStt, piper: LocalPiperTts
) -> None:
    pcm, rate = synthesize_pcm16("Please connect me to an agent.")
    with pytest.raises(ProviderTimeout) as heard:
        await stt.transcribe(phone_channel(pcm, rate), first_output_limit=0.001)
    espeak = LocalEspeakTts()
    for tts in (piper, espeak):
        with pytest.raises(ProviderTimeout) as said:
            await collect(tts.synthesize(THREE_CLAUSES, first_output_limit=0.001))
        assert (said.value.provider, said.value.seconds) == (tts.name, 0.001)
    assert (heard.value.provider, heard.value.seconds) == ("whisper_local", 0.001)
    # One call's limit, not the engine's: the next call has the engine's own.
    assert "agent" in words((await stt.transcribe(phone_channel(pcm, rate))).text)
    assert await collect(piper.synthesize("Hello.", first_output_limit=30.0))
    assert await collect(espeak.synthesize("Hello."))
    for _ in range(150):
        if not piper.rendering:
            break
        await asyncio.sleep(0.02)
    assert not piper.rendering  # the timed-out render did not go on in the background
