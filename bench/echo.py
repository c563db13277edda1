"""Echo benchmark (issue 22): does a caller's line carrying the bot back make it answer itself?

Each call goes through the real audio path: a gateway under uvicorn (Silero VAD, 300 ms
endpoint, speculation at 60 ms: the defaults), the simulated Twilio caller (``ivr.sim``) over a
real WebSocket, providers on ``FakeOpenAIServer``, all in one worker process per lane (one call
at a time each), so that the lanes' Python runs on every core. The flow is one
LLM agent with no greeting. The caller says one line, then stays silent for ``--listen-s``
while the bot answers with a scripted five-sentence reply (streamed tokens) in real speech
(piper, each piece at -23 dBFS), streamed as 24 kHz PCM in 40 ms chunks at ``pace`` x real
time. Twilio plays it on its 20 ms frame clock (``TwilioPlayout(frame_clock=True)``), and the
caller's line carries it back (``ivr.sim.echo.LineEcho``): delayed, attenuated by the echo
return loss, optionally band-limited (300-3400 Hz) and clipped, mu-law encoded again, with
line noise. The STT (``LineTranscriber``) transcribes exactly what the line carried, so an
echo that gets through comes back as the bot's own words.

A cell varies one thing from the issue's conditions (ERL 20 dB: the echo at -43 dBFS, 100 ms,
no band limit or clipping, no line noise, 4x TTS, no network jitter, the caller silent), plus
hard corners, two "phone" cells with every impairment at once (band limit, the loudspeaker
clipping at -15 dBFS, -55 dBFS line noise, 0-2 ms jitter on the gateway -> Twilio link), and
controls on the old simulated Twilio that starts audio at its exact arrival sample (``arr``).
``talk`` cells: the caller interrupts for real over the echo, 1-4 s into the reply. Per cell:

- **false%**: calls with a ``clear`` while the caller was silent; **clears**: how many.
- **own**: LLM requests whose caller text is the bot's own words (the bot answering itself;
  speculative requests included), over all calls of the cell.
- **pause**: the first false ``clear`` from the reply's first audio at the caller (ms, p50).
- **clear50/p95**, **miss** (``talk`` cells): the caller's onset (their clip's first frame
  queued, +-10 ms) to the ``clear`` arriving at the caller; no ``clear`` within 3 s.
- **corr10/50/90**, **>=thr**: the gateway's echo check (``barge_in.echo_check``, its debug
  log, captured in process): its correlation over every check in the cell, and the share at
  or over the threshold (0.6); **delay**: the delay it found (ms, p50); **@pause**: its
  correlation in the check just before each pause (p50): what let the bot's voice through.
- **lag**: the worst lateness of a lane's event loop during the cell's calls (ms): the gateway
  and the caller share it, and a late loop stamps the caller's frames late; **stall**: false
  clears within 1 s after the loop stalled 100 ms or more (on a busy machine: maybe the
  harness's, not the gateway's).

    .venv/bin/python bench/echo.py                          # the sweep: 3 calls per cell (~9 min)
    .venv/bin/python bench/echo.py --cells issue,"tts 1x" --trials 4 --verbose
    .venv/bin/python bench/echo.py --voice espeak --lanes 3 --json
    .venv/bin/python bench/echo.py --list                   # the cells

The machine is shared: the load average is printed; clear latencies are wall-clock.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from interruptions import AUTH_TOKEN, PUBLIC_URL, lane_gateway

from ivr.callio.interruption_policy import DEFAULT_POLICY
from ivr.sim.echo import Background, LineEcho
from ivr.sim.playout import LinkDelay
from ivr.testing.echo_call import FLOW, Voices, background_voices, echo_call
from ivr.testing.openai_server import FakeOpenAIServer

CLIP_DBFS = -15.0
"""The caller's loudspeaker amplifier clips at 8 dB over the bot's -23 dBFS speech level."""


BACKGROUND_SPANS_S = ((6.0, 9.0), (11.0, 14.0))
"""When the other voices talk (seconds into the call): over the bot's reply."""


@functools.cache
def background_audio(talkers: int) -> np.ndarray:
    return background_voices(talkers)


