"""Personal data is off by default: logs, the call record and the admin views carry no raw phone
or card number unless a setting, a flow's ``variables_in_clear`` or the PII token allows it.

The last test places real calls (simulated Twilio caller -> real gateway, providers a local
server speaking OpenAI's wire formats) in which the caller says and presses phone and card
numbers, and greps every log line and every admin answer for them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
import structlog
import uvicorn
from fastapi import FastAPI
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from redis_server import LOCAL_REDIS_URL
from structlog.testing import capture_logs

from ivr.flows.events import FlowState, Frame, HistoryItem, ToolCallData
from ivr.flows.loader import check_flow_text, load_flow, load_flow_text
from ivr.flows.privacy import answer_variables, mask_answer, stored_state
from ivr.flowtools.audio_test import fast_speak
from ivr.flowtools.textio import TextCallIO, pressed
from ivr.obs.logging import configure_logging
from ivr.obs.pii import PiiFilter, mask_speech, mask_text, redact
from ivr.server import free_port
from ivr.sim.caller import place_call
from ivr.sim.script import script_from_data
from ivr.state.admin import admin_router
from ivr.state.base import CallRecord, CallStatus
from ivr.state.cli import add_commands
from ivr.state.memory import MemoryCallStore
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

FLOWS = Path(__file__).resolve().parent.parent / "flows"

# -- the masker -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("card 4242 4242 4242 4242 ok", "card **** **** **** 4242 ok"),
        ("5555-5555-5555-4444", "****-****-****-4444"),
        ("4242424242424241", "************4241"),  # fails Luhn: masked all the same
        ("amex 378282246310005.", "amex ***********0005."),
        ("+14155550123", "+*********23"),
        ("call (415) 555-0142 now", "call (***) ***-**42 now"),
        ("+1 (415) 555-0142", "+* (***) ***-**42"),
        ("+44 7700 900123", "+** **** ****23"),
        ("555-0142", "***-**42"),
        ("pressed 4155550123#", "pressed ********23#"),
        ("GET /accounts/4000056655665556/balance", "GET /accounts/************5556/balance"),
        ("a=4155550123&b=1", "a=********23&b=1"),
        ("4 1 5 5 5 5 0", "* * * * * 5 0"),
    ],
)
def test_phone_and_card_numbers_are_masked_keeping_their_last_digits(
    text: str, masked: str
) -> None:
    assert mask_text(text) == masked
    assert mask_text(masked) == masked  # masking twice changes nothing


@pytest.mark.parametrize(
    "text",
    [
        "1",
        "42",
        "press 1 or 2",
        "account 12345",
        "PIN 123456",
        "we open at 10:30 today",
        "you owe $1,250.00",
        "1,250,000 dollars",
        "1250000.00",
        "due 2024-06-01",
        "2024-06-01T10:30:00.123456Z",
        "2024-06-01 10:30:00",
        "CA3f1234567890abcdef1234567890ab",
        "MZ0123456789abcdef0123456789abcd",
        "gw-1-1234567-ab12",
        "http://127.0.0.1:8081/x",
        "pi is 3.14159265",
        "v1.2.3",
    ],
)
def test_short_numbers_amounts_times_dates_and_ids_are_left_alone(text: str) -> None:
    assert mask_text(text) is text


def test_digit_words_are_masked_in_what_people_said() -> None:
    said = "my card is four two four two four two four two four two four two four two four two"
    assert mask_speech(said) == "my card is " + "* " * 12 + "four two four two"
    assert mask_speech("oh one two three four five six") == "* * * * * five six"
    assert mask_speech("I want one or two tickets") == "I want one or two tickets"
    assert mask_speech("call 4155550123") == "call ********23"


def test_an_input_made_of_many_short_groups_is_masked_in_linear_time() -> None:
    hostile = "1 " * 20_000 + "x"  # a regex that backtracks would take minutes
    started = time.perf_counter()
    masked = mask_text(hostile)
    assert time.perf_counter() - started < 0.5
    assert masked.count("*") == 20_000 - 4  # a run that long keeps 4, as a card


def test_pii_values_are_masked_numbers_or_only_their_length() -> None:
    assert redact("+15550100999") == "+*********99"
    assert redact("I want to pay with 4242 4242 4242 4242") == "[38 chars]"
    assert redact(["a", "b"]) == "[redacted]"
    assert redact("") == "" and redact(None) is None


# -- the log processor ------------------------------------------------------------------------

CARD = "4242 4242 4242 4242"
PHONE = "+14155550123"


def test_the_filter_redacts_pii_keys_and_masks_numbers_in_every_other_value() -> None:
    event = {
        "event": f"caller gave {CARD}",
        "pii_text": f"my card is {CARD}",
        "pii_number": PHONE,
        "detail": {"numbers": [PHONE, "1", ("555-0142",)], "count": 4155550123},
        "call_sid": "CA0123456789012345678901234567890a",
        "version": "123456789012",
        "seconds": 0.25,
    }
    out = PiiFilter()(None, "info", event)
    assert out["event"] == "caller gave **** **** **** 4242"
    assert out["pii_text"] == "[30 chars]" and out["pii_number"] == "+*********23"
    assert out["detail"] == {"numbers": ["+*********23", "1", ["***-**42"]], "count": 4155550123}
    assert out["call_sid"] == "CA0123456789012345678901234567890a"  # ids are no numbers
    assert out["version"] == "123456789012" and out["seconds"] == 0.25


def _log_some_personal_data() -> None:
    log = structlog.get_logger("ivr.test")
    log.info("caller.said", pii_text=f"my card is {CARD}", stt_s=0.2)
    log.info("call.transfer", pii_number=PHONE)
    log.warning(f"callback requested to {PHONE}", detail={"card": CARD.replace(" ", "-")})
    try:
        raise ValueError(f"backend refused card {CARD.replace(' ', '')}")
    except ValueError:
        log.exception("flow.http_failed")


RAW = (CARD, CARD.replace(" ", ""), CARD.replace(" ", "-"), PHONE, PHONE[1:])


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_configured_logging_writes_no_raw_number_in_either_format(fmt: str) -> None:
    stream = io.StringIO()
    configure_logging(fmt, "info", stream=stream)
    _log_some_personal_data()
    written = stream.getvalue()
    assert written.count("\n") >= 4 and "Traceback" in written and "flow.http_failed" in written
    assert [raw for raw in RAW if raw in written] == []
    assert "+*********23" in written and "**** **** **** 4242" not in written  # redacted whole
    assert "************4242" in written and "[30 chars]" in written
    if fmt == "json":
        lines = [json.loads(line) for line in written.splitlines()]
        assert lines[0]["pii_text"] == "[30 chars]" and lines[0]["level"] == "info"
        assert lines[0]["timestamp"].endswith("Z")  # stamped after the filter: not masked


def test_log_pii_true_writes_personal_data_unmasked_and_says_so() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", log_pii=True, stream=stream)
    _log_some_personal_data()
    written = stream.getvalue()
    assert "logging.personal_data_enabled" in written
    assert all(raw in written for raw in (CARD, PHONE, CARD.replace(" ", "")))


def test_capture_logs_still_sees_every_event_after_configure_logging() -> None:
    configure_logging("json", "info", stream=io.StringIO())
    with capture_logs() as logs:
        structlog.get_logger("ivr.test").info("caller.said", pii_text=CARD)
    assert logs == [{"event": "caller.said", "pii_text": CARD, "log_level": "info"}]


# -- flows: variables_in_clear ----------------------------------------------------------------

COLLECT = """\
name: collect
start: ask_card
variables:
  agent: "+15550100999"
  note: ""
