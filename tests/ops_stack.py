"""The ops stack without Docker: two real ``ivr serve`` gateways behind HAProxy (the config in
deploy/haproxy/), a private Redis, and Prometheus scraping them with deploy/prometheus/rules.yml.
Providers are ``FakeOpenAIServer`` (a real local server speaking OpenAI's wire formats).

    scripts/stack           # bring it up, place a few calls, print the URLs; Ctrl-C ends it
    scripts/stack --check   # ... then run the live dashboard check and exit (1 on failure)

Every process it starts is its child and is stopped when it leaves (also on errors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from gateway_procs import (
    API_KEY,
    AUTH_TOKEN,
    PUBLIC_URL,
    GatewayProcess,
    GatewayProcesses,
    agent_replies,
    fast_speak,
    free_port,
    gateway_env,
)
from ops_checks import (
    PROM_DIR,
    REPO,
    RULES,
    Row,
    counters_without_series,
    dashboard_files,
    format_table,
    live_check,
    tool,
)
from redis_server import RedisServer

from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_data
from ivr.testing.openai_server import FakeOpenAIServer

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
SCRAPE_INTERVAL_S = 1.0
# The fake STT tells the caller's lines apart by length: a long question, a short goodbye.
QUESTION = "Hello, what are your opening hours on weekdays and on weekends?"
GOODBYE = "Goodbye."
CALL_SCRIPTS: list[list[Any]] = [
    [QUESTION, GOODBYE],
    [QUESTION, GOODBYE],
    # Talks over the bot's answer: a barge-in.
    [QUESTION, {"barge_in": {"say": GOODBYE, "after": 0.3}}],
]


def fake_transcribe(wav: bytes, form: dict[str, str]) -> str:
    with wave.open(io.BytesIO(wav), "rb") as w:
        seconds = w.getnframes() / w.getframerate()
    return "thanks goodbye" if seconds < 1.5 else "what are your opening hours"


class Child:
    """One child process with its output in a log file; ``stop()`` ends it (TERM, then KILL)."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@dataclass(slots=True)
class Stack:
    workdir: Path
    fake: FakeOpenAIServer
    gateways: list[GatewayProcess]
    lb_port: int
    lb_metrics_port: int
    prom_port: int
    started: float = field(default_factory=time.monotonic)

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def prom_url(self) -> str:
        return f"http://127.0.0.1:{self.prom_port}"

    def window(self) -> str:
        """A range-vector window covering everything since the stack started."""
        return f"{int(time.monotonic() - self.started) + 15}s"


def prometheus_config(gateway_ports: list[int], lb_metrics: int, prom_port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with local targets, a 1 s interval and our rules."""
    config: dict[str, Any] = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    interval = f"{SCRAPE_INTERVAL_S:g}s"
    config["global"].update(
        scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval
    )
    config["global"]["external_labels"] = {"stack": "ivr-local"}
    config["rule_files"] = [str(RULES)]
    targets = {
        "ivr": [f"127.0.0.1:{p}" for p in gateway_ports],
        "haproxy": [f"127.0.0.1:{lb_metrics}"],
        "prometheus": [f"127.0.0.1:{prom_port}"],
    }
    for job in config["scrape_configs"]:
        if job["job_name"] not in targets:
            raise ValueError(
                f"deploy/prometheus/prometheus.yml: job {job['job_name']!r} is unknown to "
                "tests/ops_stack.py; give it local targets there"
            )
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


async def _poll(what: str, probe: Any, within: float, children: list[Child]) -> None:
    """Await ``probe()`` until it returns True; fail with ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        for child in children:
            child.check_alive()
        with contextlib.suppress(httpx.HTTPError, OSError):
            if await probe():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not reached within {within} s")
        await asyncio.sleep(0.1)


async def _haproxy_ready(http: httpx.AsyncClient, metrics_port: int) -> bool:
    text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    return 'haproxy_backend_active_servers{proxy="gateways"} 2' in text


async def _targets_scraped(http: httpx.AsyncClient, prom_url: str, count: int) -> bool:
    body = (await http.get(f"{prom_url}/api/v1/targets")).json()
    active = body["data"]["activeTargets"]
    return len(active) == count and all(t["health"] == "up" for t in active)


def start_haproxy(workdir: Path, gateway_ports: list[int], port: int, metrics_port: int) -> Child:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "IVR_LB_BIND": f"127.0.0.1:{port}",
        "IVR_LB_METRICS_BIND": f"127.0.0.1:{metrics_port}",
        "IVR_GATEWAY_1": f"127.0.0.1:{gateway_ports[0]}",
        "IVR_GATEWAY_2": f"127.0.0.1:{gateway_ports[1]}",
    }
    args = [tool("haproxy"), "-db", "-f", str(HAPROXY_CFG)]
    return Child("haproxy", args, workdir / "haproxy.log", env)