@dataclass(frozen=True, slots=True)
class Cell:
    name: str
    erl_db: float = 20.0
    delay_ms: float = 100
    band: bool = False
    clip: bool = False
    noise_dbfs: float | None = None
    pace: float = 4.0
    talk: bool = False
    frame_clock: bool = True
    jitter_ms: float = 0.0
    """Gateway -> Twilio: each message up to this much later (uniform), in order."""
    talkers: int = 0
    """Other voices in the caller's room while the bot answers (8: babble; 1: a voice)."""
    under_db: float = 0.0
    """How far under the caller's own level those voices are."""

    def echo(self, seed: int, voices: Voices) -> LineEcho:
        background = None
        if self.talkers:
            level = voices.caller_level_dbfs() - self.under_db
            background = Background(background_audio(self.talkers), level, BACKGROUND_SPANS_S)
        return LineEcho(
            delay_s=self.delay_ms / 1000, gain_db=-self.erl_db, band_limit=self.band,
            clip_dbfs=CLIP_DBFS if self.clip else None, noise_dbfs=self.noise_dbfs, seed=seed,
            background=background,
        )  # fmt: skip

    def link(self, seed: int) -> LinkDelay | None:
        return LinkDelay(jitter_s=self.jitter_ms / 1000, seed=seed) if self.jitter_ms else None

    def describe(self) -> str:
        noise = "-" if self.noise_dbfs is None else f"{self.noise_dbfs:.0f}"
        return (
            f"{self.erl_db:>3.0f} {self.delay_ms:>5.4g} {'y' if self.band else '-':>4} "
            f"{'y' if self.clip else '-':>4} {noise:>5} {self.pace:>2.2g}x "
            f"{'y' if self.talk else '-':>4} {'tick' if self.frame_clock else 'arr':>4} "
            f"{self.jitter_ms:>3g}"
        )


CELLS = (
    Cell("issue"),  # -20 dB ERL (-43 dBFS), 100 ms, mu-law both ways, the caller silent
    *(Cell(f"erl {e}", erl_db=e) for e in (6, 10, 30, 40)),
    *(Cell(f"delay {d}", delay_ms=d) for d in (20, 250, 500)),
    Cell("delay +1/2 sample", delay_ms=100.0625),  # an acoustic path: no whole sample
    Cell("band-limited", band=True),
    Cell("clipped", clip=True),
    *(Cell(f"noise {n}", noise_dbfs=n) for n in (-65, -55, -45)),
    Cell("tts 1x", pace=1.0),
    Cell("tts 0.9x", pace=0.9),  # a TTS that cannot keep up: the player runs dry
    Cell("jitter 2 ms", jitter_ms=2),
    Cell("double talk", talk=True),
    Cell("double talk 1x", talk=True, pace=1.0),
    Cell("double talk 6 dB", talk=True, erl_db=6),
    Cell("6 dB + 20 ms", erl_db=6, delay_ms=20),
    Cell("40 dB + 500 ms", erl_db=40, delay_ms=500),
    Cell("30 dB + noise -45", erl_db=30, noise_dbfs=-45),
    Cell("phone 4x", band=True, clip=True, noise_dbfs=-55, jitter_ms=2),
    Cell("phone 1x", band=True, clip=True, noise_dbfs=-55, jitter_ms=2, pace=1.0),
    # Controls: the old simulated Twilio, which starts audio at its exact arrival sample.
    *(Cell(f"babble -{u}", erl_db=80, talkers=8, under_db=u) for u in (10, 15, 20)),
    *(Cell(f"a voice -{u}", erl_db=80, talkers=1, under_db=u) for u in (10, 20)),
    Cell("babble -10 + echo", talkers=8, under_db=10),
    Cell("arrival playout", frame_clock=False),
    Cell("1x arrival playout", pace=1.0, frame_clock=False),
)


@dataclass(slots=True)
class Trial:
    cell: Cell
    seed: int
    after_s: float = 0.0
    false_clears: int = 0
    own_requests: int = 0
    requests: int = 0
    clear_latency_s: float | None = None
    first_pause_s: float | None = None
    """The first false clear, from the reply's first audio."""
    correlations: list[float] = field(default_factory=list)
    delays_ms: list[int] = field(default_factory=list)
    pause_correlations: list[float] = field(default_factory=list)
    loop_lag_ms: float = 0.0
    """The event loop's worst lateness during the call."""
    after_stall: int = 0
    """False clears within 1 s of the loop stalling 100 ms or more: maybe the harness's."""
    heard: list[str] = field(default_factory=list)
    """What the line STT answered, by source."""
    error: str = ""


