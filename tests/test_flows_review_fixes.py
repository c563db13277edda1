"""Regression tests for defects a review found in the flow engine, runner and registry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ivr.flows.agent import MAX_TOOL_ROUNDS
from ivr.flows.engine import new_state, step
from ivr.flows.events import (
    AgentTurn,
    CallerSaid,
    CallStarted,
    FlowAction,
    FlowEvent,
    FlowState,
    Hangup,
    HttpRequest,
    HttpResult,
    IntentClassified,
    Listen,
    LlmReplied,
    Resumed,
    Say,
    ToolCallEvent,
    Transfer,
)
from ivr.flows.loader import load_flow_text
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.registry import FlowRegistry
from ivr.flows.runner import FlowRunner
from ivr.flowtools.textio import TextCallIO, said
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

HANDOFFS = load_flow_text(
    """
name: desk
start: greeter
nodes:
  greeter:
    kind: agent
    system: Greet.
    tools:
      - {name: to_pricing, description: Prices., next: pricing}
  pricing:
    kind: agent
    respond_immediately: true
    system: Prices.
    tools:
      - {name: to_technical, description: Tech., next: technical}
  technical:
    kind: agent
    respond_immediately: true
    system: Tech.
    tools:
      - {name: to_pricing, description: Prices., next: pricing}
      - {name: note, description: Note., result: noted}
      - name: lookup
        description: Look up.
        http: {url: "http://127.0.0.1:1/x", timeout: 1}
""",
    "desk.yaml",
)


def run(flow: object, state: FlowState, event: FlowEvent) -> tuple[FlowState, list[FlowAction]]:
    return step(flow, state, event)  # type: ignore[arg-type]


def tool_reply(*calls: tuple[str, str]) -> LlmReplied:
    return LlmReplied("", tool_calls=tuple(ToolCallEvent(i, n, "{}") for i, n in calls))


def started(flow: Flow, text: str) -> tuple[FlowState, list[FlowAction]]:
    state, _ = run(flow, new_state(flow, env={}), CallStarted())
    return run(flow, state, CallerSaid(text))


def test_handoffs_between_agents_that_respond_immediately_stop_after_the_round_limit() -> None:
    state, actions = started(HANDOFFS, "how much is it?")
    model_calls = 1
    while model_calls <= 3 * MAX_TOOL_ROUNDS and isinstance(actions[-1], AgentTurn):
        names = {t.name for t in actions[-1].tools}
        target = "to_technical" if "to_technical" in names else "to_pricing"
        state, actions = run(HANDOFFS, state, tool_reply(("c1", target)))
        model_calls += 1 if isinstance(actions[-1], AgentTurn) else 0
    assert isinstance(actions[-1], Listen), f"still asking the model after {model_calls} calls"
    assert model_calls <= MAX_TOOL_ROUNDS
    assert any(isinstance(a, Say) and "wrong" in a.text for a in actions)


def at_technical() -> FlowState:
    state, _ = started(HANDOFFS, "tech question")
    state, _ = run(HANDOFFS, state, tool_reply(("c1", "to_pricing")))
    state, _ = run(HANDOFFS, state, tool_reply(("c2", "to_technical")))
    assert state.node == "technical"
    state, _ = run(HANDOFFS, state, LlmReplied("ok"))
    state, _ = run(HANDOFFS, state, CallerSaid("more"))
    return state


def test_a_reply_with_many_tool_calls_runs_only_a_few_and_answers_every_one() -> None:
    state = at_technical()
    calls = [(f"n{i}", "note") for i in range(20)]
    state, _ = run(HANDOFFS, state, tool_reply(*calls))
    results = [m.content for m in state.history if m.role == "tool" and m.tool_call_id]
    results = results[-20:]
    assert results.count("noted") == 8
    assert sum(r.startswith("not run") for r in results) == 12


def test_duplicate_tool_call_ids_do_not_crash_the_http_tool_answer() -> None:
    state = at_technical()
    state, actions = run(HANDOFFS, state, tool_reply(("dup", "note"), ("dup", "lookup")))
    assert isinstance(actions[-1], HttpRequest)
    state, actions = run(HANDOFFS, state, HttpResult(True, 200, {"a": 1}))
    assert isinstance(actions[-1], AgentTurn)
    assert state.history[-1].role == "tool" and '"a": 1' in state.history[-1].content


def test_what_the_caller_heard_before_the_model_failed_stays_in_the_history() -> None:
    state, _ = started(HANDOFFS, "hello")
    state, _ = run(HANDOFFS, state, LlmReplied("Our plan costs ninety", error="stream broke"))
    assert [m.content for m in state.history if m.role == "assistant"] == ["Our plan costs ninety"]


CLASSIFY = load_flow_text(
    """
