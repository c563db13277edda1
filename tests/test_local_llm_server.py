"""The packaged offline LLM answers over the OpenAI chat API, streamed, and cleans up."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from ivr.engines.llm_server import LocalLlmError, LocalLlmServer, available

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(120),
]

SYSTEM = "You are a phone assistant for Acme Bank. Answer in one short sentence."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[LocalLlmServer]:
    async with LocalLlmServer() as srv:
        yield srv


@pytest.fixture
def client(server: LocalLlmServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)


async def test_a_streamed_reply_arrives_as_several_non_empty_chunks(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    stream = await client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "I want to check my balance"},
        ],
        stream=True,
        temperature=0.2,
        max_tokens=24,
    )
    pieces = [
        c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 1
    assert "".join(pieces).strip()


async def test_the_model_list_names_the_served_model(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.model]


async def test_max_tokens_limits_a_non_streamed_reply(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    reply = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me a long story about a bank."}],
        max_tokens=5,
        temperature=0.0,
    )
    assert reply.usage is not None and reply.usage.completion_tokens <= 5
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content


async def test_a_request_is_rejected_with_400_when_messages_are_empty(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    from openai import BadRequestError, UnprocessableEntityError

    with pytest.raises((BadRequestError, UnprocessableEntityError)):
        await client.chat.completions.create(model=server.model, messages=[], max_tokens=4)


async def test_the_server_process_is_gone_after_the_context_exits() -> None:
    async with LocalLlmServer() as srv:
        pid = srv.pid
        assert pid is not None and _alive(pid)
    assert not _alive(pid)


async def test_cancelling_startup_leaves_no_server_process() -> None:
    srv = LocalLlmServer()
    task = asyncio.create_task(srv.__aenter__())
    for _ in range(1000):  # the subprocess appears within milliseconds
        if srv.pid is not None:
            break
        await asyncio.sleep(0.01)
    pid = srv.pid
    assert pid is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _alive(pid)


async def test_a_server_that_cannot_load_its_model_reports_stderr_and_the_install_command(
    tmp_path: Path,
) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF but not really")
    with pytest.raises(LocalLlmError) as info:
        async with LocalLlmServer(model=bogus, startup_timeout=30):
            pass
    message = str(info.value)
    assert "pip install" in message
    assert "could not load" in message


async def test_a_client_that_hangs_up_mid_stream_does_not_block_the_next_request(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    stream = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Count from one to one hundred in words."}],
        stream=True,
        max_tokens=200,
    )
    async for _chunk in stream:
        break
    await stream.close()
    reply = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        timeout=20,
    )
    assert reply.choices[0].message.content


async def _prompt_and_cached_tokens(
    server: LocalLlmServer, client: AsyncOpenAI, messages: list[ChatCompletionMessageParam]
) -> tuple[int, int]:
    reply = await client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0.0, timeout=20
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0


async def test_a_request_sharing_the_previous_prompt_evaluates_only_what_is_new(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    system: ChatCompletionMessageParam = {
        "role": "system",
        "content": SYSTEM + " The branch opens at nine.",
    }
    first: list[ChatCompletionMessageParam] = [
        system,
        {"role": "user", "content": "When do you open?"},
    ]
    second: list[ChatCompletionMessageParam] = [
        system,
        {"role": "user", "content": "Where is the branch?"},
    ]
    unrelated: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]

    await _prompt_and_cached_tokens(server, client, first)
    prompt, cached = await _prompt_and_cached_tokens(server, client, second)
    # The system prompt's tokens were kept from the first request; the question was not.
    assert 20 < cached < prompt, (cached, prompt)
    _, cached_unrelated = await _prompt_and_cached_tokens(server, client, unrelated)
    assert cached_unrelated < 10, cached_unrelated  # at most the chat template's first tokens


async def test_a_reply_cut_off_by_the_client_leaves_a_cache_the_next_request_can_use(
    server: LocalLlmServer, client: AsyncOpenAI
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Count from one to fifty in words."},
    ]
    stream = await client.chat.completions.create(
        model=server.model, messages=messages, stream=True, max_tokens=100, temperature=0.0
    )
    async for _chunk in stream:
        break
    await stream.close()
    reply = await client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0.0, timeout=20
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens - 1
    assert reply.choices[0].message.content
