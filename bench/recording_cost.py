"""What recording costs per call: hook CPU on the event loop, memory while the call lasts, and
render + encode CPU and file size per minute of call, for FLAC and Ogg/Opus.

The call is synthetic but shaped like a real one: espeak-ng speech taking turns on the two
channels with faint line noise on the caller's (about half of each channel is speech).

    .venv/bin/python bench/recording_cost.py [--minutes 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from audio_fixtures import noise_pcm16, speech_pcm16

from ivr.audio.codec import pcm16_to_ulaw
from ivr.recording.encode import encode
from ivr.recording.recorder import CallRecorder

RATE = 8000
FRAME = 160
BOT_CHUNK = 800  # the player sends 100 ms at a time


class StepClock:
    """Monotonic time advanced by the bench: the call runs as fast as the CPU allows."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def channels(minutes: float) -> tuple[bytes, bytes]:
    """Caller and bot mu-law, turn by turn: one speaks while the other is silent."""
    n = int(minutes * 60 * RATE)
    caller = np.frombuffer(noise_pcm16(minutes * 60, dbfs=-55.0), dtype="<i2").copy()[:n]
    bot = np.zeros(n, dtype=np.int16)
    lines = [
        speech_pcm16(
            "Our opening hours are nine to five on weekdays, and ten to two on Saturdays."
        ),
        speech_pcm16("When are you open on Sundays, and can I book a table for two tonight?"),
    ]
    t, turn = 0, 0
    while t < n:
        line = np.frombuffer(lines[turn % 2], dtype="<i2")
        m = min(line.size, n - t)
        target = bot if turn % 2 == 0 else caller
        target[t : t + m] = line[:m]
        t += m + RATE // 2
        turn += 1
    return pcm16_to_ulaw(caller.tobytes()), pcm16_to_ulaw(bot.tobytes())


def feed(caller: bytes, bot: bytes) -> tuple[CallRecorder, float, int]:
    """Feed a whole call through the hooks; returns the recorder, hook seconds and calls."""
    clock = StepClock()
    recorder = CallRecorder("CA0", "MZ0", max_seconds=4 * 3600, clock=clock)
    spent, hooks = 0.0, 0
    for i in range(len(caller) // FRAME):
        clock.now = i * FRAME / RATE
        start = time.perf_counter()
        recorder.caller_audio(caller[i * FRAME : (i + 1) * FRAME], clock.now)
        if i % 5 == 0:  # a 100 ms chunk of bot audio every fifth frame
            recorder.bot_audio(bot[i * FRAME : i * FRAME + BOT_CHUNK])
            hooks += 1
        spent += time.perf_counter() - start
        hooks += 1
    clock.now = len(caller) / RATE
    recorder.stop()
    return recorder, spent, hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    args = parser.parse_args()
    caller, bot = channels(args.minutes)
    recorder, hook_s, hooks = feed(caller, bot)
    held = len(caller) + len(bot)
    print(f"call: {args.minutes:g} min, {hooks} hook calls")
    print(f"hooks on the event loop: {1e6 * hook_s / hooks:.2f} us per call, "
          f"{1000 * hook_s / args.minutes:.1f} ms CPU per call-minute")  # fmt: skip
    print(f"memory held until the call ends: {held / args.minutes / 1e6:.2f} MB per minute")
    start = time.process_time()
    rendered = recorder.render()
    render_s = time.process_time() - start
    print(f"render (decode both channels): {1000 * render_s / args.minutes:.1f} ms CPU per minute")
    with tempfile.TemporaryDirectory() as folder:
        for fmt, suffix in (("flac", ".flac"), ("opus", ".ogg")):
            path = Path(folder) / f"call{suffix}"
            start = time.process_time()
            size = encode(rendered, path, fmt)  # type: ignore[arg-type]
            cpu = time.process_time() - start
            print(f"{fmt:>4}: {size / args.minutes / 1000:7.1f} kB per minute, "
                  f"encode {1000 * cpu / args.minutes:6.1f} ms CPU per minute")  # fmt: skip


if __name__ == "__main__":
    main()
