"""The graceful drain on SIGTERM, proven with real ``ivr serve`` processes on the local Redis
(a fresh prefix per test), behind the test load balancer, with simulated Twilio calls.

Without REST credentials a draining instance keeps its calls until they end, refusing new
streams; with them it moves each call at a turn boundary to another instance (a REST redirect
to a planned stream, no apology, not counted as a resume); either way it exits once its calls
are gone, or when ``IVR_DRAIN_SECONDS`` runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from gateway_procs import (
    AGENT_NUMBER,
    AUTH_TOKEN,
    FIRST_QUESTION,
    FIRST_REPLY,
    FIRST_TRANSCRIPT,
    LAST_TRANSCRIPT,
    PUBLIC_URL,
    Cluster,
    GatewayProcess,
    agent_replies,
    cluster,
    fast_speak,
    speech_seconds,
)
from redis_server import LOCAL_REDIS_URL
from twilio.request_validator import RequestValidator
from websockets.exceptions import InvalidStatus

from ivr.sim.caller import CallReport, place_call
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import script_from_data
from ivr.sim.webhook import CallIds, TwilioSide, parse_stream, rebase
from ivr.state.base import CallStatus
from ivr.state.outcomes import Outcome
from ivr.testing.openai_server import FakeOpenAIServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

GREETING = "Hello, you've reached Acme. How can I help you today?"  # flows/default.yaml
RESUME_PROMPT = "Sorry, we were cut off for a moment."  # flows/default.yaml
GOODBYE = "Thanks for calling. Goodbye!"  # flows/default.yaml
SECOND_QUESTION = "Are you open on Saturday?"
SECOND_TRANSCRIPT = "are you open on saturday"
SECOND_REPLY = "You said: are you open on saturday."
FRAME_S = 0.02
EXIT_SLACK_S = 10.0
"""How long after its last call (or its drain running out) a draining process may take to exit:
uvicorn's shutdown and the gateway's teardown take well under a second, the rest is headroom
for a CPU shared with other test runs."""


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="sk-test") as server:
        server.speak = fast_speak  # before the gateways start: they pre-synthesise prompts
        server.chat = agent_replies
        yield server


@pytest.fixture
async def rest_api() -> AsyncIterator[FakeTwilioRestApi]:
    async with FakeTwilioRestApi(auth_token=AUTH_TOKEN) as api:
        yield api


# -- helpers ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Exit:
    """When a process was seen gone (``time.monotonic()``), polled every 20 ms."""

    proc: GatewayProcess
    at: float | None = None


@contextlib.asynccontextmanager
async def exit_watch(proc: GatewayProcess) -> AsyncIterator[Exit]:
    seen = Exit(proc)

    async def watch() -> None:
        while proc.process.poll() is None:  # noqa: ASYNC110 - polls a child process
            await asyncio.sleep(0.02)
        seen.at = time.monotonic()

    task = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def exited(seen: Exit, within: float) -> float:
    """When the process exited (it must within ``within`` s); asserts a clean exit code."""
    deadline = time.monotonic() + within
    while seen.at is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{seen.proc.name} still running\n{seen.proc.tail()}")
        await asyncio.sleep(0.05)
    assert seen.proc.process.returncode == 0, seen.proc.tail()
    return seen.at


def sigterm(proc: GatewayProcess) -> float:
    t = time.monotonic()
    proc.process.send_signal(signal.SIGTERM)
    return t


async def readyz(proc: GatewayProcess) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        resp = await http.get(f"{proc.base_url}/readyz")
    return resp.status_code, resp.json()


async def until_unready(proc: GatewayProcess, within: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while (got := await readyz(proc))[0] != 503:
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} still ready: {got}\n{proc.tail()}")
        await asyncio.sleep(0.05)
    return got[1]


async def synthesis_of(fake: FakeOpenAIServer, text: str, within: float = 20.0) -> float:
    """When the bot asked the TTS for ``text`` (``time.monotonic()``); its playout at the caller
    starts moments later and lasts ``speech_seconds(text)``. Not for prompts the gateway
    synthesised at startup."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        asked = [r for r in fake.requests_for("speech") if (r.json or {}).get("input") == text]
        if asked:
            return asked[-1].time
        await asyncio.sleep(0.05)
    raise AssertionError(f"the bot never said {text!r}")


