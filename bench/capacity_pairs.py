"""Two builds of the gateway loaded at the same time, so the machine's drift hits both alike.

Single runs of ``bench/capacity.py`` spread by ±10 % a turn on the machines we get, and a
machine's speed flips minute to minute (``bench/README.md``): a 5 % change is lost between two
runs a few minutes apart, even interleaved. Here the two builds run at once: two
``capacity.py`` processes, each with its own gateway pinned to the same CPU
(``--gateway-cpus``), its own callers and fake providers on the other, its own Redis database,
the same load. The core then carries both (``--calls 50``: 100 calls on it). Each round prints
both rows; the summary is B - A per round and its mean.

A build is a checkout whose ``ivr`` goes first on the gateway's ``PYTHONPATH`` ('' = this
one's):

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/capacity_pairs.py --a /tmp/base --rounds 3       # ~4.5 min
    .venv/bin/python bench/capacity_pairs.py --a /tmp/base --calls 100      # 200 on the core
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
COLUMNS = (
    ("cpu_ms_per_turn", "CPU/turn ms"),
    ("talk_cpu_per_call_min", "talk s/c-min"),
    ("listen_cpu_per_call_min", "listen s/c-min"),
    ("p95_ms", "p95 ms"),
    ("errors", "errors"),
)


async def capacity_row(build: str, calls: int, redis: str, extra: list[str]) -> dict[str, Any]:
    """One ``capacity.py`` level for ``build``; its row as ``--json`` gives it."""
    cmd = [sys.executable, str(BENCH / "capacity.py"), "--levels", str(calls), "--classic", ""]
    cmd += ["--redis", redis, "--json", *extra]
    if build:
        cmd += ["--env", f"PYTHONPATH={build}"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    text = out.decode()
    start = text.rfind("\n[\n")
    if proc.returncode != 0 or start < 0:
        tail = (err.decode() or text)[-800:]
        raise RuntimeError(f"capacity.py for {build or 'this checkout'} failed: {tail}")
    rows: list[dict[str, Any]] = json.loads(text[start:])
    return rows[0]


def line(name: str, row: dict[str, Any]) -> str:
    return f"  {name}  " + "  ".join(f"{label} {row[key]}" for key, label in COLUMNS)


async def main_async(args: argparse.Namespace) -> int:
    diffs: dict[str, list[float]] = {key: [] for key, _ in COLUMNS}
    base = args.redis.rstrip("/")
    for n in range(args.rounds):
        a, b = await asyncio.gather(
            capacity_row(args.a, args.calls, f"{base}/{args.db}", args.extra),
            capacity_row(args.b, args.calls, f"{base}/{args.db + 1}", args.extra),
        )
        print(f"round {n + 1}: {args.calls} calls each, {2 * args.calls} on the core", flush=True)
        print(line(f"A {args.a or '.'}", a))
        print(line(f"B {args.b or '.'}", b), flush=True)
        for key, _ in COLUMNS:
            diffs[key].append(float(b[key]) - float(a[key]))
    print(f"\nB - A over {args.rounds} round(s), mean [each]:")
    for key, label in COLUMNS:
        values = diffs[key]
        each = " ".join(f"{v:+.3g}" for v in values)
        print(f"  {label:16} {statistics.fmean(values):+.3g}  [{each}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a", required=True, help="build A: a checkout path ('' = this one)")
    p.add_argument("--b", default="", help="build B (default: this checkout)")
    p.add_argument("--calls", type=int, default=50, help="arrival-load calls of each build")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--redis", default="redis://127.0.0.1:6379", help="server; DBs --db, --db+1")
    p.add_argument("--db", type=int, default=1)
    p.add_argument("extra", nargs="*", help="more capacity.py arguments, after --")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
