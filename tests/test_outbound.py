"""Outbound calls: ``POST /calls`` and ``ivr dial`` on a real gateway, Twilio played by the local
REST stand-in, whose callees pick up like Twilio connects a call (signed ``Url`` request, Media
Stream) and play recorded audio: a person saying "Hello?", an answering machine's greeting,
beep and silence. The gateway classifies them from the audio (and from Twilio's async AMD
callback when asked) and the flow branches: a greeting for the person, a voicemail after the
beep for the machine."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from amd_fixtures import CALLEES, Callee, callee_audio, write_wav
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from twilio.request_validator import RequestValidator

from ivr.cli import main as ivr_main
from ivr.flowtools.audio_test import fast_speak, speech_seconds
from ivr.server import RunningServer
from ivr.sim.callee import Callee as SimCallee
from ivr.sim.callee import SimulatedCallees
from ivr.sim.report import CallReport
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import script_from_data
from ivr.state.base import CallRecord
from ivr.testing.openai_server import FakeOpenAIServer

ADMIN = "admin-secret"
OUR_NUMBER = "+15550100000"
HUMAN = "+15550101001"
MACHINE = "+15550101002"
GREETING = "Hello {{ name }}, this is Acme with a reminder about your appointment tomorrow."
VOICEMAIL = "Hi {{ name }}, this is Acme. Please call us back about tomorrow."
FRAME_S = 0.02

FLOW = f"""
name: reminder
start: route
variables:
  name: there
nodes:
  route:
    kind: branch
    cases:
      - when: {{var: answered_by, equals: machine}}
        next: voicemail
    default: greet
  greet:
    kind: say
    text: "{GREETING}"
    next: hangup
  voicemail:
    kind: say
    after_beep: true
    text: "{VOICEMAIL}"
    next: hangup
"""


def said(template: str, name: str) -> str:
    return template.replace("{{ name }}", name)


@pytest.fixture
def flows_dir(tmp_path: Path) -> Path:
    d = tmp_path / "flows"
    d.mkdir()
    (d / "reminder.yaml").write_text(FLOW)
    (d / "routes.yaml").write_text("default: reminder\n")
    return d


def fixture(kind: str) -> Callee:
    return next(c for c in CALLEES if c.kind == kind and c.noise_dbfs is None)


def callee_scripts(tmp_path: Path) -> tuple[dict[str, SimCallee], float]:
    """The human and machine callees. The machine's greeting + beep is the callee's one turn
    (the clip ends with the beep), so bot audio after the beep belongs to that turn."""
    human = callee_audio(fixture("human"), tail_s=0.0)
    machine = callee_audio(fixture("machine"), tail_s=0.0)
    assert machine.beep_end_s is not None
    hello = write_wav(tmp_path / "hello.wav", human.pcm16)
    greeting = write_wav(tmp_path / "greeting.wav", machine.pcm16)
    human_script = {
        "wait_for_greeting": False,
        "max_wait": 10,
        "turn_gap": 1.0,
        "steps": [{"wav": str(hello), "wait": False}],
    }
    machine_script = {
        "wait_for_greeting": False,
        "max_wait": 10,
        "steps": [{"wav": str(greeting), "wait": False}, {"silence": 7.0}],
    }
    callees = {
        HUMAN: SimCallee(
            script_from_data(human_script), "human", amd_after_s=human.speech_end_s + 0.3
        ),
        MACHINE: SimCallee(
            script_from_data(machine_script), "machine_end_beep", amd_after_s=machine.beep_end_s
        ),
    }
    return callees, machine.beep_end_s


@pytest.fixture
def fake(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.speak = fast_speak
    return fake_openai


class Twilio:
    """The REST stand-in and the callees it connects."""

    def __init__(self, api: FakeTwilioRestApi, callees: SimulatedCallees) -> None:
        self.api, self.callees = api, callees

    def settings(self, flows_dir: Path, **more: Any) -> dict[str, Any]:
        return {
            "twilio_account_sid": self.api.account_sid,
            "twilio_api_base_url": self.api.url,
            "admin_token": ADMIN,
            "outbound_from": OUR_NUMBER,
            "flows_dir": str(flows_dir),
            **more,
        }

    def serve(self, server: RunningServer) -> None:
        self.callees.http_base = server.base_url


@pytest.fixture
async def twilio(tmp_path: Path) -> AsyncIterator[Twilio]:
    callees, _ = callee_scripts(tmp_path)
    sims = SimulatedCallees("", AUTH_TOKEN, PUBLIC_URL, callees)
    async with FakeTwilioRestApi(auth_token=AUTH_TOKEN, answer=sims.answer) as api:
        sims.rest_api = api
        yield Twilio(api, sims)


async def post_call(server: RunningServer, body: Any, token: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(f"{server.base_url}/calls", json=body, headers=headers)


async def dial(server: RunningServer, to: str, **body: Any) -> str:
    resp = await post_call(server, {"to": to, "flow": "reminder", **body})
    assert resp.status_code == 201, resp.text
    sid = resp.json()["call_sid"]
    assert isinstance(sid, str)
    return sid


async def ended_record(server: RunningServer, sid: str) -> CallRecord:
    """The call's record once it is ended (within 5 s)."""
    for _ in range(100):
        record = await server.gateway.store.get(sid)
        if record is not None and record.is_ended:
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"call {sid} not ended: {record}")


