"""Hold-probe benchmark: what a real STT makes of the first few hundred ms of caller speech.

While the bot holds on over a caller's sound (their backchannel habit, or a node's raised
``min_speech_ms``), the gateway transcribes the sound's audio so far once its speech spans
``HOLD_PROBE_MS`` (``ivr.call.barge_in``) and pauses the bot at once if the words are more than
backchannel. The later the request, the more words it has, and the later the bot stops.
The earlier, the likelier a real STT mishears a fragment: a backchannel heard as a word
("you") pauses the bot for nothing, and a sentence heard as nothing (or "Oh") waits for the
hold to run out.

This asks a real STT (the offline whisper tiny.en, the gateway's own engine, int8 on CPU).
For each clip (backchannels and interruptions, in espeak's and piper's voices), the audio
goes through the phone channel (8 kHz mu-law) and the gateway's endpointer (Silero VAD, its
pre-roll), and at each probe point the endpointer's ``utterance_audio()``, exactly what the
gateway would send, is transcribed and judged with the default interruption policy.

Per probe point it prints: backchannels taken for a real turn (each a needless pause), the
interruptions taken for one (each stopped at the probe rather than at the hold's end), and
the local decode time. A cloud STT (the issue's 150 ms) and the endpointer's onset lag come on
top of the probe point for when the bot stops.

    .venv/bin/python bench/hold_probe.py                      # probes at 200, 300, 400, 500 ms
    .venv/bin/python bench/hold_probe.py --probes-ms 250,300 --voices piper --verbose
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog
from interruptions import BACKCHANNELS as BENCH_BACKCHANNELS
from interruptions import PLAIN_REAL, REAL

from ivr.audio.codec import FRAME_BYTES_PCM16, pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.endpointer import EndpointConfig, Endpointer, SpeechEnded
from ivr.audio.resample import resample
from ivr.audio.vad import SileroVad
from ivr.callio.interruption_policy import DEFAULT_POLICY
from ivr.stt.whisper_local import LocalWhisperStt
from ivr.testing.audio import piper_voice
from ivr.tts.espeak_local import synthesize_pcm16

BACKCHANNELS = (*BENCH_BACKCHANNELS, "right", "sure", "got it", "oh okay")
INTERRUPTIONS = tuple(
    dict.fromkeys(
        (
            *REAL,
            *PLAIN_REAL,
            "No, that is wrong.",
            "Yeah, but I asked about my bill.",  # starts as a backchannel: the hold's end decides
            "Okay, wait, that is not right.",
        )
    )
)
LEAD_S = 0.4
"""Quiet line before the caller speaks (the endpointer's pre-roll fills from it)."""
NOISE_DBFS = -60.0
"""A phone line is never digitally silent: low noise under everything."""


Synthesize = Callable[[str], tuple[bytes, int]]


@dataclass(slots=True)
class Probe:
    text: str
    voice: str
    backchannel: bool
    heard: dict[int, str] = field(default_factory=dict)
    """Probe point (ms of speech span) -> the STT's words."""
    decode_s: dict[int, float] = field(default_factory=dict)


def phone_line(pcm16: bytes, rate: int, seed: int) -> bytes:
    """``pcm16`` at ``rate`` as the gateway receives it: 8 kHz mu-law round trip, after
    LEAD_S of line noise, with line noise under it, in whole 20 ms frames."""
    x = np.frombuffer(resample(pcm16, rate, 8000), dtype="<i2").astype(np.float64)
    x = np.concatenate((np.zeros(round(LEAD_S * 8000)), x, np.zeros(8000)))
    rng = np.random.default_rng(seed)
    x += rng.normal(0.0, 32768 * 10 ** (NOISE_DBFS / 20), x.size)
    frames = x.size // (FRAME_BYTES_PCM16 // 2)
    pcm = np.clip(x[: frames * FRAME_BYTES_PCM16 // 2], -32768, 32767).astype("<i2").tobytes()
    return ulaw_to_pcm16(pcm16_to_ulaw(pcm))


def audio_at_spans(pcm16_8k: bytes, spans_ms: list[int]) -> dict[int, bytes]:
    """What the gateway would send the STT when the speech's span first reaches each of
    ``spans_ms``: the endpointer's utterance audio (pre-roll included) at that frame. A
    clip whose speech ends sooner gives its whole utterance for the later points."""
    endpointer = Endpointer(SileroVad(), EndpointConfig())
    out: dict[int, bytes] = {}
    last = b""
    for i in range(0, len(pcm16_8k) - FRAME_BYTES_PCM16 + 1, FRAME_BYTES_PCM16):
        event = endpointer.push(pcm16_8k[i : i + FRAME_BYTES_PCM16], i / 16000)
        if endpointer.in_speech:
            last = endpointer.utterance_audio()
            for span in spans_ms:
                if span not in out and endpointer.speech_span_ms >= span:
                    out[span] = last
        if isinstance(event, SpeechEnded):
            break
    endpointer.close()
    return {span: out.get(span, last) for span in spans_ms}


async def run(args: argparse.Namespace) -> list[Probe]:
    spans = [int(p) for p in args.probes_ms.split(",")]
    texts = list(BACKCHANNELS) + list(INTERRUPTIONS)
    voices: dict[str, Synthesize] = {}
    for voice in args.voices.split(","):
        voices[voice] = synthesize_pcm16 if voice == "espeak" else await piper_voice(texts)
    stt = LocalWhisperStt(cpu_threads=2)
    await stt.warm()
    probes: list[Probe] = []
    try:
        for voice, synthesize in voices.items():
            for n, text in enumerate(texts):
                probe = Probe(text, voice, text in BACKCHANNELS)
                pcm, rate = synthesize(text)
                at = audio_at_spans(phone_line(pcm, rate, seed=n), spans)
                for span, audio in at.items():
                    started = time.perf_counter()
                    heard = await stt.transcribe(resample(audio, 8000, stt.sample_rate))
                    probe.decode_s[span] = time.perf_counter() - started
                    probe.heard[span] = heard.text.strip()
                probes.append(probe)
                if args.verbose:
                    print(f"{voice:<7} {text!r}: {probe.heard}")
    finally:
        await stt.aclose()
    return probes


def report(probes: list[Probe], spans: list[int]) -> None:
    print(f"\n{'probe at':>9} {'voice':<7} {'backchannels taken for a turn':>30} "
          f"{'interruptions taken for one':>28} {'decode p50':>11}")  # fmt: skip
    for span in spans:
        for voice in sorted({p.voice for p in probes}):
            mine = [p for p in probes if p.voice == voice]
            bc = [p for p in mine if p.backchannel]
            real = [p for p in mine if not p.backchannel]
            bc_real = sum(DEFAULT_POLICY.is_real_turn(p.heard[span]) for p in bc)
            real_real = sum(DEFAULT_POLICY.is_real_turn(p.heard[span]) for p in real)
            decode = statistics.median(p.decode_s[span] for p in mine) * 1000
            print(
                f"{span:>7}ms {voice:<7} {f'{bc_real} / {len(bc)}':>30} "
                f"{f'{real_real} / {len(real)}':>28} {decode:>9.0f}ms"
            )


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probes-ms", default="200,300,400,500", help="speech spans to probe at")
    parser.add_argument("--voices", default="espeak,piper", help="of: espeak, piper")
    parser.add_argument("--verbose", action="store_true", help="print every transcript")
    args = parser.parse_args()
    started = time.perf_counter()
    probes = await run(args)
    report(probes, [int(p) for p in args.probes_ms.split(",")])
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    asyncio.run(main())
