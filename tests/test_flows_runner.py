"""The runner against real local servers: an OpenAI-compatible LLM server and an HTTP backend."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ivr.flows.events import FlowState
from ivr.flows.loader import load_flow_text
from ivr.flows.runner import FlowRunner
from ivr.flowtools.testing import BackendRoute, LocalJsonServer
from ivr.flowtools.textio import CallerTurn, TextCallIO, hangs_up, pressed, said, silent
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall

AGENT_FLOW = load_flow_text(
    """
name: helper
start: chat
nodes:
  chat:
    kind: agent
    greeting: Hello, how can I help?
    system: You help callers. The caller is {{ name }}.
    tools:
      - name: set_name
        description: Remember the caller's name.
        parameters:
          type: object
          properties: {name: {type: string, minLength: 1}}
          required: [name]
        set: {name: "{{ args.name }}"}
        result: saved
      - name: finish
        description: End the call.
        next: bye
    max_turns: 5
    on_max_turns: bye
  bye:
    kind: hangup
    say: Goodbye.
variables:
  name: unknown
""",
    "helper.yaml",
)

HTTP_FLOW = load_flow_text(
    """
name: lookup
start: ask
variables: {api: "http://127.0.0.1:1"}
nodes:
  ask:
    kind: ask
    prompt: Order number?
    pattern: "[0-9]+"
    store: order
    next: fetch
  fetch:
    kind: http
    request:
      url: "{{ api }}/orders/{{ order }}"
      timeout: 2
      map: {status: order.status}
    next: tell
    on_error: sorry
  tell:
    kind: hangup
    say: Your order is {{ status }}.
  sorry:
    kind: hangup
    say: The order system is not answering.
