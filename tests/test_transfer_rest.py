"""Transfers through Twilio's REST API: the real gateway redirects the call to ``<Dial>`` through
a local server speaking Twilio's REST wire format, and the simulated caller plays Twilio's part
(``stop`` on the redirected stream, the new TwiML takes over). The ``<Connect action>`` path
stays the fallback when the REST call fails or no account SID is configured."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory, record_of
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from ivr.flowtools.audio_test import fast_speak, speech_seconds
from ivr.server import RunningServer
from ivr.sim.caller import CallReport, place_call
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import script_from_data
from ivr.state.base import CallStatus
from ivr.telephony.rest import TwilioRest
from ivr.testing.openai_server import FakeOpenAIServer

SUPPORT = "+15550100001"
AGENT = "+15550100999"
HOLD = "Please hold while I connect you to an agent."
DIAL = f"<Dial><Number>{AGENT}</Number></Dial>"
FRAME_S = 0.02


@pytest.fixture
def fake(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.speak = fast_speak  # a faster fake voice: the same checks, shorter calls
    return fake_openai


@pytest.fixture
async def rest_api() -> AsyncIterator[FakeTwilioRestApi]:
    async with FakeTwilioRestApi(auth_token=AUTH_TOKEN) as api:
        yield api


def calls_ended(outcome: str) -> float:
    return REGISTRY.get_sample_value("ivr_calls_total", {"outcome": outcome}) or 0.0


async def press_for_agent(server: RunningServer, api: FakeTwilioRestApi) -> CallReport:
    report = await place_call(
        server.base_url,
        script=script_from_data({"steps": [{"press": "2"}], "max_wait": 15}),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        to=SUPPORT,
        rest_api=api,
    )
    assert not report.errors and not report.violations, report.format_transcript()
    return report


def assert_hold_played_in_full(report: CallReport) -> float:
    """The hold prompt's turn: heard whole, not cut. Returns when its last sample played."""
    hold = report.turns[-1]
    assert hold.caller_text == "[keys 2]" and not hold.interrupted, report.format_transcript()
    assert hold.bot_audio_seconds == pytest.approx(speech_seconds(HOLD), abs=FRAME_S)
    assert hold.bot_audio_end_t is not None
    return hold.bot_audio_end_t


@pytest.mark.slow
async def test_a_transfer_is_a_rest_redirect_to_dial_after_the_hold_prompt_played_in_full(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, rest_api: FakeTwilioRestApi
) -> None:
    transfers, stops = calls_ended("transferred_cold"), calls_ended("caller_hung_up")
    settings = {"twilio_account_sid": rest_api.account_sid, "twilio_api_base_url": rest_api.url}
    async with gateway_factory(**settings) as server:
        report = await press_for_agent(server, rest_api)
        record = await record_of(server, report)
        active = await server.gateway.store.list_active()

    hold_end = assert_hold_played_in_full(report)
    # One authenticated update, carrying the Dial, for this call, after the prompt finished.
    [request] = rest_api.requests
    assert request.status_code == 200
    assert request.path.endswith(f"/Accounts/{rest_api.account_sid}/Calls/{report.call_sid}.json")
    assert DIAL in request.form["Twiml"]
    [update_t] = report.rest_update_t
    assert update_t >= hold_end, f"REST update at {update_t:.3f} s, prompt ended {hold_end:.3f} s"
    assert update_t - hold_end < 1.0, "the transfer should follow the prompt's mark promptly"
    # Twilio's part: the stream ended by the update (stop), the Dial took over, no action request.
    assert [s.ended_by for s in report.streams] == ["rest"]
    assert len(report.twiml) == 2 and report.closing_twiml is not None
    assert DIAL in report.closing_twiml
    # The stop that followed is the transfer completing, not the caller hanging up.
    assert (record.status, record.end_action, record.transfer_to) == (
        CallStatus.TRANSFERRING,
        "transfer",
        AGENT,
    )
    assert calls_ended("transferred_cold") == transfers + 1
    assert calls_ended("caller_hung_up") == stops
    # No action request follows a REST redirect, so the gateway closed the record itself.
    assert record.is_ended and report.call_sid not in {r.call_sid for r in active}


@pytest.mark.slow
async def test_a_rest_api_refusing_the_credentials_falls_back_to_dial_from_the_action(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    transfers = calls_ended("transferred_cold")
    async with FakeTwilioRestApi(auth_token="not-" + AUTH_TOKEN) as api:
        settings = {"twilio_account_sid": api.account_sid, "twilio_api_base_url": api.url}
        async with gateway_factory(**settings) as server:
            with capture_logs() as logs:
                report = await press_for_agent(server, api)
            record = await record_of(server, report)

    assert [r.status_code for r in api.requests] == [401]
    failed = [e for e in logs if e["event"] == "twilio_rest.failed"]
    assert failed and failed[0]["status"] == 401 and "TWILIO_AUTH_TOKEN" in failed[0]["hint"]
    assert_hold_played_in_full(report)
    # The gateway closed the stream and the <Connect action> answered the Dial.
    assert [s.ended_by for s in report.streams] == ["gateway"]
    assert report.rest_update_t == []
    assert report.closing_twiml is not None and DIAL in report.closing_twiml
    assert (record.end_action, record.transfer_to, record.status) == (
        "transfer",
        AGENT,
        CallStatus.ENDED,
    )
    assert calls_ended("transferred_cold") == transfers + 1


@pytest.mark.slow
async def test_without_an_account_sid_the_transfer_takes_the_action_path(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, rest_api: FakeTwilioRestApi
) -> None:
    async with gateway_factory(twilio_api_base_url=rest_api.url) as server:
        report = await press_for_agent(server, rest_api)
        record = await record_of(server, report)

    assert rest_api.requests == []
    assert_hold_played_in_full(report)
    assert [s.ended_by for s in report.streams] == ["gateway"]
    assert report.closing_twiml is not None and DIAL in report.closing_twiml
    assert (record.end_action, record.transfer_to, record.status) == (
        "transfer",
        AGENT,
        CallStatus.ENDED,
    )


# -- the REST client against the fake REST API ------------------------------------------------


def rest_client(api: FakeTwilioRestApi, *, timeout: float = 5.0) -> TwilioRest:
    return TwilioRest(api.account_sid, api.auth_token, api_base_url=api.url, timeout=timeout)


async def test_redirecting_a_call_twilio_no_longer_knows_is_a_false(
    rest_api: FakeTwilioRestApi,
) -> None:
    async with rest_client(rest_api) as rest:
        assert await rest.redirect("CA" + "0" * 32, "<Response><Hangup/></Response>") is False
    assert [r.status_code for r in rest_api.requests] == [404]


async def test_an_unreachable_or_silent_rest_api_is_a_false_within_the_timeout() -> None:
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    port = silent.sockets[0].getsockname()[1]
    async with silent:
        rest = TwilioRest("AC1", "token", api_base_url=f"http://127.0.0.1:{port}", timeout=0.3)
        async with rest:
            started = asyncio.get_running_loop().time()
            assert await rest.redirect("CA1", "<Response/>") is False
            assert asyncio.get_running_loop().time() - started < 1.0
    closed = TwilioRest("AC1", "token", api_base_url=f"http://127.0.0.1:{port}", timeout=2.0)
    async with closed:
        assert await closed.redirect("CA1", "<Response/>") is False  # refused: logged, not raised
