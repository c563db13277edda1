"""Answering machine detection on the labelled callee fixtures: accuracy, how soon it decides,
how close to the beep a voicemail can start, and what it costs per call.

    .venv/bin/python bench/amd.py [--repeat 5]

Accuracy is on synthetic fixtures (espeak-ng greetings through the phone channel, tones for
beeps, brown and white line noise: tests/amd_fixtures.py), not on recordings of real people and
voicemail boxes. CPU (``process_time``, best of ``--repeat``) until the detector is done (a
person: at the decision; a machine: at the end of its beep), three ways: the detector alone in
100 ms batches; the call's watch as the session feeds it (20 ms taps, analysed on the event loop
every 100 ms); and, for comparison, the same batches each handed to a worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from amd_fixtures import CALLEES, callee_audio

from ivr.audio.amd import AnsweringMachineDetector
from ivr.control.answer import AnswerWatch
from ivr.obs.logging import configure_logging

BATCH = 320 * 5


def detect(pcm16: bytes) -> tuple[AnsweringMachineDetector, float]:
    detector = AnsweringMachineDetector()
    t0 = time.process_time()
    for i in range(0, len(pcm16), BATCH):
        detector.push(pcm16[i : i + BATCH])
        if detector.done:
            break
    return detector, time.process_time() - t0


async def watch_cost(pcm16: bytes) -> float:
    """CPU of a call's watch as the session feeds it: one 20 ms payload per tap."""
    watch = AnswerWatch()
    t0 = time.process_time()
    for i in range(0, len(pcm16), 320):
        watch.feed(pcm16[i : i + 320])
    return time.process_time() - t0


async def thread_cost(pcm16: bytes) -> float:
    """The same analysis with each 100 ms batch handed to a worker thread (the alternative
    not taken), paced at 5 ms a batch so that each hop wakes the loop like a real one."""
    detector = AnsweringMachineDetector()
    t0 = time.process_time()
    for i in range(0, len(pcm16), BATCH):
        await asyncio.to_thread(detector.push, pcm16[i : i + BATCH])
        if detector.done:
            break
        await asyncio.sleep(0.005)
    return time.process_time() - t0


async def min_costs(pcm16: bytes, repeat: int) -> tuple[float, float]:
    await asyncio.to_thread(lambda: None)  # the executor's thread exists, as in a gateway
    watched = min([await watch_cost(pcm16) for _ in range(repeat)])
    threaded = min([await thread_cost(pcm16) for _ in range(repeat)])
    return watched, threaded


def main() -> None:
    configure_logging("console", "warning")
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    right = 0
    rows = []
    cpu: list[float] = []
    cpu_watch: list[float] = []
    cpu_thread: list[float] = []
    per_frame: list[float] = []
    after_speech: list[float] = []
    beep_lag: list[float] = []
    for callee in CALLEES:
        audio = callee_audio(callee)
        runs = [detect(audio.pcm16) for _ in range(args.repeat)]
        detector, _ = runs[0]
        spent = min(s for _, s in runs)
        watched, threaded = asyncio.run(min_costs(audio.pcm16, args.repeat))
        cpu_thread.append(threaded)
        cpu.append(spent)
        cpu_watch.append(watched)
        per_frame.append(spent / max(1, detector.frames))
        decision = detector.decision
        ok = decision is not None and decision.answered_by == callee.kind
        right += ok
        if callee.kind == "human" and decision is not None:
            after_speech.append(decision.at_s - audio.speech_end_s)
        end = detector.greeting_end
        if end is not None and audio.beep_end_s is not None:
            beep_lag.append(end.at_s - audio.beep_end_s)
        rows.append(
            f"{callee.name:18} {callee.kind:8} -> "
            f"{decision.answered_by if decision else '-':8} {'ok' if ok else 'WRONG':5} "
            f"at {decision.at_s if decision else 0:5.2f} s "
            f"({decision.reason if decision else ''}), "
            f"greeting end {end.at_s if end else 0:5.2f} s beep {end.beep_hz if end else None}, "
            f"{detector.frames} frames, {spent * 1000:.2f} ms CPU"
        )
    print("\n".join(rows))
    n = len(CALLEES)
    humans = sum(c.kind == "human" for c in CALLEES)
    print(
        f"\naccuracy: {right}/{n} ({100 * right / n:.0f} %): {humans} people, {n - humans} machines"
    )
    print(
        f"person decided after they stopped speaking: median {statistics.median(after_speech):.2f}"
        f" s, max {max(after_speech):.2f} s"
    )
    print(
        f"voicemail may start after the beep ended: median {statistics.median(beep_lag) * 1000:.0f}"
        f" ms, max {max(beep_lag) * 1000:.0f} ms"
    )
    print(
        f"CPU per call, detector alone: median {statistics.median(cpu) * 1000:.2f} ms, "
        f"max {max(cpu) * 1000:.2f} ms "
        f"({statistics.median(per_frame) * 1e6:.1f} us per 20 ms frame)"
    )
    print(
        f"CPU per call, the call's watch (tap + detector, on the loop): "
        f"median {statistics.median(cpu_watch) * 1000:.2f} ms, max {max(cpu_watch) * 1000:.2f} ms"
    )
    print(
        f"CPU per call if each 100 ms batch went to a worker thread: "
        f"median {statistics.median(cpu_thread) * 1000:.2f} ms, "
        f"max {max(cpu_thread) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
