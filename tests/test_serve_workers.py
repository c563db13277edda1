"""``ivr serve --workers N``: N full gateways on one port (SO_REUSEPORT), proven with a real
``ivr serve`` process tree on the local Redis (a fresh prefix per test) and simulated Twilio
calls: the kernel spreads calls over both workers, a call's webhook and stream may be answered
by different ones, SIGTERM drains every worker, a worker that dies is replaced, and settings
that cannot work stop the start with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_procs import (
    AGENT_NUMBER,
    API_KEY,
    AUTH_TOKEN,
    FIRST_QUESTION,
    FIRST_TRANSCRIPT,
    IVR,
    PUBLIC_URL,
    GatewayProcess,
    GatewayProcesses,
    _delete_prefix,
    agent_replies,
    fast_speak,
    free_port,
    gateway_env,
)
from redis_server import LOCAL_REDIS_URL

from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_data
from ivr.state.base import CallRecord, CallStatus
from ivr.state.redis_store import RedisCallStore
from ivr.testing.openai_server import FakeOpenAIServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

EXIT_SLACK_S = 10.0
"""After its last call, how long a draining process tree may take to exit (headroom for a CPU
shared with other test runs; uvicorn's shutdown takes well under a second)."""


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=API_KEY) as server:
        server.speak = fast_speak
        server.chat = agent_replies
        server.transcribe = lambda wav, form: FIRST_TRANSCRIPT  # calls run concurrently
        yield server


@contextlib.asynccontextmanager
async def workers(
    tmp_path: Path, fake: FakeOpenAIServer, count: int = 2, *, wait: bool = True
) -> AsyncIterator[tuple[GatewayProcess, RedisCallStore]]:
    """``ivr serve --workers count`` on a fresh Redis prefix, once every worker serves
    (``wait=False``: as soon as the parent runs)."""
    prefix = f"ivrtest:{uuid.uuid4().hex[:12]}:"
    env = gateway_env(
        providers_url=fake.base_url, api_key=API_KEY, public_url=PUBLIC_URL,
        auth_token=AUTH_TOKEN, redis_url=LOCAL_REDIS_URL, redis_prefix=prefix,
        IVR_DRAIN_SECONDS="60",
    )  # fmt: skip
    store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix)
    with GatewayProcesses(tmp_path) as group:
        proc = group.start("gw", env, serve_args=("--workers", str(count)))
        try:
            if wait:
                await started_workers(proc, count)
            yield proc, store
        finally:
            group.close()
            await store.aclose()
            await _delete_prefix(LOCAL_REDIS_URL, prefix)


def instances(proc: GatewayProcess) -> list[str]:
    """Instance ids of the workers that started, in order."""
    return [e["instance"] for e in proc.log_events("gateway.started")]


async def started_workers(proc: GatewayProcess, count: int, within: float = 60.0) -> list[str]:
    """Until ``count`` workers have started (and the port answers); their instance ids."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=1.0) as http:
        while True:
            if not proc.alive:
                raise AssertionError(f"ivr serve exited during startup\n{proc.tail()}")
            started = instances(proc)
            if len(started) >= count:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{proc.base_url}/healthz")).status_code == 200:
                        return started
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(started)} of {count} workers started\n{proc.tail()}")
            await asyncio.sleep(0.1)


def stat_fields(proc_dir: Path) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, ... (raises OSError once the
    process is gone)."""
    return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()


def worker_children(parent: int) -> list[int]:
    """Pids of the parent's worker processes: multiprocessing's spawn children, not its
    resource tracker."""
    found = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat_fields(proc_dir)[1]) != parent:
                continue
            if b"--multiprocessing-fork" in (proc_dir / "cmdline").read_bytes():
                found.append(int(proc_dir.name))
    return sorted(found)


async def spawned_workers(parent: int, count: int, within: float = 20.0) -> list[int]:
    """The worker pids once ``count`` exist: long before any has imported the gateway."""
    deadline = time.monotonic() + within
    while len(found := worker_children(parent)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} workers spawned"
        await asyncio.sleep(0.02)
    return found