variables_in_clear: [account]
nodes:
  ask_card:
    kind: ask
    prompt: Your card number?
    store: card
    next: ask_account
  ask_account:
    kind: ask
    prompt: Your account number?
    store: account
    next: copy
  copy:
    kind: set
    values: {card_copy: "{{ card }}", note: "card {{ card }}", fixed: "+15550100888"}
    next: bye
  bye:
    kind: transfer
    number: "{{ agent }}"
"""


def test_an_unknown_variable_in_clear_is_an_error_at_its_line_and_column() -> None:
    text = COLLECT.replace("variables_in_clear: [account]", "variables_in_clear: [card, acount]")
    flow, problems = check_flow_text(text, "collect.yaml")
    assert flow is None and len(problems) == 1
    problem = problems[0]
    assert (problem.file, problem.line, problem.column) == ("collect.yaml", 6, 28)
    assert "unknown variable 'acount'; did you mean 'account'?" in problem.message


def test_the_shipped_payments_flow_keeps_the_account_in_clear() -> None:
    payments = load_flow(FLOWS / "payments.yaml")
    assert payments.variables_in_clear == ["account"]
    assert "account" in answer_variables(payments)  # returned from verify_caller's ask node


# -- what the call record keeps ---------------------------------------------------------------


def collect_state() -> FlowState:
    flow = load_flow_text(COLLECT, "collect.yaml")
    return FlowState(
        flow="collect",
        version=flow.version,
        node="bye",
        vars={
            "caller": PHONE,
            "call_sid": "CA1",
            "card": CARD,
            "account": "12345",
            "card_copy": CARD,
            "note": f"card {CARD}",
            "fixed": "+15550100888",
            "agent": "+15550100999",
            "last_input": "one two three four five",
            "holder": "Ann, cell 415 555 0142",
        },
        history=[
            HistoryItem(role="user", content="text me on 415-555-0142"),
            HistoryItem(
                role="assistant",
                content="",
                tool_calls=[ToolCallData(id="t1", name="pay", arguments=f'{{"card": "{CARD}"}}')],
            ),
        ],
        pending_answer="4000 0566 5566 5556",
        stack=[Frame(flow="collect", version="v", node="copy", vars={"card": "4000056655665556"})],
    )


def test_the_record_masks_answers_and_numbers_but_the_live_state_keeps_them() -> None:
    flow = load_flow_text(COLLECT, "collect.yaml")
    live = collect_state()
    before = live.model_dump()
    kept = stored_state(flow, live)
    assert live.model_dump() == before  # the call goes on with what the caller said
    assert kept.vars["card"] == "************4242"  # an answer: its digits alone
    assert kept.vars["card_copy"] == "************4242"  # a copy of an answer is one too
    assert kept.vars["last_input"] == "***45"  # digit words count as digits
    assert kept.vars["note"] == "************4242"  # so is a template that reads one
    assert kept.vars["holder"] == "Ann, cell *** *** **42"  # not an answer: numbers masked
    assert kept.history[0].content == "text me on ***-***-**42"
    assert kept.history[1].tool_calls[0].arguments == '{"card": "**** **** **** 4242"}'
    assert kept.pending_answer == "************5556"
    assert kept.stack[0].vars == {"card": "************5556"}


def test_clear_variables_the_call_numbers_and_the_flow_files_own_values_stay() -> None:
    kept = stored_state(load_flow_text(COLLECT, "collect.yaml"), collect_state())
    assert kept.vars["account"] == "12345"  # variables_in_clear
    assert (kept.vars["caller"], kept.vars["call_sid"]) == (PHONE, "CA1")
    assert kept.vars["agent"] == "+15550100999"  # the flow's own transfer number
    assert kept.vars["fixed"] == "+15550100888"  # a set literal


def test_a_pin_is_masked_whole_and_a_menu_key_not_at_all() -> None:
    assert mask_answer("1234") == "****"
    assert mask_answer("123") == "***"
    assert mask_answer("1") == "1" and mask_answer("agent") == "agent"
    assert mask_answer("my account is 12345") == "***45"


# -- a resumed call works on the record ------------------------------------------------------


class Backend:
    """The account backend: a real local HTTP server that records what it was asked."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                requests.append((self.command, unquote(self.path)))
                path = urlsplit(self.path).path
                body: dict[str, Any] = {"name": "Ann"}
                if path.endswith("/balance"):
                    body = {"balance": 42.5}
                elif path.endswith("/payments"):
                    body = {"confirmation": "C-1"}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def paths(self) -> list[str]:
        return [urlsplit(path).path for _, path in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def backend() -> Iterator[Backend]:
    server = Backend()
    yield server
    server.close()


class InstanceDied(Exception):
    """Raised from inside a call to stop it dead, as a SIGKILL would."""


@pytest.mark.parametrize("in_clear", [True, False], ids=["account-in-clear", "account-masked"])
async def test_a_payment_resumed_on_another_instance_uses_what_the_record_kept(
    gateway_factory: GatewayFactory,
    backend: Backend,
    prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    in_clear: bool,
) -> None:
    flows = tmp_path / "flows"
    shutil.copytree(FLOWS, flows, ignore=shutil.ignore_patterns("tests"))
    if not in_clear:
        payments = flows / "payments.yaml"
        text = payments.read_text().replace("variables_in_clear: [account]", "")
        payments.write_text(text)
    monkeypatch.setenv("SUPPORT_BACKEND_URL", backend.url)
    shared = {"flows_dir": str(flows), "redis_url": LOCAL_REDIS_URL, "redis_prefix": prefix}
    async with gateway_factory(**shared) as a, gateway_factory(**shared) as b:
        record = CallRecord(call_sid="CA-pay", from_number=PHONE, to_number="+15550100004",
                            stream_sid="MZ-1", status=CallStatus.ACTIVE)  # fmt: skip
        await a.gateway.flows.pin(record)
        record = await a.gateway.store.create(record)
        first = TextCallIO.scripted([pressed("12345")])

        def die_on_the_menu(_spec: object) -> None:
            if not first.script:  # the account is entered; the caller is on `offer`
                raise InstanceDied

        first.on_listen = die_on_the_menu
        with pytest.raises(InstanceDied):
            await a.gateway.flows.run(first, record)
        stored = await b.gateway.store.update("CA-pay", lambda r: setattr(r, "stream_sid", "MZ-2"))
        await b.gateway.flows.run(TextCallIO.scripted([pressed("1")]), stored)
    assert stored.node == "offer"
    expected = "12345" if in_clear else "***45"
    assert stored.variables["account"] == expected
    # Before the drop the live state held the digits; after it, what the record kept.
    assert backend.paths() == [
        "/accounts/12345",
        "/accounts/12345/balance",
        f"/accounts/{expected}/payments",
    ]


# -- admin API and `ivr calls` ----------------------------------------------------------------


def a_record(sid: str = "CA-adm") -> CallRecord:
    return CallRecord(
        call_sid=sid,
        from_number=PHONE,
        to_number="+15550100004",
        status=CallStatus.ACTIVE,
        variables={"caller": PHONE, "account": "12345", "note": f"card {CARD}"},
        history=[{"role": "user", "content": "call me on 415 555 0142"}],  # type: ignore[list-item]
    )


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_admin_answers_are_masked_unless_the_pii_token_asks_for_pii() -> None:
    store = MemoryCallStore()
    await store.create(a_record())
    app = FastAPI()
    app.include_router(admin_router(store, token="adm", pii_token="pii"))
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:

        async def get(path: str, token: str) -> httpx.Response:
            return await client.get(path, headers={"Authorization": f"Bearer {token}"})

        masked = [await get("/admin/calls/CA-adm", t) for t in ("adm", "pii")]
        masked.append(await get("/admin/calls", "adm"))
        refused = await get("/admin/calls/CA-adm?pii=true", "adm")
        clear = await get("/admin/calls/CA-adm?pii=true", "pii")
        listed = await get("/admin/calls?pii=true", "pii")
        wrong = await get("/admin/calls", "nope")
    for answer in masked:
        assert answer.status_code == 200
        assert [raw for raw in (*RAW, "4155550142") if raw in answer.text] == []
        assert "+*********23" in answer.text and "**** **** **** 4242" in answer.text
    assert refused.status_code == 403 and "PII bearer token" in refused.text
    assert clear.status_code == 200 and clear.json()["from_number"] == PHONE
    assert clear.json()["variables"]["note"] == f"card {CARD}"
    assert listed.json()["calls"][0]["history"][0]["content"] == "call me on 415 555 0142"
    assert wrong.status_code == 403


async def test_pii_true_is_refused_when_no_pii_token_is_configured() -> None:
    store = MemoryCallStore()
    await store.create(a_record())
    app = FastAPI()
    app.include_router(admin_router(store, token="adm"))
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:
        auth = {"Authorization": "Bearer adm"}
        answer = await client.get("/admin/calls/CA-adm?pii=true", headers=auth)
    assert answer.status_code == 403 and "no PII token" in answer.text


def run_cli(*argv: str) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="ivr")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