name: cls
start: menu
intents:
  balance: {examples: [balance]}
nodes:
  menu:
    kind: ask
    prompt: What do you need?
    routes: [{intent: balance, next: bye}]
    classify: true
    extract:
      schema: {type: object, properties: {amount: {type: integer}}}
      required: false
    max_retries: 3
    fallback: bye
  bye:
    kind: hangup
""",
    "cls.yaml",
)


@pytest.mark.parametrize("intent", [["balance"], {"x": 1}])
def test_an_intent_that_is_not_a_name_is_no_match_not_a_crash(intent: object) -> None:
    state, _ = started(CLASSIFY, "erm money")
    state, actions = run(CLASSIFY, state, IntentClassified(intent))  # type: ignore[arg-type]
    assert state.node == "menu" and state.attempts == 1 and isinstance(actions[-1], Listen)


def test_extracted_slots_that_break_the_schema_are_not_stored() -> None:
    state, _ = started(CLASSIFY, "erm money")
    state, _ = run(CLASSIFY, state, IntentClassified(None, {"amount": {"deep": [1]}}))
    assert "amount" not in state.vars


@pytest.fixture
async def llm_server() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer(api_key="sk-test") as server:
        yield server


@pytest.fixture
async def llm(llm_server: FakeOpenAIServer) -> AsyncIterator[OpenAICompatLlm]:
    model = OpenAICompatLlm(
        base_url=llm_server.base_url, api_key="sk-test", model="m", max_tokens=None
    )
    yield model
    await model.aclose()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.mark.parametrize("answer", ['{"intent": ["balance"]}', '{"intent": {"x": 1}}'])
async def test_a_classifier_answer_of_the_wrong_shape_is_no_match(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient, answer: str
) -> None:
    llm_server.chat = [ChatScript(text=answer)]
    io = TextCallIO.scripted([said("erm something about money")])
    final = await FlowRunner(CLASSIFY, io, llm, http).run()
    assert final.outcome == "caller_hangup" and final.node == "menu"


def test_deeply_nested_tool_arguments_are_a_tool_error() -> None:
    state = at_technical()
    deep = "[" * 100_000 + "]" * 100_000
    calls = (ToolCallEvent("d1", "note", deep),)
    state, _ = run(HANDOFFS, state, LlmReplied("", tool_calls=calls))
    assert state.history[-1].content.startswith("ERROR")


# ------------------------------------------------------------------ http node


async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1000)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n")
    try:
        for _ in range(40):
            await asyncio.sleep(0.2)
            writer.write(b" ")
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    writer.close()


HTTP_FLOW_TEXT = """
name: h
start: fetch
variables: {url: "http://127.0.0.1:1/", name: x}
nodes:
  fetch:
    kind: http
    request: {url: "{{ url }}", headers: {X-Name: "{{ name }}"}, timeout: 1}
    next: ok
    on_error: failed
  ok: {kind: hangup, say: fine}
  failed: {kind: hangup, say: "failed {{ http_error }}"}
