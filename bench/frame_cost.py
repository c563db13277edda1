"""What the gateway's own Python costs one listening frame, without the socket under it.

The listening bar of issue 21 (CPU-s per call-minute) is the socket's floor (``ws_floor.py``:
picows receiving Twilio's messages, no gateway code) plus what the gateway does with each
message. This measures the second part alone, in seconds rather than minutes: ``--calls`` real
``CallSession``s (the production endpointer: WebRTC's gate, Silero behind it) each fed
``--seconds`` of Twilio media messages through the stream's own receive loop
(``ivr.call.stream._receive``: parse, dispatch, hearing, VAD, endpointer, the floor's history)
from a list in memory instead of a socket. The sweep is over the caller's line, from digital
silence to hiss loud enough to open WebRTC's gate now and then (Silero then judges it, batched
across the calls). No provider is asked: line noise is never a turn.

``--mode`` says how the frames are handed over:

* ``tasks`` (default): as the gateway does. Every 20 ms tick each call's own task wakes for its
  frame, all calls' frames in one burst (as ``capacity.py``'s callers send them).
* ``one-pass``: the same ticks, but one task hands every call its frame in turn. This is what a
  per-tick media pass written in Python would save (rows where Silero runs do not compare: a
  pass waits on each window's batch).
* ``round-robin``: passes as ``one-pass`` but back to back, with no clock: every call's state
  is still in the CPU's caches from the last pass. ``--evict-mb 32`` reads that much between
  two passes (its own CPU not counted), as the rest of the host does while the loop idles.
* ``back-to-back``: no clock; each call's frames in a row. What the Python costs with one call's
  state hot in the CPU's caches the whole time.

    .venv/bin/python bench/frame_cost.py                        # the sweep (~3 min)
    .venv/bin/python bench/frame_cost.py --calls 100 --rms 0,64 --mode one-pass
    .venv/bin/python bench/frame_cost.py --calls 100 --rms 0 --mode round-robin --evict-mb 32

Per level: us of this process's CPU a frame (best and median of ``--rounds``), the same as
CPU-s per call-minute (3000 frames), and how many Silero windows a frame cost. Pinned to
``--cpu`` (default 0), so that the numbers compare with ``ws_floor.py``'s server on CPU 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
import uvloop
from gateway_harness import inbound_media_json, noise_payloads

from ivr.audio.gated_vad import shared_pool
from ivr.audio.silero_batch import SileroBatcher
from ivr.call.player import AudioPlayer
from ivr.call.prompts import PromptCache
from ivr.call.session import CallSession
from ivr.call.stream import _receive
from ivr.config import Settings
from ivr.gateway import endpointer_factory
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.telephony import twilio
from ivr.telephony.twilio import Media
from ivr.tts.openai_http import OpenAIHttpTts

FRAMES_PER_MINUTE = 3000
FRAME_S = 0.02
MODES = ("tasks", "one-pass", "round-robin", "back-to-back")
WIDTHS = (8, 14, 7, 15, 13)
UNREACHABLE = "http://127.0.0.1:9/v1"
"""Providers no frame of line noise reaches; a request there would fail the run loudly."""


class FrameClock:
    """Twilio's 20 ms: every stream may take its next message once a tick has passed for it,
    all streams' frames in one burst a tick (as ``capacity.py``'s callers send them)."""

    def __init__(self) -> None:
        self.ticks = 0
        self._tick: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self, ticks: int) -> None:
        started = time.monotonic()
        for n in range(1, ticks + 1):
            await asyncio.sleep(max(0.0, started + n * FRAME_S - time.monotonic()))
            self.ticks, tick = n, self._tick
            self._tick = asyncio.get_running_loop().create_future()
            tick.set_result(None)

    async def wait_for(self, ticks: int) -> None:
        while self.ticks < ticks:
            await self._tick  # one future a tick, awaited by every stream


class ListOfMessages:
    """The ``MediaSocket.receive`` side of a stream, from a list on the frame clock: ``None``
    once it is read."""

    def __init__(self, messages: list[str], clock: FrameClock | None) -> None:
        self._messages = messages
        self._clock = clock
        self._next = 0

    async def receive(self) -> str | None:
        i = self._next
        if i >= len(self._messages):
            return None
        if self._clock is not None:
            await self._clock.wait_for(i + 1)
        self._next = i + 1
        return self._messages[i]


def new_session(settings: Settings) -> CallSession:
    async def nothing(*_: object) -> None:
        pass

    return CallSession(
        player=AudioPlayer(nothing, nothing, nothing),
        endpointer=endpointer_factory(settings)(),
        stt=OpenAIHttpStt(base_url=UNREACHABLE, api_key="unused"),
        tts=OpenAIHttpTts(base_url=UNREACHABLE, api_key="unused"),
        prompts=PromptCache(),
        on_end=lambda _: None,
    )


async def one_round(
    args: argparse.Namespace, batcher: SileroBatcher, rms: float, seed: int
) -> tuple[float, float]:
    """us of CPU a frame, and Silero windows a frame, for ``--calls`` fresh calls."""
    settings = Settings()
    # Every call hears the same line, as capacity.py's callers do; each round a new stretch.
    payloads = noise_payloads(rms, args.seconds, seed)
    frames = len(payloads)
    streams = []
    for i in range(args.calls):
        sid = f"MZ{i:032x}"
        messages = [inbound_media_json(sid, n + 3, n + 1, p) for n, p in enumerate(payloads)]
        streams.append((new_session(settings), messages))
    windows = batcher.windows
    clock = FrameClock()
    started = time.process_time()
    evicting = 0.0
    if args.mode in ("one-pass", "round-robin"):
        paced = args.mode == "one-pass"
        evict = Eviction(args.evict_mb)
        passes = one_pass_a_tick(streams, clock if paced else None, frames, evict)
        await asyncio.gather(*([clock.run(frames)] if paced else []), passes)
        evicting = evict.spent
    else:
        paced = args.mode == "tasks"  # back to back: each call's frames in a row, no clock
        receiving = [
            _receive(ListOfMessages(m, clock if paced else None), s, None)  # type: ignore[arg-type]
            for s, m in streams
        ]
        await asyncio.gather(*([clock.run(frames)] if paced else []), *receiving)
    spent = time.process_time() - started - evicting
    calls_frames = args.calls * frames
    return spent / calls_frames * 1e6, (batcher.windows - windows) / calls_frames


class Eviction:
    """Reads ``mb`` MB between two passes (0: nothing), as other work on the core would
    between two ticks, so a pass finds its calls' state out of the CPU's caches; its own CPU
    is kept apart (``spent``)."""

    def __init__(self, mb: int) -> None:
        self._buffer = np.ones(mb * 131072) if mb else None  # float64: 131072 a MB
        self.spent = 0.0

    def __call__(self) -> None:
        if self._buffer is not None:
            started = time.process_time()
            self._buffer.sum()
            self.spent += time.process_time() - started


async def one_pass_a_tick(
    streams: list[tuple[CallSession, list[str]]],
    clock: FrameClock | None,
    frames: int,
    evict: Eviction,
) -> None:
    """The shape the media path would take with one pass a tick: a single task hands every
    call its frame in turn (parsed and dispatched as ``_receive`` does, minus its error
    handling), instead of waking each call's own task. No clock: the passes back to back."""
    for n in range(frames):
        if clock is not None:
            await clock.wait_for(n + 1)
        evict()
        for session, messages in streams:
            message = twilio.parse_message(messages[n])
            assert isinstance(message, Media)
            await session.on_media(message.payload, message.timestamp_ms / 1000)