def bot_turns(report: CallReport) -> list[Any]:
    return [t for t in report.turns if t.bot_first_audio_t is not None]


# -- refused ------------------------------------------------------------------------------


async def test_bad_dials_are_refused_with_the_reason(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        cases = [
            ({"to": "555-0100", "flow": "reminder"}, ADMIN, 400, "E.164"),
            ({"to": HUMAN, "flow": "nope"}, ADMIN, 404, "flow 'nope' does not exist"),
            ({"to": HUMAN, "flow": "reminder", "vars": {"nme": "x"}}, ADMIN, 400, "'nme'"),
            ({"to": HUMAN, "flow": "reminder", "vars": {"caller": "x"}}, ADMIN, 400, "gateway"),
            ({"to": HUMAN}, ADMIN, 400, "flow: Field required"),
            ({"to": HUMAN, "flow": "reminder"}, None, 401, "admin token"),
            ({"to": HUMAN, "flow": "reminder"}, "wrong", 401, "admin token"),
        ]
        for body, token, status, reason in cases:
            resp = await post_call(server, body, token)
            assert resp.status_code == status, (body, resp.text)
            assert reason in resp.json()["error"], (body, resp.text)
        async with httpx.AsyncClient() as http:
            resp = await http.post(
                f"{server.base_url}/calls", content=b"{not json", headers=_bearer()
            )
        assert resp.status_code == 400 and "not JSON" in resp.json()["error"]
    assert twilio.api.creates == []  # nothing refused ever reached Twilio


async def test_without_an_admin_token_post_calls_is_off(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    async with gateway_factory(**twilio.settings(flows_dir, admin_token="")) as server:
        resp = await post_call(server, {"to": HUMAN, "flow": "reminder"})
    assert resp.status_code == 404 and "IVR_ADMIN_TOKEN" in resp.json()["error"]


async def test_ivr_dial_refuses_with_exit_code_and_reason(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio: Twilio,
    flows_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        twilio.serve(server)
        base = ["dial", "--gateway", server.base_url, "--token", ADMIN]
        code = await asyncio.to_thread(ivr_main, [*base, "5550100", "--flow", "reminder"])
        err = capsys.readouterr().err
        assert code == 1 and "E.164" in err and "HTTP 400" in err
        code = await asyncio.to_thread(ivr_main, [*base, HUMAN, "--flow", "ghost"])
        err = capsys.readouterr().err
        assert code == 1 and "HTTP 404" in err and "'ghost' does not exist" in err
        code = await asyncio.to_thread(ivr_main, [*base, HUMAN, "--flow", "x", "--var", "oops"])
        assert code == 2 and "NAME=VALUE" in capsys.readouterr().err
        assert twilio.api.creates == []
        nobody = "+15550109998"  # rings unanswered: placed all the same
        argv = [*base, nobody, "--flow", "reminder", "--var", "name=Sam"]
        code = await asyncio.to_thread(ivr_main, argv)
        out = capsys.readouterr().out
        [create] = twilio.api.creates
        record = await server.gateway.store.get(create.call_sid)
        ended = await ended_record(server, create.call_sid)  # Twilio: no-answer
    assert code == 0 and f"placed {create.call_sid} (flow reminder)" in out
    assert create.to == nobody
    assert record is not None and record.variables == {"name": "Sam"}
    assert record.direction == "outbound" and record.flow_name == "reminder"
    assert twilio.callees.statuses == [(create.call_sid, "no-answer")]
    assert ended.stream_count == 0  # ended by the status callback, never answered


# -- the calls ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_person_answers_and_hears_the_greeting_right_after_hello(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        twilio.serve(server)
        sid = await dial(server, HUMAN, vars={"name": "Sam"})
        report = await twilio.callees.wait_for(sid, 20)
        record = await ended_record(server, sid)
    assert not report.errors and not report.violations, report.format_transcript()
    assert twilio.callees.statuses == [(sid, "completed")]
    create = twilio.api.creates[0]
    assert (create.to, create.from_, create.url) == (
        HUMAN,
        OUR_NUMBER,
        PUBLIC_URL + "/twilio/outbound",
    )
    assert create.machine_detection == ""  # Twilio's AMD is off unless asked for
    assert record is not None and record.direction == "outbound"
    assert record.answered_by == "human" and record.flow_name == "reminder"
    [turn] = bot_turns(report)  # the greeting, after "Hello?"
    assert turn.bot_audio_seconds == pytest.approx(
        speech_seconds(said(GREETING, "Sam")), abs=FRAME_S
    )
    assert turn.latency_s is not None and 0.5 < turn.latency_s < 2.0, report.format_transcript()


@pytest.mark.slow
async def test_a_machine_gets_the_voicemail_after_its_beep_and_nothing_before(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio: Twilio,
    flows_dir: Path,
) -> None:
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        twilio.serve(server)
        sid = await dial(server, MACHINE, vars={"name": "Sam"})
        report = await twilio.callees.wait_for(sid, 30)
        record = await server.gateway.store.get(sid)
    assert not report.errors and not report.violations, report.format_transcript()
    assert record is not None and record.answered_by == "machine"
    [turn] = bot_turns(report)  # nothing during the greeting: one bot turn, after the beep
    greeting_step = report.turns.index(turn)
    assert report.turns[greeting_step].caller_text is not None
    beep_end = turn.caller_end_t  # the greeting + beep clip ends with the beep
    assert turn.bot_first_audio_t is not None and turn.bot_first_audio_t >= beep_end
    assert turn.bot_first_audio_t - beep_end < 0.6, report.format_transcript()
    assert turn.bot_audio_seconds == pytest.approx(
        speech_seconds(said(VOICEMAIL, "Sam")), abs=FRAME_S
    )
    assert not turn.interrupted


@pytest.mark.slow
async def test_a_verdict_that_comes_mid_hello_waits_for_the_person_to_finish(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    # Twilio's "human" can arrive while the person is still saying "Hello?": the greeting
    # waits for them to stop rather than start over them (and be cut as a barge-in).
    hello = fixture("human")
    mid_hello = (hello.lead_s + callee_audio(hello, tail_s=0.0).speech_end_s) / 2
    human = twilio.callees.callees[HUMAN]
    twilio.callees.callees[HUMAN] = dataclasses.replace(human, amd_after_s=mid_hello)
    settings = twilio.settings(flows_dir, twilio_amd="DetectMessageEnd")
    async with gateway_factory(**settings) as server:
        twilio.serve(server)
        sid = await dial(server, HUMAN, vars={"name": "Sam"})
        report = await twilio.callees.wait_for(sid, 20)
        record = await ended_record(server, sid)
    assert not report.errors and not report.violations, report.format_transcript()
    assert record.twilio_answered_by == "human", record
    [turn] = bot_turns(report)
    assert turn.bot_first_audio_t is not None and turn.bot_first_audio_t > turn.caller_end_t
    assert not turn.interrupted, report.format_transcript()
    assert turn.bot_audio_seconds == pytest.approx(
        speech_seconds(said(GREETING, "Sam")), abs=FRAME_S
    )


async def test_twilio_amd_callback_signed_is_taken_and_unsigned_is_refused(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    settings = twilio.settings(flows_dir, twilio_amd="DetectMessageEnd")
    async with gateway_factory(**settings) as server:
        twilio.serve(server)
        sid = await dial(server, HUMAN)
        report = await twilio.callees.wait_for(sid, 20)
        record = await server.gateway.store.get(sid)
        forged = await _amd_post(server, sid, "machine_end_beep", token="not-the-token")
        unsigned = await _amd_post(server, sid, "machine_end_beep", token=None)
        bad_value = await _amd_post(server, sid, "robot", token=AUTH_TOKEN)
        after = await server.gateway.store.get(sid)
    create = twilio.api.creates[0]
    assert create.machine_detection == "DetectMessageEnd" and create.async_amd
    assert create.amd_callback == PUBLIC_URL + "/twilio/amd"
    [sent] = [r.form for r in twilio.api.requests if r.path.endswith("/Calls.json")]
    assert sent == {  # what the twilio library sent, in Twilio's parameter names
        "To": HUMAN,
        "From": OUR_NUMBER,
        "Url": PUBLIC_URL + "/twilio/outbound",
        "Method": "POST",
        "MachineDetection": "DetectMessageEnd",
        "AsyncAmd": "true",
        "AsyncAmdStatusCallback": PUBLIC_URL + "/twilio/amd",
        "AsyncAmdStatusCallbackMethod": "POST",
        "StatusCallback": PUBLIC_URL + "/twilio/status",
        "StatusCallbackMethod": "POST",
    }
    assert [(c.answered_by, c.status_code) for c in twilio.callees.amd_callbacks] == [
        ("human", 200)
    ]
    assert record is not None and record.twilio_answered_by == "human"
    assert record.answered_by == "human"
    assert bot_turns(report), report.format_transcript()
    assert (forged, unsigned, bad_value) == (403, 403, 400)
    assert (
        after is not None and after.twilio_answered_by == "human"
    )  # the forgeries changed nothing


async def _amd_post(server: RunningServer, sid: str, answered_by: str, token: str | None) -> int:
    url = PUBLIC_URL + "/twilio/amd"
    params = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "AnsweredBy": answered_by}
    headers = {}
    if token is not None:
        headers["X-Twilio-Signature"] = RequestValidator(token).compute_signature(url, params)
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{server.base_url}/twilio/amd", data=params, headers=headers)
    return resp.status_code


# -- campaigns ----------------------------------------------------------------------------


async def test_a_csv_campaign_keeps_its_rate_and_reports_bad_rows(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    twilio: Twilio,
    flows_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [
        "number,name",
        "+15550102001,Ann",
        "555-0102,Bob",  # line 3: not E.164
        "+15550102002,Cy",
        "+15550102001,Ann again",  # line 5: the same number twice
        "+15550102003,",
        "+15550102004,Dee,extra",  # line 7: more cells than columns
        "+15550102005,Eve",
    ]
    csv_path = tmp_path / "numbers.csv"
    csv_path.write_text("\n".join(rows) + "\n")
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        twilio.serve(server)
        argv = ["dial", "--csv", str(csv_path), "--rate", "4/s", "--flow", "reminder"]
        argv += ["--gateway", server.base_url, "--token", ADMIN, "--concurrency", "2"]
        code = await asyncio.to_thread(ivr_main, argv)
    out = capsys.readouterr()
    creates = twilio.api.creates
    assert [c.to for c in creates] == [
        "+15550102001", "+15550102002", "+15550102003", "+15550102005"
    ]  # fmt: skip
    gaps = [b.t - a.t for a, b in itertools.pairwise(creates)]
    # 4 calls a second: starts 0.25 s apart, seen through two HTTP hops (the first request
    # also opens connections: tens of ms of jitter on one gap, none on the whole run).
    assert min(gaps) >= 0.15 and sum(gaps) >= 3 * 0.25 - 0.05, gaps
    assert code == 1
    assert "row 3" in out.err and "not E.164" in out.err
    assert "row 5" in out.err and "same number as row 2" in out.err
    assert "row 7" in out.err and "more cells than columns" in out.err
    assert "4 placed, 3 not placed (3 bad rows)" in out.out


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}


# -- faults -------------------------------------------------------------------------------


async def test_twilio_refusing_or_unreachable_is_a_502_with_its_reason(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    wrong_account = twilio.settings(flows_dir, twilio_auth_token=AUTH_TOKEN + "x")
    wrong_account["twilio_account_sid"] = "AC" + "1" * 32
    async with gateway_factory(**wrong_account) as server:
        refused = await post_call(server, {"to": HUMAN, "flow": "reminder"})
        assert await server.gateway.store.list_active() == []
    closed = twilio.settings(flows_dir, twilio_api_base_url="http://127.0.0.1:9")  # discard port
    async with gateway_factory(**closed) as server:
        unreachable = await post_call(server, {"to": HUMAN, "flow": "reminder"})
        assert await server.gateway.store.list_active() == []
    assert refused.status_code == 502 and "Authenticate" in refused.json()["error"]
    assert unreachable.status_code == 502 and "unreachable" in unreachable.json()["error"]
    assert twilio.api.creates == []


async def test_the_answer_webhook_runs_only_calls_we_placed_and_only_once(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, twilio: Twilio, flows_dir: Path
) -> None:
    twilio.callees.no_answer_after_s = None  # it rings on while the test plays Twilio
    async with gateway_factory(**twilio.settings(flows_dir)) as server:
        placed = await dial(server, "+15550109999")  # nobody answers this number
        first = await _answered(server, placed)
        again = await _answered(server, placed, stream_started=True)
        stranger = await _answered(server, "CA" + "2" * 32)
        forged = await _answered(server, placed, token="wrong")
    assert first.status_code == 200 and "<Connect" in first.text
    assert again.status_code == 409
    assert stranger.status_code == 200 and "<Hangup" in stranger.text  # not ours: hang up
    assert forged.status_code == 403


async def _answered(
    server: RunningServer, sid: str, *, token: str = AUTH_TOKEN, stream_started: bool = False
) -> httpx.Response:
    if stream_started:  # what the stream does when it attaches: the call now has one

        def attach(record: Any) -> None:
            record.stream_count = 1

        await server.gateway.store.update(sid, attach)
    url = PUBLIC_URL + "/twilio/outbound"
    params = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "CallStatus": "in-progress"}
    signature = RequestValidator(token).compute_signature(url, params)
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.post(
            f"{server.base_url}/twilio/outbound",
            data=params,
            headers={"X-Twilio-Signature": signature},
        )