async def carrier_of(cl: Cluster) -> tuple[str, GatewayProcess]:
    """The only live call's CallSid and the instance whose stream carries it."""
    record = await cl.only_active_call()
    record = await cl.wait_record(
        record.call_sid, lambda r: r.status == CallStatus.ACTIVE and r.instance_id is not None
    )
    return record.call_sid, cl.proc_for(record.instance_id)


def chat_history(fake: FakeOpenAIServer, index: int) -> list[str]:
    request = fake.requests_for("chat")[index]
    assert request.json is not None
    return [f"{m['role']}:{m.get('content') or ''}" for m in request.json["messages"]]


def assert_heard_exactly(report: CallReport, expected: list[str]) -> None:
    """One bot turn per text, each exactly as long as that text (the fake voice's length is
    exact to a frame): nothing else was said, no apology, no repeated prompt."""
    spoken = [t.bot_audio_seconds for t in report.turns]
    wanted = [speech_seconds(text) for text in expected]
    assert spoken == pytest.approx(wanted, abs=2 * FRAME_S), report.format_transcript()
    assert not any(t.interrupted for t in report.turns), report.format_transcript()


def assert_clean(report: CallReport) -> None:
    assert not report.errors and not report.violations, report.format_transcript()


async def dial(cl: Cluster, steps: list[Any], **kwargs: Any) -> asyncio.Task[CallReport]:
    script = script_from_data({"steps": steps, "max_wait": 15}, source="drain")
    return asyncio.create_task(
        place_call(
            cl.lb.url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
            to=AGENT_NUMBER, **kwargs,
        )
    )  # fmt: skip


async def finished(call: asyncio.Task[CallReport], within: float) -> CallReport:
    try:
        return await asyncio.wait_for(asyncio.shield(call), within)
    finally:
        if not call.done():
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)


async def new_stream_url(proc: GatewayProcess) -> str:
    """The public wss:// URL (with its fresh one-use token) of a new call's stream, from a
    signed voice webhook answered by ``proc``."""
    sid, account = "CA" + secrets.token_hex(16), "AC" + secrets.token_hex(16)
    ids = CallIds(sid, account, "+15550009999", AGENT_NUMBER)
    async with httpx.AsyncClient(timeout=5.0) as http:
        twilio = TwilioSide(http, proc.base_url, PUBLIC_URL, AUTH_TOKEN, ids)
        twiml = await twilio.request("/twilio/voice", twilio.params("ringing"))
    stream = parse_stream(twiml)
    assert stream is not None, twiml
    return stream.url


async def handshake(url: str, proc: GatewayProcess) -> int:
    """Open Twilio's signed stream handshake for public ``url`` at ``proc``: the HTTP status
    (101 when the WebSocket was accepted; it is closed again at once)."""
    headers = {"X-Twilio-Signature": RequestValidator(AUTH_TOKEN).compute_signature(url, {})}
    try:
        async with websockets.connect(
            rebase(url, proc.base_url.replace("http://", "ws://")),
            additional_headers=headers,
            open_timeout=5,
            compression=None,
        ):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


# -- the tests --------------------------------------------------------------------------------