async def main(args: argparse.Namespace) -> None:
    pool = shared_pool(Settings().silero_threshold)
    silero = await asyncio.to_thread(pool.acquire)  # off the loop it waits for the model
    if silero is None:
        raise RuntimeError("the Silero pool gave no model")
    batcher = silero.batcher()  # this loop's, shared by every call's Silero
    pool.release(silero)
    print(f"{args.calls} calls x {args.seconds:g} s of line noise, mode {args.mode}, ", end="")
    evicted = f", {args.evict_mb} MB read between passes" if args.evict_mb else ""
    print(f"{args.rounds} rounds, CPU {args.cpu}{evicted}")
    head = ("line rms", "us/frame best", "median", "CPU-s/call-min", "Silero/frame")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, WIDTHS, strict=True)))
    # Rounds outermost: this machine's speed drifts by a third within minutes, so every level
    # gets a round early and late instead of its rounds in a row (levels would read the drift).
    results: dict[float, list[tuple[float, float]]] = {rms: [] for rms in args.rms}
    for seed in range(args.rounds):
        for rms in args.rms:
            results[rms].append(await one_round(args, batcher, rms, seed))
    for rms, rounds in results.items():
        us = sorted(r[0] for r in rounds)
        per_min = us[0] * FRAMES_PER_MINUTE / 1e6
        windows = statistics.median(r[1] for r in rounds)
        row = (f"{rms:g}", f"{us[0]:.2f}", f"{statistics.median(us):.2f}", f"{per_min:.4f}",
               f"{windows:.3f}")  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(row, WIDTHS, strict=True)))
    print("the socket under it: .venv/bin/python bench/ws_floor.py --stacks picows")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--seconds", type=float, default=10.0, help="of line noise a call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--rms", type=lambda s: [float(x) for x in s.split(",")], default=[0, 16, 64, 256, 1024],
        help="the caller's line noise levels (PCM16 rms, white), comma-separated",
    )  # fmt: skip
    p.add_argument("--cpu", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="tasks", help="see the module docstring")
    p.add_argument("--evict-mb", type=int, default=0, help="read between passes (pass modes)")
    args = p.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    uvloop.run(main(args))
