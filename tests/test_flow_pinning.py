"""A call finishes on the flow version it started with, on whichever instance resumes it.

Two gateways ("instances") load flows from different directories and share one Redis (each
with its own client, as two processes would). A call pinned on A is resumed on B after B's
files changed; B must run A's version, loaded from the sources A saved in the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog
from redis_server import LOCAL_REDIS_URL, RedisServer
from structlog.testing import capture_logs

from ivr.callio.io import ListenSpec
from ivr.config import Settings
from ivr.flows.nodes import AgentNode
from ivr.flows.problems import FlowLoadError
from ivr.flows.registry import FlowRegistry
from ivr.flows.sources import load_flow_from_sources
from ivr.flowtools.textio import CallerTurn, TextCallIO, pressed
from ivr.gateway import Gateway, build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.state.base import CallRecord, CallStatus
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.tts.openai_http import OpenAIHttpTts

NUMBER = "+15550001"
UNUSED = "http://127.0.0.1:9"  # providers are never reached: these flows only say and listen


def main_flow(tag: str, *, subflow: bool = False) -> str:
    ask = (
        "  ask:\n    kind: subflow\n    flow: check\n    next: bye\n"
        if subflow
        else f"  ask:\n    kind: menu\n    prompt: 'Menu of {tag}. Press 1.'\n"
        "    options:\n      - {key: '1', next: bye}\n"
    )
    return (
        f"name: main\nnumbers: ['{NUMBER}']\nstart: hi\nresume_prompt: 'Back on {tag}.'\n"
        f"nodes:\n  hi:\n    kind: say\n    text: 'Welcome to {tag}.'\n    next: ask\n"
        f"{ask}  bye:\n    kind: hangup\n    say: 'Goodbye from {tag}.'\n"
    )


def check_flow(tag: str) -> str:
    return (
        "name: check\nstart: ask\nnodes:\n"
        f"  ask:\n    kind: menu\n    prompt: 'Check of {tag}. Press 1.'\n"
        "    options:\n      - {key: '1', next: done}\n"
        "  done:\n    kind: return\n"
    )


def write(directory: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(text, encoding="utf-8")
    return directory


class InstanceDied(Exception):
    """Raised from inside a call to stop it dead, as a SIGKILL would."""


def die_on_listen(_spec: ListenSpec) -> None:
    raise InstanceDied


@pytest.fixture(autouse=True)
def all_log_levels() -> Iterator[None]:
    """Another test's gateway may have configured a level filter; these tests read warnings."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.configure(**saved)


Instance = Callable[[Path], Any]


@pytest.fixture
async def instance(prefix: str) -> AsyncIterator[Callable[[Path], Any]]:
    """``async with instance(flows_dir) as gateway``: a gateway on the shared Redis."""
    made: list[Gateway] = []

    @asynccontextmanager
    async def start(flows_dir: Path) -> AsyncIterator[Gateway]:
        settings = Settings(flows_dir=str(flows_dir), redis_url=LOCAL_REDIS_URL,
                            redis_prefix=prefix, llm_api_key="sk-test")  # fmt: skip
        gateway = build_gateway(
            settings,
            stt=OpenAIHttpStt(base_url=UNUSED, api_key="sk-test"),
            tts=OpenAIHttpTts(base_url=UNUSED, api_key="sk-test"),
            llm=OpenAICompatLlm(base_url=UNUSED, api_key="sk-test", model="m"),
        )
        made.append(gateway)
        yield gateway

    yield start
    for gateway in made:
        await gateway.aclose()


async def start_call(gateway: Gateway, sid: str = "CA-pin") -> CallRecord:
    """What the webhook does: pin the flow, store the call; then a stream takes it."""
    record = CallRecord(call_sid=sid, to_number=NUMBER, from_number="+15559999",
                        stream_sid="MZ-1", status=CallStatus.ACTIVE)  # fmt: skip
    await gateway.flows.pin(record)
    return await gateway.store.create(record)


async def run_until_death(gateway: Gateway, record: CallRecord) -> TextCallIO:
    """The call runs on ``gateway`` until it first waits for the caller; the instance dies."""
    io = TextCallIO(on_listen=die_on_listen)
    with pytest.raises(InstanceDied):
        await gateway.flows.run(io, record)
    return io


