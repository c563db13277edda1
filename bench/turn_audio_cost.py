"""CPU a turn's audio conversions cost alone, the way the gateway does them and the way it did
before stop 41, over reply lengths and the chunk sizes the TTS path writes:

* ``stt upload``: the caller's utterance made ready for an OpenAI-compatible STT, twice a turn
  (the transcript speculated at a pause, then the final one): resampled to 16 kHz (before) or
  sent at the line's 8 kHz as it is (``IVR_STT_SAMPLE_RATE``, now);
* ``tts resample``: a reply's 24 kHz PCM to 8 kHz in a stream, ``StreamResampler`` (soxr HQ)
  against soxr MQ, tried at stop 41 and not taken (3-5 % cheaper);
* ``mu-law``: the reply's 8 kHz PCM to mu-law, ``audioop.lin2ulaw`` (before) against the lookup
  table (``ivr.audio.codec.pcm16_to_ulaw``, now).

Each row is CPU-us (``process_time``) per unit, the best of ``--rounds``; in a loaded gateway
each costs ~2x its figure here (caches shared with a hundred calls: ``bench/README.md``).

    .venv/bin/python bench/turn_audio_cost.py
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import numpy as np
import soxr

from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import StreamResampler, _to_pcm16, resample

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

TTS_RATE = 24_000
CHUNKINGS = {
    "40 ms": [0.04],
    "as a reply is read": [0.04] * 4 + [0.16] * 2 + [0.3] * 4 + [1.0] * 100,
    "1 s": [1.0],
}
"""Seconds of 24 kHz audio per chunk, repeated to the reply's length ("as a reply is read": the
start in small reads while the caller's audio fills, then up to a second, ``ivr.call.speech``)."""


def best_us(work: Callable[[], object], rounds: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(repeat):
            work()
        best = min(best, (time.process_time() - t0) / repeat)
    return best * 1e6


def voice(seconds: float, rate: int, seed: int) -> bytes:
    """Speech-like PCM16: noise shaped to a speech level (what the cost depends on is length)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 3000, int(seconds * rate)).clip(-32768, 32767).astype("<i2").tobytes()


def chunks(pcm: bytes, pattern: list[float]) -> list[bytes]:
    out, at, i = [], 0, 0
    while at < len(pcm):
        size = int(pattern[min(i, len(pattern) - 1)] * TTS_RATE) * 2
        out.append(pcm[at : at + size])
        at += size
        i += 1
    return out


def stream_mq(pieces: list[bytes]) -> None:
    """``StreamResampler``'s work with soxr MQ instead of HQ (inline)."""
    stream = soxr.ResampleStream(TTS_RATE, 8000, 1, dtype="float32", quality="MQ")
    for piece in pieces:
        x = np.frombuffer(piece, dtype="<i2").astype(np.float32)
        _to_pcm16(stream.resample_chunk(x))
    stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


def stream_hq(pieces: list[bytes]) -> None:
    resampler = StreamResampler(TTS_RATE, 8000)
    for piece in pieces:
        resampler.push(piece)
    resampler.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    r = args.rounds
    print("CPU-us per unit, best of", r, "rounds (before -> now)")
    print("\nstt upload, per transcript: an utterance of")
    for seconds in (1.0, 3.0, 6.0):
        pcm = voice(seconds, 8000, 1)
        before = best_us(lambda pcm=pcm: resample(pcm, 8000, 16000), r, 20)
        now = best_us(lambda pcm=pcm: resample(pcm, 8000, 8000), r, 20)
        print(f"  {seconds:4.1f} s   {before:8.0f} -> {now:6.0f}")
    print("\ntts resample (HQ, as the gateway does), mu-law (before -> now), per reply of")
    for seconds in (1.0, 5.0, 11.0, 20.0):
        pcm = voice(seconds, TTS_RATE, 2)
        for name, pattern in CHUNKINGS.items():
            pieces = chunks(pcm, pattern)
            hq = best_us(lambda p=pieces: stream_hq(p), r, 3)
            mq = best_us(lambda p=pieces: stream_mq(p), r, 3)
            at_8k = [resample(p, TTS_RATE, 8000) for p in pieces]
            old = best_us(lambda a=at_8k: [audioop.lin2ulaw(x, 2) for x in a], r, 5)
            new = best_us(lambda a=at_8k: [pcm16_to_ulaw(x) for x in a], r, 5)
            print(
                f"  {seconds:4.1f} s in {len(pieces):3d} chunks ({name}):"
                f" resample HQ {hq:5.0f} (MQ {mq:5.0f}), mu-law {old:5.0f} -> {new:5.0f}"
            )


if __name__ == "__main__":
    main()
