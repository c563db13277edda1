"""The example flows, end to end through the audio path: the simulated Twilio caller (real HTTP,
WebSocket, espeak speech and DTMF) calls the real gateway under uvicorn, whose STT/LLM/TTS is a
local server speaking OpenAI's wire formats. Hot reload is checked with calls in progress."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory, record_of
from structlog.testing import capture_logs

from ivr.flowtools.audio_test import fast_speak, speech_seconds
from ivr.flowtools.cli import main as flows_main
from ivr.server import RunningServer
from ivr.sim.caller import CallReport, place_call
from ivr.state.base import CallRecord
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall

pytestmark = pytest.mark.slow

FLOWS = Path(__file__).resolve().parent.parent / "flows"
SUPPORT = "+15550100001"
SALES = "+15550100002"
AGENT = "+15550100999"
MENU = (
    "For your account balance, press 1 or say balance. To speak to an agent, press 2 or say agent."
)
WELCOME = "Thank you for calling Acme."
GOODBYE = "Thank you for calling Acme. Goodbye."
ASK_ACCOUNT = "Please enter or say your five digit account number."
NO_INPUT = "Sorry, I didn't hear anything."
HOLD = "Please hold while I connect you to an agent."
FRAME_S = 0.02  # each spoken segment is padded to whole 20 ms frames


class Backend:
    """The account backend: a real local HTTP server that records the paths it was asked."""

    def __init__(self, balances: dict[str, dict[str, Any]]) -> None:
        paths: list[str] = []
        self.paths = paths

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                paths.append(self.path)
                account = self.path.split("/")[2] if self.path.count("/") >= 3 else ""
                body = balances.get(account)
                data = json.dumps(body or {"error": "unknown"}).encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def backend() -> Iterator[Backend]:
    server = Backend({"12345": {"balance": 42.5, "due_date": "June 1"}})
    yield server
    server.close()


@pytest.fixture
def fake(fake_openai: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_openai.speak = fast_speak  # 3x faster fake voice: the same checks, shorter calls
    return fake_openai


def script_steps(steps: list[Any], **options: Any) -> Any:
    from ivr.sim.script import script_from_data

    return script_from_data({"steps": steps, "max_wait": 15, **options})


async def place(server: RunningServer, to: str, steps: list[Any], **options: Any) -> CallReport:
    report = await place_call(
        server.base_url,
        script=script_steps(steps, **options),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        to=to,
    )
    assert not report.errors and not report.violations, report.format_transcript()
    return report


def spoken(fake: FakeOpenAIServer) -> str:
    """Everything the gateway sent to TTS (startup pre-synthesis included), in order."""
    return " | ".join(str((r.json or {}).get("input")) for r in fake.requests_for("speech"))


def audio_seconds(*texts: str) -> float:
    return sum(speech_seconds(t) for t in texts)


def copy_flows(tmp_path: Path) -> Path:
    target = tmp_path / "flows"
    shutil.copytree(FLOWS, target, ignore=shutil.ignore_patterns("tests"))
    return target


def edit_flow(path: Path, change: Any) -> None:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


# -- support ----------------------------------------------------------------------------------


async def test_support_balance_by_keypad_then_agent_by_voice_is_a_dial(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SUPPORT_BACKEND_URL", backend.url)
    fake.transcripts.append("agent")
    async with gateway_factory() as server:
        report = await place(
            server,
            SUPPORT,
            [{"press": "1"}, {"press": "12345"}, {"press": "1"}, "I want an agent."],
        )
        record = await record_of(server, report)
    assert backend.paths == ["/accounts/12345/balance"]
    said = spoken(fake)
    assert "Your balance is 42.5 dollars," in said and "due on June 1." in said, said
    for prompt in (WELCOME, MENU, ASK_ACCOUNT, HOLD):
        assert prompt in said  # static prompts: synthesised at startup, played from cache
    # The caller heard every answer: greeting+menu, account prompt, balance+menu, menu, hold.
    turns = report.turns
    assert [t.caller_text for t in turns] == [
        None,
        "[keys 1]",
        "[keys 12345]",
        "[keys 1]",
        "I want an agent.",
    ]
    assert all(t.bot_audio_seconds > 0.3 and not t.interrupted for t in turns), (
        report.format_transcript()
    )
    assert turns[-1].bot_audio_seconds == pytest.approx(speech_seconds(HOLD), abs=FRAME_S)
    assert report.closing_twiml is not None
    assert f"<Dial><Number>{AGENT}</Number></Dial>" in report.closing_twiml
    # support.yaml lists `account` under variables_in_clear: the lookup needs it on a resume.
    assert record.variables["account"] == "12345" and record.variables["balance"] == 42.5
    assert (record.end_action, record.transfer_to, record.node) == ("transfer", AGENT, "to_agent")


async def test_support_goodbye_plays_to_the_end_before_the_hangup(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SUPPORT_BACKEND_URL", backend.url)
    async with gateway_factory() as server:
        report = await place(server, SUPPORT, [{"press": "1"}, {"press": "12345"}, {"press": "2"}])
        record = await record_of(server, report)
    last = report.turns[-1]
    assert last.caller_text == "[keys 2]" and not last.interrupted
    assert last.bot_audio_seconds == pytest.approx(speech_seconds(GOODBYE), abs=FRAME_S)
    assert last.bot_first_audio_t is not None
    # The gateway closed the stream only after the goodbye had played at the caller.
    stream = report.streams[-1]
    assert stream.ended_by == "gateway"
    assert stream.ended_t >= last.bot_first_audio_t + last.bot_audio_seconds - 0.05
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
    assert record.end_action == "hangup" and record.node == "goodbye"


async def test_support_silence_reprompts_then_falls_back_to_an_agent(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    flows = copy_flows(tmp_path)
    edit_flow(flows / "support.yaml", lambda d: d["defaults"].update(no_input_timeout=1.0))
    async with gateway_factory(flows_dir=str(flows)) as server:
        report = await place(server, SUPPORT, [{"silence": 30}], wait_for_greeting=False)
        record = await record_of(server, report)
    # All the bot said, in one stretch: greeting+menu, twice (no-input prompt + menu), hold.
    heard = sum(t.bot_audio_seconds for t in report.turns)
    expected = audio_seconds(WELCOME, MENU, NO_INPUT, MENU, NO_INPUT, MENU, HOLD)
    assert heard == pytest.approx(expected, abs=7 * FRAME_S), report.format_transcript()
    # Three 1 s timeouts, not the flow's 6 s: the call is audio plus about three seconds.
    assert report.duration_s < expected + 3 * 1.0 + 2.0
    assert report.closing_twiml is not None and f"<Number>{AGENT}</Number>" in report.closing_twiml
    assert (record.node, record.end_action) == ("to_agent", "transfer")


# -- hot reload -------------------------------------------------------------------------------


async def wait_until(check: Any, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if await check() if asyncio.iscoroutinefunction(check) else check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out waiting")


async def version_for(server: RunningServer, number: str) -> str:
    probe = CallRecord(call_sid="CA-probe", to_number=number)
    await server.gateway.flows.pin(probe)
    return probe.flow_version


async def test_editing_a_flow_changes_new_calls_only_and_a_broken_edit_is_refused(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    flows = copy_flows(tmp_path)
    support = flows / "support.yaml"
    new_welcome = "Welcome to the brand new Acme customer line, thank you very much for calling."
    new_ask = "Account number?"

    def rewrite(d: dict[str, Any]) -> None:
        d["nodes"]["welcome"]["text"] = new_welcome
        d["nodes"]["ask_account"]["prompt"] = new_ask

    async with gateway_factory(flows_dir=str(flows)) as server:
        old = await version_for(server, SUPPORT)
        # Call 1 waits on the menu while the file changes, then presses 1.
        call_1 = asyncio.create_task(
            place(server, SUPPORT, [{"silence": 4.0}, {"press": "1"}], wait_for_greeting=False)
        )

        async def call_1_on_menu() -> bool:
            active = await server.gateway.store.list_active()
            return any(r.to_number == SUPPORT and r.node == "main_menu" for r in active)

        await wait_until(call_1_on_menu)
        edit_flow(support, rewrite)

        async def changed() -> bool:
            return await version_for(server, SUPPORT) != old

        await wait_until(changed)
        new = await version_for(server, SUPPORT)
        assert not call_1.done(), "call 1 must still be in progress during the reload"
        report_2 = await place(server, SUPPORT, [{"press": "1"}])
        report_1 = await call_1
        # A broken edit (unknown target) is refused; the new version keeps answering.
        with capture_logs() as logs:
            edit_flow(support, lambda d: d["nodes"]["welcome"].update(next="nowhere"))
            await wait_until(lambda: any(e["event"] == "flows.refused" for e in logs))
        assert await version_for(server, SUPPORT) == new
        report_3 = await place(server, SUPPORT, [{"hangup": None}])
        records = [await record_of(server, r) for r in (report_1, report_2, report_3)]
    assert [r.flow_version for r in records] == [old, new, new]
    # What each call heard, measured on its audio: call 1 old texts (also after the reload),
    # calls 2 and 3 the new ones.
    greeting_old, greeting_new = audio_seconds(WELCOME, MENU), audio_seconds(new_welcome, MENU)
    assert abs(greeting_new - greeting_old) > 0.5  # the lengths tell the versions apart
    one = FRAME_S * 2
    assert report_1.turns[0].bot_audio_seconds == pytest.approx(greeting_old, abs=one)
    assert report_1.turns[-1].bot_audio_seconds == pytest.approx(
        speech_seconds(ASK_ACCOUNT), abs=one
    )
    assert report_2.turns[0].bot_audio_seconds == pytest.approx(greeting_new, abs=one)
    assert report_2.turns[-1].bot_audio_seconds == pytest.approx(speech_seconds(new_ask), abs=one)
    assert report_3.turns[0].bot_audio_seconds == pytest.approx(greeting_new, abs=one)
    refused = [e for e in logs if e["event"] == "flows.refused"]
    assert any("nowhere" in json.dumps(e, default=str) for e in refused), refused


# -- sales ------------------------------------------------------------------------------------


async def test_sales_greeter_hands_off_to_pricing_whose_prompt_has_the_prices(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer
) -> None:
    fake.transcripts.extend(["what does the business plan cost", "I'd like a quote"])
    answer = "The Business plan is 199 dollars a month with 6,000 minutes included."
    fake.chat = [
        ChatScript(tool_calls=[ScriptToolCall("to_pricing")]),
        ChatScript(text=answer),
        ChatScript(tool_calls=[ScriptToolCall("book_demo")]),
    ]
    async with gateway_factory() as server:
        report = await place(
            server, SALES, ["What does the business plan cost?", "I'd like a quote."]
        )
        record = await record_of(server, report)
    chats = [r.json for r in fake.requests_for("chat")]
    assert len(chats) == 3
    systems = [c["messages"][0]["content"] for c in chats if c]
    assert "first contact of Acme Voice sales" in systems[0]
    assert "$199 per month" not in systems[0]
    assert "pricing specialist" in systems[1] and "Business: $199 per month" in systems[1]
    tools = {t["function"]["name"] for t in chats[1]["tools"]} if chats[1] else set()
    assert {"book_demo", "to_technical", "end_call"} <= tools
    said = spoken(fake)
    assert "199 dollars a month" in said, said
    assert (
        report.closing_twiml is not None and "<Number>+15550100998</Number>" in report.closing_twiml
    )
    assert (record.node, record.end_action) == ("human", "transfer")


# -- ivr flows test --audio -------------------------------------------------------------------


def test_flows_test_audio_runs_the_example_tests_through_the_gateway(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = flows_main(["flows", "test", "--audio", str(FLOWS / "tests" / "default_test.yaml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 passed, 0 failed" in out
    assert out.count("[audio]") == 2


def test_flows_test_audio_reports_what_the_call_did_not_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shutil.copy(FLOWS / "default.yaml", tmp_path / "default.yaml")
    shutil.copy(FLOWS / "routes.yaml", tmp_path / "routes.yaml")
    (tmp_path / "tests").mkdir()
    wrong = {
        "flow": "default",
        "tests": [
            {
                "name": "wrong expectations",
                "steps": [
                    {"node": "goodbye", "bot_says": "Welcome to Globex"},
                    {
                        "say": "bye",
                        "llm": [{"tool_calls": [{"name": "end_call"}]}],
                        "ended": "transfer",
                    },
                ],
            }
        ],
    }
    (tmp_path / "tests" / "wrong_test.yaml").write_text(yaml.safe_dump(wrong), encoding="utf-8")
    code = flows_main(["flows", "test", "--audio", str(tmp_path / "tests" / "wrong_test.yaml")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "expected node 'goodbye', at 'assistant'" in out
    assert "expected the bot to say 'Welcome to Globex'" in out
    assert "expected the call to end with transfer, got hangup" in out
    assert "<Dial" in out  # the failure names what Twilio got instead