async def test_ivr_calls_masks_numbers_unless_pii(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ivr.state.redis_store import RedisCallStore

    store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix)
    await store.create(a_record("CA-cli"))
    await store.aclose()
    common = ("--redis-url", LOCAL_REDIS_URL, "--redis-prefix", prefix)

    def cli(*argv: str) -> str:
        assert run_cli("calls", *argv, *common) == 0
        return capsys.readouterr().out

    shown = await asyncio.to_thread(
        lambda: [cli("show", "CA-cli"), cli("show", "CA-cli", "--json"), cli("list")]
    )
    for out in shown:
        assert [raw for raw in (*RAW, "4155550142") if raw in out] == [], out
        assert "+*********23" in out
    clear = await asyncio.to_thread(cli, "show", "CA-cli", "--pii", "--json")
    assert json.loads(clear)["variables"]["note"] == f"card {CARD}"


# -- end to end: a corpus of numbers through real calls ---------------------------------------

CALLER = "+14155550199"
CALLED = "+15550100077"
SAID = {  # what the fake STT hears, in order
    "card": "my card number is 4242 4242 4242 4242",
    "callback": "call me back on (415) 555-0142",
    "agent": "also my other card 5555-5555-5555-4444 and my mobile +44 7700 900123",
    "barge_in": "wait, text 415-555-0142 instead",
}
PRESSED = {"card_keys": "4000056655665556", "callback_keys": "4155550123"}
REPLY = (
    "+44 7700 900123 gets a text about the card ending 4444, and a letter goes to the address "
    "we have on file for you within five working days, with everything we talked about today."
)
CORPUS = [
    CALLER, CALLED, "4242 4242 4242 4242", "(415) 555-0142", "555-0142",
    "5555-5555-5555-4444", "+44 7700 900123", *PRESSED.values(),
]  # fmt: skip
CHECK_URL = (
    "{{ backend_url }}/cards/{{ card_keys }}"
    "?said={{ card }}&cb={{ callback }}&cbk={{ callback_keys }}"
)
COLLECT_FLOW = f"""\
name: collect
numbers: ["{CALLED}"]
start: ask_card
variables:
  backend_url: {{env: PII_BACKEND_URL, default: "http://127.0.0.1:9"}}
nodes:
  ask_card: {{kind: ask, prompt: Your card number please., store: card, next: card_keys}}
  card_keys: {{kind: ask, prompt: 'Now type it, then hash.', store: card_keys, next: callback}}
  callback: {{kind: ask, prompt: A number to call you back?, store: callback, next: keys}}
  keys: {{kind: ask, prompt: 'Type it too, then hash.', store: callback_keys, next: check}}
  check:
    kind: http
    request: {{url: "{CHECK_URL}", map: {{holder: name}}}}
    next: chat
    on_error: chat
  chat:
    kind: agent
    system: You take notes for the card team.
    greeting: 'Anything else, {{{{ holder }}}}?'
    max_turns: 2
    on_max_turns: bye
  bye:
    kind: transfer
    say: Connecting you now.
    number: "+1{{{{ callback_keys }}}}"
"""


