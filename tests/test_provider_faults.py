"""Every way a provider fails in production, made by a real local server at the socket or the
payload level (``FakeOpenAIServer`` faults), against the real OpenAI-compatible clients: each
comes out as a ProviderError of the right kind within its time bound; retries and fallbacks
happen only before the first output and within the stage's budget; every failure is counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args

import pytest
from prometheus_client import REGISTRY

from ivr.config import STREAMING_STT, STREAMING_TTS, Settings, SttProviderName, TtsProviderName
from ivr.errors import ConfigError, ProviderError, ProviderErrorKind, ProviderStatusError
from ivr.llm.base import ChatMessage, LlmEvent, TextDelta
from ivr.llm.build import build_llm
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.llm.resilient import ResilientLlm
from ivr.providers.openai_http import StageLimits, retry_after
from ivr.providers.resilience import RetryPolicy, turn_deadline
from ivr.stt.build import BUILDERS as stt_builders
from ivr.stt.build import build_streaming_stt, build_stt
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.stt.resilient import ResilientStt
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault, sse_body
from ivr.tts.build import BUILDERS as tts_builders
from ivr.tts.build import build_streaming_tts, build_tts
from ivr.tts.openai_http import OpenAIHttpTts
from ivr.tts.resilient import ResilientTts
from ivr.tts.voice import StreamingVoice

KEY = "sk-faults"
FIRST = 0.5  # first-output limit of every adapter here (STT: the whole answer)
STALL = 0.5
SLACK = 0.5  # correctness, not speed: a loaded 2-core machine must pass
FAST = 1.0  # a fault that needs no timer must surface well within this
PCM = b"\x10\x00" * 8000  # 0.5 s at 16 kHz
USER = [ChatMessage(role="user", content="What is my balance?")]
ENDPOINT = {"stt": "transcriptions", "llm": "chat", "tts": "speech"}
Kind = ProviderErrorKind


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    with FakeOpenAIServer(api_key=KEY) as primary, FakeOpenAIServer(api_key=KEY) as fallback:
        yield primary, fallback


@pytest.fixture
def srv(servers: tuple[FakeOpenAIServer, FakeOpenAIServer]) -> FakeOpenAIServer:
    servers[0].reset()
    return servers[0]


@pytest.fixture
def backup(servers: tuple[FakeOpenAIServer, FakeOpenAIServer]) -> FakeOpenAIServer:
    servers[1].reset()
    return servers[1]


def stt_for(server: FakeOpenAIServer | str, name: str = "openai_stt") -> OpenAIHttpStt:
    url = server if isinstance(server, str) else server.base_url
    return OpenAIHttpStt(base_url=url, api_key=KEY, timeout=FIRST, name=name)


def tts_for(server: FakeOpenAIServer | str, name: str = "openai_tts") -> OpenAIHttpTts:
    url = server if isinstance(server, str) else server.base_url
    limits = {"first_byte_timeout": FIRST, "stall_timeout": STALL, "total_timeout": 5.0}
    return OpenAIHttpTts(base_url=url, api_key=KEY, name=name, **limits)


def llm_for(server: FakeOpenAIServer | str, name: str = "openai_compat") -> OpenAICompatLlm:
    url = server if isinstance(server, str) else server.base_url
    limits = {"first_token_timeout": FIRST, "stall_timeout": STALL, "total_timeout": 5.0}
    return OpenAICompatLlm(base_url=url, api_key=KEY, model="gemma-4-31b", name=name, **limits)


async def drive(stage: str, provider: Any, got: list[Any]) -> None:
    """One stage call to the end, collecting its outputs into ``got`` as they come."""
    try:
        if stage == "stt":
            got.append(await provider.transcribe(PCM))
        elif stage == "tts":
            async for chunk in provider.synthesize("Your balance is one hundred dollars."):
                got.append(chunk)
        else:
            async for event in provider.stream_chat(USER):
                got.append(event)
    finally:
        await provider.aclose()


def adapter(stage: str, server: FakeOpenAIServer | str) -> Any:
    return {"stt": stt_for, "tts": tts_for, "llm": llm_for}[stage](server)


def counted(stage: str, provider: str, kind: str) -> float:
    labels = {"stage": stage, "provider": provider, "kind": kind}
    return REGISTRY.get_sample_value("ivr_provider_errors_total", labels) or 0.0


# ---- each fault at each adapter -------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    fault: Fault
    kind: ProviderErrorKind
    within: float
    retryable: bool
    mid_stream: bool = False
    """Some output reached the caller before the error."""


def _common(after_first: int) -> dict[str, Case]:
    """Faults every endpoint can suffer; ``after_first`` chunks carry the first output."""
    return {
        "close before headers": Case(Fault(drop=True), Kind.RESET, FAST, True),
        "stall without a byte": Case(Fault(hang=True), Kind.TIMEOUT, FIRST + SLACK, True),
        "http 503": Case(Fault(status=503), Kind.STATUS, FAST, True),
        "http 429 retry-after": Case(
            Fault(status=429, headers={"Retry-After": "7"}), Kind.STATUS, FAST, True
        ),
        "http 400": Case(Fault(status=400), Kind.STATUS, FAST, False),
        "stall before the first output": Case(
            Fault(after_chunks=after_first - 1, then="stall"), Kind.TIMEOUT, FIRST + SLACK, True
        ),
    }


def _chunk(choices: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"} | {
        "choices": choices
    }


SSE = "text/event-stream"
CASES: dict[str, dict[str, Case]] = {
    "stt": _common(after_first=2)
    | {
        "reset mid-answer": Case(Fault(after_chunks=1), Kind.RESET, FAST, True),
        "not JSON": Case(Fault(raw=b"Service Unavailable"), Kind.PAYLOAD, FAST, False),
        "HTML page": Case(
            Fault(raw=b"<html>502</html>", content_type="text/html"), Kind.PAYLOAD, FAST, False
        ),
        '"text": null': Case(Fault(raw=b'{"text": null}'), Kind.PAYLOAD, FAST, False),
        "wrong shape": Case(Fault(raw=b'{"transcript": "hi"}'), Kind.PAYLOAD, FAST, False),
    },
    "llm": _common(after_first=2)
    | {
        "reset mid-stream": Case(Fault(after_chunks=3), Kind.RESET, FAST, True, mid_stream=True),
        "stall mid-stream": Case(
            Fault(after_chunks=3, then="stall"), Kind.TIMEOUT, STALL + SLACK, True, True
        ),
        "chunk not JSON": Case(
            Fault(raw=sse_body("{oops"), content_type=SSE), Kind.PAYLOAD, FAST, False
        ),
        '"choices": null': Case(
            Fault(raw=sse_body(_chunk(None)), content_type=SSE), Kind.PAYLOAD, FAST, False
        ),
        '"delta": null': Case(
            Fault(raw=sse_body(_chunk([{"index": 0, "delta": None}])), content_type=SSE),
            Kind.PAYLOAD,
            FAST,
            False,
        ),
        "content not a string": Case(
            Fault(raw=sse_body(_chunk([{"index": 0, "delta": {"content": 5}}])), content_type=SSE),
            Kind.PAYLOAD,
            FAST,
            False,
        ),
        "JSON body, not a stream": Case(
            Fault(raw=json.dumps({"choices": []}).encode()), Kind.PAYLOAD, FAST, False
        ),
        "empty stream": Case(Fault(raw=sse_body(), content_type=SSE), Kind.PAYLOAD, FAST, False),
    },
    "tts": _common(after_first=1)
    | {
        "reset mid-stream": Case(Fault(after_chunks=2), Kind.RESET, FAST, True, mid_stream=True),
        "stall mid-stream": Case(
            Fault(after_chunks=2, then="stall"), Kind.TIMEOUT, STALL + SLACK, True, True
        ),
        "JSON instead of audio": Case(Fault(raw=b'{"error": "quota"}'), Kind.PAYLOAD, FAST, False),
        "HTML page": Case(
            Fault(raw=b"<html>502</html>", content_type="text/html"), Kind.PAYLOAD, FAST, False
        ),
        "no audio": Case(Fault(raw=b"", content_type="audio/pcm"), Kind.PAYLOAD, FAST, False),
        "half a sample": Case(  # the whole sample is played, the odd byte is the error
            Fault(raw=b"\x01\x02\x03", content_type="audio/pcm"), Kind.PAYLOAD, FAST, False, True
        ),
    },
}
MATRIX = [(stage, name) for stage, cases in CASES.items() for name in cases]


@pytest.mark.parametrize(("stage", "name"), MATRIX, ids=[f"{s}: {n}" for s, n in MATRIX])
async def test_each_fault_is_a_provider_error_of_its_kind_within_its_bound(
    srv: FakeOpenAIServer, stage: str, name: str
) -> None:
    case = CASES[stage][name]
    srv.faults[ENDPOINT[stage]] = case.fault
    got: list[Any] = []
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        await drive(stage, adapter(stage, srv), got)
    elapsed = time.monotonic() - started
    error = info.value
    assert (error.kind, error.retryable) == (case.kind, case.retryable), str(error)
    assert elapsed < case.within, f"{error} after {elapsed:.2f} s"
    assert bool(got) is case.mid_stream, got
    assert len(srv.requests_for(ENDPOINT[stage])) == 1  # adapters never retry by themselves
    if error.kind is not Kind.PAYLOAD:
        assert error.__cause__ is not None  # translated with `raise ... from`


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_no_server_listening_is_a_fast_retryable_connect_error(stage: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        await drive(stage, adapter(stage, url), [])
    assert info.value.kind is Kind.CONNECT and info.value.retryable, str(info.value)
    assert time.monotonic() - started < FAST


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_429_carries_the_servers_retry_after(srv: FakeOpenAIServer, stage: str) -> None:
    srv.faults[ENDPOINT[stage]] = Fault(status=429, headers={"Retry-After": "7"})
    with pytest.raises(ProviderStatusError) as info:
        await drive(stage, adapter(stage, srv), [])
    assert (info.value.status, info.value.retry_after) == (429, 7.0)


async def test_the_timeout_names_the_limit_that_ran_out(srv: FakeOpenAIServer) -> None:
    srv.faults["speech"] = Fault(after_chunks=2, then="stall")
    with pytest.raises(ProviderError, match=r"no next chunk within 0.5 s"):
        await drive("tts", tts_for(srv), [])
    srv.faults["chat"] = Fault(hang=True)
    with pytest.raises(ProviderError, match=r"no first token within 0.5 s"):
        await drive("llm", llm_for(srv), [])


def test_retry_after_reads_seconds_milliseconds_and_http_dates() -> None:
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < (retry_after({"retry-after": soon}) or 0) <= 30
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None


# ---- retries and fallbacks: only before the first output, within the budget ---------------

POLICY = RetryPolicy(budget=1.0, min_attempt=0.4)


def resilient(stage: str, *servers: FakeOpenAIServer) -> Any:
    names = {"stt": "openai_stt", "tts": "openai_tts", "llm": "openai_compat"}
    make = {"stt": stt_for, "tts": tts_for, "llm": llm_for}[stage]
    providers = [make(s, names[stage] + ("_fallback" if i else "")) for i, s in enumerate(servers)]
    wrapper = {"stt": ResilientStt, "tts": ResilientTts, "llm": ResilientLlm}[stage]
    return wrapper(providers, POLICY)


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
@pytest.mark.parametrize(
    "fault", [Fault(drop=True, times=1), Fault(status=503, times=1)], ids=["reset", "503"]
)
async def test_a_retryable_failure_before_any_output_is_retried_once_and_counted(
    srv: FakeOpenAIServer, stage: str, fault: Fault
) -> None:
    srv.transcripts.append("my balance")
    srv.faults[ENDPOINT[stage]] = fault
    kind = "reset" if fault.drop else "status"
    before = counted(stage, resilient(stage, srv).name, kind)
    got: list[Any] = []
    await drive(stage, resilient(stage, srv), got)
    assert got
    assert len(srv.requests_for(ENDPOINT[stage])) == 2
    assert counted(stage, resilient(stage, srv).name, kind) == before + 1


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_a_first_output_limit_replaces_the_wrappers_budget_for_one_call(
    srv: FakeOpenAIServer, stage: str
) -> None:
    srv.faults[ENDPOINT[stage]] = Fault(hang=True, times=10)
    wrapper = resilient(stage, srv)  # POLICY: a 1.0 s budget
    call = {
        "stt": lambda: wrapper.transcribe(PCM, first_output_limit=0.3),
        "tts": lambda: anext(wrapper.synthesize("Hello.", first_output_limit=0.3)),
        "llm": lambda: anext(wrapper.stream_chat(USER, first_output_limit=0.3)),
    }[stage]
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        await call()
    elapsed = time.monotonic() - started
    await wrapper.aclose()
    assert info.value.kind == Kind.TIMEOUT
    assert 0.25 < elapsed < 0.3 + SLACK  # not the budget's 1.0 s


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
@pytest.mark.parametrize(
    "fault",
    [Fault(status=400), Fault(raw=b"<html>", content_type="text/html"), Fault(status=401)],
    ids=["400", "garbage", "401"],
)
async def test_a_non_retryable_failure_is_not_retried(
    srv: FakeOpenAIServer, stage: str, fault: Fault
) -> None:
    srv.faults[ENDPOINT[stage]] = fault
    with pytest.raises(ProviderError) as info:
        await drive(stage, resilient(stage, srv), [])
    assert not info.value.retryable
    assert len(srv.requests_for(ENDPOINT[stage])) == 1


@pytest.mark.parametrize("stage", ["llm", "tts"])
async def test_nothing_is_retried_or_failed_over_after_the_first_output(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer, stage: str
) -> None:
    srv.faults[ENDPOINT[stage]] = Fault(after_chunks=3)
    got: list[Any] = []
    with pytest.raises(ProviderError) as info:
        await drive(stage, resilient(stage, srv, backup), got)
    assert info.value.kind is Kind.RESET and got
    assert len(srv.requests_for(ENDPOINT[stage])) == 1
    assert backup.requests_for(ENDPOINT[stage]) == []


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_a_stall_uses_the_whole_budget_so_it_is_not_retried(
    srv: FakeOpenAIServer, stage: str
) -> None:
    srv.faults[ENDPOINT[stage]] = Fault(hang=True)
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        await drive(stage, resilient(stage, srv), [])
    assert info.value.kind is Kind.TIMEOUT
    assert time.monotonic() - started < POLICY.budget + SLACK
    assert len(srv.requests_for(ENDPOINT[stage])) == 1


async def test_retry_after_is_honoured_when_it_fits_the_budget(srv: FakeOpenAIServer) -> None:
    srv.faults["speech"] = Fault(status=429, headers={"Retry-After": "0.2"}, times=1)
    started = time.monotonic()
    await drive("tts", resilient("tts", srv), [])
    assert time.monotonic() - started >= 0.2
    requests = srv.requests_for("speech")
    assert len(requests) == 2 and requests[1].time - requests[0].time >= 0.2


async def test_a_retry_after_longer_than_the_budget_is_not_waited_for(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    srv.faults["chat"] = Fault(status=429, headers={"Retry-After": "5"})
    started = time.monotonic()
    got: list[LlmEvent] = []
    await drive("llm", resilient("llm", srv, backup), got)
    assert time.monotonic() - started < FAST
    assert len(srv.requests_for("chat")) == 1 and len(backup.requests_for("chat")) == 1
    assert "".join(e.text for e in got if isinstance(e, TextDelta)).startswith("You said")


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_the_fallback_answers_when_the_primary_keeps_failing(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer, stage: str
) -> None:
    backup.transcripts.append("my balance")
    srv.faults[ENDPOINT[stage]] = Fault(drop=True)
    before = counted(stage, resilient(stage, srv).name, "reset")
    got: list[Any] = []
    await drive(stage, resilient(stage, srv, backup), got)
    assert got
    assert len(srv.requests_for(ENDPOINT[stage])) == 2  # the try and its one retry
    assert len(backup.requests_for(ENDPOINT[stage])) == 1
    assert counted(stage, resilient(stage, srv).name, "reset") == before + 2


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_a_hung_primary_leaves_the_fallback_time_within_the_same_budget(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer, stage: str
) -> None:
    backup.transcripts.append("my balance")
    srv.faults[ENDPOINT[stage]] = Fault(hang=True)
    started = time.monotonic()
    got: list[Any] = []
    await drive(stage, resilient(stage, srv, backup), got)
    elapsed = time.monotonic() - started
    assert got
    # The primary got budget - min_attempt (0.6 s); the fallback answered at once.
    assert POLICY.budget - POLICY.min_attempt - 0.05 < elapsed < POLICY.budget + SLACK
    assert len(backup.requests_for(ENDPOINT[stage])) == 1


@pytest.mark.parametrize("stage", ["stt", "llm", "tts"])
async def test_when_every_provider_fails_the_caller_gets_the_last_error_uncounted(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer, stage: str
) -> None:
    srv.faults[ENDPOINT[stage]] = Fault(hang=True)
    backup.faults[ENDPOINT[stage]] = Fault(status=400)
    wrapper = resilient(stage, srv, backup)
    primary, fallback = (p.name for p in wrapper.providers)
    before = (counted(stage, primary, "timeout"), counted(stage, fallback, "status"))
    started = time.monotonic()
    with pytest.raises(ProviderStatusError) as info:
        await drive(stage, wrapper, [])
    assert time.monotonic() - started < POLICY.budget + SLACK
    assert info.value.provider == fallback and info.value.status == 400
    # The wrapper counted the timeout it recovered from; the caller counts what it gets.
    assert (counted(stage, primary, "timeout"), counted(stage, fallback, "status")) == (
        before[0] + 1,
        before[1],
    )


async def test_a_null_choices_chunk_from_the_primary_is_answered_by_the_fallback(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    srv.faults["chat"] = Fault(raw=sse_body(_chunk(None)), content_type=SSE)
    got: list[LlmEvent] = []
    await drive("llm", resilient("llm", srv, backup), got)
    assert "".join(e.text for e in got if isinstance(e, TextDelta)).startswith("You said")
    assert len(srv.requests_for("chat")) == 1  # PAYLOAD is not retried on the same server


@pytest.mark.parametrize("stage", ["llm", "tts"])
async def test_closing_the_wrapped_stream_early_closes_the_server_side_stream(
    srv: FakeOpenAIServer, stage: str
) -> None:
    """Barge-in: the caller closes the stream after the first output; the HTTP stream goes."""
    srv.speech_chunk_delay = 0.05
    srv.chat = ChatScript(text=" ".join(["word"] * 50), token_delay=0.03)
    wrapper = resilient(stage, srv)
    if stage == "tts":
        stream = wrapper.synthesize("A long answer that takes seconds to say. " * 5)
    else:
        stream = wrapper.stream_chat(USER)
    async with contextlib.aclosing(stream):
        await anext(stream)
    rec = srv.requests_for(ENDPOINT[stage])[0]
    assert await asyncio.to_thread(rec.wait_finished, 3.0)
    assert rec.outcome == "disconnected"
    await wrapper.aclose()


# ---- settings and wiring ----------------------------------------------------------------------


def test_cloud_defaults_keep_dead_air_under_two_seconds() -> None:
    settings = Settings(
        _env_file=None, stt_provider="openai", tts_provider="openai", llm_api_key="k"
    )  # type: ignore[call-arg]
    stt, tts = build_stt(settings), build_tts(settings)
    llm = build_llm(settings, base_url="https://api.cerebras.ai/v1", api_key="k", model="m")
    assert isinstance(stt, ResilientStt) and isinstance(tts, ResilientTts)
    assert isinstance(llm, ResilientLlm)
    assert stt.policy.budget == stt.providers[0].timeout == 1.5  # type: ignore[attr-defined]
    assert llm.providers[0].limits == StageLimits(1.2, 1.0, 20.0)  # type: ignore[attr-defined]
    assert tts.providers[0].limits == StageLimits(1.0, 1.0, 10.0)  # type: ignore[attr-defined]
    assert (llm.policy.budget, tts.policy.budget) == (1.2, 1.0)
    assert 0.3 + stt.policy.budget < 2.0  # endpoint silence + the stage's whole budget
    assert settings.heard_within == 1.5  # and the turn deadline on top (test_fault_suite)


def test_the_turn_deadline_is_off_with_offline_engines_and_can_be_set_or_turned_off() -> None:
    assert Settings(_env_file=None).heard_within is None  # type: ignore[call-arg]
    cloud = {"stt_provider": "openai", "tts_provider": "openai", "llm_api_key": "k"}
    assert Settings(_env_file=None, **cloud, heard_within_ms=0).heard_within is None  # type: ignore[call-arg]
    assert Settings(_env_file=None, **cloud, heard_within_ms=1800).heard_within == 1.8  # type: ignore[call-arg]
    # Half cloud: the offline STT's normal turn is slower than the deadline.
    assert Settings(_env_file=None, tts_provider="openai", llm_api_key="k").heard_within is None  # type: ignore[call-arg]


async def test_a_turn_deadline_shortens_a_stages_limit_but_leaves_it_min_attempt(
    srv: FakeOpenAIServer,
) -> None:
    srv.faults["transcriptions"] = Fault(hang=True, times=10)
    stt = ResilientStt([OpenAIHttpStt(base_url=srv.base_url, api_key=KEY, timeout=5.0)],
                       RetryPolicy(5.0, 0.5))  # fmt: skip
    loop = asyncio.get_running_loop()
    for deadline_in, expected in ((0.8, 0.8), (0.1, 0.5)):  # min_attempt is the floor
        token = turn_deadline.set(time.monotonic() + deadline_in)
        started = loop.time()
        try:
            with pytest.raises(ProviderError) as info:
                await stt.transcribe(b"\0\0" * 1600)
        finally:
            turn_deadline.reset(token)
        assert info.value.kind == ProviderErrorKind.TIMEOUT
        assert expected - 0.05 < loop.time() - started < expected + 0.3
    await stt.aclose()


def test_the_offline_engines_keep_generous_limits() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.use_local_llm
    assert (settings.stt_answer_timeout, settings.llm_first_token_limit) == (10.0, 5.0)
    assert settings.llm_stall_limit == 3.0


def test_the_limits_and_fallbacks_come_from_ivr_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "IVR_STT_PROVIDER": "openai",
        "IVR_STT_TIMEOUT": "2",
        "IVR_STT_FALLBACK_BASE_URL": "http://stt-b/v1",
        "IVR_TTS_PROVIDER": "openai",
        "IVR_TTS_FIRST_BYTE_TIMEOUT": "0.8",
        "IVR_TTS_STALL_TIMEOUT": "0.7",
        "IVR_TTS_TIMEOUT": "9",
        "IVR_TTS_FALLBACK_BASE_URL": "http://tts-b/v1",
        "IVR_TTS_FALLBACK_VOICE": "coral",
        "IVR_LLM_API_KEY": "k",
        "IVR_LLM_FIRST_TOKEN_TIMEOUT": "1.4",
        "IVR_LLM_STALL_TIMEOUT": "0.9",
        "IVR_LLM_FALLBACK_BASE_URL": "https://router.huggingface.co/v1",
        "IVR_LLM_FALLBACK_API_KEY": "hf_x",
        "IVR_LLM_FALLBACK_MODEL": "google/gemma-4-31B-it:cerebras",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    stt: Any = build_stt(settings)
    tts: Any = build_tts(settings)
    llm: Any = build_llm(settings, base_url="https://api.cerebras.ai/v1", api_key="k", model="m")
    assert [p.timeout for p in stt.providers] == [2.0, 2.0] and stt.policy.budget == 2.0
    assert [p.name for p in stt.providers] == ["openai_stt", "openai_stt_fallback"]
    assert tts.providers[1].limits == StageLimits(0.8, 0.7, 9.0)
    assert [p.voice for p in tts.providers] == ["alloy", "coral"] and tts.voice == "alloy"
    assert [p.model for p in llm.providers] == ["m", "google/gemma-4-31B-it:cerebras"]
    assert llm.providers[1].limits == StageLimits(1.4, 0.9, 20.0)
    assert llm.providers[1].request_params(USER)["extra_body"] == {"reasoning_effort": "none"}


def test_every_provider_name_the_settings_take_has_a_builder() -> None:
    assert set(get_args(SttProviderName)) == set(stt_builders)
    assert set(get_args(TtsProviderName)) == set(tts_builders)
    built = {name: build_stt(Settings(_env_file=None, stt_provider=name)).name  # type: ignore[call-arg]
             for name in stt_builders if name not in STREAMING_STT}  # fmt: skip
    assert built == {"local": "whisper_local", "openai": "openai_stt"}
    keys = {"deepgram_api_key": "dg", "stt_api_key": "sk", "cartesia_api_key": "c",
            "cartesia_voice": "v", "elevenlabs_api_key": "e", "elevenlabs_voice": "v"}  # fmt: skip

    def settings(**values: str) -> Settings:
        return Settings(_env_file=None, **keys, **values)  # type: ignore[call-arg, arg-type]

    streaming = {
        name: getattr(build_streaming_stt(settings(stt_provider=name)), "name", None)
        for name in get_args(SttProviderName)
    }
    assert streaming == {
        "local": None, "openai": None, "deepgram": "deepgram",
        "deepgram-flux": "deepgram_flux", "openai-realtime": "openai_realtime",
    }  # fmt: skip
    voices = {
        name: getattr(build_streaming_tts(settings(tts_provider=name)), "name", None)
        for name in STREAMING_TTS
    }
    assert voices == {"cartesia": "cartesia", "elevenlabs": "elevenlabs"}
    with pytest.raises(ConfigError, match="DEEPGRAM_API_KEY"):
        build_streaming_stt(Settings(_env_file=None, stt_provider="deepgram"))  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="CARTESIA_API_KEY"):
        build_tts(Settings(_env_file=None, tts_provider="cartesia"))  # type: ignore[call-arg]
    voice = build_tts(settings(tts_provider="elevenlabs"))  # the call's voice: its sessions
    assert isinstance(voice, StreamingVoice) and voice.streaming.name == "elevenlabs"


def test_a_fallback_for_an_offline_engine_is_refused_at_startup() -> None:
    settings = Settings(_env_file=None, stt_fallback_base_url="http://stt-b/v1")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="IVR_STT_FALLBACK_BASE_URL"):
        build_stt(settings)


async def test_build_llm_fails_over_to_the_configured_fallback(
    srv: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        llm_api_key=KEY,
        llm_fallback_base_url=backup.base_url,
        llm_fallback_api_key=KEY,
    )
    srv.faults["chat"] = Fault(status=500)
    llm = build_llm(settings, base_url=srv.base_url, api_key=KEY, model="m")
    got: list[LlmEvent] = []
    await drive("llm", llm, got)
    assert got and len(backup.requests_for("chat")) == 1