"""


async def run_http(http: httpx.AsyncClient, url: str, name: str = "x") -> tuple[FlowState, float]:
    flow = load_flow_text(HTTP_FLOW_TEXT, "h.yaml")
    io = TextCallIO.scripted([])
    loop = asyncio.get_running_loop()
    began = loop.time()
    final = await FlowRunner(flow, io, None, http, call_vars={"url": url, "name": name}).run()
    return final, loop.time() - began


async def test_a_backend_that_drips_its_answer_is_cut_off_at_the_total_timeout(
    http: httpx.AsyncClient,
) -> None:
    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        final, took = await run_http(http, f"http://127.0.0.1:{port}/")
    finally:
        server.close()
    assert final.node == "failed" and took < 3


@pytest.mark.parametrize(
    ("url", "name"),
    [("http://127.0.0.1:1/a\nb", "x"), ("http://127.0.0.1:1/", "José")],
)
async def test_a_request_httpx_refuses_takes_the_error_edge(
    http: httpx.AsyncClient, url: str, name: str
) -> None:
    final, _ = await run_http(http, url, name)
    assert final.node == "failed" and final.vars["http_error"]


async def test_a_huge_answer_is_refused_not_read_into_memory(http: httpx.AsyncClient) -> None:
    big = b'{"a": "' + b"x" * 3_000_000 + b'"}'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1000)
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(big)}"
        writer.write(head.encode() + b"\r\n\r\n")
        try:
            writer.write(big)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        final, _ = await run_http(http, f"http://127.0.0.1:{port}/")
    finally:
        server.close()
    assert final.node == "failed" and "large" in final.vars["http_error"]


# ------------------------------------------------------------------ hot reload


async def test_a_routes_file_that_is_not_utf8_is_a_problem_and_watching_goes_on(
    tmp_path: Path,
) -> None:
    flow = "name: default\nstart: bye\nnodes:\n  bye: {kind: hangup, say: Hello}\n"
    (tmp_path / "default.yaml").write_text(flow)
    registry = FlowRegistry(tmp_path)
    registry.load()
    (tmp_path / "routes.yaml").write_bytes(b"default: default\n# caf\xe9\n")
    problems = registry.reload()
    assert problems and "routes.yaml" in problems[0].file

    seen: list[int] = []

    async def on_reload(found: list[Problem]) -> None:
        seen.append(len(found))
        if len(seen) == 1:
            raise RuntimeError("a hook that fails once")

    stop = asyncio.Event()
    task = asyncio.create_task(registry.watch(stop, on_reload))
    try:
        await asyncio.sleep(0.3)
        (tmp_path / "default.yaml").write_text(flow.replace("Hello", "Hi"))
        for _ in range(50):
            await asyncio.sleep(0.1)
            if seen:
                break
        (tmp_path / "routes.yaml").write_text("default: default\n")
        (tmp_path / "default.yaml").write_text(flow.replace("Hello", "Hey there"))
        for _ in range(50):
            await asyncio.sleep(0.1)
            node = registry.get("default").nodes["bye"]
            if getattr(node, "say", "") == "Hey there":
                break
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert getattr(registry.get("default").nodes["bye"], "say", "") == "Hey there"
    assert len(seen) >= 2


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "schema",
    [
        "{type: object, properties: {acct: string}}",
        "{type: object, properties: {'bad name': {type: string}}}",
    ],
)
def test_extract_properties_must_be_schemas_with_variable_names(schema: str) -> None:
    text = f"""
name: v
start: ask
nodes:
  ask:
    kind: ask
    prompt: Account?
    extract: {{schema: {schema}}}
    next: bye
  bye: {{kind: hangup}}
"""
    with pytest.raises(FlowLoadError):
        load_flow_text(text, "v.yaml")


def test_a_literal_transfer_number_must_be_e164() -> None:
    text = """
name: v
start: x
nodes:
  x: {kind: transfer, number: "555-0100"}