async def test_without_rest_a_draining_instance_refuses_streams_finishes_its_call_and_exits(
    tmp_path: Path, fake: FakeOpenAIServer
) -> None:
    fake.transcripts.extend([FIRST_TRANSCRIPT, SECOND_TRANSCRIPT, LAST_TRANSCRIPT])
    drain = {"IVR_DRAIN_SECONDS": "60"}
    async with cluster(tmp_path, fake, LOCAL_REDIS_URL, per_instance=[drain, drain]) as cl:
        call = await dial(cl, [FIRST_QUESTION, SECOND_QUESTION, "Thanks, goodbye."])
        call_sid, carrier = await carrier_of(cl)
        other = next(p for p in cl.procs if p is not carrier)
        async with exit_watch(carrier) as seen:
            # As the pod terminates the balancer stops sending it connections (Kubernetes
            # endpoints, the manifest's preStop sleep); the call's <Connect action> goes elsewhere.
            cl.lb.backends = [other.port]
            signalled = sigterm(carrier)  # during the greeting: every caller turn comes later
            status = await until_unready(carrier)
            assert status["draining"] and status["calls"] == 1, status
            assert (await readyz(other))[0] == 200
            # A new call's stream (token minted by the other instance) is refused with 503,
            # not 403: its token stays unspent, and the ready instance still takes it.
            url = await new_stream_url(other)
            assert await handshake(url, carrier) == 503
            assert await handshake(url, other) == 101
            assert carrier.alive, "the carrier must wait for its call"
            report = await finished(call, 45)
            exit_t = await exited(seen, EXIT_SLACK_S)
        record = await cl.store.get(call_sid)

    assert_clean(report)
    # The whole call on one stream, on the draining instance: every turn answered, no apology.
    assert [s.ended_by for s in report.streams] == ["gateway"], report.format_transcript()
    assert_heard_exactly(report, [GREETING, FIRST_REPLY, SECOND_REPLY, GOODBYE])
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    assert len(fake.requests_for("chat")) == 3
    assert record is not None and record.stream_count == 1
    assert record.instance_id == carrier.instance_id
    assert record.status == CallStatus.ENDED and record.end_action == "hangup"
    [(stream_conn, _)] = cl.lb.requests("GET /twilio/stream/")
    assert stream_conn.backend == carrier.port and stream_conn.closed_t is not None
    # All three caller turns were heard and answered after the signal; the process outlived
    # the call and then exited at once.
    assert all(r.time > signalled for r in fake.requests_for("transcriptions"))
    assert stream_conn.closed_t <= exit_t < stream_conn.closed_t + EXIT_SLACK_S
    [drained] = carrier.log_events("drain.finished")
    assert drained["moved"] == 0 and drained["left"] == 0 and drained["seconds"] < 60
    assert carrier.log_events("stream.refused_draining")
    [ended] = carrier.log_events("call.ended", call_sid=call_sid)
    assert ended["outcome"] == "flow_hung_up" and ended["resumes"] == 0
    assert not carrier.log_events("call.resume_requested")
    assert not other.log_events("call.resume_requested")
    print(
        f"\ndrain, no REST: the call went on {stream_conn.closed_t - signalled:.1f} s after "
        f"SIGTERM; the process exited {exit_t - stream_conn.closed_t:.2f} s after it ended"
    )


