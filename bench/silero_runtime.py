"""What a run of Silero costs, in numpy (``ivr.audio.silero_net``) and in onnxruntime, by batch
size, alone and with the caches cold as in a loaded gateway.

The gateway judges each caller's 32 ms windows in batches across calls (``SileroBatcher``):
1 window when a lone call speaks or a woken model is primed, ~5-15 under load. Between two runs
in a gateway, the event loop's other work (frames, JSON, base64, the reply's audio) evicts the
model's weights and code; ``--cold`` emulates that by walking 16 MB and a dict list between
runs. Thread CPU time per run, best of ``--rounds`` rounds of ``--runs`` runs, on one CPU.

    .venv/bin/python bench/silero_runtime.py
    .venv/bin/python bench/silero_runtime.py --batches 1,8 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

from ivr.audio.vad import SileroModel


def polluter() -> Callable[[], None]:
    junk = np.ones(4_000_000, np.float32)
    objects = [{"n": i, "s": str(i)} for i in range(100_000)]

    def pollute() -> None:
        junk.sum()
        sum(d["n"] for d in objects[::7])

    return pollute


def cost_us(model: SileroModel, batch: int, runs: int, rounds: int, cold: bool) -> float:
    rng = np.random.default_rng(batch)
    audio = (rng.standard_normal((batch, model.context + model.window)) * 0.1).astype(np.float32)
    states = np.zeros((2, batch, 128), np.float32)
    pollute = polluter() if cold else (lambda: None)
    for _ in range(20):
        model.predict_batch(audio, states)
    best = float("inf")
    for _ in range(rounds):
        spent = 0
        for _ in range(runs):
            pollute()
            t = time.thread_time_ns()
            model.predict_batch(audio, states)
            spent += time.thread_time_ns() - t
        best = min(best, spent / runs / 1000)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,2,4,8,12,16,32", help="windows a run")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", type=int, default=0, help="the CPU to run on")
    args = p.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    models = [SileroModel(8000, runtime="onnxruntime"), SileroModel(8000, runtime="numpy")]
    print("Silero v5 at 8 kHz, us a run (us a window), thread CPU time, best of rounds")
    heads = ("windows", "warm: onnxruntime", "numpy", "cold: onnxruntime", "numpy")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (7, 18, 14, 18, 14), strict=True)))
    for batch in (int(b) for b in args.batches.split(",")):
        cells = []
        for cold in (False, True):
            for model in models:
                us = cost_us(model, batch, args.runs, args.rounds, cold)
                cells.append(f"{us:7.0f} ({us / batch:4.0f})")
        print(f"{batch:>7} {cells[0]:>18} {cells[1]:>14} {cells[2]:>18} {cells[3]:>14}")


if __name__ == "__main__":
    main()