def start_prometheus(workdir: Path, config: dict[str, Any], port: int) -> Child:
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    args = [
        tool("prometheus"),
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    return Child("prometheus", args, workdir / "prometheus.log", dict(os.environ))


@contextlib.asynccontextmanager
async def run_stack(workdir: Path) -> AsyncIterator[Stack]:
    """Redis, fake providers, 2 gateways, HAProxy and Prometheus, with their logs in
    ``workdir`` (an existing directory); all stopped on exit."""
    redis = RedisServer()
    children: list[Child] = []
    with FakeOpenAIServer(api_key=API_KEY) as fake, GatewayProcesses(workdir) as group:
        fake.speak = fast_speak  # before the gateways start: they pre-synthesise prompts
        fake.chat = agent_replies
        fake.transcribe = fake_transcribe
        try:
            await asyncio.to_thread(redis.start)
            env = gateway_env(
                providers_url=fake.base_url,
                api_key=API_KEY,
                public_url=PUBLIC_URL,
                auth_token=AUTH_TOKEN,
                redis_url=redis.url,
                redis_prefix=f"ivrops:{uuid.uuid4().hex[:8]}:",
                # A capacity, so utilisation panels have data; a short drain on shutdown.
                IVR_MAX_CALLS="20",
                IVR_DRAIN_SECONDS="2",
            )
            gateways = [group.start(f"gw-{i}", env) for i in (1, 2)]
            ports = [g.port for g in gateways]
            lb, lb_metrics, prom = free_port(), free_port(), free_port()
            children.append(start_haproxy(workdir, ports, lb, lb_metrics))
            children.append(
                start_prometheus(workdir, prometheus_config(ports, lb_metrics, prom), prom)
            )
            await group.wait_healthy()
            stack = Stack(workdir, fake, gateways, lb, lb_metrics, prom)
            async with httpx.AsyncClient(timeout=2.0) as http:
                await _poll(
                    "HAProxy with both gateways up",
                    lambda: _haproxy_ready(http, lb_metrics),
                    20,
                    children,
                )
                await _poll(
                    "Prometheus scraping every target",
                    lambda: _targets_scraped(http, stack.prom_url, 4),
                    20,
                    children,
                )
            yield stack
        finally:
            for child in reversed(children):
                child.stop()
            group.close()
            redis.close()


# -- traffic --------------------------------------------------------------------------------------


async def place_calls(base_url: str, scripts: list[list[Any]]) -> list[CallReport]:
    """Real simulated calls, concurrently, signed like Twilio's; one failing cancels the rest."""
    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(
                place_call(
                    base_url, script=script_from_data(s, source=f"call {i}"),
                    auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
                )
            )
            for i, s in enumerate(scripts)
        ]  # fmt: skip
    return [t.result() for t in tasks]


async def startup_rows(stack: Stack) -> list[Row]:
    """Each gateway's ``/metrics`` before any call: every counter a panel or rule reads must
    have a series already (at 0), or "nothing went wrong" reads as "no data"."""
    rows = []
    async with httpx.AsyncClient(timeout=5.0) as http:
        for gateway in stack.gateways:
            text = (await http.get(f"{gateway.base_url}/metrics")).text
            what = f"{gateway.name} /metrics at startup"
            problems = counters_without_series(text, dashboard_files())
            rows += [Row(what, "EMPTY", 0, problem) for problem in problems]
            rows += [] if problems else [Row(what, "OK", 1, "every counter read has a series")]
    return rows


async def drive_traffic(stack: Stack) -> list[CallReport]:
    """Calls on a healthy fleet, in two waves: no provider fails, no stream is refused, and
    still every panel and recording rule must answer (counters start at zero).

    A labelled histogram series (latency by provider) appears on its first observation, and
    rate() cannot see that first one. So a warm-up wave goes to each gateway directly (every
    latency series then exists on both) and, two scrapes later, the main wave goes through
    HAProxy and moves them all."""
    warm_up = [[QUESTION, {"barge_in": {"say": GOODBYE, "after": 0.3}}]]
    async with asyncio.TaskGroup() as group:
        first = [group.create_task(place_calls(g.base_url, warm_up)) for g in stack.gateways]
    await asyncio.sleep(2.5 * SCRAPE_INTERVAL_S)
    main = await place_calls(stack.lb_url, [*CALL_SCRIPTS, [QUESTION, QUESTION, GOODBYE]])
    return [report for task in first for report in task.result()] + main


async def settle(stack: Stack) -> None:
    """Two scrapes and a rule evaluation after the last call, so the last samples are in."""
    await asyncio.sleep(2.5 * SCRAPE_INTERVAL_S + 0.5)


def _summary(reports: list[CallReport]) -> str:
    turns = list(itertools.chain.from_iterable(r.turns for r in reports))
    errors = [e for r in reports for e in r.errors]
    return f"{len(reports)} calls, {len(turns)} turns, caller-side errors: {errors or 'none'}"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/stack", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="run the live check and exit")
    parser.add_argument("--out", type=Path, help="write the live check's table here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ivr-stack-") as tmp:
        async with run_stack(Path(tmp)) as stack:
            print(
                f"gateways  {', '.join(g.base_url for g in stack.gateways)}\n"
                f"haproxy   {stack.lb_url}  (stats http://127.0.0.1:{stack.lb_metrics_port}/stats)\n"
                f"prometheus {stack.prom_url}\nlogs      {tmp}",
                flush=True,
            )
            before = await startup_rows(stack)
            print(_summary(await drive_traffic(stack)), flush=True)
            await settle(stack)
            rows = before + live_check(stack.prom_url, dashboard_files(), stack.window())
            table = format_table(rows)
            print(table)
            if args.out:
                args.out.write_text(table + "\n")
            if args.check:
                return 1 if any(r.failed for r in rows) else 0
            print("stack is up; Ctrl-C stops it", flush=True)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main()))
