"""The offline demo's turns: end of the caller's speech -> first bot audio, per turn, per run.

Runs ``ivr demo`` (the Harbor Bikes call, every engine offline) ``--runs`` times in a fresh
process each, from this checkout or (``--code DIR``) another one as well (its code and its
flows, ``PYTHONPATH=DIR``, run in ``DIR``; nothing is written there: the recording goes to a
temporary directory). Prints each run's spoken turns as the caller heard them and the gateway's
endpoint silence per turn, then per turn p50 and max over the runs. Issue 22's bar: every turn
<= 1.0 s.

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

HERE = Path(__file__).resolve().parent.parent
LATENCY = re.compile(r"turn latency \(end of caller speech -> first bot audio heard\): (.*)")
BREAKDOWN_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s")
TURNS = ("which bike", "agent question", "goodbye")
"""The demo's spoken caller turns (the first caller turn is a key press)."""


def one_run(code: Path) -> tuple[list[float], list[int]]:
    """(latency per spoken turn as heard, endpoint silence per turn at the gateway) of a run."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(code)}
        cmd = [sys.executable, "-m", "ivr.cli", "demo", "--record", f"{tmp}/call.wav"]
        done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    match = LATENCY.search(done.stdout)
    if done.returncode or match is None:
        raise RuntimeError(f"demo failed ({done.returncode}): {done.stderr[-400:]}")
    heard = [float(x.removesuffix(" s")) for x in match.group(1).split(", ")]
    table = done.stdout.split("per-turn breakdown", 1)[-1].splitlines()
    silences = [int(m.group(2)) for line in table if (m := BREAKDOWN_ROW.match(line))]
    return heard[1:], silences  # the key press is answered at once: not a spoken turn


def measure(label: str, code: Path, runs: int) -> list[list[float]]:
    every = []
    for i in range(runs):
        heard, silences = one_run(code)
        every.append(heard)
        load = os.getloadavg()[0]
        cells = ", ".join(f"{x:.2f}" for x in heard)
        print(f"{label:7} run {i + 1}: {cells} s (endpoint silence {silences} ms, load {load:.2f})")
    return every


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
        results.append(("before", measure("before", Path(args.code).resolve(), args.runs)))
    results.append(("after", measure("after", HERE, args.runs)))
    print("\nend of caller speech -> first bot audio heard, per spoken turn:")
    for label, runs in results:
        summary(label, runs)


if __name__ == "__main__":
    main()