async def test_with_rest_a_draining_instance_moves_its_call_to_another_at_a_turn_boundary(
    tmp_path: Path, fake: FakeOpenAIServer, rest_api: FakeTwilioRestApi
) -> None:
    fake.transcripts.extend([FIRST_TRANSCRIPT, SECOND_TRANSCRIPT, LAST_TRANSCRIPT])
    rest = {
        "IVR_TWILIO_ACCOUNT_SID": rest_api.account_sid,
        "IVR_TWILIO_API_BASE_URL": rest_api.url,
        "IVR_LOG_PII": "true",  # the log then names the prompt a moved call skipped
    }
    async with cluster(tmp_path, fake, LOCAL_REDIS_URL, per_instance=[rest, rest]) as cl:
        # The silence outlasts the move; the caller then asks the next question.
        steps = [FIRST_QUESTION, {"silence": 3.5}, SECOND_QUESTION, "Thanks, goodbye."]
        call = await dial(cl, steps, rest_api=rest_api)
        call_sid, carrier = await carrier_of(cl)
        other = next(p for p in cl.procs if p is not carrier)
        before = await cl.store.get(call_sid)
        assert before is not None and before.stream_count == 1
        async with exit_watch(carrier) as seen:
            # A terminating instance leaves the balancer's rotation (Kubernetes takes the pod
            # out of the endpoints as it sends SIGTERM; /readyz says so too).
            cl.lb.backends = [other.port]
            # Signal while the first reply plays: the move must wait for the turn boundary.
            reply_asked = await synthesis_of(fake, FIRST_REPLY)
            await asyncio.sleep(max(0.0, reply_asked + 0.4 - time.monotonic()))
            signalled = sigterm(carrier)
            report = await finished(call, 45)
            exit_t = await exited(seen, EXIT_SLACK_S)
        record = await cl.store.get(call_sid)

    assert_clean(report)
    # One REST update of this call: Twilio was told to connect a new (planned) stream through
    # the public URL; the old stream ended with the stop that follows a redirect.
    [update] = rest_api.requests
    assert update.status_code == 200 and update.path.endswith(f"/Calls/{call_sid}.json")
    moved_to = parse_stream(update.form["Twiml"])
    assert moved_to is not None and moved_to.url.startswith("wss://gw.example.com/twilio/stream/")
    assert moved_to.action is not None and "streams=1" in moved_to.action
    assert [s.ended_by for s in report.streams] == ["rest", "gateway"], report.format_transcript()
    [(first, _), (second, _)] = cl.lb.requests("GET /twilio/stream/")
    assert first.backend == carrier.port and second.backend == other.port
    # At the turn boundary: the signal came while the first reply played; the redirect only
    # once it had played in full (report times count from the call's start, t0).
    [update_t] = report.rest_update_t
    t0 = rest_api.updates[0].t - update_t
    reply_end = report.turns[1].bot_audio_end_t
    assert reply_end is not None, report.format_transcript()
    assert signalled - t0 < reply_end - 0.3, (signalled - t0, report.format_transcript())
    assert update_t >= reply_end - FRAME_S, (update_t, report.format_transcript())
    # The caller heard no apology and nothing twice: the conversation went on where it was.
    assert_heard_exactly(report, [GREETING, FIRST_REPLY, SECOND_REPLY, GOODBYE])
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    assert len(fake.requests_for("chat")) == 3, "one model request per caller turn"
    assert chat_history(fake, 1)[-3:] == [
        f"user:{FIRST_TRANSCRIPT}",
        f"assistant:{FIRST_REPLY}",
        f"user:{SECOND_TRANSCRIPT}",
    ]
    assert other.log_events("call.stream_started", call_sid=call_sid, planned=True, resumed=False)
    skipped = other.log_events("call.move_prompt_skipped", call_sid=call_sid)
    assert [e["pii_text"] for e in skipped] == [RESUME_PROMPT]
    assert not other.log_events("call.resume_requested")
    # The move is not a resume: the stored stream count is unchanged.
    assert record is not None and record.stream_count == 1
    assert record.instance_id == other.instance_id
    assert record.status == CallStatus.ENDED and record.end_action == "hangup"
    # The draining process moved the call, then exited without waiting for the call's end.
    assert carrier.log_events("call.moved", call_sid=call_sid)
    [drained] = carrier.log_events("drain.finished")
    assert drained["moved"] == 1 and drained["left"] == 0
    assert exit_t - signalled < EXIT_SLACK_S
    assert first.closed_t is not None and exit_t >= first.closed_t
    [left] = carrier.log_events("call.stream_ended", call_sid=call_sid)
    assert left["reason"] == "moved"
    print(
        f"\nmove: SIGTERM {reply_end - (signalled - t0):.2f} s before the reply ended; redirect "
        f"{(update_t - reply_end) * 1000:.0f} ms after it; new stream "
        f"{(report.streams[1].started_t - update_t) * 1000:.0f} ms after the redirect; "
        f"process exited {exit_t - signalled:.2f} s after SIGTERM"
    )


