"""The gateway's echo check alone, offline: what each impairment of a real line does to its
correlation (issue 22). Seconds, not minutes: for iterating on ``ivr.audio.echo``.

The bot's reply (piper at -23 dBFS, as ``bench/echo.py`` speaks it) plays on a simulated
Twilio playout; the caller's line carries it back through ``ivr.sim.echo.LineEcho`` (100 ms,
mu-law both ways), and the gateway's ``FarEndReference`` is filled the way its player fills
it: in 40 ms chunks, each placed where the gateway thinks it started playing, which is off
from where Twilio really started it by 0..``misplaced`` samples (a chunk sent to an idle
queue: Twilio starts it on its next frame tick, or after the network's jitter). Every 20 ms
the gateway's ``check_echo`` judges the caller's last 240 ms (skipping quiet ones, as
``BargeInJudge`` does). Per row: the correlation's p10/p50/p90, the share of checks under the
threshold (0.6; one of those while the bot talks pauses it), and the delay found; then when the
call's echo path was learned (``EchoPath``: sure matches, whitened or raw, agreeing on a delay)
and the share of checks that neither the correlation nor the learned path took for echo (with
no caller level to go by: the caller has not spoken yet, as under a greeting).

    .venv/bin/python bench/echo_check.py                 # every row (~20 s)
    .venv/bin/python bench/echo_check.py --voice espeak
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from dataclasses import dataclass

import numpy as np

from ivr.audio.echo import EchoPath, check_echo
from ivr.audio.far_end import FarEndReference
from ivr.callio.interruption_policy import DEFAULT_POLICY
from ivr.sim.echo import LineEcho, level_dbfs
from ivr.sim.playout import TwilioPlayout, ulaw_decode, ulaw_encode
from ivr.testing.echo_call import Voices

RATE = 8000
CHUNK = 320  # 40 ms
WINDOW = 1920  # the judge's 240 ms
T0 = 100.0


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    echo: LineEcho
    misplaced: int = 0
    """Each 40 ms chunk of the reference is off by 0..this many samples (uniform)."""


ROWS = (
    Row("exact copy, echo -43 dBFS (the issue)", LineEcho(0.1, -20.0)),
    Row("exact copy, echo -33 dBFS", LineEcho(0.1, -10.0)),
    *(Row(f"line noise {n} dBFS", LineEcho(0.1, -20.0, noise_dbfs=n)) for n in (-65, -55, -45)),
    Row("line noise -55, echo -33 dBFS", LineEcho(0.1, -10.0, noise_dbfs=-55.0)),
    Row("delay +1/4 sample", LineEcho(0.10003125, -20.0)),
    Row("delay +1/2 sample", LineEcho(0.1000625, -20.0)),
    Row("band-limited 300-3400 Hz", LineEcho(0.1, -20.0, band_limit=True)),
    Row("clipped at -15 dBFS", LineEcho(0.1, -20.0, clip_dbfs=-15.0)),
    *(Row(f"chunks misplaced 0..{k} samples", LineEcho(0.1, -20.0), k) for k in (1, 2, 8, 40)),
    Row("phone: band, clip, noise -55", LineEcho(0.1, -20.0, True, -15.0, -55.0)),
)


def ulaw(x: np.ndarray) -> bytes:
    return ulaw_encode(np.clip(np.rint(x), -32768, 32767).astype("<i2").tobytes())


@dataclass(slots=True)
class Measured:
    corr: np.ndarray
    delay_ms: np.ndarray
    missed_with_path: np.ndarray
    """Per check: neither the correlation nor the call's learned echo path took it for echo."""
    learned_after_s: float | None
    """When the echo path was learned, from the reply's start."""


def measure(row: Row, bot: np.ndarray, seed: int) -> Measured:
    """Every non-quiet check over the reply, as ``BargeInJudge`` makes them (no caller level:
    the caller has not spoken yet, as during a greeting)."""
    rng = np.random.default_rng(seed)
    played = ulaw(bot)
    playout = TwilioPlayout("MZ1", t0=T0)
    reference = FarEndReference(history_s=len(played) / RATE + 2)
    for at in range(0, len(played), CHUNK):
        chunk = played[at : at + CHUNK]
        body = {"payload": base64.b64encode(chunk).decode()}
        message = {"event": "media", "streamSid": "MZ1", "media": body}
        playout.receive(json.dumps(message), now=T0 + at / RATE)  # back to back
        off = int(rng.integers(0, row.misplaced + 1)) if row.misplaced else 0
        reference.played(T0 + (at - off) / RATE, chunk)
    silence = bytes([0xFF]) * 160
    ends = range(160, len(played) + 2 * RATE, 160)
    line = b"".join(row.echo.mix_frame(silence, playout, end).ulaw for end in ends)
    near = np.frombuffer(ulaw_decode(line), dtype="<i2").astype(np.float64)
    corr, delay, missed = [], [], []
    path, learned = EchoPath(), None
    threshold = DEFAULT_POLICY.echo_threshold
    for end in range(WINDOW, near.size, 160):
        window = near[end - WINDOW : end]
        if level_dbfs(window[-RATE // 10 :]) < -50.0:  # the judge's QUIET
            continue
        at = T0 + end / RATE
        check = check_echo(window, at, reference)
        if check.far_db > -55.0:
            path.learn(check, WINDOW, at, reference)
            if learned is None and path.delay_s is not None:
                learned = end / RATE
            corr.append(check.correlation)
            delay.append(1000 * check.delay_s)
            floor = _noise_floor(near[max(0, end - 5 * RATE) : end])
            echo = check.is_echo(threshold) or path.explains(window, at, reference, floor)
            missed.append(not echo)
    return Measured(np.array(corr), np.array(delay), np.array(missed), learned)


def _noise_floor(x: np.ndarray) -> float:
    """As ``BargeInJudge.noise_power``: the quietest 200 ms (mean square) of ``x``."""
    step = RATE // 5
    windows = x[: x.size - x.size % step].reshape(-1, step)
    return float(np.min(np.mean(windows * windows, axis=1))) if windows.size else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--voice", default="piper", choices=["piper", "espeak"])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    voices = await Voices.render(args.voice)
    pieces = [voices.bot.catalogue.audio_of(t) for t in voices.bot.catalogue.texts]
    bot = np.concatenate([np.concatenate([p, np.zeros(RATE // 4)]) for p in pieces])
    threshold = DEFAULT_POLICY.echo_threshold
    print(
        f"{args.voice} reply, {bot.size / RATE:.1f} s at -23 dBFS; echo 100 ms; "
        f"threshold {threshold}"
    )
    print(
        f"{'line':<40} {'checks':>6} {'corr p10':>8} {'p50':>5} {'p90':>5} {'< thr':>6} "
        f"{'delay p50':>9} {'path after':>10} {'missed':>7}"
    )
    for row in ROWS:
        m = measure(row, bot, args.seed)
        p10, p50, p90 = np.percentile(m.corr, [10, 50, 90])
        under = 100 * float(np.mean(m.corr < threshold))
        after = "-" if m.learned_after_s is None else f"{m.learned_after_s:.2f} s"
        print(
            f"{row.label:<40} {m.corr.size:>6} {p10:>8.2f} {p50:>5.2f} {p90:>5.2f} "
            f"{under:>5.0f}% {np.median(m.delay_ms):>7.1f}ms {after:>10} "
            f"{100 * float(np.mean(m.missed_with_path)):>6.1f}%"
        )


if __name__ == "__main__":
    asyncio.run(main())
