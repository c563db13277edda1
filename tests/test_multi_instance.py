"""Issue 4: call state in Redis, proven with real processes. Two ``ivr serve`` processes share a
private redis-server behind a real TCP load balancer; the simulated caller is Twilio, the
providers are a real local server speaking OpenAI's wire formats. Instances are SIGKILLed and
Redis is stopped mid-call; the calls must go on."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from gateway_procs import (
    AGENT_NUMBER,
    AUTH_TOKEN,
    FIRST_REPLY,
    FIRST_TRANSCRIPT,
    LAST_TRANSCRIPT,
    PUBLIC_URL,
    REPO,
    SUPPORT_NUMBER,
    Cluster,
    agent_replies,
    bot_bursts,
    cluster,
    failover_call,
    fast_speak,
    resume_timing,
    speech_seconds,
)
from redis_server import RedisServer

from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_data
from ivr.state.base import CallStatus
from ivr.testing.openai_server import FakeOpenAIServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

RESUME_PROMPT = "Sorry, we were cut off for a moment."  # flows/default.yaml
GREETING = "Hello, you've reached Acme. How can I help you today?"  # flows/default.yaml
PRESS_2 = script_from_data([{"press": "2"}], source="support: agent")  # -> transfer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="sk-test") as server:
        server.speak = fast_speak  # before the gateways start: they pre-synthesise prompts
        yield server


@pytest.fixture
async def two(
    tmp_path: Path, fake: FakeOpenAIServer, redis_server: RedisServer
) -> AsyncIterator[Cluster]:
    async with cluster(tmp_path, fake, redis_server.url, instances=2) as cl:
        yield cl


def chat_history(fake: FakeOpenAIServer, index: int) -> list[str]:
    request = fake.requests_for("chat")[index]
    assert request.json is not None
    return [f"{m['role']}:{m.get('content') or ''}" for m in request.json["messages"]]


def assert_clean(report: CallReport) -> None:
    assert not report.errors and not report.violations, report.format_transcript()


async def test_the_webhook_and_the_stream_land_on_different_instances_and_the_call_completes(
    two: Cluster, fake: FakeOpenAIServer
) -> None:
    fake.transcripts.extend([FIRST_TRANSCRIPT, LAST_TRANSCRIPT])
    fake.chat = agent_replies
    report = await place_call(
        two.lb.url,
        script=["What are your opening hours?", "Thanks, goodbye."],
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        to=AGENT_NUMBER,
    )
    assert_clean(report)
    a, b = two.procs
    [(webhook_conn, _)] = two.lb.requests("POST /twilio/voice")
    [(stream_conn, _)] = two.lb.requests("GET /twilio/stream/")
    assert webhook_conn.backend == a.port and stream_conn.backend == b.port
    # Each process saw only its half: A accepted the webhook, B carried the media.
    assert await a.metric('ivr_webhooks_total{outcome="accepted"}') == 1.0
    assert await b.metric('ivr_webhooks_total{outcome="accepted"}') in (None, 0.0)
    assert b.log_events("call.stream_started", call_sid=report.call_sid)
    assert not a.log_events("call.stream_started", call_sid=report.call_sid)
    record = await two.store.get(report.call_sid)
    assert record is not None, two.tails()
    assert record.instance_id == b.instance_id
    assert record.stream_count == 1
    assert record.status == CallStatus.ENDED and record.end_action == "hangup"
    assert [m.content for m in record.history if m.role == "user"] == [
        FIRST_TRANSCRIPT,
        LAST_TRANSCRIPT,
    ]
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    spoken = [t for t in report.turns if t.bot_audio_seconds > 0]
    assert len(spoken) == 3, report.format_transcript()  # greeting, reply, goodbye


async def test_a_call_survives_a_sigkill_of_the_instance_carrying_it(
    two: Cluster, fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    run = await failover_call(two, tmp_path / "failover.wav")
    report = run.report
    assert_clean(report)
    survivor = next(p for p in two.procs if p is not run.carrier)
    assert not run.carrier.alive and survivor.alive
    # The caller saw the gateway drop the socket, asked the action URL and got a new stream.
    assert [s.ended_by for s in report.streams] == ["gateway", "gateway"], report.streams
    assert len(report.resume_gaps_s) == 1
    # Through the LB, everything after the kill reached the survivor (failing over if needed).
    later = [c for c in two.lb.connections if c.accepted_t > run.killed_at]
    assert later and all(c.backend == survivor.port for c in later), later
    resumed = survivor.log_events("call.resume_requested", call_sid=run.call_sid)
    assert resumed and resumed[0]["node"] == "assistant", survivor.tail()
    assert survivor.log_events("call.stream_started", call_sid=run.call_sid, resumed=True)
    # History survived: the first request after the resume carries the turn before the kill.
    chats = fake.requests_for("chat")
    assert len(chats) == 2, [c.json for c in chats]
    after = chat_history(fake, 1)
    assert after[-3:] == [
        f"user:{FIRST_TRANSCRIPT}",
        f"assistant:{FIRST_REPLY}",
        f"user:{LAST_TRANSCRIPT}",
    ], after
    # The resume prompt was spoken first on the new stream (the fake voice's length is exact).
    timing = resume_timing(report, run.wav_path, two.lb, run.killed_at)
    assert abs(timing.first_burst_s - speech_seconds(RESUME_PROMPT)) < 0.03, timing
    record = await two.store.get(run.call_sid)
    assert record is not None
    assert record.stream_count == 2
    assert record.instance_id == survivor.instance_id
    assert record.status == CallStatus.ENDED and record.end_action == "hangup"
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    print(
        f"\nresume: drop -> audio again {timing.heard_gap_s * 1000:.0f} ms "
        f"(reconnect {timing.reconnect_s * 1000:.0f} ms, action RTT "
        f"{timing.action_rtt_s * 1000:.0f} ms, new stream -> audio "
        f"{timing.new_stream_to_audio_s * 1000:.0f} ms; first burst {timing.first_burst_s:.3f} s "
        f"vs resume prompt {speech_seconds(RESUME_PROMPT):.3f} s; kill -> LB saw drop "
        f"{timing.kill_to_drop_s * 1000:.0f} ms)"
    )


async def test_a_call_runs_on_its_version_on_an_instance_whose_flow_file_was_edited(
    tmp_path: Path, fake: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    """A has the repo's flows, B an edited default.yaml (other greeting and resume prompt):
    the call is pinned where the webhook lands, and the instance without that version runs it
    from the sources in Redis, before and after the SIGKILL."""
    dirs = [tmp_path / "flows-a", tmp_path / "flows-b"]
    for d in dirs:
        shutil.copytree(REPO / "flows", d)
    edited = dirs[1] / "default.yaml"
    text = edited.read_text()
    assert GREETING in text and RESUME_PROMPT in text
    edited.write_text(text.replace(GREETING, "Hi.").replace(RESUME_PROMPT, "Oops."))
    envs = [{"IVR_FLOWS_DIR": str(d)} for d in dirs]
    async with cluster(tmp_path, fake, redis_server.url, per_instance=envs) as cl:
        run = await failover_call(cl, tmp_path / "edited.wav")
        assert_clean(run.report)
        record = await cl.store.get(run.call_sid)
        assert record is not None and record.stream_count == 2
        [(webhook_conn, _)] = cl.lb.requests("POST /twilio/voice")
        pinner = next(p for p in cl.procs if p.port == webhook_conn.backend)
        other = next(p for p in cl.procs if p is not pinner)
        loaded = other.log_events("flows.version_from_store", version=record.flow_version)
        assert loaded, cl.tails()
        for proc in cl.procs:
            assert not proc.log_events("flows.version_missing"), proc.tail()
        # What the caller heard is the pinned version's: the fake voice's length tells the
        # texts apart (over a second between the versions; 0.1 s slack for frame edges).
        greeting = bot_bursts(run.wav_path, 0.0)[0]
        expected = GREETING if pinner is cl.procs[0] else "Hi."
        assert abs(greeting[1] - greeting[0] - speech_seconds(expected)) < 0.1, greeting
        timing = resume_timing(run.report, run.wav_path, cl.lb, run.killed_at)
        expected = RESUME_PROMPT if pinner is cl.procs[0] else "Oops."
        assert abs(timing.first_burst_s - speech_seconds(expected)) < 0.1, timing


async def test_calls_go_on_while_redis_is_down_and_redis_catches_up(
    tmp_path: Path, fake: FakeOpenAIServer, redis_server: RedisServer
) -> None:
    questions = [
        ("What are your opening hours?", "what are your opening hours"),
        ("Are you open on Saturday?", "are you open on saturday"),
        ("Do you deliver to my town?", "do you deliver to my town"),
        ("Can I pay by card?", "can i pay by card"),
        ("Do you have parking?", "do you have parking"),
        ("Thanks, goodbye.", LAST_TRANSCRIPT),
    ]
    fake.transcripts.extend(t for _, t in questions)
    fake.chat = agent_replies
    async with cluster(tmp_path, fake, redis_server.url, instances=1) as one:
        gw = one.procs[0]
        dialled = place_call(
            one.lb.url, script=[q for q, _ in questions], auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL, to=AGENT_NUMBER,
        )  # fmt: skip
        call = asyncio.create_task(dialled)
        try:
            record = await one.only_active_call()
            sid = record.call_sid
            await one.wait_record(sid, lambda r: any(m.role == "assistant" for m in r.history))
            redis_server.stop()
            assert await gw.metric("ivr_store_degraded") is not None
            # The caller's second question is answered with Redis gone.
            await _chat_requests(fake, 2)
            assert await gw.metric("ivr_store_degraded") == 1.0, gw.tail()
            new_call = await place_call(
                one.lb.url, script=PRESS_2, auth_token=AUTH_TOKEN,
                public_base_url=PUBLIC_URL, to=SUPPORT_NUMBER,
            )  # fmt: skip
            assert_clean(new_call)
            assert new_call.turns and new_call.turns[0].bot_audio_seconds > 1.0
            assert new_call.closing_twiml and "<Dial" in new_call.closing_twiml, new_call.twiml
            assert not call.done(), "the first call must still be up when Redis returns"
            redis_server.start()
            await _metric_becomes(gw.metric, "ivr_store_degraded", 0.0, within=10)
            # Redis restarted empty; the instance wrote back what happened meanwhile.
            caught_up = await one.store.get(sid)
            assert caught_up is not None, gw.tail()
            users = [m.content for m in caught_up.history if m.role == "user"]
            assert users[:2] == [questions[0][1], questions[1][1]], caught_up.history
            assert caught_up.flow_state.get("node") == "assistant"
            transferred = await one.store.get(new_call.call_sid)
            assert transferred is not None and transferred.end_action == "transfer"
            report = await asyncio.wait_for(call, 40)
        finally:
            if redis_server.process is None:
                redis_server.start()
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
    assert_clean(report)
    answered = [t for t in report.turns if t.caller_text is not None and t.bot_audio_seconds > 0]
    assert len(answered) == len(questions), report.format_transcript()
    assert report.closing_twiml and "<Hangup" in report.closing_twiml
    final = fake.requests_for("chat")
    assert len(final) == len(questions), "one LLM request per caller turn, none lost"


async def _chat_requests(fake: FakeOpenAIServer, n: int, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while len(fake.requests_for("chat")) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(fake.requests_for('chat'))} LLM requests, wanted {n}")
        await asyncio.sleep(0.05)
    await asyncio.to_thread(fake.requests_for("chat")[n - 1].wait_finished, 5.0)


async def _metric_becomes(
    metric: Callable[[str], Awaitable[float | None]], name: str, value: float, within: float
) -> None:
    deadline = time.monotonic() + within
    while (got := await metric(name)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed {got}, wanted {value}")
        await asyncio.sleep(0.2)