async def resume(gateway: Gateway, call_sid: str, turns: list[CallerTurn]) -> TextCallIO:
    """A new stream for the call on ``gateway``: it loads the record and runs the flow."""
    record = await gateway.store.update(call_sid, lambda r: setattr(r, "stream_sid", "MZ-2"))
    io = TextCallIO.scripted(turns)
    await gateway.flows.run(io, record)
    return io


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return (tmp_path / "a", tmp_path / "b")


async def test_a_call_resumes_on_its_version_on_an_instance_whose_files_changed(
    instance: Instance, dirs: tuple[Path, Path]
) -> None:
    a_dir = write(dirs[0], {"main.yaml": main_flow("one")})
    b_dir = write(dirs[1], {"main.yaml": main_flow("two")})
    async with instance(a_dir) as a, instance(b_dir) as b:
        record = await start_call(a)
        first = await run_until_death(a, record)
        assert first.bot_lines == ["Welcome to one.", "Menu of one. Press 1."]
        with capture_logs() as logs:
            second = await resume(b, record.call_sid, [pressed("1")])
    assert second.bot_lines == ["Back on one.", "Menu of one. Press 1.", "Goodbye from one."]
    assert [e for e in logs if e["event"] == "flows.version_from_store"]
    assert not [e for e in logs if e["event"] == "flows.version_missing"]
    # B's own version is another one: new calls there still get it.
    async with instance(b_dir) as b2:
        assert (await start_call(b2, "CA-new")).flow_version != record.flow_version


async def test_a_changed_sub_flow_is_pinned_with_the_flow_that_includes_it(
    instance: Instance, dirs: tuple[Path, Path]
) -> None:
    main = main_flow("main", subflow=True)  # the including file is the same on both
    a_dir = write(dirs[0], {"main.yaml": main, "check.yaml": check_flow("one")})
    b_dir = write(dirs[1], {"main.yaml": main, "check.yaml": check_flow("two")})
    async with instance(a_dir) as a, instance(b_dir) as b:
        record = await start_call(a)
        first = await run_until_death(a, record)
        assert first.bot_lines[-1] == "Check of one. Press 1."
        second = await resume(b, record.call_sid, [pressed("1")])
    assert second.bot_lines == ["Back on main.", "Check of one. Press 1.", "Goodbye from main."]


async def test_without_the_sources_the_call_goes_on_with_the_current_version_logged(
    instance: Instance, dirs: tuple[Path, Path], prefix: str
) -> None:
    a_dir = write(dirs[0], {"main.yaml": main_flow("one")})
    b_dir = write(dirs[1], {"main.yaml": main_flow("two")})
    async with instance(a_dir) as a, instance(b_dir) as b:
        record = await start_call(a)
        await run_until_death(a, record)
        await _redis_delete(f"{prefix}flow:{record.flow_version}")  # expired, say
        with capture_logs() as logs:
            second = await resume(b, record.call_sid, [pressed("1")])
    assert second.bot_lines[-1] == "Goodbye from two."
    missing = [e for e in logs if e["event"] == "flows.version_missing"]
    assert missing and missing[0]["version"] == record.flow_version


async def test_sources_of_another_version_are_refused_and_the_call_falls_back(
    instance: Instance, dirs: tuple[Path, Path], prefix: str
) -> None:
    a_dir = write(dirs[0], {"main.yaml": main_flow("one")})
    b_dir = write(dirs[1], {"main.yaml": main_flow("two")})
    async with instance(a_dir) as a, instance(b_dir) as b:
        record = await start_call(a)
        await run_until_death(a, record)
        # Tampered (or a bug): the stored files are not the pinned version's.
        await b.store.save_flow_sources("feedface0000", {"main.yaml": main_flow("three")}, 60)
        await a.store.update(record.call_sid, lambda r: setattr(r, "flow_version", "feedface0000"))
        with capture_logs() as logs:
            second = await resume(b, record.call_sid, [pressed("1")])
    assert second.bot_lines[-1] == "Goodbye from two."
    events = [e["event"] for e in logs]
    assert "flows.sources_mismatch" in events and "flows.version_missing" in events


