"""Offline whisper, greedy (beam 1) against beam search (beam 5, the gateway's): what each
hears, how fast, and what its last-word probability tells the end-of-turn rules.

Same clips for both: the 16 finished sentences of ``tests/turn_fixtures.py``, the demo call's
spoken steps (with its vocabulary prompt, as ``ivr demo`` runs) and three short answers, in
espeak's voice and in piper's (through the mu-law phone channel, upsampled to 16 kHz by the
gateway's resampler). For each beam size it prints the word error rate (jiwer, after
lower-casing, dropping punctuation and spelling digits out), the decode latency (median, p95)
and CPU seconds per clip, then the last-word probability on the finished
sentences and on the same sentences stopped at their mid-sentence pause (60 ms in, as
speculation transcribes them), and how many of each fall under ``UNSURE_LAST_WORD``: a paused
clip under it waits longer (good), a finished one under it waits longer too (the cost).

    .venv/bin/python bench/whisper_beam.py [--runs 3]
    .venv/bin/python bench/whisper_beam.py --window     # beam 5: 30 s window vs utterance + 1 s

Run it on an otherwise idle machine: CPU seconds are process-wide.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jiwer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from turn_fixtures import COMPLETE, PAUSED, espeak_clip, paused_text, piper_clips

from ivr.audio.resample import resample
from ivr.call.turn_end import UNSURE_LAST_WORD
from ivr.control.summary import percentile
from ivr.demo import DEMO_STEPS, DEMO_VOCABULARY
from ivr.stt.whisper_local import LocalWhisperStt

SHORT_ANSWERS = ("Yes.", "No, thank you.", "Two.")
TAIL_TO_60_MS = 2 * round(8000 * 0.14)  # the fixtures' 200 ms of pause -> 60 ms
_DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@dataclass(frozen=True, slots=True)
class Clip:
    voice: str
    said: str
    pcm16_8k: bytes
    prompt: str | None = None
    paused: bool = False


@dataclass(slots=True)
class Heard:
    clip: Clip
    text: str = ""
    probability: float | None = None
    latencies: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def normalise(text: str) -> str:
    """Lower case, no punctuation, digits spelled out one by one ("456" -> "four five six")."""
    text = re.sub(r"\d", lambda m: f" {_DIGITS[int(m.group())]} ", text.lower())
    text = re.sub(r"[^a-z' ]+", " ", text.replace("’", "'"))
    return " ".join(text.split())


def clips() -> list[Clip]:
    spoken_steps = [s for s in DEMO_STEPS if isinstance(s, str)]
    plain = list(COMPLETE) + list(SHORT_ANSWERS)
    paused = [paused_text(cut) for cut in PAUSED]
    out: list[Clip] = []
    for voice, render in (
        ("espeak", lambda texts: [espeak_clip(t) for t in texts]),
        ("piper", piper_clips),
    ):
        out += [Clip(voice, t, c) for t, c in zip(plain, render(plain), strict=True)]
        out += [
            Clip(voice, t, c, prompt=DEMO_VOCABULARY)
            for t, c in zip(spoken_steps, render(spoken_steps), strict=True)
        ]
        out += [
            Clip(voice, cut, c[:-TAIL_TO_60_MS], paused=True)
            for cut, c in zip(PAUSED, render(paused), strict=True)
        ]
    return out


async def decode_all(
    beam: int, prompt: str | None, todo: list[Clip], runs: int, short: bool = False
) -> list[Heard]:
    stt = LocalWhisperStt(beam_size=beam, prompt=prompt, short_window=short)
    await stt.warm()
    heard = []
    try:
        for clip in todo:
            result = Heard(clip)
            audio = resample(clip.pcm16_8k, 8000, stt.sample_rate)
            for _ in range(runs):
                cpu = time.process_time()
                transcript = await stt.transcribe(audio)
                result.cpu.append(time.process_time() - cpu)
                result.latencies.append(transcript.seconds)
                result.text, result.probability = transcript.text, transcript.last_word_probability
            heard.append(result)
    finally:
        await stt.aclose()
    return heard


async def decode(beam: int, every: list[Clip], runs: int, short: bool = False) -> list[Heard]:
    plain = [c for c in every if c.prompt is None]
    primed = [c for c in every if c.prompt is not None]
    return await decode_all(beam, None, plain, runs, short) + await decode_all(
        beam, DEMO_VOCABULARY, primed, runs, short
    )


def report(beam: int, heard: list[Heard], window: str = "30 s") -> None:
    print(f"\nwhisper tiny.en, beam {beam}, encoder window {window}")
    for voice in ("espeak", "piper"):
        finished = [h for h in heard if h.clip.voice == voice and not h.clip.paused]
        wer = jiwer.wer(
            [normalise(h.clip.said) for h in finished], [normalise(h.text) for h in finished]
        )
        latencies = [x for h in finished for x in h.latencies]
        cpu = [x for h in finished for x in h.cpu]
        exact = sum(normalise(h.clip.said) == normalise(h.text) for h in finished)
        print(
            f"  {voice:6s} WER {wer * 100:5.1f} %  exact {exact}/{len(finished)}"
            f"  latency p50 {statistics.median(latencies) * 1000:4.0f} ms"
            f" p95 {percentile(latencies, 0.95) * 1000:4.0f} ms"
            f"  cpu p50 {statistics.median(cpu):.2f} s"
        )
        for h in finished:
            if normalise(h.clip.said) != normalise(h.text):
                print(f"      said {h.clip.said!r:62s} heard {h.text!r}")
        for kind, group in (
            ("finished", [h for h in finished if h.clip.said in COMPLETE]),
            ("paused", [h for h in heard if h.clip.voice == voice and h.clip.paused]),
        ):
            probs = [h.probability for h in group if h.probability is not None]
            unsure = sum(p < UNSURE_LAST_WORD for p in probs)
            mean = statistics.mean(probs) if probs else float("nan")
            print(
                f"    last word, {kind:8s}: mean p {mean:.2f}, under {UNSURE_LAST_WORD}:"
                f" {unsure}/{len(group)}, no probability: {len(group) - len(probs)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="decodes per clip (latency)")
    parser.add_argument(
        "--window",
        action="store_true",
        help="beam 5 with whisper's 30 s window against the short one (utterance + 1 s, >= 10 s)",
    )
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, runs {args.runs}")
    every = clips()  # before the event loop: piper's renderer runs its own
    if args.window:
        for short in (False, True):
            heard = asyncio.run(decode(5, every, args.runs, short))
            report(5, heard, "utterance + 1 s, >= 10 s" if short else "30 s")
    else:
        for beam in (1, 5):
            report(beam, asyncio.run(decode(beam, every, args.runs)))
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