class EchoChecks:
    """A structlog processor keeping, by call (its ``call_sid`` context), the gateway's echo
    checks (correlation, delay) and the pauses (``None``) in the order they came; everything
    else is dropped, warnings counted by event, errors printed."""

    def __init__(self) -> None:
        self.by_call: dict[str, list[tuple[float, int] | None]] = defaultdict(list)
        self.warnings: Counter[str] = Counter()

    def __call__(self, _: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        name = event.get("event")
        if name == "barge_in.echo_check":
            sid = str(event.get("call_sid", ""))
            self.by_call[sid].append((float(event["correlation"]), int(event["delay_ms"])))
        elif name == "barge_in.paused":
            self.by_call[str(event.get("call_sid", ""))].append(None)
        elif method == "warning":
            self.warnings[str(name)] += 1
        elif method in ("error", "critical", "exception"):
            print(f"  [{method}] {dict(event)}", file=sys.stderr)
        raise structlog.DropEvent


class LoopLag:
    """How late this process's event loop (gateways and callers alike) wakes a 20 ms timer:
    a late loop stamps the caller's frames late, which the echo check feels too."""

    def __init__(self) -> None:
        self.late: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.02)
            self.late.append((t, time.monotonic() - t - 0.02))

    def worst(self, since: float) -> float:
        return max((late for t, late in self.late if t >= since), default=0.0)

    def stalled_before(self, t: float, within: float = 1.0, stall: float = 0.1) -> bool:
        """A stall of ``stall`` s or more ended at most ``within`` s before ``t``."""
        return any(s <= t <= s + late + within for s, late in self.late if late >= stall)


async def run_call(
    server: Any, fake: FakeOpenAIServer, voices: Voices, trial: Trial,
    args: argparse.Namespace, checks: EchoChecks, lag: LoopLag,
) -> None:  # fmt: skip
    cell = trial.cell
    started = time.monotonic()
    call = await echo_call(
        server.base_url, fake, voices, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL,
        echo=cell.echo(trial.seed, voices), frame_clock=cell.frame_clock,
        link=cell.link(trial.seed),
        pace=cell.pace,
        talk_after_s=trial.after_s if cell.talk else None, listen_s=args.listen_s,
        stt_delay_s=args.stt_ms / 1000, llm_first_token_s=args.llm_ms / 1000,
    )  # fmt: skip
    report = call.report
    trial.loop_lag_ms = 1000 * lag.worst(started)
    if report.errors or report.violations:
        trial.error = "; ".join(report.errors + [v.reason for v in report.violations])
    if cell.talk and not any(t.caller_text and "bill" in t.caller_text for t in report.turns):
        trial.error = trial.error or "the interruption was never said"
    trial.requests = len(call.requests)
    trial.own_requests = call.own_requests
    trial.false_clears = len(call.false_clears)
    trial.after_stall = sum(lag.stalled_before(started + c) for c in call.false_clears)
    trial.first_pause_s = call.first_pause_s
    trial.clear_latency_s = call.clear_latency_s
    found = checks.by_call.pop(report.call_sid, [])
    trial.correlations = [c[0] for c in found if c is not None]
    trial.delays_ms = [c[1] for c in found if c is not None]
    # The check just before each pause: the correlation that let the bot's voice through.
    trial.pause_correlations = [
        prev[0] for prev, c in zip([None, *found], found, strict=False) if c is None and prev
    ]
    trial.heard = [f"{h.source}:{h.text[:40]}" for h in call.heard]


def plan(args: argparse.Namespace) -> list[Trial]:
    wanted = [c for c in CELLS if args.cells is None or c.name in args.cells]
    unknown = set(args.cells or ()) - {c.name for c in CELLS}
    if unknown:
        raise SystemExit(f"unknown cells: {sorted(unknown)}; see --list")
    rng = random.Random(args.seed)
    # Trial-major order: the lanes work through every cell before repeating one.
    return [
        Trial(cell, seed=args.seed * 1000 + i * 100 + j, after_s=round(rng.uniform(1.0, 4.0), 2))
        for i in range(args.trials)
        for j, cell in enumerate(wanted)
    ]


