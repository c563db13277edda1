"""Speculative turns through the real gateway: STT, the LLM and TTS of the first sentence start
while the caller's endpoint silence runs, are kept when the turn ends on the same words and are
thrown away (requests cancelled, nothing heard, nothing in the history) when the caller goes on.

The caller is the simulated Twilio media stream; the providers are a real local server speaking
OpenAI's wire formats (FakeOpenAIServer), so every request below really went over HTTP.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory, dial
from prometheus_client import REGISTRY

from ivr.config import CLOUD_HEARD_WITHIN
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.testing.audio import voiced_seconds
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault

pytestmark = pytest.mark.slow

FLOWS = Path(__file__).resolve().parent.parent / "flows"


def speculations(stage: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "ivr_speculations_total", {"stage": stage, "outcome": outcome}
    )
    return value or 0.0


def counts() -> dict[str, float]:
    return {
        f"{stage}.{outcome}": speculations(stage, outcome)
        for stage in ("stt", "llm", "tts")
        for outcome in ("used", "wasted", "failed")
    }


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counts().items() if v - before[k]}


def answer_by_last_words(request: dict[str, Any], token_delay: float = 0.0) -> ChatScript:
    """A reply that says which words it answers, so the test can tell replies apart."""
    last = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    return ChatScript(text=f"You said {last}. Anything else?", token_delay=token_delay)


async def test_a_finished_turn_uses_the_stt_llm_and_tts_started_during_its_silence(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    before = counts()
    async with gateway_factory(speculate_after_ms=100) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    # One request per stage: the speculative ones were adopted, nothing was asked twice.
    assert len(fake_openai.requests_for("transcriptions")) == 1
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 1 and chats[0].outcome == "completed"
    used = delta(before)
    assert used.get("stt.used") == 1 and used.get("llm.used") == 1, used
    assert used.get("tts.used") == 1, used
    assert not any(k.endswith((".wasted", ".failed")) for k in used), used
    reply = report.turns[-1]
    assert reply.bot_text is None or "opening hours" in (reply.bot_text or "")
    assert reply.bot_audio_seconds > 0


async def test_caller_going_on_after_a_pause_cancels_the_speculation_unheard(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # Transcripts in request order: the first pause, then the whole utterance.
    fake_openai.transcripts_per_utterance = False
    fake_openai.transcripts.extend(["check my balance", "check my balance then an agent"])
    # A slow model: the speculative request is still streaming when the caller goes on.
    fake_openai.chat = lambda request: answer_by_last_words(request, token_delay=0.15)
    before = counts()
    script: list[Any] = [
        {"say": "Check my balance.", "wait": False},
        {"silence": 0.18},  # longer than the 100 ms pause, shorter than the 300 ms end
        {"say": "Then an agent.", "wait": False},
    ]
    async with gateway_factory(speculate_after_ms=100) as server:
        report = await dial(server, script)
    assert not report.errors and not report.violations, report.format_transcript()
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 2, [c.json for c in chats]
    speculative, committed = chats
    assert speculative.json is not None and committed.json is not None
    assert speculative.json["messages"][-1]["content"] == "check my balance"
    assert speculative.outcome == "disconnected"  # cancelled while it streamed
    assert committed.json["messages"][-1]["content"] == "check my balance then an agent"
    # Nothing of the speculative reply reached the caller, nor the history.
    users = [m["content"] for m in committed.json["messages"] if m["role"] == "user"]
    assert "check my balance" not in users
    heard = [t.bot_text for t in report.turns if t.bot_audio_seconds > 0]
    assert not any("You said check my balance." in (text or "") for text in heard), heard
    counted = delta(before)
    assert counted.get("stt.wasted") == 1 and counted.get("llm.wasted") == 1, counted
    assert counted.get("stt.used") == 1 and counted.get("llm.used") == 1, counted


async def test_a_speculative_stt_failure_is_never_heard(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    # The request made at the pause fails (not retryable); the finished turn asks again.
    fake_openai.faults["transcriptions"] = Fault(status=400, times=1)
    before = counts()
    async with gateway_factory(speculate_after_ms=100) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    stt = fake_openai.requests_for("transcriptions")
    assert len(stt) == 2
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 1
    assert chats[0].json is not None
    assert chats[0].json["messages"][-1]["content"] == "what are your opening hours"
    assert delta(before).get("stt.failed") == 1
    # The caller heard the answer, not the "sorry, I didn't catch that" prompt.
    assert "opening hours" in (report.turns[-1].bot_text or report.format_transcript())


async def test_speculation_off_sends_each_request_after_the_turn_ends(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    before = counts()
    async with gateway_factory(speculate_after_ms=0) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 1
    caller_end = report.turns[-1].caller_end_t
    # Without speculation the model is asked only after the 300 ms endpoint silence.
    assert chats[0].time >= caller_end + 0.3
    assert delta(before) == {}


async def test_the_same_words_after_a_resumed_pause_need_no_second_llm_request(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The caller pauses, makes a sound that STT hears as nothing new (a breath, "uh"), and
    # stops: both pauses transcribe to the same words, so the reply started at the first is kept.
    fake_openai.transcripts_per_utterance = False
    fake_openai.transcripts.extend(["check my balance", "check my balance"])
    fake_openai.chat = lambda request: answer_by_last_words(request, token_delay=0.05)
    before = counts()
    script: list[Any] = [
        {"say": "Check my balance.", "wait": False},
        {"silence": 0.18},
        {"say": "Uh.", "wait": False},
    ]
    async with gateway_factory(speculate_after_ms=60) as server:
        report = await dial(server, script)
    assert not report.errors and not report.violations, report.format_transcript()
    assert len(fake_openai.requests_for("transcriptions")) == 2
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 1 and chats[0].outcome == "completed"
    counted = delta(before)
    assert counted.get("llm.used") == 1 and "llm.wasted" not in counted, counted
    assert counted.get("stt.wasted") == 1 and counted.get("stt.used") == 1, counted


# -- end of turn: the words at a pause move the end -------------------------------------------

PAUSE_TO_LOOK_IT_UP: list[Any] = [
    {"say": "My account number is", "wait": False},
    {"silence": 0.7},
    {"say": "four five six.", "wait": False},
]


def assert_one_reply_to_the_whole_sentence(report: CallReport, fake: FakeOpenAIServer) -> None:
    assert not report.errors and not report.violations, report.format_transcript()
    chats = fake.requests_for("chat")
    assert len(chats) == 1, [c.json for c in chats]
    assert chats[0].json is not None
    users = [m["content"] for m in chats[0].json["messages"] if m["role"] == "user"]
    assert users == ["my account number is 4 5 6"], users


async def test_a_700_ms_pause_after_an_open_clause_does_not_end_the_turn(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # "My account number is" leaves the clause open: the turn waits the node's longest pause
    # (1.5 s), so the caller's 0.7 s pause to look up the number does not cut them off.
    fake_openai.transcripts_per_utterance = False
    fake_openai.transcripts.extend(["my account number is", "my account number is 4 5 6"])
    fake_openai.chat = answer_by_last_words
    async with gateway_factory(speculate_after_ms=60, turn_model="off") as server:
        report = await dial(server, PAUSE_TO_LOOK_IT_UP)
    assert_one_reply_to_the_whole_sentence(report, fake_openai)


def heard_before_the_caller_finished(report: CallReport) -> list[float]:
    """Bot audio that reached the caller before their last words ended (a cut-off)."""
    caller = [t for t in report.turns if t.caller_text is not None]
    done = caller[-1].caller_end_t
    return [
        t.bot_first_audio_t
        for t in caller
        if t.bot_first_audio_t is not None and t.bot_first_audio_t < done
    ]


async def test_a_700_ms_pause_after_words_that_may_go_on_does_not_end_the_turn(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # "I think that is" may be a whole answer or go on ("... correct"): the turn waits
    # halfway to the longest pause (900 ms), past the caller's 700 ms pause; the 300 ms it
    # waited before cut them off.
    fake_openai.transcribe = lambda wav, form: (
        "I think that is correct" if voiced_seconds(wav) > 1.0 else "I think that is"
    )
    fake_openai.chat = answer_by_last_words
    script: list[Any] = [
        {"say": "I think that is,", "wait": False},
        {"silence": 0.7},
        {"say": "correct.", "wait": False},
    ]
    async with gateway_factory(speculate_after_ms=60, turn_model="off") as server:
        report = await dial(server, script)
    assert not report.errors and not report.violations, report.format_transcript()
    assert heard_before_the_caller_finished(report) == [], report.format_transcript()
    chats = [c.json for c in fake_openai.requests_for("chat") if c.json is not None]
    users = [[m["content"] for m in chat["messages"] if m["role"] == "user"] for chat in chats]
    assert users[-1] == ["I think that is correct"], users


async def test_a_caller_who_goes_on_after_their_turn_ended_is_answered_whole(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The turn ends at the caller's pause (they paused longer than it waits) and the reply is
    # on its way, slow, when they go on: "right". Before a word of the reply was heard, that
    # is the rest of their sentence, not a backchannel to a reply they never heard: the reply
    # is dropped and the model is asked about the whole sentence, as one caller message.
    fake_openai.transcribe = lambda wav, form: (
        "I think that is" if voiced_seconds(wav) > 0.6 else "right"
    )

    def slow_unless_whole(request: dict[str, Any]) -> ChatScript:
        reply = answer_by_last_words(request)
        if "right" in request["messages"][-1]["content"]:
            return reply
        return replace(reply, first_token_delay=1.5)  # still coming when the caller goes on

    fake_openai.chat = slow_unless_whole
    script: list[Any] = [
        {"say": "I think that is,", "wait": False},
        {"silence": 1.1},  # longer than the 900 ms that "that is" waits
        {"say": "right.", "wait": False},
        {"silence": 2.5},
    ]
    async with gateway_factory(speculate_after_ms=60, turn_model="off") as server:
        report = await dial(server, script)
    assert not report.errors and not report.violations, report.format_transcript()
    chats = [c.json for c in fake_openai.requests_for("chat") if c.json is not None]
    users = [[m["content"] for m in chat["messages"] if m["role"] == "user"] for chat in chats]
    assert users[-1] == ["I think that is right"], users
    spoken = " ".join(r.json["input"] for r in fake_openai.requests_for("speech") if r.json)
    assert "You said I think that is right." in spoken, spoken
    assert heard_before_the_caller_finished(report) == [], report.format_transcript()


async def test_words_that_come_after_the_endpoint_silence_still_keep_the_turn_open(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # An STT slower than the 300 ms endpoint silence (offline whisper takes ~0.4 s): the words
    # at the pause arrive after that silence would have ended the turn. The turn waits for
    # them, they leave the clause open, and the caller gets to finish the sentence.
    fake_openai.transcripts_per_utterance = False
    fake_openai.transcripts.extend(["my account number is", "my account number is 4 5 6"])
    fake_openai.chat = answer_by_last_words
    fake_openai.faults["transcriptions"] = Fault(delay=0.5)
    async with gateway_factory(speculate_after_ms=60, turn_model="off") as server:
        report = await dial(server, PAUSE_TO_LOOK_IT_UP)
    assert_one_reply_to_the_whole_sentence(report, fake_openai)


async def test_an_stt_that_never_answers_leaves_the_re_ask_in_time(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The pause's words never come (STT stalls): the turn may wait for them, but not so long
    # that the "sorry, I didn't catch that" misses the turn deadline (1.5 s with cloud
    # providers): the turn ends before it, and the re-ask is heard within it.
    fake_openai.faults["transcriptions"] = Fault(hang=True)
    within_ms = round(CLOUD_HEARD_WITHIN * 1000)
    async with gateway_factory(
        speculate_after_ms=60, turn_model="off", heard_within_ms=within_ms
    ) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.violations, report.format_transcript()
    [turn] = [t for t in report.turns if t.caller_text is not None]
    assert turn.bot_first_audio_t is not None, report.format_transcript()
    # No words, so no model request: what the caller heard is the cached re-ask.
    assert fake_openai.requests_for("chat") == [] and turn.bot_audio_seconds > 1.0
    heard_after = turn.bot_first_audio_t - turn.caller_end_t
    assert heard_after < CLOUD_HEARD_WITHIN - 0.05, f"re-ask heard {heard_after:.3f} s after"


async def test_without_the_words_the_same_pause_cuts_the_caller_off(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The control: turns that end on 300 ms of silence alone end at the 0.7 s pause.
    fake_openai.transcripts.extend(["my account number is", "4 5 6"])
    fake_openai.chat = answer_by_last_words
    async with gateway_factory(speculate_after_ms=0) as server:
        report = await dial(server, PAUSE_TO_LOOK_IT_UP)
    assert not report.errors
    chats = fake_openai.requests_for("chat")
    assert chats and chats[0].json is not None
    users = [m["content"] for m in chats[0].json["messages"] if m["role"] == "user"]
    assert users[0] == "my account number is", users


async def test_words_that_settle_nothing_are_judged_by_the_audio_turn_model(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # "what are your opening hours" neither leaves a clause open nor closes the call: the
    # Smart Turn model (from the pipecat-ai wheel, off the event loop) is asked, once.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words

    def asked() -> float:
        return sum(
            REGISTRY.get_sample_value("ivr_turn_model_total", {"outcome": o}) or 0.0
            for o in ("complete", "incomplete", "timeout", "error", "unavailable")
        )

    before = asked()
    async with gateway_factory(speculate_after_ms=60, turn_model="smart-turn") as server:
        assert server.gateway.services.turn_model is not None
        assert server.gateway.services.turn_model.available
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    assert asked() - before == 1
    assert report.turns[-1].bot_audio_seconds > 0


async def test_a_speculative_llm_request_that_is_reset_is_never_heard(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The reply requested at the pause is reset before its headers: the prefetch failed, so
    # the finished turn sends its own request and the caller hears the answer, with no
    # apology; the failure is counted for the SRE.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    fake_openai.faults["chat"] = Fault(drop=True, times=1)
    before = counts()
    errors_before = REGISTRY.get_sample_value(
        "ivr_provider_errors_total", {"stage": "llm", "provider": "openai_compat", "kind": "reset"}
    )
    async with gateway_factory(speculate_after_ms=60) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    chats = fake_openai.requests_for("chat")
    assert len(chats) == 2 and chats[-1].outcome == "completed", [c.outcome for c in chats]
    assert delta(before).get("llm.failed") == 1, delta(before)
    errors = REGISTRY.get_sample_value(
        "ivr_provider_errors_total", {"stage": "llm", "provider": "openai_compat", "kind": "reset"}
    )
    assert (errors or 0.0) > (errors_before or 0.0)
    reply = report.turns[-1]
    assert reply.bot_audio_seconds > 0 and reply.latency_s is not None
    assert "opening hours" in (reply.bot_text or report.format_transcript())


async def test_a_speculative_llm_request_that_fails_after_the_turn_took_it_is_never_heard(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The reply requested at the pause is still being tried when the turn ends and takes it
    # over; then it fails (reset half a second in). The turn sends its own request, as it
    # would have without speculation: the caller hears the answer, not the apology.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    fake_openai.faults["chat"] = Fault(drop=True, delay=0.5, times=1)
    before = counts()
    async with gateway_factory(speculate_after_ms=60) as server:
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    chats = fake_openai.requests_for("chat")
    outcomes = [c.outcome for c in chats]
    assert len(chats) == 2 and chats[-1].outcome == "completed", outcomes
    assert delta(before).get("llm.used") == 1, delta(before)
    reply = report.turns[-1]
    assert reply.bot_audio_seconds > 0
    assert "opening hours" in (reply.bot_text or report.format_transcript())
    assert "sorry" not in (reply.bot_text or "").lower(), report.format_transcript()


async def test_a_prefetched_sentence_whose_voice_resets_after_the_turn_took_it_goes_on(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # The first sentence's speech is asked for at the pause and the turn adopts it; then the
    # TTS server resets that answer mid-sentence (800 ms in, streamed at real time). The caller
    # hears its start and then the reply's second sentence: no apology (the reply went on), no
    # second request for the first sentence (its audio had begun), the second one voiced.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    fake_openai.speech_chunk_bytes = 4800  # 100 ms of 24 kHz PCM16
    fake_openai.speech_chunk_delay = 0.1
    before = counts()
    async with gateway_factory(speculate_after_ms=100) as server:
        # Set once startup has voiced its own phrases: the next answer is the prefetch's.
        fake_openai.faults["speech"] = Fault(after_chunks=8, then="reset", times=1)
        report = await dial(server, ["What are your opening hours?"])
    assert not report.errors and not report.violations, report.format_transcript()
    asked = {r.json["input"]: r.outcome for r in fake_openai.requests_for("speech") if r.json}
    first = "You said what are your opening hours."
    assert asked.get(first) == "disconnected" and asked.get("Anything else?") == "completed", asked
    assert [r.json["input"] for r in fake_openai.requests_for("speech") if r.json].count(first) == 1
    assert delta(before).get("tts.used") == 1, delta(before)
    reply = report.turns[-1]
    # ~0.8 s of the first sentence (of ~2.4) and the second (~0.9 s), not the apology.
    assert 1.2 < reply.bot_audio_seconds < 2.6, reply.bot_audio_seconds
    assert "sorry" not in (reply.bot_text or "").lower(), report.format_transcript()


# -- a say node's reply: its first sentence is what the pause prefetches ---------------------

BIKES = "+15550100778"
BIKES_FLOW = """\
name: bikes
numbers: ["+15550100778"]
start: which
variables: {bike: ""}
intents:
  mountain: {description: a mountain bike, examples: [mountain]}