"""
    with pytest.raises(FlowLoadError, match=r"E\.164"):
        load_flow_text(text, "v.yaml")


def test_a_rendered_transfer_number_that_is_not_e164_hangs_up_instead() -> None:
    flow = load_flow_text(
        """
name: v
start: x
variables: {desk: ""}
nodes:
  x: {kind: transfer, number: "{{ desk }}"}
""",
        "v.yaml",
    )
    state, actions = run(flow, new_state(flow, {"desk": "call me"}, env={}), CallStarted())
    assert not any(isinstance(a, Transfer) for a in actions)
    assert isinstance(actions[-1], Hangup) and state.outcome == "hangup"
    assert any(isinstance(a, Say) and "can't transfer" in a.text for a in actions)
    assert state.transfer_to is None
    state, actions = run(flow, new_state(flow, {"desk": "+15550100998"}, env={}), CallStarted())
    assert actions[-1] == Transfer("+15550100998")


# ------------------------------------------------------------------ url building


URL_FLOW = load_flow_text(
    """
name: u
start: ask
variables: {api: "http://127.0.0.1:1"}
nodes:
  ask:
    kind: ask
    prompt: Say or enter your five digit account number.
    pattern: "[0-9]{5}"
    store: account
    extract:
      schema: {type: object, properties: {reason: {type: string}}}
      required: false
    next: look
  look:
    kind: http
    request: {url: "{{ api }}/accounts/{{ account }}/balance?q={{ last_input }}", timeout: 1}
    next: bye
    on_error: bye
  bye: {kind: hangup}
""",
    "u.yaml",
)


def test_values_in_an_http_url_are_percent_encoded_except_the_base() -> None:
    state = new_state(URL_FLOW, env={})
    state.vars["account"] = "../admin/delete?x="
    state.vars["last_input"] = "a b&c"
    state.node = "look"
    state, actions = run(URL_FLOW, state, Resumed())
    request = actions[-1]
    assert isinstance(request, HttpRequest)
    assert request.url == (
        "http://127.0.0.1:1/accounts/..%2Fadmin%2Fdelete%3Fx%3D/balance?q=a%20b%26c"
    )


def test_a_classified_answer_is_stored_as_cleaned_digits() -> None:
    state, _ = started(URL_FLOW, "one two three four five")
    state, _ = run(URL_FLOW, state, IntentClassified(None, {"reason": None}))
    assert state.vars["account"] == "12345"


# ------------------------------------------------------------------ secrets


SECRET_FLOW = """
name: crm
start: ask
variables:
  crm_token: {env: CRM_TOKEN, default: ""}
  api: "http://127.0.0.1:1"
nodes:
  ask:
    kind: ask
    prompt: Order?
    store: order
    next: look
  look:
    kind: http
    request:
      url: "{{ api }}/lookup"
      headers: {Authorization: "Bearer {{ crm_token }}"}
    next: bye
    on_error: bye
  bye: {kind: hangup}
"""


async def test_values_from_the_environment_are_not_persisted_but_survive_a_resume(
    http: httpx.AsyncClient,
) -> None:
    flow = load_flow_text(SECRET_FLOW, "crm.yaml")
    env = {"CRM_TOKEN": "sk-live-SECRET"}
    saved: list[str] = []

    async def persist(state: FlowState) -> None:
        saved.append(state.model_dump_json())
        assert "sk-live-SECRET" not in json.dumps(state.vars)

    heard: list[bytes] = []

    async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(4000))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(backend, "127.0.0.1", 0)
    api = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        io = TextCallIO.scripted([])
        await FlowRunner(flow, io, None, http, persist, call_vars={"api": api}, env=env).run()
        assert saved and not any("sk-live-SECRET" in text for text in saved)
        state = FlowState.model_validate_json(saved[-2])  # died while asking for the order
        io = TextCallIO.scripted([said("42")])
        await FlowRunner(flow, io, None, http, env=env).run(state)
    finally:
        server.close()
    assert heard and b"Authorization: Bearer sk-live-SECRET" in heard[0]