async def test_a_call_that_does_not_end_is_cut_when_the_drain_runs_out(
    tmp_path: Path, fake: FakeOpenAIServer
) -> None:
    drain_s = 3.0
    async with cluster(
        tmp_path, fake, LOCAL_REDIS_URL, instances=1, per_instance=[{"IVR_DRAIN_SECONDS": "3"}]
    ) as cl:
        # The caller stays silent: the flow listens (no-input after 6 s) past the 3 s drain.
        call = await dial(cl, [{"silence": 20}])
        call_sid, carrier = await carrier_of(cl)
        async with exit_watch(carrier) as seen:
            signalled = sigterm(carrier)
            exit_t = await exited(seen, drain_s + EXIT_SLACK_S)
        # Let the load balancer see the backend's close before the caller goes: cancelling
        # the call at once can close the client side first (seen once in a full run).
        # The first stream is the call's; once it is cut, Twilio follows the <Connect action>
        # and may open another before the call is cancelled (seen once under -n 2).
        (stream_conn, _), *resumes = cl.lb.requests("GET /twilio/stream/")
        async with asyncio.timeout(5):
            while stream_conn.closed_t is None:  # noqa: ASYNC110 - the LB keeps no event
                await asyncio.sleep(0.02)
        call.cancel()  # no instance is left to resume it
        await asyncio.gather(call, return_exceptions=True)
        record = await cl.store.get(call_sid)
    overlapping = [conn for conn, _ in resumes if conn.accepted_t < stream_conn.closed_t]
    assert not overlapping, "a second stream while the call's was open"

    took = exit_t - signalled
    assert drain_s - 0.2 <= took < drain_s + EXIT_SLACK_S / 2, took
    [drained] = carrier.log_events("drain.finished")
    assert drained["left"] == 1 and drained["moved"] == 0
    assert drained["seconds"] == pytest.approx(drain_s, abs=0.6)
    # The call was live until then: its stream was closed by the exiting process.
    assert stream_conn.closed_by == "backend" and stream_conn.closed_t is not None
    assert signalled + drain_s - 0.2 <= stream_conn.closed_t <= exit_t
    # Cut, not ended: left for the <Connect action> to resume on another instance.
    [left] = carrier.log_events("call.stream_ended", call_sid=call_sid)
    assert left["reason"] == "disconnect"
    assert record is not None
    # There is no other instance here. The draining carrier still answers the <Connect action>
    # (the store is shared: another instance could take the stream) and turns the new stream
    # away: refused with 503, or, once its listener has closed, never connected at all (the
    # actions reach it on a kept-alive connection; seen once in a fresh clone's full run). So
    # before it exits either Twilio's "completed" reaches it (seen once in a full run) or the
    # action comes back until the resume limit apologises (seen once in CI). Either way the
    # call was dropped by what followed the cut, never by the drain itself.
    ended = carrier.log_events("call.ended", call_sid=call_sid)
    if ended:
        [how] = [e["ended_by"] for e in ended]
        assert how in ("twilio", "connect_action"), ended
        assert record.outcome == Outcome.DROPPED
        if how == "connect_action":
            assert carrier.log_events("call.resume_limit", call_sid=call_sid)
            # Every resumed stream that reached it was refused, and there were resumed streams.
            refused = carrier.log_events("stream.refused_draining")
            unconnected = [c for c in cl.lb.connections if c.closed_by == "no-backend"]
            assert len(resumes) <= len(refused) and (resumes or unconnected), (resumes, refused)
    else:
        assert record.status == CallStatus.RECONNECTING
    print(f"\ndrain timeout {drain_s:.0f} s: the process exited {took:.2f} s after SIGTERM")
