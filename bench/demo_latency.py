"""The offline demo's turns: end of the caller's speech -> first bot audio, per turn, per run.

Runs ``ivr demo`` (the Harbor Bikes call, every engine offline) ``--runs`` times in a fresh
process each, from this checkout or (``--code DIR``) another one as well (its code and its
flows, ``PYTHONPATH=DIR``, run in ``DIR``; nothing is written there: the recording goes to a
temporary directory). Prints each run's spoken turns as the caller heard them and the gateway's
endpoint silence per turn, then per turn p50 and max over the runs, and where the agent turn's
time went at the gateway (p50 per stage: endpoint silence, STT, the LLM's first token and first
clause, piper's first piece). Issue 22's bar: every turn <= 1.0 s.

    .venv/bin/python bench/demo_latency.py --runs 3 --code ../old   # before vs after (~7 min)
    .venv/bin/python bench/demo_latency.py --runs 3

The machine is shared: the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ivr.demo import STAGES

HERE = Path(__file__).resolve().parent.parent
LATENCY = re.compile(r"turn latency \(end of caller speech -> first bot audio heard\): (.*)")
BREAKDOWN_ROW = re.compile(r"^\s+(\d+)((?:\s+(?:\d+|-))+)\s*$")
TURNS = ("which bike", "agent question", "goodbye")
"""The demo's spoken caller turns (the first caller turn is a key press)."""


Breakdown = list[dict[str, int]]
"""Per turn at the gateway: milliseconds per stage (a stage that did not run is missing)."""


def one_run(code: Path) -> tuple[list[float], Breakdown]:
    """(latency per spoken turn as heard, the gateway's breakdown per turn) of a run."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(code)}
        cmd = [sys.executable, "-m", "ivr.cli", "demo", "--record", f"{tmp}/call.wav"]
        done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    match = LATENCY.search(done.stdout)
    if done.returncode or match is None:
        raise RuntimeError(f"demo failed ({done.returncode}): {done.stderr[-400:]}")
    heard = [float(x.removesuffix(" s")) for x in match.group(1).split(", ")]
    table = done.stdout.split("per-turn breakdown", 1)[-1].splitlines()
    rows = [m.group(2).split() for line in table if (m := BREAKDOWN_ROW.match(line))]
    stages = [{k: int(v) for k, v in zip(STAGES, row, strict=False) if v != "-"} for row in rows]
    return heard[1:], stages  # the key press is answered at once: not a spoken turn


def measure(label: str, code: Path, runs: int) -> tuple[list[list[float]], list[Breakdown]]:
    every, breakdowns = [], []
    for i in range(runs):
        heard, stages = one_run(code)
        every.append(heard)
        breakdowns.append(stages)
        load = os.getloadavg()[0]
        cells = ", ".join(f"{x:.2f}" for x in heard)
        silences = [turn.get("endpoint_silence") for turn in stages]
        print(f"{label:7} run {i + 1}: {cells} s (endpoint silence {silences} ms, load {load:.2f})")
    return every, breakdowns


def agent_stages(label: str, breakdowns: list[Breakdown]) -> None:
    """Where the agent turn's time went, p50 over the runs (its row: the one with an LLM)."""
    agent = [next((t for t in run if "llm_ttft" in t), None) for run in breakdowns]
    turns = [t for t in agent if t is not None]
    if not turns:
        return
    cells = [
        f"{stage} {statistics.median(t.get(stage, 0) for t in turns):.0f}"
        for stage in STAGES
        if any(stage in t for t in turns)
    ]
    print(f"  {label:7} agent turn at the gateway, p50 ms: " + ", ".join(cells))


def summary(label: str, runs: list[list[float]]) -> None:
    for i, turn in enumerate(TURNS):
        values = [run[i] for run in runs if i < len(run)]
        if values:
            p50, worst = statistics.median(values), max(values)
            print(f"  {label:7} {turn:15} p50 {p50:.2f} s  max {worst:.2f} s")
    worst_turns = [max(run) for run in runs if run]
    within = sum(x <= 1.0 for x in worst_turns)
    print(f"  {label:7} runs with every turn <= 1.0 s: {within}/{len(runs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--code", help="another checkout to compare with (a path to its checkout)")
    args = parser.parse_args()
    results = []
    if args.code:
        results.append(("before", *measure("before", Path(args.code).resolve(), args.runs)))
    results.append(("after", *measure("after", HERE, args.runs)))
    print("\nend of caller speech -> first bot audio heard, per spoken turn:")
    for label, runs, breakdowns in results:
        summary(label, runs)
        agent_stages(label, breakdowns)


if __name__ == "__main__":
    main()