async def run(args: argparse.Namespace) -> list[Trial]:
    """Every planned call, over ``args.lanes`` worker processes (a gateway each): one event
    loop for all would be one core's worth of Python, and late."""
    trials = plan(args)
    lanes = [trials[i :: args.lanes] for i in range(args.lanes)]
    options = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKER_OPTIONS]
    by_name = {c.name: c for c in CELLS}
    done: list[Trial] = []

    async def lane(mine: list[Trial]) -> None:
        planned = json.dumps(
            [{"cell": t.cell.name, "seed": t.seed, "after_s": t.after_s} for t in mine]
        )
        worker = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", planned, *options, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert worker.stdout is not None
            async for line in worker.stdout:
                data = json.loads(line)
                done.append(Trial(**{**data, "cell": by_name[data["cell"]]}))
                if args.verbose:
                    print(f"  [{len(done)}/{len(trials)}] {data['cell']}: {brief(done[-1])}")
            await worker.wait()
        finally:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()

    await asyncio.gather(*(lane(mine) for mine in lanes if mine))
    if len(done) < len(trials):
        print(f"note: {len(trials) - len(done)} calls never reported (a worker died)")
    order = {(t.cell.name, t.seed): i for i, t in enumerate(trials)}
    return sorted(done, key=lambda t: order[(t.cell.name, t.seed)])


async def work(args: argparse.Namespace) -> None:
    """A worker: its own gateway, the planned calls one after another, a JSON line each."""
    checks = EchoChecks()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, checks],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    by_name = {c.name: c for c in CELLS}
    trials = [Trial(**{**t, "cell": by_name[t["cell"]]}) for t in json.loads(args.worker)]
    voices = await Voices.render(args.voice)
    lag = LoopLag()
    watch = asyncio.create_task(lag.run())
    with tempfile.TemporaryDirectory() as tmp:
        flows = Path(tmp)
        (flows / "echo.yaml").write_text(FLOW)
        (flows / "routes.yaml").write_text("default: echo\n")
        try:
            async with lane_gateway(args.vad, flows) as (server, fake):
                for trial in trials:
                    try:
                        await run_call(server, fake, voices, trial, args, checks, lag)
                    except Exception as exc:  # a broken call is reported, not fatal
                        trial.error = repr(exc)
                    print(json.dumps({**asdict(trial), "cell": trial.cell.name}), flush=True)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
    if voices.bot.unknown:
        print(f"note: TTS pieces rendered by espeak: {voices.bot.unknown}", file=sys.stderr)
    if checks.warnings:
        print(f"  gateway warnings in one lane: {dict(checks.warnings)}", file=sys.stderr)