async def test_a_version_is_written_once_per_instance_not_on_every_call(
    instance: Instance, dirs: tuple[Path, Path], prefix: str
) -> None:
    a_dir = write(dirs[0], {"main.yaml": main_flow("one")})
    async with instance(a_dir) as a:
        record = await start_call(a, "CA-1")
        key = f"{prefix}flow:{record.flow_version}"
        assert await _redis_ttl(key) > 6 * 3600 - 60  # outlives any call pinned to it
        await _redis_delete(key)
        await start_call(a, "CA-2")
        assert await _redis_ttl(key) == -2, "the second call of a version must not write it"


async def test_a_kept_old_version_shares_its_own_files_not_the_broken_edit_on_disk(
    tmp_path: Path,
) -> None:
    write(tmp_path, {"main.yaml": main_flow("one")})
    registry = FlowRegistry(tmp_path)
    registry.load()
    old = registry.get("main")
    (tmp_path / "main.yaml").write_text(main_flow("two").replace("next: ask", "next: nowhere"))
    assert registry.reload(), "the broken edit is refused"
    assert registry.get("main").version == old.version
    sources = registry.sources(registry.get("main"))
    assert sources == {"main.yaml": main_flow("one")}
    assert load_flow_from_sources(sources, "main").version == old.version


async def test_knowledge_files_travel_with_the_flow_byte_for_byte(tmp_path: Path) -> None:
    facts = "Open 9\u201317 h.\r\nClosed on Sundays."  # CRLF and non-ASCII kept exactly
    flow = (
        "name: main\nstart: agent\nnodes:\n  agent:\n    kind: agent\n    system: Be brief.\n"
        "    knowledge: [kb/facts.md, ../shared/terms.md]\n"
    )
    flows = write(tmp_path / "flows", {"main.yaml": flow, "kb/facts.md": facts})
    write(tmp_path, {"shared/terms.md": "Terms apply."})
    registry = FlowRegistry(flows)
    registry.load()
    loaded = registry.get("main")
    sources = registry.sources(loaded)
    assert sources is not None and sources["kb/facts.md"] == facts
    (flows / "kb" / "facts.md").write_text("Changed.")  # the disk moved on; the copy did not
    again = load_flow_from_sources(sources, "main")
    assert again.version == loaded.version
    node = again.nodes["agent"]
    assert isinstance(node, AgentNode) and facts in node.knowledge_text
    assert "Terms apply." in node.knowledge_text


def test_sources_with_an_absolute_path_are_refused() -> None:
    with pytest.raises(FlowLoadError, match=r"absolute path in sources: /etc/x\.md"):
        load_flow_from_sources({"main.yaml": main_flow("one"), "/etc/x.md": "x"}, "main")


def test_sources_without_the_named_flow_say_so() -> None:
    with pytest.raises(FlowLoadError, match="no flow named 'sales' in the sources"):
        load_flow_from_sources({"main.yaml": main_flow("one")}, "sales")


# -- the gateway's store while Redis is down ----------------------------------------------------


async def test_sources_saved_while_redis_is_down_are_served_locally_and_written_back(
    redis_server: RedisServer,
) -> None:
    primary = RedisCallStore(redis_server.url, socket_timeout=1.0, pool_timeout=1.0)
    store = ResilientCallStore(primary, min_backoff=0.02, max_backoff=0.2)
    other = RedisCallStore(redis_server.url)  # another instance's view
    await store.start()
    try:
        redis_server.stop()
        await store.save_flow_sources("v1abc", {"main.yaml": "x"}, ttl=60)
        assert store.degraded
        assert await store.load_flow_sources("v1abc") == {"main.yaml": "x"}
        redis_server.start()
        for _ in range(250):
            if not store.degraded:
                break
            await asyncio.sleep(0.02)
        assert await other.load_flow_sources("v1abc") == {"main.yaml": "x"}
        assert 50 < await primary._redis.ttl("ivr:flow:v1abc") <= 60
    finally:
        await store.aclose()
        await other.aclose()


async def _redis_delete(key: str) -> None:
    client = aioredis.Redis.from_url(LOCAL_REDIS_URL)
    try:
        await client.delete(key)
    finally:
        await client.aclose()


async def _redis_ttl(key: str) -> int:
    client = aioredis.Redis.from_url(LOCAL_REDIS_URL)
    try:
        return int(await client.ttl(key))
    finally:
        await client.aclose()
