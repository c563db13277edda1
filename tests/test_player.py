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
