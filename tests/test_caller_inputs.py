"""The queue between the caller's inputs and the flow's ``listen()``: what is waited for
arrives in one turn of the event loop (under load each turn of the loop is a wait behind every
other call's work), a timeout returns None, and nothing queued is lost to one."""

from __future__ import annotations

import asyncio

from ivr.call.inputs import CallerInputs, Key


async def test_an_input_reaches_a_waiting_listener_in_one_turn_of_the_loop() -> None:
    inputs = CallerInputs()
    listener = asyncio.create_task(inputs.next(5.0))
    await asyncio.sleep(0)  # the listener is waiting
    inputs.put(Key("1"))
    await asyncio.sleep(0)  # one turn: asyncio.wait_for took two (its own task, then ours)
    assert listener.done() and listener.result() == Key("1")


async def test_a_wait_that_runs_out_returns_none_and_a_later_input_waits_for_the_next() -> None:
    inputs = CallerInputs()
    assert await inputs.next(0.02) is None
    assert await inputs.next(0.0) is None
    inputs.put(Key("2"))
    assert await inputs.next(0.0) == Key("2")  # queued already: taken, whatever the wait


async def test_an_input_that_lands_as_the_wait_runs_out_is_not_lost() -> None:
    inputs = CallerInputs()
    listener = asyncio.create_task(inputs.next(0.05))
    await asyncio.sleep(0.05)
    inputs.put(Key("3"))  # about when the timeout fires
    first = await listener
    assert first == Key("3") or (first is None and await inputs.next(0.0) == Key("3"))
