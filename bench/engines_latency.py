"""Latency of the offline engines on this machine.

    .venv/bin/python bench/engines_latency.py [--runs 5]

TTS: load time, time to first audio, total and CPU seconds for a 2-sentence reply (and a
3-clause one, which piper streams per clause). STT: from end of utterance to text, beam 1
vs 5, on 3 piper utterances sent through the phone channel. Medians over ``--runs``.
CPU seconds are process-wide (all threads), so run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import audioop
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import soxr

from ivr.stt.whisper_local import LocalWhisperStt
from ivr.tts.base import TextToSpeech
from ivr.tts.espeak_local import LocalEspeakTts
from ivr.tts.piper_local import LocalPiperTts

REPLY = (
    "Your current balance is one hundred twenty three dollars and forty five cents. "
    "Is there anything else I can help you with today?"
)
CLAUSES = (
    "Thanks for calling the bank, I can check your balance for you, "
    "or connect you to an agent if you prefer."
)
UTTERANCES = (
    "Yes.",
    "I would like to check my balance.",
    "My account number is four five six seven.",
)


@dataclass(frozen=True, slots=True)
class Run:
    first_s: float
    total_s: float
    cpu_s: float
    audio_s: float


def phone_channel(pcm16: bytes, rate: int) -> bytes:
    """Down to 8 kHz mu-law and back up to 16 kHz PCM16, as a caller's speech arrives."""
    narrow = soxr.resample(np.frombuffer(pcm16, "<i2"), rate, 8000).astype("<i2").tobytes()
    decoded = audioop.ulaw2lin(audioop.lin2ulaw(narrow, 2), 2)
    wide = soxr.resample(np.frombuffer(decoded, "<i2"), 8000, 16000)
    return bytes(np.clip(wide, -32768, 32767).astype("<i2").tobytes())


def median(runs: list[Run], key: Callable[[Run], float]) -> float:
    return statistics.median(key(r) for r in runs)


async def time_tts(tts: TextToSpeech, text: str) -> tuple[Run, bytes]:
    started, cpu = time.perf_counter(), time.process_time()
    first: float | None = None
    chunks: list[bytes] = []
    async for chunk in tts.synthesize(text):
        first = first if first is not None else time.perf_counter() - started
        chunks.append(chunk)
    total = time.perf_counter() - started
    pcm = b"".join(chunks)
    run = Run(first or total, total, time.process_time() - cpu, len(pcm) / 2 / tts.sample_rate)
    return run, pcm


async def bench_tts(label: str, tts: LocalPiperTts | LocalEspeakTts, runs: int) -> None:
    started = time.perf_counter()
    await tts.warm()
    print(f"{label}: load {time.perf_counter() - started:.2f} s")
    for name, text in (("2-sentence reply", REPLY), ("3-clause sentence", CLAUSES)):
        results = [(await time_tts(tts, text))[0] for _ in range(runs)]
        print(
            f"  {name:18s} first audio {median(results, lambda r: r.first_s) * 1000:6.0f} ms"
            f"  total {median(results, lambda r: r.total_s) * 1000:6.0f} ms"
            f"  cpu {median(results, lambda r: r.cpu_s):.2f} s"
            f"  audio {median(results, lambda r: r.audio_s):.2f} s"
        )
    await tts.aclose()


async def bench_stt(beam: int, clips: list[bytes], runs: int) -> None:
    stt = LocalWhisperStt(beam_size=beam)
    started = time.perf_counter()
    await stt.warm()
    print(f"whisper beam {beam}: load {time.perf_counter() - started:.2f} s")
    for words, clip in zip(UTTERANCES, clips, strict=True):
        walls, cpus, text = [], [], ""
        for _ in range(runs):
            cpu = time.process_time()
            heard = await stt.transcribe(clip)
            walls.append(heard.seconds)
            cpus.append(time.process_time() - cpu)
            text = heard.text
        print(
            f"  {len(clip) / 32000:4.1f} s audio  latency {statistics.median(walls) * 1000:5.0f} ms"
            f" (max {max(walls) * 1000:4.0f})  cpu {statistics.median(cpus):.2f} s"
            f"  said {words!r} heard {text!r}"
        )
    await stt.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--piper-threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, runs {args.runs}")
    await bench_tts("espeak", LocalEspeakTts(), args.runs)
    for threads in args.piper_threads:
        await bench_tts(
            f"piper ({threads} onnx thread)", LocalPiperTts(intra_op_threads=threads), args.runs
        )
    voice = LocalPiperTts()
    clips = [phone_channel((await time_tts(voice, u))[1], voice.sample_rate) for u in UTTERANCES]
    await voice.aclose()
    for beam in (1, 5):
        await bench_stt(beam, clips, args.runs)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