""",
    "lookup.yaml",
)


@pytest.fixture
async def llm_server() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer(api_key="sk-test") as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
async def llm(llm_server: FakeOpenAIServer) -> AsyncIterator[OpenAICompatLlm]:
    model = OpenAICompatLlm(
        base_url=llm_server.base_url, api_key="sk-test", model="m", max_tokens=None
    )
    yield model
    await model.aclose()


def chat_messages(server: FakeOpenAIServer, index: int) -> list[dict[str, Any]]:
    body = server.requests_for("chat")[index].json
    assert body is not None
    messages: list[dict[str, Any]] = body["messages"]
    return messages


async def run_agent(
    server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient,
    scripts: list[ChatScript], turns: list[CallerTurn],
) -> tuple[FlowState, TextCallIO]:  # fmt: skip
    server.chat = scripts
    io = TextCallIO.scripted(turns)
    final = await FlowRunner(AGENT_FLOW, io, llm, http).run()
    return final, io


async def test_an_agent_reply_is_streamed_to_the_caller_and_kept_in_the_history(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    scripts = [ChatScript(text="We open at nine."), ChatScript(text="You're welcome.")]
    final, io = await run_agent(
        llm_server, llm, http, scripts, [said("When do you open?"), said("thanks")]
    )
    assert io.bot_lines == ["Hello, how can I help?", "We open at nine.", "You're welcome."]
    second = chat_messages(llm_server, 1)
    assert second[0]["role"] == "system" and "The caller is unknown" in second[0]["content"]
    assert [m["content"] for m in second[1:]] == [
        "Hello, how can I help?", "When do you open?", "We open at nine.", "thanks",
    ]  # fmt: skip
    assert final.outcome == "caller_hangup"


async def test_a_tool_call_with_invalid_arguments_goes_back_to_the_model_as_an_error(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    scripts = [
        ChatScript(tool_calls=[ScriptToolCall("set_name", '{"name": 5}', id="c1")]),
        ChatScript(tool_calls=[ScriptToolCall("set_name", '{"name": "Ann"}', id="c2")]),
        ChatScript(text="Nice to meet you, Ann."),
    ]
    final, io = await run_agent(llm_server, llm, http, scripts, [said("I'm Ann")])
    error = chat_messages(llm_server, 1)[-1]
    assert error["role"] == "tool" and error["tool_call_id"] == "c1"
    assert (
        "invalid arguments" in error["content"]
        and "arguments.name must be of type string" in error["content"]
    )
    assert chat_messages(llm_server, 2)[-1] == {
        "role": "tool",
        "content": "saved",
        "tool_call_id": "c2",
    }
    assert final.vars["name"] == "Ann"
    assert io.bot_lines[-1] == "Nice to meet you, Ann."


async def test_arguments_that_are_not_json_twice_make_the_agent_apologise_not_crash(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    bad = ChatScript(tool_calls=[ScriptToolCall("set_name", "{name: Ann")])
    final, io = await run_agent(llm_server, llm, http, [bad, bad], [said("I'm Ann")])
    assert len(llm_server.requests_for("chat")) == 2  # one retry, then no more model calls
    assert "Sorry, something went wrong on our side." in io.bot_lines
    assert final.vars["name"] == "unknown" and final.outcome == "caller_hangup"


async def test_a_handoff_tool_leaves_the_agent_for_its_target(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    scripts = [ChatScript(text="Bye then.", tool_calls=[ScriptToolCall("finish")])]
    final, io = await run_agent(llm_server, llm, http, scripts, [said("that's all")])
    assert io.bot_lines[-2:] == ["Bye then.", "Goodbye."]
    assert final.outcome == "hangup" and io.hung_up


async def test_after_a_barge_in_the_history_keeps_only_what_the_caller_heard(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    scripts = [
        ChatScript(text="Once upon a time there was a dragon who loved tea."),
        ChatScript(text="Sure, stopping."),
    ]
    turns = [said("tell me a story"), said("stop please", barge_in_after_words=4)]
    _, io = await run_agent(llm_server, llm, http, scripts, turns)
    assert "Once upon a time --" in io.bot_lines
    history = [m["content"] for m in chat_messages(llm_server, 1)[1:]]
    assert history == [
        "Hello, how can I help?",
        "tell me a story",
        "Once upon a time",
        "stop please",
    ]


async def test_an_unreachable_llm_is_an_apology_and_the_call_goes_on(
    http: httpx.AsyncClient,
) -> None:
    dead = OpenAICompatLlm(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="k", model="m")
    io = TextCallIO.scripted([said("hello?"), hangs_up()])
    final = await FlowRunner(AGENT_FLOW, io, dead, http).run()
    await dead.aclose()
    assert io.bot_lines[-1] == "Sorry, something went wrong on our side."
    assert final.outcome == "caller_hangup"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def run_lookup(http: httpx.AsyncClient, api: str) -> tuple[FlowState, TextCallIO]:
    io = TextCallIO.scripted([pressed("42")])
    final = await FlowRunner(HTTP_FLOW, io, None, http, call_vars={"api": api}).run()
    return final, io


async def test_an_http_node_maps_the_backend_answer(http: httpx.AsyncClient) -> None:
    with LocalJsonServer(
        {"GET /orders/42": BackendRoute(json={"order": {"status": "shipped"}})}
    ) as backend:
        final, io = await run_lookup(http, backend.url)
    assert io.bot_lines == ["Order number?", "Your order is shipped."]
    assert final.vars["http_status"] == 200


async def test_a_backend_that_is_down_takes_the_error_edge_instead_of_crashing(
    http: httpx.AsyncClient,
) -> None:
    final, io = await run_lookup(http, f"http://127.0.0.1:{free_port()}")
    assert io.bot_lines[-1] == "The order system is not answering."
    assert final.node == "sorry" and "ConnectError" in final.vars["http_error"]


async def test_a_backend_error_status_takes_the_error_edge(http: httpx.AsyncClient) -> None:
    with LocalJsonServer(
        {"GET /orders/42": BackendRoute(status=500, json={"error": "boom"})}
    ) as backend:
        final, _ = await run_lookup(http, backend.url)
    assert final.node == "sorry" and final.vars["http_error"] == "HTTP 500"


async def test_state_is_persisted_before_each_prompt_is_spoken(http: httpx.AsyncClient) -> None:
    io = TextCallIO.scripted([silent(), hangs_up()])
    seen: list[tuple[str, int]] = []

    async def on_step(state: FlowState) -> None:
        seen.append((state.node, len(io.transcript)))

    await FlowRunner(HTTP_FLOW, io, None, http, on_step).run()
    # 1st step: nothing said yet; 2nd: after prompt + the caller's silence, before the reprompt.
    assert seen == [("ask", 0), ("ask", 2), ("ask", 5)]


async def test_a_call_resumes_from_a_saved_state_with_an_apology_and_the_question_again(
    http: httpx.AsyncClient,
) -> None:
    saved: list[str] = []

    async def persist(state: FlowState) -> None:
        saved.append(state.model_dump_json())

    first = TextCallIO.scripted([silent(), hangs_up()])
    await FlowRunner(HTTP_FLOW, first, None, http, persist).run()
    state = FlowState.model_validate_json(saved[1])  # the instance "died" after the reprompt
    flow = HTTP_FLOW.model_copy(update={"resume_prompt": "Sorry, we were cut off."})
    io = TextCallIO.scripted([hangs_up()])
    await FlowRunner(flow, io, None, http).run(state)
    assert io.bot_lines == ["Sorry, we were cut off.", "Order number?"]


async def test_a_resumed_call_of_a_flow_without_an_apology_gets_the_gateway_one(
    http: httpx.AsyncClient,
) -> None:
    saved: list[str] = []

    async def persist(state: FlowState) -> None:
        saved.append(state.model_dump_json())

    assert HTTP_FLOW.resume_prompt is None
    gateway_prompt = "Sorry, we had a brief technical problem."
    first = TextCallIO.scripted([silent(), hangs_up()])
    await FlowRunner(HTTP_FLOW, first, None, http, persist, resume_prompt=gateway_prompt).run()
    assert gateway_prompt not in first.bot_lines  # said only when a call resumes
    state = FlowState.model_validate_json(saved[1])
    io = TextCallIO.scripted([hangs_up()])
    await FlowRunner(HTTP_FLOW, io, None, http, persist, resume_prompt=gateway_prompt).run(state)
    assert io.bot_lines == [gateway_prompt, "Order number?"]
    assert not any(gateway_prompt in s for s in saved)  # configuration, not part of the call


async def test_slots_are_extracted_with_structured_output(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    flow = load_flow_text(
        """
