"""Warm transfers against the local Twilio REST stand-in: a real gateway, the simulated caller,
and ``ConferenceDesk`` playing Twilio's conference rooms and the agent's phone (it rings,
answers or not, hears the ``<Say>`` summary, enters the room) with signed status callbacks."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory, record_of
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from twilio.request_validator import RequestValidator

from ivr.control.transfers import WarmTransfer
from ivr.control.warm_summary import INSTRUCTIONS, write_summary
from ivr.flows.loader import check_flow_text
from ivr.flowtools.audio_test import fast_speak, speech_seconds
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import RunningServer
from ivr.sim.caller import CallReport, place_call
from ivr.sim.conference import AgentPhone, ConferenceDesk
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import script_from_data
from ivr.state.base import CallRecord, CallStatus
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.testing.openai_wire import ChatScript, ScriptToolCall

AGENT = "+15550100999"
CALLER = "+15550001111"
OUR_NUMBER = "+15550002222"
HOLD = "Please hold while I connect you to an agent."
FALLBACK = "Sorry, nobody could take your call. Goodbye."
HOLD_MUSIC = "https://music.example.com/hold.mp3"
FRAME_S = 0.02

MENU_FLOW = f"""
name: t
start: menu
variables:
  agent: "{AGENT}"
nodes:
  menu:
    kind: ask
    prompt: For billing press 2.
    routes: [{{key: "2", next: to_agent}}]
    fallback: hangup
  to_agent:
    kind: transfer
    number: "{{{{ agent }}}}"
    say: {HOLD}
    warm: true
    summary: "Caller {{{{ caller }}}} pressed {{{{ last_input }}}} for billing."
    hold_music: {HOLD_MUSIC}
    ring_timeout: 15
    fallback: nobody
  nobody:
    kind: say
    text: "{FALLBACK}"
    next: hangup
"""

AGENT_FLOW = f"""
name: t
start: assistant
nodes:
  assistant:
    kind: agent
    greeting: Hello, how can I help?
    system: Be brief.
    tools:
      - name: person
        description: Put the caller through to a person.
        next: to_agent
    on_no_input: hangup
  to_agent:
    kind: transfer
    number: "{AGENT}"
    warm: true
    summarize: true
    summary: The caller asked for a person.
    fallback: sorry
  sorry: {{kind: hangup, say: "{FALLBACK}"}}
