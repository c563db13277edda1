"""After the call: the report's turns, marks, clears and violations from what the line carried,
the recording, and (with a transcriber) what the bot said in each turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import soxr

from ivr.sim.line import CallerTurn, Line
from ivr.sim.playout import SAMPLE_RATE, Segment, Violation, render_track, ulaw_decode, write_wav
from ivr.sim.report import CallReport, TurnReport

Transcriber = Callable[[bytes], Awaitable[str]]
"""PCM16 mono 16 kHz -> text; used only to print what the bot said."""


async def finish_report(
    line: Line, report: CallReport, record_path: str | Path | None, transcriber: Transcriber | None
) -> None:
    end = time.monotonic()
    report.duration_s = line.rel(end)
    for p in line.playouts:
        report.marks_echoed += len(p.echoes)
        report.marks_cleared += sum(e.cleared for e in p.echoes)
        report.clears += [line.rel(t) for t in p.clears]
        report.violations += [
            Violation(line.rel(v.t), v.code, v.reason, v.excerpt) for v in p.violations
        ]
    report.violations.sort(key=lambda v: v.t)
    n = round(report.duration_s * SAMPLE_RATE)
    bot = [s for p in line.playouts for s in p.segments]
    report.bot_audio_s = sum(len(s.audio) for s in bot) / SAMPLE_RATE
    report.turns = _turns(line, bot, end)
    if record_path is not None:
        caller = ulaw_decode(render_track(line.caller_track, n))
        await asyncio.to_thread(write_wav, record_path, [caller, ulaw_decode(render_track(bot, n))])
    if transcriber is not None:
        await _transcribe(report.turns, bot, n, transcriber)


def _turns(line: Line, bot: list[Segment], end: float) -> list[TurnReport]:
    """Bot audio belongs to the turn during which it *arrived* (after that caller turn ended)."""
    turns = line.caller_turns
    out: list[TurnReport] = []
    if line.first_stream_t is not None:
        until = turns[0].end_t if turns else end
        greet = _turn(line, CallerTurn(None, line.first_stream_t, line.first_stream_t), bot, until)
        if greet.bot_first_audio_t is not None:
            out.append(greet)
    for i, t in enumerate(turns):
        out.append(_turn(line, t, bot, turns[i + 1].end_t if i + 1 < len(turns) else end))
    return out


def _turn(line: Line, t: CallerTurn, bot: list[Segment], until: float) -> TurnReport:
    mine = [s for s in bot if t.end_t <= s.arrived_t < until and s.audio]
    rep = TurnReport(t.text, line.rel(t.start_t), line.rel(t.end_t))
    if mine:
        first = min(s.start for s in mine) / SAMPLE_RATE
        rep.bot_first_audio_t = first
        rep.latency_s = first - rep.caller_end_t
        rep.bot_audio_seconds = sum(len(s.audio) for s in mine) / SAMPLE_RATE
        rep.bot_audio_end_t = max(s.end for s in mine) / SAMPLE_RATE
    clears = [c for p in line.playouts for c in p.clears]
    rep.interrupted = any(t.end_t <= c < until for c in clears)
    return rep


async def _transcribe(
    turns: list[TurnReport], bot: list[Segment], n: int, transcriber: Transcriber
) -> None:
    track = render_track(bot, n)
    bounds = [t.bot_first_audio_t for t in turns]
    for i, t in enumerate(turns):
        if t.bot_first_audio_t is None:
            continue
        start = round(t.bot_first_audio_t * SAMPLE_RATE)
        later = [b for b in bounds[i + 1 :] if b is not None]
        stop = round(later[0] * SAMPLE_RATE) if later else n
        pcm = np.frombuffer(ulaw_decode(track[start:stop]), dtype="<i2")
        pcm16k = await asyncio.to_thread(soxr.resample, pcm, SAMPLE_RATE, 16000)
        t.bot_text = (await transcriber(pcm16k.astype("<i2").tobytes())).strip()
