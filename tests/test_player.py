"""The outbound player: pacing against the playout clock, marks, and barge-in bookkeeping."""

from __future__ import annotations

import asyncio
import time

import pytest

from ivr.call.player import AudioPlayer, heard_prefix


class Wire:
    """What the player put on the WebSocket, with send times."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, object]] = []

    async def media(self, ulaw: bytes) -> None:
        self.sent.append((time.monotonic(), "media", len(ulaw)))

    async def mark(self, name: str) -> None:
        self.sent.append((time.monotonic(), "mark", name))

    async def clear(self) -> None:
        self.sent.append((time.monotonic(), "clear", None))

    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.sent]


async def start_player(
    wire: Wire, lead: float = 0.2, refill: float = 0.0
) -> tuple[AudioPlayer, asyncio.Task[None]]:
    player = AudioPlayer(
        wire.media, wire.mark, wire.clear, lead_seconds=lead, refill_seconds=refill,
        chunk_frames=5,
    )  # fmt: skip
    return player, asyncio.create_task(player.run_sender())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_audio_is_paced_to_stay_within_the_lead_of_playout() -> None:
    wire = Wire()
    player, task = await start_player(wire, lead=0.2)
    segment = player.open_segment("one two three")
    await player.write(segment, b"\x00" * 8000)  # 1 s of audio
    player.close_segment(segment)
    await asyncio.sleep(0.5)
    await stop(task)
    media = [(t, n) for t, kind, n in wire.sent if kind == "media"]
    start = media[0][0]
    sent_seconds = sum(int(n) for _, n in media) / 8000  # type: ignore[call-overload]
    elapsed = wire.sent[-1][0] - start
    # Everything sent so far must be playable within elapsed + lead (+ one chunk of slack).
    assert sent_seconds <= elapsed + 0.2 + 0.1 + 0.05
    assert sent_seconds < 1.0, "1 s of audio must not all be sent in 0.5 s with a 0.2 s lead"
    assert all(int(n) % 160 == 0 for _, n in media)  # type: ignore[call-overload]


async def test_the_sender_tops_up_by_the_refill_in_one_wake_up_and_stays_within_it() -> None:
    wire = Wire()
    player, task = await start_player(wire, lead=0.2, refill=0.4)
    segment = player.open_segment("a long sentence")
    await player.write(segment, b"\x00" * 24_000)  # 3 s of audio
    player.close_segment(segment)
    await asyncio.sleep(1.5)
    await stop(task)
    media = [(t, int(n)) for t, kind, n in wire.sent if kind == "media"]  # type: ignore[call-overload]
    start = media[0][0]
    bursts: list[list[int]] = []  # messages sent back to back, in one wake-up
    last = -1.0
    for t, n in media:
        if t - last > 0.05:
            bursts.append([])
        bursts[-1].append(n)
        last = t
        sent = sum(m for _, m in media if _ <= t) / 8000
        # Never more than lead + refill (+ one message of slack) ahead of the playout clock.
        assert sent <= (t - start) + 0.2 + 0.4 + 0.1 + 0.05
    # 1.5 s of playout in 100 ms messages: one wake-up per message would be ~15; topped up by
    # 0.4 s at a time it is the first fill and then one wake-up every ~0.4 s.
    assert 3 <= len(bursts) <= 6, [len(b) for b in bursts]
    assert all(len(b) >= 3 for b in bursts[1:-1]), [len(b) for b in bursts]


async def test_a_segment_ends_with_its_mark_and_is_played_when_the_mark_echoes() -> None:
    wire = Wire()
    player, task = await start_player(wire, lead=1.0)
    segment = player.open_segment("hello")
    await player.write(segment, b"\x00" * 900)  # not a whole number of frames
    player.close_segment(segment)
    await asyncio.sleep(0.05)
    assert wire.kinds() == ["media", "media", "mark"]
    assert sum(int(n) for _, k, n in wire.sent if k == "media") == 960  # type: ignore[call-overload]
    name = str(wire.sent[-1][2])
    assert not segment.played.is_set()
    player.on_mark(name)
    await asyncio.wait_for(player.wait_played(segment), 1)
    await stop(task)


async def test_interrupt_sends_clear_drops_queued_audio_and_ignores_stale_marks() -> None:
    wire = Wire()
    player, task = await start_player(wire, lead=0.1)
    segment = player.open_segment("a long sentence that will not be heard in full")
    await player.write(segment, b"\x00" * 16000)  # 2 s
    player.close_segment(segment)
    await asyncio.sleep(0.3)
    sent_before = len(wire.sent)
    await player.interrupt()
    assert wire.kinds()[-1] == "clear"
    await asyncio.sleep(0.3)
    assert len(wire.sent) == sent_before + 1, "nothing may be sent after the clear"
    assert segment.dropped and segment.played.is_set()
    # The echo Twilio sends for the cleared mark must not count as playback of new speech.
    fresh = player.open_segment("new")
    player.on_mark(f"g0:{segment.seq}")
    assert not fresh.played.is_set()
    await stop(task)


async def test_wait_played_falls_back_to_the_playout_clock_when_marks_never_echo() -> None:
    wire = Wire()
    player, task = await start_player(wire, lead=1.0)
    segment = player.open_segment("x")
    await player.write(segment, b"\x00" * 800)  # 0.1 s
    player.close_segment(segment)
    started = time.monotonic()
    await asyncio.wait_for(player.wait_played(segment), 5)
    assert time.monotonic() - started >= 0.1
    await stop(task)


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.0, ""), (1.0, "one two three four"), (0.5, "one two"), (0.2, "one")],
)
def test_heard_prefix_keeps_only_words_fully_played(fraction: float, expected: str) -> None:
    assert heard_prefix("one two three four", fraction) == expected


def test_the_sender_wakes_once_a_top_up_on_a_loop_whose_timers_fire_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvloop (the server's loop) keeps time in whole milliseconds: on a busy loop (here a task
    that never lets it wait, as a hundred calls' frames do) a timer fires up to ~1.5 ms before
    its time by our clock. The sender must top up then, not wait out the rest in sleeps that
    round to nothing (a spin of wake-ups: ~8 a top-up at 100 calls)."""
    import uvloop

    sleeps = 0
    real_sleep = asyncio.sleep

    async def counted_sleep(delay: float, result: object = None) -> object:
        nonlocal sleeps
        sleeps += delay > 0  # the busy task's sleep(0) is no timer
        return await real_sleep(delay, result)

    async def busy_loop() -> None:
        while True:  # noqa: ASYNC110 - a loop that never waits is the point
            await asyncio.sleep(0)

    async def play() -> int:
        wire = Wire()
        busy = asyncio.create_task(busy_loop())
        # 20 ms messages, one a wake-up: ~100 wake-ups in the 2 s. The player's clock runs 1 %
        # slow: by it every timer fires 0.2 ms early, as uvloop's do by a varying part of a
        # millisecond on a busy loop.
        t0 = time.monotonic()
        player = AudioPlayer(
            wire.media, wire.mark, wire.clear, lead_seconds=0.2, refill_seconds=0.0,
            chunk_frames=1, clock=lambda: t0 + 0.99 * (time.monotonic() - t0),
        )  # fmt: skip
        task = asyncio.create_task(player.run_sender())
        segment = player.open_segment("a long sentence")
        await player.write(segment, b"\x00" * 24_000)  # 3 s of audio
        player.close_segment(segment)
        done = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(2.0, done.set_result, None)
        await done
        await stop(task)
        await stop(busy)
        return sum(1 for _, kind, _ in wire.sent if kind == "media")

    monkeypatch.setattr(asyncio, "sleep", counted_sleep)
    messages = uvloop.run(play())
    # Each wake-up is one sleep and sends at least one message.
    assert messages >= 100
    assert sleeps <= messages + 2, f"{sleeps} sleeps for {messages} messages: it spun"