"""


def write_flow(directory: Path, flow: str) -> str:
    (directory / "routes.yaml").write_text("default: t\n")
    (directory / "t.yaml").write_text(flow)
    return str(directory)


@pytest.fixture
def fake(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.speak = fast_speak
    return fake_openai


@pytest.fixture
async def twilio_side() -> AsyncIterator[tuple[FakeTwilioRestApi, ConferenceDesk]]:
    async with FakeTwilioRestApi(auth_token=AUTH_TOKEN) as api:
        desk = ConferenceDesk(api, phones={AGENT: AgentPhone()}, public_base=PUBLIC_URL)
        try:
            yield api, desk
        finally:
            await desk.aclose()


def warm_transfers(outcome: str) -> float:
    return REGISTRY.get_sample_value("ivr_warm_transfers_total", {"outcome": outcome}) or 0.0


async def call(
    server: RunningServer, api: FakeTwilioRestApi, desk: ConferenceDesk, steps: list[Any]
) -> CallReport:
    desk.gateway_base = server.base_url
    report = await place_call(
        server.base_url,
        script=script_from_data({"steps": steps, "max_wait": 20}),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        from_=CALLER,
        to=OUR_NUMBER,
        rest_api=api,
    )
    assert not report.errors and not report.violations, report.format_transcript()
    return report


def rest_settings(api: FakeTwilioRestApi, tmp_path: Path, flow: str) -> dict[str, Any]:
    return {
        "twilio_account_sid": api.account_sid,
        "twilio_api_base_url": api.url,
        "flows_dir": write_flow(tmp_path, flow),
    }


# -- the agent answers: held, briefed, joined ----------------------------------------------------


@pytest.mark.slow
async def test_a_warm_transfer_holds_the_caller_briefs_the_agent_and_joins_them(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, desk = twilio_side
    connected = warm_transfers("connected")
    async with gateway_factory(**rest_settings(api, tmp_path, MENU_FLOW)) as server:
        report = await call(server, api, desk, [{"press": "2"}, {"silence": 2.5}])
        await desk.wait_for_status(desk.calls[0], "completed")  # its callback reached us
        record = await record_of(server, report)

    room = f"warm-{report.call_sid}"
    # 1. The hold prompt played in full, then the caller was redirected into the room, on hold.
    hold = report.turns[-1]
    assert hold.bot_audio_seconds == pytest.approx(speech_seconds(HOLD), abs=FRAME_S)
    assert hold.bot_audio_end_t is not None and report.rest_update_t[0] >= hold.bot_audio_end_t
    assert [s.ended_by for s in report.streams] == ["rest"]
    redirect, create = api.requests[0], api.requests[1]
    assert redirect.path.endswith(f"/Calls/{report.call_sid}.json")
    assert f">{room}</Conference>" in redirect.form["Twiml"]
    assert 'startConferenceOnEnter="false"' in redirect.form["Twiml"]
    assert f'waitUrl="{HOLD_MUSIC}"' in redirect.form["Twiml"]
    # 2. The agent leg: our number calls the agent, with the summary and the same room.
    assert create.path.endswith("/Calls.json") and create.status_code == 201
    assert (create.form["To"], create.form["From"], create.form["Timeout"]) == (
        AGENT,
        OUR_NUMBER,
        "15",
    )
    assert create.form["StatusCallback"] == (
        f"{PUBLIC_URL}/twilio/transfer/agent?caller={report.call_sid}"
    )
    assert create.form["StatusCallbackEvent"].split() == [
        "initiated",
        "ringing",
        "answered",
        "completed",
    ]
    [agent] = desk.calls
    assert agent.heard == [f"Caller {CALLER} pressed 2 for billing."]  # template, real values
    assert agent.rooms == [room]
    # 3. Both in the room; the caller hanging up ended it and the agent's call.
    events = [(e.event, e.call_sid) for e in desk.room_log(room)]
    assert events[:3] == [
        ("participant-join", report.call_sid),
        ("participant-join", agent.create.call_sid),
        ("conference-start", ""),
    ]
    assert events[3:] == [("participant-leave", report.call_sid), ("conference-end", "")]
    assert agent.statuses[-1] == "completed"
    assert all(c.status_code == 204 for c in desk.callbacks), desk.callbacks
    # 4. The record: connected, ended by the transfer, never resumed.
    leg = record.warm_transfer
    assert leg is not None and (leg.status, leg.agent_call_sid) == (
        "connected",
        agent.create.call_sid,
    )
    assert record.is_ended and record.status == CallStatus.TRANSFERRING
    assert record.stream_count == 1
    assert warm_transfers("connected") == connected + 1


# -- the agent does not take the call: the caller is back at the fallback --------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phone", "result", "statuses"),
    [
        (AgentPhone(answers=False), "no-answer", ["initiated", "ringing", "no-answer"]),
        (AgentPhone(answers=False, unanswered="busy"), "busy", ["initiated", "ringing", "busy"]),
        (
            AgentPhone(hang_up_after_summary=True),
            "not-joined",
            ["initiated", "ringing", "in-progress", "completed"],
        ),
    ],
)
async def test_an_agent_who_does_not_take_the_call_brings_the_caller_back_to_the_fallback(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
    phone: AgentPhone,
    result: str,
    statuses: list[str],
) -> None:
    api, desk = twilio_side
    desk.phones[AGENT] = phone
    before = warm_transfers(result)
    async with gateway_factory(**rest_settings(api, tmp_path, MENU_FLOW)) as server:
        report = await call(server, api, desk, [{"press": "2"}, {"silence": 8}])
        record = await record_of(server, report)

    [agent] = desk.calls
    assert agent.statuses == statuses
    # Off hold by a REST redirect onto a new stream; the flow went on at its fallback, which
    # hung up (the gateway closed that stream).
    assert [s.ended_by for s in report.streams] == ["rest", "gateway"], report.format_transcript()
    back = api.updates[1]
    assert back.call_sid == report.call_sid and back.twiml is not None
    assert "<Connect" in back.twiml and "<Stream" in back.twiml
    room = f"warm-{report.call_sid}"
    assert [(e.event, e.call_sid) for e in desk.room_log(room)][-2:] == [
        ("participant-leave", report.call_sid),
        ("conference-end", ""),
    ]
    # The caller heard the hold prompt, then the fallback prompt, and no resume apology.
    [turn] = [t for t in report.turns if t.caller_text == "[keys 2]"]
    expected = speech_seconds(HOLD) + speech_seconds(FALLBACK)
    assert turn.bot_audio_seconds == pytest.approx(expected, abs=2 * FRAME_S)
    assert turn.bot_audio_end_t is not None
    assert turn.bot_audio_end_t >= report.streams[1].started_t + speech_seconds(FALLBACK) - 0.05
    assert record.node == "nobody"
    assert record.variables["transfer_status"] == result
    assert (record.end_action, record.transfer_to, record.warm_transfer) == ("hangup", "", None)
    assert record.stream_count == 2 and record.is_ended
    assert warm_transfers(result) == before + 1


@pytest.mark.slow
async def test_a_caller_who_hangs_up_on_hold_hangs_up_the_ringing_agent(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, desk = twilio_side
    desk.phones[AGENT] = AgentPhone(ring_seconds=10.0)
    async with gateway_factory(**rest_settings(api, tmp_path, MENU_FLOW)) as server:
        report = await call(server, api, desk, [{"press": "2"}, {"silence": 2}])
        [agent] = desk.calls
        await desk.wait_for_status(agent, "canceled")
        record = await record_of(server, report)

    hang_ups = [u for u in api.updates if u.call_sid == agent.create.call_sid]
    assert [u.status for u in hang_ups] == ["completed"]
    assert agent.statuses == ["initiated", "ringing", "canceled"] and agent.rooms == []
    leg = record.warm_transfer
    assert leg is not None and (leg.status, leg.result) == ("failed", "caller-left")
    assert record.is_ended and record.status == CallStatus.ENDED


# -- the summary from the conversation -------------------------------------------------------


@pytest.mark.slow
async def test_the_agent_hears_a_summary_the_llm_wrote_from_the_conversation(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, desk = twilio_side
    said = "I was charged twice for order 42 and I want a person"
    written = "The caller was charged twice for order 42 and wants a refund."
    fake.transcribe = lambda audio, form: said  # every transcription (a pause's too) hears it

    def model(request: dict[str, Any]) -> ChatScript:  # speculative turns may ask too
        if request["messages"][0]["content"] == INSTRUCTIONS:
            return ChatScript(text=written)
        return ChatScript(tool_calls=[ScriptToolCall("person")])

    fake.chat = model
    async with gateway_factory(**rest_settings(api, tmp_path, AGENT_FLOW)) as server:
        report = await call(server, api, desk, [{"say": said}, {"silence": 2.5}])
        record = await record_of(server, report)

    [agent] = desk.calls
    assert agent.heard == [written]
    [summary_request] = [
        r.json
        for r in fake.requests_for("chat")
        if r.json is not None and r.json["messages"][0]["content"] == INSTRUCTIONS
    ]
    system, user = summary_request["messages"]
    assert system["content"] == INSTRUCTIONS
    assert f"Caller: {said}" in user["content"]
    assert "Assistant: Hello, how can I help?" in user["content"]
    assert "What the flow knows: The caller asked for a person." in user["content"]
    leg = record.warm_transfer
    assert leg is not None and leg.status == "connected"


async def test_a_summary_the_llm_does_not_write_in_time_is_the_template(
    fake_openai: FakeOpenAIServer,
) -> None:
    fake_openai.chat = [ChatScript(hang=True), ChatScript(status=500)]
    llm = OpenAICompatLlm(base_url=fake_openai.base_url, api_key="sk-test", model="m")
    warm = WarmTransfer("Template facts.", summarize=True, conversation=(("user", "hi"),))
    try:
        slow = await write_summary(warm, llm, limit=0.3)
        broken = await write_summary(warm, llm, limit=3.0)
    finally:
        await llm.aclose()
    assert (slow.text, slow.source) == ("Template facts.", "template")
    assert 0.3 <= slow.seconds < 1.0
    assert (broken.text, broken.source) == ("Template facts.", "template")
    # Without a conversation there is nothing to summarise: no model call at all.
    quiet = await write_summary(WarmTransfer("Only facts.", summarize=True), llm)
    assert quiet.source == "template" and len(fake_openai.requests_for("chat")) == 2


# -- status callbacks are Twilio's or nothing ------------------------------------------------


async def test_a_status_callback_with_a_bad_signature_is_refused_and_changes_nothing(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, _ = twilio_side
    caller = "CA" + "1" * 32
    form = {"CallSid": "CA" + "2" * 32, "CallStatus": "no-answer", "AccountSid": api.account_sid}
    async with gateway_factory(**rest_settings(api, tmp_path, MENU_FLOW)) as server:
        await server.gateway.store.create(
            CallRecord(call_sid=caller, status=CallStatus.TRANSFERRING)
        )
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            answers = {}
            for path in ("/twilio/transfer/agent", "/twilio/transfer/conference"):
                url = f"{PUBLIC_URL}{path}?caller={caller}"
                forged = RequestValidator("not-the-token").compute_signature(url, form)
                bad = await http.post(
                    f"{path}?caller={caller}", data=form, headers={"X-Twilio-Signature": forged}
                )
                good = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
                ok = await http.post(
                    f"{path}?caller={caller}", data=form, headers={"X-Twilio-Signature": good}
                )
                unknown = "CA" + "3" * 32
                url = f"{PUBLIC_URL}{path}?caller={unknown}"
                missing = await http.post(
                    f"{path}?caller={unknown}",
                    data=form,
                    headers={
                        "X-Twilio-Signature": RequestValidator(AUTH_TOKEN).compute_signature(
                            url, form
                        )
                    },
                )
                answers[path] = (bad.status_code, ok.status_code, missing.status_code)
        record = await server.gateway.store.get(caller)

    # Forged: 403. Signed, for a call with no warm transfer pending: accepted, nothing to do.
    assert answers == {
        "/twilio/transfer/agent": (403, 204, 404),
        "/twilio/transfer/conference": (403, 204, 204),
    }
    assert record is not None and record.warm_transfer is None and api.requests == []


# -- without REST credentials the transfer is cold ------------------------------------------


@pytest.mark.slow
async def test_without_an_account_sid_a_warm_transfer_is_made_cold(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, desk = twilio_side
    settings = {"twilio_api_base_url": api.url, "flows_dir": write_flow(tmp_path, MENU_FLOW)}
    async with gateway_factory(**settings) as server:
        with capture_logs() as logs:
            report = await call(server, api, desk, [{"press": "2"}])
        record = await record_of(server, report)

    assert [e for e in logs if e["event"] == "call.warm_transfer_made_cold"]
    assert report.closing_twiml is not None and f"<Number>{AGENT}</Number>" in report.closing_twiml
    assert api.requests == [] and desk.calls == []
    assert (record.end_action, record.transfer_to) == ("transfer", AGENT)


# -- the flow file ---------------------------------------------------------------------------


def problems(flow: str) -> list[str]:
    checked, found = check_flow_text(textwrap.dedent(flow), "t.yaml")
    assert checked is None, "expected the flow to be refused"
    return [f"{p.line}:{p.column} {p.message}" for p in found]


TRANSFER_HEAD = """
name: t
start: go
nodes:
  bye: {kind: hangup}
  go:
    kind: transfer
    number: "+15550100999"
