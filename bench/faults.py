"""Provider fault suite (issue 8): one real call per single provider fault, and what the caller
heard on the faulted turn.

Each row is a call to a real ``ivr serve`` process with the production provider stack (STT, LLM
and TTS over OpenAI's wire formats, retries, stage limits; ``[fallback]`` rows also have a
healthy IVR_*_FALLBACK_BASE_URL) against ``FakeOpenAIServer``s in this process (answer times
STT 150 / LLM 200 / TTS 100 ms). The caller speaks three lines; the fault hits every request of
one stage during the second turn only (see tests/fault_calls.py for how, and how the caller's
recording is read).

    .venv/bin/python bench/faults.py                   # every fault, ~3.5 min
    .venv/bin/python bench/faults.py --only "tts stall" --lanes 2
    .venv/bin/python bench/faults.py --no-fallback --json
    .venv/bin/python bench/faults.py --infra           # Redis and instance faults, ~2 min
    .venv/bin/python bench/faults.py --infra --only redis

Targets (issue 8): the caller hears a reply or the apology within 1.5 s of the end of their
speech, no dead air over 2 s, the call goes on.

``--infra`` runs tests/infra_faults.py instead: Redis paused (SIGSTOP), black-holed and killed
for 10 s mid-call (from the moment the call's second question reaches speech recognition), the
instance carrying a call SIGTERMed (drain) and SIGKILLed mid-reply, and its stream handshake or
its voice webhook replayed, on two ``ivr serve`` processes behind HAProxy
(deploy/haproxy/haproxy.cfg). Columns: heard after (the faulted turn: end of caller speech ->
first bot audio; "drop": the call's stream dropped -> audio again), the longest dead air of the
faulted call, whether its next turn was answered, calls dropped (of those placed in the case),
new calls answered during the fault, payments the backend made (of paying calls: must be 1
each), records complete in Redis after the fault, most streams one call had (more than 2 is a
resume loop), fewest gateways HAProxy kept in rotation during a Redis fault, and the HTTP
status of each replayed handshake (HAProxy, gw-1, gw-2; for the webhook replay: the handshake
of the stream its answer named). Targets: 0 calls dropped, new calls answered on either
instance, records complete, one payment; SIGKILL: audio again within 1 s; replays refused
(4xx) with the real call unaffected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fault_calls import (
    HEARD_WITHIN_S,
    MAX_DEAD_AIR_S,
    Delays,
    FaultResult,
    all_cases,
    run_cases,
)
from infra_faults import CASES as INFRA_CASES
from infra_faults import HEADER as INFRA_HEADER
from infra_faults import format_row as infra_row
from infra_faults import format_table as infra_table
from infra_faults import run_infra_cases

from ivr.config import Settings

COLUMNS = (
    ("fault", 38),
    ("heard after", 11),
    ("heard", 30),
    ("dead air", 12),
    ("next", 4),
    ("requests", 8),
    ("counted", 22),
    ("targets", 7),
)


def row(r: FaultResult) -> list[str]:
    after = "never" if r.heard_after_s is None else f"{r.heard_after_s:.2f} s"
    requests = str(r.requests) + (f"+{r.fallback_requests}fb" if r.fallback else "")
    counted = ", ".join(
        f"{k.split('/')[0]}/{k.split('/')[2]}{'(fb)' if 'fallback' in k else ''} {v:g}"
        for k, v in sorted(r.counted.items())
    )
    return [
        r.fault,
        after,
        r.heard,
        f"{r.dead_air_s:.2f} s (t{r.dead_air_turn})",
        "yes" if r.next_turn else "NO",
        requests,
        counted or "-",
        "ok" if not r.misses else "MISS",
    ]


def print_header() -> None:
    print("  ".join(f"{name:{width}}" for name, width in COLUMNS))
    print("  ".join("-" * width for _, width in COLUMNS))


def print_row(r: FaultResult) -> None:
    cells = row(r)
    print("  ".join(f"{c:{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)), flush=True)


def print_misses(results: list[FaultResult]) -> None:
    missed = [r for r in results if r.misses]
    print(
        f"\n{len(results) - len(missed)} of {len(results)} rows meet the targets "
        f"(answer within {HEARD_WITHIN_S} s, dead air <= {MAX_DEAD_AIR_S} s, call goes on, "
        "fault counted)."
    )
    for r in missed:
        print(f"  {r.fault}: " + "; ".join(r.misses))


def limits_line() -> str:
    s = Settings(stt_provider="openai", llm_api_key="x", tts_provider="openai")
    return (
        f"limits: STT answer {s.stt_answer_timeout:g} s, LLM first token "
        f"{s.llm_first_token_limit:g} s / stall {s.llm_stall_limit:g} s, TTS first byte "
        f"{s.tts_first_byte_timeout:g} s / stall {s.tts_stall_timeout:g} s; "
        f"endpoint silence {s.endpoint_silence_ms} ms"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="run rows whose name contains this (any case)")
    p.add_argument("--no-fallback", action="store_true", help="skip the [fallback] rows")
    p.add_argument("--lanes", type=int, default=5, help="gateways running calls side by side")
    p.add_argument("--vad", default="silero", choices=("silero", "webrtc"))
    p.add_argument("--stt-ms", type=int, default=150, help="fake STT answer time")
    p.add_argument("--llm-ms", type=int, default=200, help="fake LLM time to first token")
    p.add_argument("--tts-ms", type=int, default=100, help="fake TTS time to first byte")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument(
        "--infra",
        action="store_true",
        help=f"Redis and instance faults instead ({', '.join(INFRA_CASES)}; --only filters)",
    )
    return p.parse_args(argv)


async def infra_async(args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in INFRA_CASES if args.only.lower() in n]
    if not names:
        raise SystemExit(f"no infra fault matches --only {args.only!r}")
    load0, t0 = os.getloadavg(), time.monotonic()
    print(f"{len(names)} infrastructure faults on one stack, one after another\n")
    print(INFRA_HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="ivr-infra-faults-") as tmp:
        workdir = Path(os.environ.get("IVR_BENCH_DIR", tmp))
        workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any call
        results = await run_infra_cases(
            workdir, names, on_result=lambda r: print(infra_row(r), flush=True)
        )
    elapsed = time.monotonic() - t0
    print("\nInfrastructure faults (two gateways behind HAProxy, Redis behind a proxy)")
    print(infra_table(results))
    print(f"\n{elapsed:.0f} s; load average start {load0}, end {os.getloadavg()}")
    return {
        "results": [asdict(r) | {"misses": r.misses()} for r in results],
        "elapsed_s": round(elapsed, 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cases = [
        c for c in all_cases(fallback=not args.no_fallback) if args.only.lower() in c.label.lower()
    ]
    if not cases:
        raise SystemExit(f"no fault matches --only {args.only!r}")
    delays = Delays(args.stt_ms / 1000, args.llm_ms / 1000, args.tts_ms / 1000)
    load0, t0 = os.getloadavg(), time.monotonic()
    print(f"{len(cases)} faulted calls on up to {args.lanes} gateways; {limits_line()}")
    print("(rows print as calls finish; the table in suite order follows)\n")
    print_header()
    with tempfile.TemporaryDirectory(prefix="ivr-faults-") as tmp:
        workdir = Path(os.environ.get("IVR_BENCH_DIR", tmp))
        workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any call
        results = await run_cases(
            cases, workdir, lanes=args.lanes, delays=delays, vad=args.vad, on_result=print_row
        )
    elapsed = time.monotonic() - t0
    print(f"\nProvider faults on turn 2 of 3 (fake delays ms: {asdict(delays)}, VAD {args.vad})")
    print_header()
    for r in results:
        print_row(r)
    print_misses(results)
    load1 = os.getloadavg()
    print(f"\n{elapsed:.0f} s; load average start {load0}, end {load1} on {os.cpu_count()} CPUs")
    return {
        "delays_ms": {k: round(v * 1000) for k, v in asdict(delays).items()},
        "vad": args.vad,
        "targets": {"heard_within_s": HEARD_WITHIN_S, "max_dead_air_s": MAX_DEAD_AIR_S},
        "results": [asdict(r) for r in results],
        "elapsed_s": round(elapsed, 1),
        "loadavg": [load0, load1],
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> KeyboardInterrupt, so the gateway processes are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        out = asyncio.run(infra_async(args) if args.infra else main_async(args))
        if args.json:
            print(json.dumps(out, indent=2))
        return 0
    return 130


if __name__ == "__main__":
    raise SystemExit(main())
