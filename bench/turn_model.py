"""The Smart Turn v3.2 end-of-turn model on this machine: cost, and what it is worth.

    .venv/bin/python bench/turn_model.py [--runs 40] [--threads 1] [--no-stt]

Prints:
- load time (onnxruntime import + session) and the input features' share of an inference;
- inference latency p50/p95 and CPU seconds per inference, 8 s and 3 s turns, 8 kHz input
  (resampled to 16 kHz as the model needs), one at a time;
- the estimated CPU per call-minute if the model runs at every pause (``--pauses`` per minute);
- accuracy on the fixture set (tests/turn_fixtures.py: 16 finished sentences and the same
  sentences stopped at a mid-sentence pause, by espeak and by piper, through the phone channel);
- what the decision does with a 700 ms and a 1200 ms mid-sentence pause (cut-offs: the turn
  would have ended before the caller went on) and how long a finished sentence waits, for
  silence alone, the model alone, the transcript alone (the words as said, and as whisper
  tiny.en heard them) and both, with the default policy for ``expect: any`` (the model only
  lengthens the wait) and with one that lets the model shorten it (``complete_above=0.95``).

CPU seconds are this process's (all threads). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from turn_fixtures import COMPLETE, PAUSED, espeak_clip, paused_text, piper_clips

from ivr.audio.resample import resample
from ivr.call.turn_end import Completeness, silence_needed_ms, text_completeness
from ivr.callio.turn_policy import TurnPolicy, policy_for
from ivr.engines.smart_turn import SmartTurnModel, features

PAUSE_MS = 700
LONG_PAUSE_MS = 1200
Row = tuple[
    str,
    TurnPolicy,
    tuple[list[float], list[float]] | None,
    list[Completeness] | None,
    list[Completeness] | None,
]
"""label, policy, model probabilities (finished, paused), transcript verdicts (same)"""


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed(fn: Callable[[], object], runs: int) -> tuple[list[float], float]:
    """Wall seconds per run, and CPU seconds per run (process-wide)."""
    fn()  # warm
    walls = []
    cpu0 = time.process_time()
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return walls, (time.process_time() - cpu0) / runs


def cost(runs: int, threads: int, pauses_per_min: float) -> None:
    t0 = time.perf_counter()
    import onnxruntime  # noqa: F401

    t_import = time.perf_counter() - t0
    model = SmartTurnModel(threads=threads)
    t0 = time.perf_counter()
    model.load_sync()
    t_load = time.perf_counter() - t0
    speech = espeak_clip(" ".join(COMPLETE[:6]))  # ~15 s of speech
    t0 = time.perf_counter()
    model.predict(speech, 8000)
    t_first = time.perf_counter() - t0
    print(
        f"load: onnxruntime import {t_import * 1000:.0f} ms, session {t_load * 1000:.0f} ms, "
        f"first inference {t_first * 1000:.0f} ms"
    )
    print(f"inference, 8 kHz input, intra-op threads {threads}, {runs} runs each:")
    cpu_per: dict[float, float] = {}
    for seconds in (8.0, 3.0):
        clip = speech[-round(2 * 8000 * seconds) :]
        walls, cpu = _timed(partial(model.predict, clip, 8000), runs)
        fwalls, fcpu = _timed(partial(features, clip, 8000), runs)
        cpu_per[seconds] = cpu
        print(
            f"  {seconds:.0f} s turn: p50 {_pct(walls, 0.5) * 1000:.1f} ms, "
            f"p95 {_pct(walls, 0.95) * 1000:.1f} ms, CPU {cpu * 1000:.1f} ms/inference "
            f"(features: p50 {_pct(fwalls, 0.5) * 1000:.1f} ms, CPU {fcpu * 1000:.1f} ms)"
        )
    worst = max(cpu_per.values())
    print(
        f"  at {pauses_per_min:g} pauses per call-minute: "
        f"{worst * pauses_per_min:.2f} CPU-s per call-minute (worst case above)"
    )


async def _transcripts(clips: list[bytes]) -> list[str]:
    from ivr.stt.whisper_local import LocalWhisperStt

    stt = LocalWhisperStt()
    await stt.warm()
    try:
        return [(await stt.transcribe(resample(c, 8000, 16000))).text for c in clips]
    finally:
        await stt.aclose()


def _decisions(
    policy: TurnPolicy,
    p_audio: list[float] | None,
    texts: list[Completeness] | None,
    n: int,
) -> list[int]:
    return [
        silence_needed_ms(
            policy,
            None if p_audio is None else p_audio[i],
            "unknown" if texts is None else texts[i],
        )
        for i in range(n)
    ]


def accuracy(model: SmartTurnModel, with_stt: bool) -> None:
    policy = policy_for("any")
    print(
        f"\nfixtures: {len(COMPLETE)} finished sentences, the same stopped at a mid-sentence "
        f"pause; policy expect=any: min {policy.min_silence_ms}, fallback "
        f"{policy.fallback_silence_ms}, max {policy.max_silence_ms} ms"
    )
    for engine in ("espeak", "piper"):
        if engine == "espeak":
            done = [espeak_clip(t) for t in COMPLETE]
            open_ = [espeak_clip(paused_text(t)) for t in PAUSED]
        else:
            done = piper_clips(list(COMPLETE))
            open_ = piper_clips([paused_text(t) for t in PAUSED])
        p_done = [model.predict(c, 8000) for c in done]
        p_open = [model.predict(c, 8000) for c in open_]
        right = sum(p >= 0.5 for p in p_done) + sum(p < 0.5 for p in p_open)
        print(
            f"{engine}: model at 0.5: {right}/{2 * len(COMPLETE)} right "
            f"(finished judged complete {sum(p >= 0.5 for p in p_done)}/{len(p_done)}, "
            f"paused judged incomplete {sum(p < 0.5 for p in p_open)}/{len(p_open)}); "
            f"mean p finished {statistics.mean(p_done):.2f}, paused {statistics.mean(p_open):.2f}"
        )
        said_done = [text_completeness(t, "any") for t in COMPLETE]
        said_open = [text_completeness(t, "any") for t in PAUSED]
        trusting = replace(policy, complete_above=0.95)
        rows: list[Row] = [
            ("silence alone", policy, None, None, None),
            ("model", policy, (p_done, p_open), None, None),
            ("model, shortens >=0.95", trusting, (p_done, p_open), None, None),
            ("words as said", policy, None, said_done, said_open),
            ("model + words as said", policy, (p_done, p_open), said_done, said_open),
        ]
        if with_stt:
            heard_done = [text_completeness(t, "any") for t in asyncio.run(_transcripts(done))]
            heard_open_text = asyncio.run(_transcripts(open_))
            heard_open = [text_completeness(t, "any") for t in heard_open_text]
            print(f"  whisper tiny.en heard the paused clips as: {heard_open_text[:4]} ...")
            rows += [
                ("words as heard", policy, None, heard_done, heard_open),
                ("model + words as heard", policy, (p_done, p_open), heard_done, heard_open),
                ("same, shortens >=0.95", trusting, (p_done, p_open), heard_done, heard_open),
            ]
        n = len(COMPLETE)
        for label, row_policy, probabilities, t_done, t_open in rows:
            p_d, p_o = probabilities or (None, None)
            wait_done = _decisions(row_policy, p_d, t_done, n)
            wait_open = _decisions(row_policy, p_o, t_open, n)
            cut = sum(w <= PAUSE_MS for w in wait_open)
            cut_long = sum(w <= LONG_PAUSE_MS for w in wait_open)
            print(
                f"  {label:24s} pause cut off: {PAUSE_MS} ms {cut:2d}/{n} ({100 * cut / n:3.0f} %),"
                f" {LONG_PAUSE_MS} ms {cut_long:2d}/{n} ({100 * cut_long / n:3.0f} %); "
                f"finished sentence waits: median {statistics.median(wait_done):4.0f} ms, "
                f"mean {statistics.mean(wait_done):4.0f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pauses", type=float, default=6.0, help="pauses per call-minute")
    parser.add_argument("--no-stt", action="store_true", help="skip the whisper transcripts")
    args = parser.parse_args()
    cost(args.runs, args.threads, args.pauses)
    model = SmartTurnModel(threads=args.threads)
    model.load_sync()
    accuracy(model, with_stt=not args.no_stt)


if __name__ == "__main__":
    main()