"""


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("warm: true", "a warm transfer needs 'fallback:'"),
        ("summary: hi", "summary only apply with 'warm: true'"),
        (
            "fallback: bye\n    ring_timeout: 30",
            "fallback, ring_timeout only apply with 'warm: true'",
        ),
        ("warm: true\n    fallback: bye\n    ring_timeout: 2", "greater than or equal to 5"),
        (
            "warm: true\n    fallback: byee",
            "unknown target 'byee' in node 'go'; did you mean 'bye'?",
        ),
        ("warm: true\n    fallback: bye\n    hold_music: music.mp3", "must be an http(s) URL"),
        ("warm: true\n    fallback: bye\n    summary: '{{ nope }}'", "unknown variable 'nope'"),
    ],
)
def test_a_warm_transfer_node_is_checked_when_the_flow_loads(options: str, expected: str) -> None:
    found = problems(TRANSFER_HEAD + "    " + options + "\n")
    assert any(expected in p for p in found), found
    assert all(p.split(" ", 1)[0] != "0:0" for p in found), found  # every problem has a place


def test_a_warm_transfer_may_fall_back_to_a_flow_that_branches_on_why() -> None:
    flow = TRANSFER_HEAD + (
        "    warm: true\n"
        "    fallback: why\n"
        "  why:\n"
        "    kind: branch\n"
        "    cases: [{when: {var: transfer_status, equals: busy}, next: bye}]\n"
        "    default: bye\n"
    )
    checked, found = check_flow_text(flow, "t.yaml")
    assert checked is not None, found


@pytest.mark.slow
async def test_a_transfer_no_callback_settles_gives_up_at_its_deadline(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio_side: tuple[FakeTwilioRestApi, ConferenceDesk],
    tmp_path: Path,
) -> None:
    api, desk = twilio_side
    desk.phones[AGENT] = AgentPhone(ring_seconds=30.0)  # Twilio would report no-answer... late
    flow = MENU_FLOW.replace("ring_timeout: 15", "ring_timeout: 5")
    before = warm_transfers("timeout")
    async with gateway_factory(**rest_settings(api, tmp_path, flow)) as server:
        warm = server.gateway.services.warm
        assert warm is not None
        warm.after_ring = -4.0  # the deadline: 5 s of ringing - 4 = 1 s after the agent is dialled
        report = await call(server, api, desk, [{"press": "2"}, {"silence": 6}])
        [agent] = desk.calls
        await desk.wait_for_status(agent, "canceled")
        record = await record_of(server, report)

    assert [s.ended_by for s in report.streams] == ["rest", "gateway"]
    assert [u.status for u in api.updates if u.call_sid == agent.create.call_sid] == ["completed"]
    assert record.variables["transfer_status"] == "timeout" and record.node == "nobody"
    assert warm_transfers("timeout") == before + 1