name: travel
start: where
nodes:
  where:
    kind: ask
    prompt: Where to?
    extract:
      schema: {type: object, properties: {city: {type: string}}, required: [city]}
    next: done
  done:
    kind: hangup
    say: Booking {{ city }}.
""",
        "travel.yaml",
    )
    llm_server.chat = [ChatScript(text='{"city": "Paris"}')]
    io = TextCallIO.scripted([said("I'd like to go to Paris next week")])
    final = await FlowRunner(flow, io, llm, http).run()
    body = llm_server.requests_for("chat")[0].json
    assert body is not None and body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["properties"]["city"]["type"] == [
        "string",
        "null",
    ]
    assert final.vars["city"] == "Paris" and io.bot_lines[-1] == "Booking Paris."


async def test_a_long_conversation_keeps_a_bounded_history_that_starts_with_the_caller(
    llm_server: FakeOpenAIServer, llm: OpenAICompatLlm, http: httpx.AsyncClient
) -> None:
    flow = AGENT_FLOW.model_copy(
        update={
            "nodes": {
                **AGENT_FLOW.nodes,
                "chat": AGENT_FLOW.nodes["chat"].model_copy(update={"max_turns": 100}),
            }
        }
    )
    llm_server.chat = ChatScript(text="Okay.")
    io = TextCallIO.scripted([said(f"message {i}") for i in range(32)])
    final = await FlowRunner(flow, io, llm, http).run()
    assert len(final.history) <= 61
    assert final.history[0].role == "user" and final.history[-1].content == "Okay."
    last = chat_messages(llm_server, 31)
    assert last[-1] == {"role": "user", "content": "message 31"}