def digits_only(text: str) -> str:
    """Separators between digits removed, so a number leaks in any formatting is found."""
    return re.sub(r"(?<=\d)[ ()\-]+(?=\d)", "", text)


def leaks(text: str) -> list[str]:
    """The corpus numbers found in ``text``, as written or with separators removed."""
    bare = digits_only(text)
    return [n for n in CORPUS if n in text or digits_only(n).lstrip("+") in bare]


class StdlibLines(logging.Handler):
    """What Python's last-resort handler would print (warnings and up) for library loggers."""

    def __init__(self, stream: io.StringIO) -> None:
        super().__init__(logging.WARNING)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        self.stream.write(self.format(record) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("log_pii", [False, True], ids=["default", "IVR_LOG_PII=true"])
async def test_numbers_said_and_pressed_on_real_calls_never_reach_logs_or_admin_answers(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    backend: Backend,
    prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    log_pii: bool,
) -> None:
    flows = tmp_path / "flows"
    shutil.copytree(FLOWS, flows, ignore=shutil.ignore_patterns("tests"))
    (flows / "collect.yaml").write_text(COLLECT_FLOW)
    monkeypatch.setenv("PII_BACKEND_URL", backend.url)
    fake_openai.speak = fast_speak
    fake_openai.transcripts.extend(SAID.values())
    fake_openai.chat = [ChatScript(text=REPLY), ChatScript(text="Okay.")]
    written = io.StringIO()
    configure_logging("json", "debug", log_pii=log_pii, stream=written)
    stdlib = StdlibLines(written)
    logging.getLogger().addHandler(stdlib)
    answers: list[str] = []
    try:
        async with gateway_factory(
            flows_dir=str(flows), redis_url=LOCAL_REDIS_URL, redis_prefix=prefix, admin_token="adm"
        ) as server:
            sid = await _call_while_polling_admin(server.base_url, answers)
            stored = await _raw_record(prefix, sid)
    finally:
        logging.getLogger().removeHandler(stdlib)
    # The live call used the real numbers: the backend got them.
    [(_, asked)] = backend.requests
    query = parse_qs(urlsplit(asked).query)
    assert urlsplit(asked).path == f"/cards/{PRESSED['card_keys']}"
    assert query["said"] == [SAID["card"]] and query["cbk"] == [PRESSED["callback_keys"]]
    lines = written.getvalue().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds.count("caller.said") == 4 and "barge_in" in kinds and "call.transfer" in kinds
    found = {"log lines": leaks("\n".join(lines)), "admin answers": leaks("\n".join(answers))}
    # The call record in Redis keeps the call's own numbers and the number it is transferred to
    # (whichever instance answers the <Connect action> needs them), nothing else of the corpus.
    record = json.loads(stored)
    assert record["transfer_to"] == record["flow_state"]["transfer_to"] == "+14155550123"
    del record["transfer_to"], record["flow_state"]["transfer_to"]
    assert record["variables"]["callback_keys"] == "********23"
    found["stored record"] = [n for n in leaks(json.dumps(record)) if n not in (CALLER, CALLED)]
    common = ("--redis-url", LOCAL_REDIS_URL, "--redis-prefix", prefix)
    assert await asyncio.to_thread(run_cli, "calls", "show", sid, *common) == 0
    found["ivr calls show"] = leaks(capsys.readouterr().out)
    with capsys.disabled():
        print(f"\nscanned {len(lines)} log lines, {len(answers)} admin answers: {found}")
    assert CALLER in stored  # the scan finds what is there
    if log_pii:  # the corpus reaches the logs, and the scan sees it there
        assert set(found.pop("log lines")) >= {
            "4242 4242 4242 4242", "(415) 555-0142", "5555-5555-5555-4444", "+44 7700 900123",
            PRESSED["callback_keys"],  # transferred to
        }  # fmt: skip
    assert found == {k: [] for k in found}


async def _call_while_polling_admin(base_url: str, answers: list[str]) -> str:
    """Place the call; read both admin endpoints every 100 ms while it runs."""
    steps: list[Any] = [
        "My card number.",
        {"press": PRESSED["card_keys"] + "#", "gap": 0.05},
        "Call me back.",
        {"press": PRESSED["callback_keys"] + "#", "gap": 0.05},
        "And one more thing.",
        {"barge_in": {"say": "Wait, wait.", "after": 0.8}},
        {"silence": 2.0},
    ]
    call = asyncio.create_task(
        place_call(
            base_url,
            script=script_from_data({"steps": steps, "max_wait": 15}),
            auth_token=AUTH_TOKEN,
            public_base_url=PUBLIC_URL,
            from_=CALLER,
            to=CALLED,
        )
    )
    auth = {"Authorization": "Bearer adm"}
    async with httpx.AsyncClient(base_url=base_url, headers=auth) as client:
        while not call.done():
            listing = await client.get("/admin/calls")
            answers.append(listing.text)
            for entry in listing.json()["calls"]:
                answers.append((await client.get(f"/admin/calls/{entry['call_sid']}")).text)
            await asyncio.sleep(0.1)
        report = await call
        answers.append((await client.get(f"/admin/calls/{report.call_sid}")).text)
    assert not report.errors and not report.violations, report.format_transcript()
    assert report.closing_twiml is not None and "+14155550123" in report.closing_twiml
    return report.call_sid


async def _raw_record(prefix: str, call_sid: str) -> str:
    """The call's record as Redis holds it."""
    client = aioredis.from_url(LOCAL_REDIS_URL, decode_responses=True)
    try:
        raw = await client.get(f"{prefix}call:{call_sid}")
    finally:
        await client.aclose()
    assert isinstance(raw, str)
    return raw
