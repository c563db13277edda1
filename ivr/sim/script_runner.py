"""Runs the caller's script on the line: waits for the bot, speaks, presses keys, barges in."""

from __future__ import annotations

import asyncio
import time

from ivr.sim.line import CallerTurn, Line
from ivr.sim.script import BargeIn, Hangup, Press, Rendered, Say, Script, Silence, Wav


async def run_script(line: Line, steps: list[Rendered], script: Script) -> None:
    since = time.monotonic()
    if script.wait_for_greeting:
        await line.wait_bot_turn(since, script.turn_gap, script.max_wait)
    for r in steps:
        step = r.step
        if isinstance(step, Hangup):
            break
        if isinstance(step, Silence):
            await asyncio.sleep(step.silence)
            continue
        if isinstance(step, Say | Wav | Press) and step.wait and line.caller_turns:
            await line.wait_bot_turn(line.caller_turns[-1].end_t, script.turn_gap, script.max_wait)
        if isinstance(step, BargeIn):
            await _barge_in_delay(line, step, script)
        start = time.monotonic()
        end = await _press(line, step) if isinstance(step, Press) else await line.mic.queue(r.audio)
        line.caller_turns.append(CallerTurn(r.text, start, end))
    else:
        if line.caller_turns:
            await line.wait_bot_turn(line.caller_turns[-1].end_t, script.turn_gap, script.max_wait)
    line.hangup.set()


async def _barge_in_delay(line: Line, step: BargeIn, script: Script) -> None:
    since = line.caller_turns[-1].end_t if line.caller_turns else line.t0
    first = await line.wait_bot_start(since, script.max_wait)
    if first is not None:
        await asyncio.sleep(max(0.0, first + step.barge_in.after - time.monotonic()))


async def _press(line: Line, step: Press) -> float:
    t = time.monotonic()
    for i, digit in enumerate(step.press):
        if i:
            await asyncio.sleep(step.gap)
        t = await (await line.current_session()).send_dtmf(digit)
    return t
