"""How long a caller hears nothing when the instance carrying the call dies, and what a real
call costs Redis.

1. Resume time, repeated ``--runs`` times: two real ``ivr serve`` processes share a private
   redis-server behind a TCP load balancer (tests/lb.py); one agent call completes a turn, the
   instance carrying its stream is SIGKILLed, the simulated Twilio posts the ``<Connect action>``
   URL (the LB fails over to the survivor), follows the new ``<Connect><Stream>``, and the call
   ends normally. Headline: caller's old stream ended -> first bot audio on the new stream.
2. Redis commands per call-minute: one real gateway process on a private redis-server, one
   ~1-minute multi-turn call, INFO commandstats deltas (nothing else uses that Redis).

Providers are FakeOpenAIServer (real HTTP, OpenAI wire formats, instant answers), so the
numbers are the gateway's and Redis's own cost, not a model's.

    .venv/bin/python bench/resume_time.py [--runs 5] [--minute-seconds 60] [--skip-redis-ops]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gateway_procs import (
    AGENT_NUMBER,
    AUTH_TOKEN,
    PUBLIC_URL,
    ResumeTiming,
    agent_replies,
    cluster,
    failover_call,
    fast_speak,
    resume_timing,
)
from redis_server import RedisServer

from ivr.obs.logging import configure_logging
from ivr.sim.caller import place_call
from ivr.testing.openai_server import FakeOpenAIServer

PARTS = [
    ("heard_gap_s", "drop -> audio again (caller)"),
    ("reconnect_s", "  drop -> new stream start sent"),
    ("new_stream_to_audio_s", "  new stream start -> first audio"),
    ("action_rtt_s", "  action request round trip (LB)"),
    ("ws_handshake_s", "  WS handshake round trip (LB)"),
    ("upgrade_to_media_s", "  101 -> first media frame (LB)"),
    ("kill_to_drop_s", "SIGKILL -> LB saw the socket drop"),
    ("kill_to_media_s", "SIGKILL -> first media from survivor"),
]

QUESTIONS = [
    "What are your opening hours?",
    "Are you open on Saturday?",
    "Do you deliver to my town?",
    "Can I pay by card?",
    "Do you have parking?",
    "Is there a discount for students?",
]


async def one_resume(workdir: Path, redis_url: str, run: int) -> ResumeTiming:
    log_dir = workdir / f"run{run}"
    log_dir.mkdir()
    with FakeOpenAIServer(api_key="sk-test") as fake:
        fake.speak = fast_speak
        async with cluster(log_dir, fake, redis_url, instances=2) as cl:
            result = await failover_call(cl, log_dir / "call.wav")
            report = result.report
            if report.errors or report.violations or len(report.streams) != 2:
                raise RuntimeError(f"run {run} failed:\n{report.format_transcript()}")
            return resume_timing(report, result.wav_path, cl.lb, result.killed_at)


def print_resumes(timings: list[ResumeTiming]) -> None:
    print(f"\nresume after SIGKILL of the carrying instance, {len(timings)} runs (ms)")
    print(f"{'':40} {'min':>7} {'median':>7} {'max':>7}")
    for name, label in PARTS:
        values = [getattr(t, name) * 1000 for t in timings]
        print(f"{label:40} {min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}")


async def commandstats(url: str) -> dict[str, int]:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("commandstats")
    finally:
        await client.aclose()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def redis_ops(workdir: Path, seconds: float) -> None:
    """Commands a real ~``seconds`` call costs a private Redis, scaled to one call-minute."""
    server = RedisServer()
    server.start()
    log_dir = workdir / "redis-ops"
    log_dir.mkdir()
    try:
        with FakeOpenAIServer(api_key="sk-test") as fake:
            fake.speak = fast_speak
            fake.chat = agent_replies
            async with cluster(log_dir, fake, server.url, instances=1) as cl:
                script: list[str] = []
                turns = 0
                while len(script) < 200:  # ~4 s a turn: enough for any --minute-seconds
                    script.append(QUESTIONS[turns % len(QUESTIONS)])
                    fake.transcripts.append(QUESTIONS[turns % len(QUESTIONS)].lower())
                    turns += 1
                    if turns * 4.0 >= seconds:
                        break
                script.append("Thanks, goodbye.")
                fake.transcripts.append("thanks goodbye")
                before = await commandstats(server.url)
                start = time.monotonic()
                report = await place_call(
                    cl.lb.url, script=script, auth_token=AUTH_TOKEN,
                    public_base_url=PUBLIC_URL, to=AGENT_NUMBER,
                )  # fmt: skip
                await asyncio.sleep(0.5)  # teardown writes after the caller's last byte
                elapsed = time.monotonic() - start
                after = await commandstats(server.url)
    finally:
        server.close()
    if report.errors or report.violations:
        raise RuntimeError(f"redis-ops call failed:\n{report.format_transcript()}")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta["info"] = delta.get("info", 0) - 1  # our own INFO after
    delta = {k: v for k, v in delta.items() if v > 0}
    total = sum(delta.values())
    minutes = report.duration_s / 60
    answered = sum(1 for t in report.turns if t.caller_text is not None and t.bot_audio_seconds)
    print(
        f"\nRedis cost of one real call: {report.duration_s:.1f} s, {answered} caller turns "
        f"answered, {len(fake.requests_for('chat'))} LLM requests (window {elapsed:.1f} s)"
    )
    print(f"  commands: {total} total = {total / minutes:.0f} per call-minute")
    for name, count in sorted(delta.items(), key=lambda kv: -kv[1]):
        print(f"    {name:24} {count:5}  ({count / minutes:6.1f}/min)")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--minute-seconds", type=float, default=60.0)
    parser.add_argument("--skip-redis-ops", action="store_true")
    args = parser.parse_args()
    configure_logging("console", "warning")
    workdir = Path(tempfile.mkdtemp(prefix="ivr-resume-bench-"))
    print(f"logs and recordings: {workdir}")
    server = RedisServer()
    server.start()
    timings = []
    try:
        for run in range(args.runs):
            timing = await one_resume(workdir, server.url, run)
            print(f"run {run}: drop -> audio again {timing.heard_gap_s * 1000:.1f} ms")
            timings.append(timing)
    finally:
        server.close()
    if timings:
        print_resumes(timings)
    if not args.skip_redis_ops:
        await redis_ops(workdir, args.minute_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
