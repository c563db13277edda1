"""The OpenAI-compatible LLM, STT and TTS providers against FakeOpenAIServer over real HTTP,
and the fake itself against the official ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ivr.audio.wav import wav_to_pcm16
from ivr.errors import ProviderError, ProviderErrorKind, ProviderStatusError, ProviderTimeout
from ivr.llm.base import ChatMessage, LlmEvent, TextDelta, ToolCall, ToolSpec
from ivr.llm.openai_compat import CHAT_TEMPLATE_NO_THINKING, REASONING_OFF, OpenAICompatLlm
from ivr.providers.openai_http import MAX_SSE_LINE
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.openai_server import (
    SPEECH_RATE,
    ChatScript,
    FakeOpenAIServer,
    Fault,
    ScriptToolCall,
    default_speak,
)
from ivr.tts.openai_http import OpenAIHttpTts

KEY = "sk-test-key"
USER = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]


@pytest.fixture(scope="module")
def shared_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


@pytest.fixture
def srv(shared_server: FakeOpenAIServer) -> FakeOpenAIServer:
    shared_server.reset()
    return shared_server


def make_llm(srv: FakeOpenAIServer, **kwargs: Any) -> OpenAICompatLlm:
    options: dict[str, Any] = {"base_url": srv.base_url, "api_key": KEY, "model": "gemma-4-31b"}
    return OpenAICompatLlm(**(options | kwargs))


async def collect(llm: OpenAICompatLlm, *args: Any, **kwargs: Any) -> list[LlmEvent]:
    events: list[LlmEvent] = []
    try:
        async with contextlib.aclosing(llm.stream_chat(*args, **kwargs)) as stream:
            async for event in stream:
                events.append(event)
    finally:
        await llm.aclose()
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def finished(rec: Any) -> bool:
    return bool(await asyncio.to_thread(rec.wait_finished, 3.0))


# ---- LLM ------------------------------------------------------------------------------


async def test_streamed_text_arrives_in_several_deltas_that_join_to_the_reply(srv):
    reply = "Your balance is $123.45. Is there anything else?"
    srv.chat = ChatScript(text=reply, token_delay=0.01)
    events = await collect(make_llm(srv, temperature=0.2, max_tokens=99), USER)
    assert all(isinstance(e, TextDelta) for e in events)
    assert len(events) > 5
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert sent["stream"] is True and sent["model"] == "gemma-4-31b"
    assert sent["temperature"] == 0.2 and sent["max_tokens"] == 99
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert "response_format" not in sent and "tools" not in sent


async def test_tokens_that_arrive_together_go_on_as_one_delta(srv):
    # Each delta is a trip through the flow, the prefetch and the sentence splitter: tokens
    # one read finds (a busy loop, a fast model) are joined, not passed on one by one.
    body = sse(*(delta(t) for t in ("Your", " balance", " is", " fine", ".")))
    srv.faults["chat"] = Fault(raw=body, content_type="text/event-stream")
    assert await collect(make_llm(srv), USER) == [TextDelta("Your balance is fine.")]


async def test_tool_calls_split_across_deltas_are_assembled_after_the_text(srv):
    args = [{"account": "4567", "kind": "checking"}, {}]
    srv.chat = ChatScript(
        text="Let me check.",
        tool_calls=[
            ScriptToolCall("get_balance", json.dumps(args[0]), id="call_a"),
            ScriptToolCall("transfer_to_agent", ""),
        ],
    )
    tools = [ToolSpec("get_balance", "Balance of an account"), ToolSpec("transfer_to_agent", "")]
    events = await collect(make_llm(srv), USER, tools=tools)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [type(e) for e in events[-2:]] == [ToolCall, ToolCall]
    assert [c.name for c in calls] == ["get_balance", "transfer_to_agent"]
    assert calls[0].id == "call_a" and calls[1].id.startswith("call_")
    assert [json.loads(c.arguments) for c in calls] == args
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert sent["tools"][0] == {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "Balance of an account",
            "parameters": {"type": "object", "properties": {}},
        },
    }


async def test_tool_results_in_history_are_sent_in_openai_shape(srv):
    history = [
        *USER,
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=(ToolCall(id="call_1", name="get_balance", arguments='{"a": 1}'),),
        ),
        ChatMessage(role="tool", content='{"balance": 12}', tool_call_id="call_1"),
    ]
    await collect(make_llm(srv), history)
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert sent["messages"][2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_balance", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "content": '{"balance": 12}', "tool_call_id": "call_1"},
    ]


async def test_json_schema_is_sent_as_openai_strict_structured_output(srv):
    schema = {
        "title": "Intent",
        "type": "object",
        "properties": {"intent": {"type": "string", "enum": ["balance", "agent"]}},
        "required": ["intent"],
        "additionalProperties": False,
    }
    events = await collect(make_llm(srv), USER, json_schema=schema)
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Intent", "schema": schema, "strict": True},
    }
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert json.loads(text) == {"intent": "balance"}


async def test_a_late_first_token_raises_provider_timeout_and_closes_the_stream(srv):
    srv.chat = ChatScript(text="Too late.", first_token_delay=2.0)
    llm = make_llm(srv, first_token_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(ProviderTimeout) as info:
        await collect(llm, USER)
    assert 0.25 < time.monotonic() - started < 1.5
    assert info.value.retryable and info.value.seconds == 0.3
    rec = srv.requests_for("chat")[0]
    assert await finished(rec)
    assert rec.outcome == "disconnected"


async def test_a_server_that_hangs_before_any_token_raises_provider_timeout(srv):
    srv.chat = ChatScript(hang=True)
    with pytest.raises(ProviderTimeout):
        await collect(make_llm(srv, first_token_timeout=0.2), USER)


async def test_reasoning_deltas_are_never_spoken_and_do_not_count_as_the_first_token(srv):
    srv.chat = ChatScript(text="Sure.", reasoning="The user greets me so I greet back.")
    events = await collect(make_llm(srv), USER)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure."
    assert all(isinstance(e, TextDelta) for e in events)


async def test_a_stalled_stream_hits_the_total_timeout_after_some_text(srv):
    srv.chat = ChatScript(text=" ".join(["word"] * 40), token_delay=0.05)
    llm = make_llm(srv, first_token_timeout=1.0, total_timeout=0.4)
    got: list[LlmEvent] = []
    with pytest.raises(ProviderTimeout):
        async for event in llm.stream_chat(USER):
            got.append(event)
    await llm.aclose()
    assert 2 <= len(got) < 40


async def test_http_500_is_a_retryable_status_error(srv):
    srv.chat = ChatScript(status=500)
    with pytest.raises(ProviderStatusError) as info:
        await collect(make_llm(srv), USER)
    assert info.value.status == 500 and info.value.retryable


async def test_a_wrong_api_key_is_a_non_retryable_401(srv):
    with pytest.raises(ProviderStatusError) as info:
        await collect(make_llm(srv, api_key="sk-wrong"), USER)
    assert info.value.status == 401 and not info.value.retryable
    assert "Incorrect API key" in str(info.value)


def sse(*events: str) -> bytes:
    return "".join(events).encode()


def delta(text: str) -> str:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    chunk["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return f"data: {json.dumps(chunk)}\n\n"


async def events_before_error(srv, body: bytes) -> tuple[list[LlmEvent], ProviderError]:
    """What the LLM hands over from the raw event stream ``body`` before the ProviderError
    that must end it, and that error."""
    srv.faults["chat"] = Fault(raw=body, content_type="text/event-stream")
    llm, got = make_llm(srv), []
    try:
        with pytest.raises(ProviderError) as info:
            async for event in llm.stream_chat(USER):
                got.append(event)
    finally:
        await llm.aclose()
    return got, info.value


async def test_an_error_event_mid_stream_is_a_retryable_status_error_after_the_text(srv):
    body = sse(delta("Hello"), 'event: error\ndata: {"error": {"message": "overloaded"}}\n\n')
    got, error = await events_before_error(srv, body)
    assert got == [TextDelta("Hello")]
    assert error.kind is ProviderErrorKind.STATUS and error.retryable
    assert "overloaded" in str(error)


async def test_events_are_read_across_comments_crlf_and_a_missing_last_blank_line(srv):
    pieces = [": keep-alive\n\n", delta("Hi").replace("\n", "\r\n"), "\n", delta(" there")]
    srv.faults["chat"] = Fault(raw=sse(*pieces).rstrip(b"\n"), content_type="text/event-stream")
    events = await collect(make_llm(srv), USER)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hi there"


async def test_an_event_that_is_not_json_is_an_unusable_answer(srv):
    body = sse(delta("Hi"), "data: {not json\n\n")
    srv.faults["chat"] = Fault(raw=body, content_type="text/event-stream")
    with pytest.raises(ProviderError) as info:
        await collect(make_llm(srv), USER)
    assert info.value.kind is ProviderErrorKind.PAYLOAD


async def test_a_line_that_never_ends_is_refused_after_a_mebibyte_with_the_text_before_it(srv):
    # A server (or a proxy) that streams garbage without a newline must not grow our memory
    # until the total timeout: past MAX_SSE_LINE the answer is unusable, what came is kept.
    body = sse(delta("Hello")) + b"data: " + b"x" * (MAX_SSE_LINE + 4096)
    got, error = await events_before_error(srv, body)
    assert got == [TextDelta("Hello")]
    assert error.kind is ProviderErrorKind.PAYLOAD
    assert f"line longer than {MAX_SSE_LINE} bytes" in str(error)


async def test_no_server_listening_is_a_retryable_connect_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    llm = OpenAICompatLlm(base_url=url, api_key=KEY, model="m")
    with pytest.raises(ProviderError) as info:
        await collect(llm, USER)
    assert info.value.kind is ProviderErrorKind.CONNECT and info.value.retryable
    assert "cannot connect" in str(info.value)


@pytest.mark.parametrize("extra", [REASONING_OFF, CHAT_TEMPLATE_NO_THINKING])
async def test_reasoning_switches_reach_the_server_and_a_plain_server_ignores_them(srv, extra):
    srv.chat = ChatScript(text="Fine.")
    events = await collect(make_llm(srv, extra_body=extra), USER)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Fine."
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert {k: sent[k] for k in extra} == dict(extra)


async def test_the_default_request_carries_no_provider_specific_fields(srv):
    await collect(make_llm(srv), USER)
    sent = srv.requests_for("chat")[0].json
    assert sent is not None
    assert set(sent) == {"model", "messages", "stream", "temperature", "max_tokens"}


async def test_a_strict_server_refuses_unknown_fields_with_a_non_retryable_422(srv):
    srv.chat_fields = frozenset(
        {"model", "messages", "stream", "temperature", "max_tokens", "reasoning_effort"}
    )
    assert await collect(make_llm(srv), USER)
    assert await collect(make_llm(srv, extra_body=REASONING_OFF), USER)
    with pytest.raises(ProviderStatusError) as info:
        await collect(make_llm(srv, extra_body=CHAT_TEMPLATE_NO_THINKING), USER)
    assert info.value.status == 422 and not info.value.retryable
    assert "chat_template_kwargs" in str(info.value)


async def test_closing_the_reply_early_closes_the_http_stream(srv):
    srv.chat = ChatScript(text=" ".join(["word"] * 50), token_delay=0.03)
    llm = make_llm(srv)
    async with contextlib.aclosing(llm.stream_chat(USER)) as stream:
        async for _ in stream:
            break
    rec = srv.requests_for("chat")[0]
    assert await finished(rec)
    assert rec.outcome == "disconnected"
    await llm.aclose()


async def test_the_same_client_talks_to_the_hf_router_shape_by_model_name_only(srv):
    llm = make_llm(srv, model="google/gemma-4-31B-it:cerebras")
    events = await collect(llm, [ChatMessage(role="user", content="I need my balance")])
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == (
        "You said: I need my balance."
    )
    sent = srv.requests_for("chat")[0]
    assert sent.json is not None and sent.json["model"] == "google/gemma-4-31B-it:cerebras"
    assert sent.headers["authorization"] == f"Bearer {KEY}"


# ---- STT ------------------------------------------------------------------------------


def tone(seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


async def test_stt_uploads_a_wav_of_the_right_rate_and_length_as_multipart(srv):
    srv.transcripts.append(" check my balance ")
    stt = OpenAIHttpStt(
        base_url=srv.base_url, api_key=KEY, language="en", prompt="IVR, PIN", sample_rate=16_000
    )
    pcm = tone(0.75, 16_000)
    result = await stt.transcribe(pcm)
    await stt.aclose()
    assert result.text == "check my balance" and result.seconds > 0
    rec = srv.requests_for("transcriptions")[0]
    assert rec.headers["content-type"].startswith("multipart/form-data")
    assert rec.form is not None
    assert {k: rec.form[k] for k in ("model", "language", "prompt", "response_format")} == {
        "model": "whisper-1",
        "language": "en",
        "prompt": "IVR, PIN",
        "response_format": "json",
    }
    assert rec.form["file.filename"].endswith(".wav")
    wav = wav_to_pcm16(rec.files["file"])
    assert wav.sample_rate == 16_000 and wav.pcm16 == pcm and wav.seconds == 0.75


@pytest.mark.parametrize(
    ("endpoint", "path", "content_type", "body_start"),
    [
        (
            "transcriptions",
            "/v1/audio/transcriptions",
            "multipart/form-data; boundary=cut",
            '--cut\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n',
        ),
        ("chat", "/v1/chat/completions", "application/json", '{"model": "m", "messages": ['),
    ],
    ids=["upload", "json"],
)
async def test_a_body_the_client_abandons_is_recorded_as_disconnected(
    srv, endpoint, path, content_type, body_start
):
    # A speculative request the gateway cancels while sending it: the server must record it
    # as the client leaving (it used to leave the request unfinished, with a traceback).
    url = httpx.URL(srv.base_url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: fake\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n{body_start}"
    )
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(head.encode() + b" " * 4000)
    await writer.drain()
    for _ in range(100):
        if srv.requests_for(endpoint):
            break
        await asyncio.sleep(0.02)
    writer.close()
    await writer.wait_closed()
    rec = srv.requests_for(endpoint)[0]
    assert await finished(rec)
    assert rec.outcome == "disconnected"
    assert not await reader.read()  # nothing was answered


async def test_stt_sends_the_configured_rate_and_a_scripted_transcriber_sees_it(srv):
    seen: list[float] = []

    def transcribe(wav: bytes, form: dict[str, str]) -> str:
        audio = wav_to_pcm16(wav)
        seen.append(audio.sample_rate)
        return f"{audio.seconds:.2f} seconds"

    srv.transcribe = transcribe
    stt = OpenAIHttpStt(base_url=srv.base_url, api_key=KEY, sample_rate=8000, language=None)
    assert (await stt.transcribe(tone(0.5, 8000))).text == "0.50 seconds"
    await stt.aclose()
    assert seen == [8000]
    rec = srv.requests_for("transcriptions")[0]
    assert rec.form is not None and "language" not in rec.form


async def test_stt_times_out_with_provider_timeout(srv):
    srv.faults["transcriptions"] = Fault(delay=2.0)
    stt = OpenAIHttpStt(base_url=srv.base_url, api_key=KEY, timeout=0.3)
    with pytest.raises(ProviderTimeout):
        await stt.transcribe(tone(0.2, 16_000))
    await stt.aclose()


@pytest.mark.parametrize(("status", "retryable"), [(503, True), (429, True), (400, False)])
async def test_stt_maps_http_errors_to_status_errors(srv, status, retryable):
    srv.faults["transcriptions"] = Fault(status=status, times=1)
    stt = OpenAIHttpStt(base_url=srv.base_url, api_key=KEY)
    with pytest.raises(ProviderStatusError) as info:
        await stt.transcribe(tone(0.2, 16_000))
    assert info.value.status == status and info.value.retryable is retryable
    srv.transcripts.append("works again")
    assert (await stt.transcribe(tone(0.2, 16_000))).text == "works again"
    await stt.aclose()


async def test_stt_rejects_half_a_sample_before_any_request(srv):
    stt = OpenAIHttpStt(base_url=srv.base_url, api_key=KEY)
    with pytest.raises(ValueError, match="whole samples"):
        await stt.transcribe(b"\x00\x01\x02")
    await stt.aclose()
    assert srv.requests_for("transcriptions") == []


# ---- TTS ------------------------------------------------------------------------------


def make_tts(srv: FakeOpenAIServer, **kwargs: Any) -> OpenAIHttpTts:
    return OpenAIHttpTts(**({"base_url": srv.base_url, "api_key": KEY} | kwargs))


async def test_tts_streams_several_chunks_of_whole_samples(srv):
    srv.speech_chunk_bytes = 1001  # odd on purpose: the client must realign samples
    text = "Your balance is one hundred dollars."
    tts = make_tts(srv, voice="coral", model="tts-1")
    chunks = [c async for c in tts.synthesize(text)]
    await tts.aclose()
    assert len(chunks) > 1
    assert all(len(c) % 2 == 0 and c for c in chunks)
    assert b"".join(chunks) == default_speak(text)
    seconds = sum(map(len, chunks)) / 2 / SPEECH_RATE
    assert seconds == pytest.approx(0.065 * len(text), rel=0.01)
    sent = srv.requests_for("speech")[0].json
    assert sent == {"model": "tts-1", "voice": "coral", "input": text, "response_format": "pcm"}


async def test_tts_first_byte_timeout_raises_provider_timeout(srv):
    srv.faults["speech"] = Fault(hang=True)
    tts = make_tts(srv, first_byte_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(ProviderTimeout):
        async for _ in tts.synthesize("Hello."):
            pass
    assert time.monotonic() - started < 1.5
    await tts.aclose()


async def test_tts_status_errors_are_mapped(srv):
    srv.faults["speech"] = Fault(status=429)
    tts = make_tts(srv)
    with pytest.raises(ProviderStatusError) as info:
        async for _ in tts.synthesize("Hello."):
            pass
    assert info.value.status == 429 and info.value.retryable
    await tts.aclose()


async def test_cancelling_tts_mid_stream_closes_the_server_side_stream(srv):
    srv.speech_chunk_delay = 0.05
    tts = make_tts(srv)
    got: list[bytes] = []
    two = asyncio.Event()

    async def speak() -> None:
        async for chunk in tts.synthesize("A long answer that takes seconds to say. " * 5):
            got.append(chunk)
            if len(got) == 2:
                two.set()

    task = asyncio.create_task(speak())
    await asyncio.wait_for(two.wait(), 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rec = srv.requests_for("speech")[0]
    assert await finished(rec)
    assert rec.outcome == "disconnected"
    assert 2 <= len(got) < 20
    await tts.aclose()


async def test_breaking_out_of_tts_also_closes_the_server_side_stream(srv):
    srv.speech_chunk_delay = 0.05
    tts = make_tts(srv)
    async with contextlib.aclosing(tts.synthesize("Goodbye for now. " * 10)) as stream:
        async for _ in stream:
            break
    rec = srv.requests_for("speech")[0]
    assert await finished(rec)
    assert rec.outcome == "disconnected"
    await tts.aclose()


# ---- the fake itself ------------------------------------------------------------------


def raw_sse(srv: FakeOpenAIServer, body: dict[str, Any]) -> list[str]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{srv.base_url}/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_raw_sse_from_the_fake_follows_openai_framing_and_parses_as_chunks(srv):
    srv.chat = ChatScript(text="Hi there.", tool_calls=[ScriptToolCall("lookup", '{"q": "x"}')])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = raw_sse(srv, body)
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(line[6:]) for line in lines[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    arg_pieces = [
        t.function.arguments
        for c in chunks
        for ch in c.choices
        for t in ch.delta.tool_calls or ()
        if t.function and t.function.arguments
    ]
    assert len(arg_pieces) > 1 and "".join(arg_pieces) == '{"q": "x"}'
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])


def test_the_official_openai_client_parses_the_fakes_stream_and_json(srv):
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    srv.chat = [
        ChatScript(text="One, two."),
        ChatScript(tool_calls=[ScriptToolCall("f", '{"n": 1}')]),
    ]
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "One, two."
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert isinstance(reply, ChatCompletion)
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.arguments == '{"n": 1}'
    assert reply.choices[0].finish_reason == "tool_calls"
    assert client.models.list().data[0].id == "gemma-4-31b"
    with pytest.raises(openai.InternalServerError, match="used up"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    client.close()


def test_errors_use_openais_error_json_shape(srv):
    r = httpx.get(f"{srv.base_url}/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"


def test_a_json_schema_request_with_a_non_json_script_is_reported_not_sent(srv):
    srv.chat = ChatScript(text="not json")
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    }
    r = httpx.post(
        f"{srv.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 500 and "not JSON" in r.json()["error"]["message"]


def test_default_speech_lasts_65_ms_per_character_and_is_not_silent():
    pcm = np.frombuffer(default_speak("Hello, world."), dtype="<i2")
    assert len(pcm) == 13 * int(SPEECH_RATE * 0.065)
    assert np.sqrt(np.mean(pcm.astype(np.float64) ** 2)) > 1000


async def test_the_server_works_with_async_with_and_leaves_no_threads():
    async with FakeOpenAIServer() as server:
        assert f"fake-openai-{server.port}" in {t.name for t in threading.enumerate()}
        async with httpx.AsyncClient() as client:
            r = await client.get(f"{server.base_url}/models")
        assert r.status_code == 200
        server.chat = ChatScript(hang=True)
        llm = OpenAICompatLlm(
            base_url=server.base_url, api_key="x", model="m", first_token_timeout=0.1
        )
        with pytest.raises(ProviderTimeout):
            await collect(llm, USER)
    assert f"fake-openai-{server.port}" not in {t.name for t in threading.enumerate()}


def test_a_hanging_handler_does_not_block_shutdown():
    with FakeOpenAIServer() as server:
        server.faults["models"] = Fault(hang=True)
        worker = threading.Thread(target=lambda: httpx.get(f"{server.base_url}/models", timeout=5))
        worker.start()
        time.sleep(0.1)
        started = time.monotonic()
    assert time.monotonic() - started < 3
    worker.join(5)
    assert not worker.is_alive()


def test_thinking_is_switched_off_only_where_the_api_accepts_it() -> None:
    from ivr.config import Settings
    from ivr.llm.build import build_llm

    settings = Settings(llm_api_key="k")
    for url, expected in [
        ("https://api.cerebras.ai/v1", {"reasoning_effort": "none"}),
        ("https://router.huggingface.co/v1", {"reasoning_effort": "none"}),
        ("http://127.0.0.1:8000/v1", None),
    ]:
        llm = build_llm(settings, base_url=url, api_key="k", model="m")
        primary = llm.providers[0]  # type: ignore[attr-defined]
        params = primary.request_params([], tools=(), json_schema=None, max_tokens=None)
        assert params.get("extra_body") == expected, url


async def test_a_finished_tts_answer_never_holds_back_the_next_request_on_its_connection(srv):
    # The reader takes the first piece and, with audio in hand, waits; the rest and the answer's
    # end pile up in the socket and come in one read, on which aiohttp puts the connection back
    # in the pool. The next request (another call's sentence) goes out on that connection:
    # pausing the socket after that read held its answer back until the first reader read
    # again (here never: it ran into its first-byte limit).
    text = "Hello there."
    srv.speech_chunk_bytes = len(default_speak(text)) // 2 + 2  # two pieces
    srv.speech_chunk_delay = 0.05
    tts = make_tts(srv)
    first = tts.synthesize(text)
    await anext(first)
    await asyncio.sleep(0.3)  # the second piece and the end arrive meanwhile, unread
    await anext(first)  # both in one read: the answer is over, its connection pooled
    started = time.monotonic()
    second = [chunk async for chunk in tts.synthesize("Goodbye.")]
    took = time.monotonic() - started
    await first.aclose()
    await tts.aclose()
    assert b"".join(second) == default_speak("Goodbye.")
    assert took < 0.5, f"the second answer waited {took:.2f} s behind the first reader"
    peers = [r.peer for r in srv.requests_for("speech")]
    assert len(peers) == 2 and peers[0] == peers[1], "both went over one pooled connection"