nodes:
  which:
    kind: ask
    prompt: Which bike is it?
    routes:
      - {intent: mountain, next: is_mountain}
    fallback: booked
  is_mountain: {kind: set, values: {bike: mountain bike}, next: booked}
  booked:
    kind: say
    text: Great, a {{ bike }}. Bring it in any time we're open; a repair takes two days.
    next: bye
  bye: {kind: hangup}
"""


def voiced(report: CallReport, fake: FakeOpenAIServer) -> list[str]:
    """The texts the voice was asked for (startup's prompts first), once the call was heard."""
    assert not report.errors and not report.violations, report.format_transcript()
    assert report.turns[-1].bot_audio_seconds > 0
    return [r.json["input"] for r in fake.requests_for("speech") if r.json is not None]


def assert_all_used(counted: dict[str, float], *stages: str) -> None:
    """One prefetch per stage, adopted by the turn; none thrown away or failed."""
    assert all(counted.get(f"{stage}.used") == 1 for stage in stages), counted
    assert not any(k.endswith((".wasted", ".failed")) for k in counted), counted


async def test_a_say_reply_prefetches_its_first_sentence_and_uses_it(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    # Not a static prompt (its words are the caller's): synthesised for this call. The whole
    # text was prefetched once: the reply asks for its first sentence, so the
    # prefetch went unused and, on piper's one worker, made the real request wait behind it.
    flows = tmp_path / "flows"
    shutil.copytree(FLOWS, flows, ignore=shutil.ignore_patterns("tests"))
    (flows / "bikes.yaml").write_text(BIKES_FLOW, encoding="utf-8")
    fake_openai.transcripts.append("a mountain bike")
    before = counts()
    async with gateway_factory(flows_dir=str(flows), speculate_after_ms=100) as server:
        report = await place_call(
            server.base_url,
            script=["A mountain bike."],
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
            to=BIKES,
        )
    asked = voiced(report, fake_openai)
    assert asked.count("Great, a mountain bike.") == 1, asked
    assert not any(text.startswith("Great, a mountain bike. Bring") for text in asked), asked
    assert_all_used(delta(before), "tts")


async def test_a_voice_that_renders_pieces_whole_gets_the_first_words_first_prefetched(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer
) -> None:
    # piper's rule (first_piece_words = 4): the reply's first TTS request is its first four
    # words, and the pause's prefetch cut the LLM's reply the same way, so it was used.
    fake_openai.transcripts.append("what are your opening hours")
    fake_openai.chat = answer_by_last_words
    before = counts()
    async with gateway_factory(speculate_after_ms=100, tts_first_piece_words=4) as server:
        report = await dial(server, ["What are your opening hours?"])
    asked = voiced(report, fake_openai)
    reply = asked[asked.index("You said what are") :]
    assert reply[:3] == ["You said what are", "your opening hours.", "Anything else?"], asked
    assert_all_used(delta(before), "tts", "llm")