def brief(t: Trial) -> str:
    corr = statistics.median(t.correlations) if t.correlations else None
    return (
        f"false clears {t.false_clears}, own requests {t.own_requests}/{t.requests}, "
        f"clear {t.clear_latency_s}, corr p50 {corr}, stt {t.heard[:4]} {t.error[:120]}"
    )


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(trials: list[Trial]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for cell in dict.fromkeys(t.cell for t in trials):
        mine = [t for t in trials if t.cell == cell and not t.error]
        rows.append({"cell": cell.name, "conditions": cell.describe(), **figures(mine, cell.talk)})
        rows[-1]["errors"] = sum(t.cell == cell and bool(t.error) for t in trials)
    return rows


def figures(mine: list[Trial], talk: bool) -> dict[str, Any]:
    n = len(mine)
    corr = [c for t in mine for c in t.correlations]
    delays = [float(d) for t in mine for d in t.delays_ms]
    pauses = [1000 * t.first_pause_s for t in mine if t.first_pause_s is not None]
    at_pause = [c for t in mine for c in t.pause_correlations]
    row: dict[str, Any] = {
        "n": n,
        "false_pct": 100 * sum(t.false_clears > 0 for t in mine) / n if n else None,
        "false_clears": sum(t.false_clears for t in mine),
        "own_requests": sum(t.own_requests for t in mine),
        "first_pause_ms_p50": quantile(pauses, 0.5),
        "corr_p10": quantile(corr, 0.1), "corr_p50": quantile(corr, 0.5),
        "corr_p90": quantile(corr, 0.9), "checks": len(corr),
        "over_threshold_pct": (
            100 * sum(c >= DEFAULT_POLICY.echo_threshold for c in corr) / len(corr)
            if corr else None
        ),
        "delay_ms_p50": quantile(delays, 0.5), "corr_at_pause_p50": quantile(at_pause, 0.5),
        "loop_lag_ms_max": max((t.loop_lag_ms for t in mine), default=None),
        "after_stall": sum(t.after_stall for t in mine),
    }  # fmt: skip
    if talk:
        lat = [1000 * t.clear_latency_s for t in mine if t.clear_latency_s is not None]
        row |= {
            "clear_p50_ms": quantile(lat, 0.5), "clear_p95_ms": quantile(lat, 0.95),
            "missed": n - len(lat),
        }  # fmt: skip
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    def cell(v: Any, w: int, fmt: str = ".0f") -> str:
        return f"{'-':>{w}}" if v is None else f"{v:>{w}{fmt}}"

    print(
        f"{'cell':<20} {'erl':>3} {'ms':>5} {'band':>4} {'clip':>4} {'noise':>5} {'tts':>3} "
        f"{'talk':>4} {'play':>4} {'jit':>3} | {'n':>2} {'false%':>6} {'clears':>6} {'own':>4} "
        f"{'pause':>5} {'clear50':>7} {'p95':>4} {'miss':>4} | {'corr10':>6} {'50':>4} {'90':>4} "
        f"{'>=thr':>5} {'delay':>5} {'@pause':>6} {'lag':>4} {'stall':>5} {'err':>3}"
    )
    for r in rows:
        print(
            f"{r['cell']:<20} {r['conditions']} | {r['n']:>2} {cell(r['false_pct'], 6)} "
            f"{r['false_clears']:>6} {r['own_requests']:>4} {cell(r['first_pause_ms_p50'], 5)} "
            f"{cell(r.get('clear_p50_ms'), 7)} {cell(r.get('clear_p95_ms'), 4)} "
            f"{cell(r.get('missed'), 4)} | {cell(r['corr_p10'], 6, '.2f')} "
            f"{cell(r['corr_p50'], 4, '.2f')} {cell(r['corr_p90'], 4, '.2f')} "
            f"{cell(r['over_threshold_pct'], 4)}% {cell(r['delay_ms_p50'], 5)} "
            f"{cell(r['corr_at_pause_p50'], 6, '.2f')} {cell(r['loop_lag_ms_max'], 4)} "
            f"{r['after_stall']:>5} {r.get('errors', 0):>3}"
        )


WORKER_OPTIONS = ("vad", "voice", "listen_s", "stt_ms", "llm_ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="calls per cell")
    parser.add_argument(
        "--lanes", type=int, default=4, help="calls at once (a process and a gateway each)"
    )
    parser.add_argument("--cells", type=lambda s: s.split(","), default=None, help="by name")
    parser.add_argument("--vad", default="silero", choices=["silero", "webrtc"])
    parser.add_argument("--voice", default="piper", choices=["piper", "espeak"])
    parser.add_argument("--listen-s", type=float, default=18.0, help="caller silent after")
    parser.add_argument("--stt-ms", type=int, default=150)
    parser.add_argument("--llm-ms", type=int, default=140, help="LLM first token")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="a line per call")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the calls of one lane, as JSON
    args = parser.parse_args()
    if args.worker is not None:
        await work(args)
        return
    if args.list:
        for c in CELLS:
            print(f"{c.name:<20} {c.describe()}")
        return
    load0, t0 = os.getloadavg()[0], time.monotonic()
    trials = await run(args)
    rows = summarise(trials)
    print(
        f"\necho sweep: vad={args.vad}, voice={args.voice} at -23 dBFS, {args.trials} calls per "
        f"cell, caller silent {args.listen_s:.0f} s after one line; mu-law both ways in every "
        f"cell; erl dB, delay ms, clip at {CLIP_DBFS:.0f} dBFS, noise dBFS, tts pace, play = "
        "Twilio frame clock (tick) or arrival; pause = first false clear from the reply's start "
        "(ms, p50); delay = the echo check's (ms, p50); @pause = its correlation just before a "
        "pause (p50)"
    )
    print_table(rows)
    whole = figures([t for t in trials if not t.error and not t.cell.talk], talk=False)
    talking = figures([t for t in trials if not t.error and t.cell.talk], talk=True)
    print(
        f"whole sweep (caller silent): {whole['false_pct']:.0f} % of {whole['n']} calls had a "
        f"false clear, {whole['own_requests']} LLM requests on the bot's own words"
        + (
            f"; double talk: clear p95 {talking['clear_p95_ms']:.0f} ms, "
            f"{talking['missed']} missed of {talking['n']}"
            if talking["n"] and talking["clear_p95_ms"] is not None
            else ""
        )
    )
    for t in [t for t in trials if t.error][:5]:
        print(f"  error in {t.cell.name}: {t.error[:200]}")
    print(
        f"took {time.monotonic() - t0:.0f} s; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        print(json.dumps({"rows": rows, "trials": [asdict(t) for t in trials]}, default=str))


if __name__ == "__main__":
    asyncio.run(main())