def worker_pid(instance_id: str) -> int:
    """Worker instance ids end in ``-w<number>-<pid>``."""
    return int(instance_id.rsplit("-", 1)[1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet by its parent) counts as gone.
    with contextlib.suppress(OSError):
        return stat_fields(Path(f"/proc/{pid}"))[0] != "Z"
    return False


def call(proc: GatewayProcess, lines: list[Any]) -> asyncio.Task[CallReport]:
    script = script_from_data({"steps": lines, "max_wait": 15}, source="workers")
    return asyncio.create_task(
        place_call(
            proc.base_url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
            to=AGENT_NUMBER,
        )
    )  # fmt: skip


def assert_answered(report: CallReport, replies: int) -> None:
    """No protocol violation or error, and the reply heard after each caller line."""
    assert not report.errors and not report.violations, report.format_transcript()
    answered = [t for t in report.turns if t.caller_text and t.latency_s is not None]
    assert len(answered) == replies, report.format_transcript()


async def ended_record(store: RedisCallStore, call_sid: str, within: float = 5.0) -> CallRecord:
    """The call's record once it says ENDED: the caller's report is complete when its side
    hangs up, a moment before the worker has written the end."""
    deadline = time.monotonic() + within
    while True:
        record = await store.get(call_sid)
        if record is not None and record.status == CallStatus.ENDED:
            return record
        assert time.monotonic() < deadline, f"{call_sid} not ended after {within} s: {record}"
        await asyncio.sleep(0.05)


async def readyz_status(proc: GatewayProcess) -> int | None:
    """/readyz's status from whichever worker the kernel picks; None if the connection failed
    (a worker that finished draining closes its socket)."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(f"{proc.base_url}/readyz")).status_code
    except httpx.HTTPError:
        return None


# -- the tests --------------------------------------------------------------------------------


async def test_two_workers_share_the_port_both_carry_calls_and_both_drain_on_sigterm(
    tmp_path: Path, fake: FakeOpenAIServer
) -> None:
    async with workers(tmp_path, fake) as (proc, store):
        ids = instances(proc)
        assert len(set(ids)) == 2 and all(i.startswith(f"gw-{proc.port}-w") for i in ids), ids
        pids = [worker_pid(i) for i in ids]
        assert proc.process.pid not in pids and all(alive(p) for p in pids)

        # Calls in batches until both workers have carried one (the kernel hashes each new
        # connection to a worker: a batch of 4 all on one worker has odds of 1 in 8).
        carriers: dict[str, int] = {}
        for _ in range(6):
            reports = await asyncio.gather(*(call(proc, [FIRST_QUESTION]) for _ in range(4)))
            for report in reports:
                assert_answered(report, 1)
                record = await ended_record(store, report.call_sid)
                assert record.instance_id is not None, report.call_sid
                carriers[record.instance_id] = carriers.get(record.instance_id, 0) + 1
            if len(carriers) == 2:
                break
        assert set(carriers) == set(ids), carriers

        # SIGTERM to the parent: every worker drains; the live call finishes on its worker.
        long_call = call(proc, [FIRST_QUESTION, {"silence": 1.0}, FIRST_QUESTION])
        # Until its stream is up (a record with a carrier), not just its webhook answered: a
        # stream that arrives after both workers drain is refused, and nobody is left for it.
        deadline = time.monotonic() + 15
        while not (live := [r for r in await store.list_active() if r.instance_id is not None]):
            assert time.monotonic() < deadline, proc.tail()
            await asyncio.sleep(0.05)
        carrier = live[0].instance_id
        proc.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while (status := await readyz_status(proc)) == 200:
            assert time.monotonic() < signalled + 5, "still ready after SIGTERM"
            await asyncio.sleep(0.05)
        assert proc.alive, "the parent must wait for the worker that carries a call"
        try:
            report = await asyncio.wait_for(long_call, 45)
        except TimeoutError:  # seen once in a fresh clone's full run: say what the pool did
            call_sid = live[0].call_sid
            events = [e["event"] for e in proc.log_events(call_sid=call_sid)]
            pytest.fail(f"the call did not end 45 s after SIGTERM; its events {events}\n"
                        f"{proc.tail(120)}")  # fmt: skip
        call_ended = time.monotonic()
        code = await asyncio.to_thread(proc.process.wait, EXIT_SLACK_S)
        exited = time.monotonic()

    assert status in (503, None)
    assert_answered(report, 2)
    assert all(r.time > signalled for r in fake.requests_for("transcriptions")[-2:])
    assert code == 0, proc.tail()
    assert exited - call_ended < EXIT_SLACK_S
    assert not any(alive(p) for p in pids), "a worker outlived the parent"
    assert len(proc.log_events("server.drain_requested")) == 2
    drained = proc.log_events("drain.finished")
    assert len(drained) == 2 and all(d["left"] == 0 and d["moved"] == 0 for d in drained)
    ended = proc.log_events("call.ended", call_sid=report.call_sid)
    assert [e["outcome"] for e in ended] == ["caller_hung_up"], ended
    assert carrier in ids
    [stopped] = proc.log_events("server.workers_stopped")
    assert stopped["exit_code"] == 0
    print(f"\n--workers 2: calls per worker {sorted(carriers.values())}")


async def test_a_worker_that_dies_is_replaced_and_the_pool_keeps_serving(
    tmp_path: Path, fake: FakeOpenAIServer
) -> None:
    async with workers(tmp_path, fake) as (proc, _):
        first = instances(proc)
        victim = worker_pid(first[0])
        os.kill(victim, signal.SIGKILL)
        ids = await started_workers(proc, 3)
        replacement = ids[2]
        assert worker_pid(replacement) not in [worker_pid(i) for i in first]
        assert replacement.rsplit("-", 1)[0] == first[0].rsplit("-", 1)[0]  # same worker number
        [died] = proc.log_events("server.worker_died")
        assert died["exit_code"] == -signal.SIGKILL and died["restarting"] is True
        reports = await asyncio.gather(*(call(proc, [FIRST_QUESTION]) for _ in range(2)))
        for report in reports:
            assert_answered(report, 1)
        assert proc.alive


async def test_a_worker_killed_while_it_starts_is_replaced_not_taken_for_bad_settings(
    tmp_path: Path, fake: FakeOpenAIServer
) -> None:
    """The OOM killer or an operator can kill a worker before it serves: that says nothing about
    its settings, so the pool replaces it instead of stopping (CI once killed one between its
    ``gateway.started`` line and its socket listening, and the whole pool exited)."""
    async with workers(tmp_path, fake, wait=False) as (proc, _):
        victim = (await spawned_workers(proc.process.pid, 2))[0]
        os.kill(victim, signal.SIGKILL)
        ids = await started_workers(proc, 2)
        assert victim not in [worker_pid(i) for i in ids]
        [died] = proc.log_events("server.worker_died")
        assert died["exit_code"] == -signal.SIGKILL
        assert died["serving"] is False and died["restarting"] is True
        assert not proc.log_events("server.worker_failed_to_start")
        reports = await asyncio.gather(*(call(proc, [FIRST_QUESTION]) for _ in range(2)))
        for report in reports:
            assert_answered(report, 1)
        assert proc.alive


def run_serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return subprocess.run(
        [str(IVR), "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_workers_without_a_shared_store_are_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    env = gateway_env(
        providers_url="http://127.0.0.1:9/v1", api_key=API_KEY, public_url=PUBLIC_URL,
        auth_token=AUTH_TOKEN, redis_url="", redis_prefix="ivrtest:",
    )  # fmt: skip
    done = run_serve(env, "--workers", "2")
    assert done.returncode == 2, done.stderr
    assert "--workers 2 needs a shared call store (IVR_REDIS_URL)" in done.stderr
    zero = run_serve({**env, "IVR_REDIS_URL": LOCAL_REDIS_URL}, "--workers", "0")
    assert zero.returncode == 2 and "--workers must be at least 1, got 0" in zero.stderr


def test_a_worker_that_cannot_start_stops_the_whole_pool(tmp_path: Path) -> None:
    flows = tmp_path / "flows"
    flows.mkdir()
    (flows / "default.yaml").write_text("name: default\nstart: nowhere\nnodes: {}\n")
    env = gateway_env(
        providers_url="http://127.0.0.1:9/v1", api_key=API_KEY, public_url=PUBLIC_URL,
        auth_token=AUTH_TOKEN, redis_url=LOCAL_REDIS_URL, redis_prefix="ivrtest:",
        IVR_FLOWS_DIR=str(flows),
    )  # fmt: skip
    started = time.monotonic()
    done = run_serve(env, "--workers", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "cannot start: FlowLoadError" in done.stderr, done.stderr[-3000:]
    assert "server.worker_failed_to_start" in done.stderr
    assert time.monotonic() - started < 60
