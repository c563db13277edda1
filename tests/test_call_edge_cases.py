"""Call-handling edge cases from review, each against a real gateway under uvicorn.

Twilio's side is a raw WebSocket client (``Line``) where the scenario needs control the
simulated caller does not give: dropping the socket mid-prompt, replaying a stream token,
keeping an old stream half-open. Providers are the local OpenAI-wire server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from prometheus_client import REGISTRY
from test_admission import assert_apology, assert_stream, readyz, voice_webhook
from twilio.request_validator import RequestValidator

from ivr.audio.codec import pcm16_to_ulaw
from ivr.audio.resample import resample
from ivr.callio.io import CallIO
from ivr.server import RunningServer
from ivr.state.base import CallRecord, CallStatus
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault, default_speak

pytestmark = pytest.mark.slow

FRAME = 160  # 20 ms of 8 kHz mu-law
SILENCE = b"\xff" * FRAME
VALIDATOR = RequestValidator(AUTH_TOKEN)


# -- Twilio's side ---------------------------------------------------------------------------


def speech(text: str) -> list[bytes]:
    """Speech-like caller audio as 20 ms mu-law frames (the fake STT ignores its content)."""
    ulaw = pcm16_to_ulaw(resample(default_speak(text), 24000, 8000))
    ulaw += SILENCE[: -len(ulaw) % FRAME]
    return [ulaw[i : i + FRAME] for i in range(0, len(ulaw), FRAME)]


async def webhook(base: str, path: str, call_sid: str, **extra: str) -> str:
    params = {"CallSid": call_sid, "AccountSid": "AC1", "From": "+15550001111", "To": "+1555"}
    params.update(extra)
    signature = VALIDATOR.compute_signature(PUBLIC_URL + path, params)
    async with httpx.AsyncClient() as http:
        response = await http.post(
            base + path, data=params, headers={"X-Twilio-Signature": signature}
        )
    assert response.status_code == 200, response.text
    return response.text


async def voice(base: str, call_sid: str) -> str:
    return await webhook(base, "/twilio/voice", call_sid)


async def after_stream(base: str, call_sid: str) -> str:
    """What the <Connect action> URL answers once Twilio sees the stream end."""
    return await webhook(base, "/twilio/after-stream", call_sid, CallStatus="in-progress")


def stream_path(twiml: str) -> str | None:
    match = re.search(r'url="wss://gw\.example\.com(/twilio/stream/[^"]+)"', twiml)
    return match.group(1) if match else None


async def handshake(base: str, path: str) -> websockets.ClientConnection:
    signature = VALIDATOR.compute_signature(f"wss://gw.example.com{path}", {})
    return await websockets.connect(
        base.replace("http://", "ws://") + path,
        additional_headers={"X-Twilio-Signature": signature},
    )


class Line:
    """One Media Stream as Twilio runs it: plays the gateway's audio in real time, echoes each
    mark once the audio before it has played (every pending one at once on ``clear``), and
    notes what the gateway sent when."""

    def __init__(self, ws: websockets.ClientConnection, stream_sid: str) -> None:
        self.ws = ws
        self.stream_sid = stream_sid
        self.events: list[tuple[float, str, int]] = []  # (monotonic time, event, media bytes)
        self._seq = 1
        self._ts = 0
        self._clock_start: float | None = None
        self._played_until = 0.0  # when the audio received so far has played (monotonic)
        self._marks: deque[tuple[float, dict[str, Any]]] = deque()  # (when due, mark)
        self._marks_changed = asyncio.Event()
        self._echoes = asyncio.create_task(self._echo_marks())
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, base: str, path: str, call_sid: str, stream_sid: str) -> Line:
        line = cls(await handshake(base, path), stream_sid)
        await line.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await line.send(start_event(call_sid, stream_sid))
        return line

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            try:
                async for raw in self.ws:
                    self._received(json.loads(raw))
            finally:
                self._echoes.cancel()

    def _received(self, message: dict[str, Any]) -> None:
        now = time.monotonic()
        size = 0
        if message["event"] == "media":
            size = len(base64.b64decode(message["media"]["payload"]))
            self._played_until = max(self._played_until, now) + size / 8000
        elif message["event"] == "mark":
            self._marks.append((self._played_until, message["mark"]))
            self._marks_changed.set()
        elif message["event"] == "clear":  # the queued audio is gone: every pending mark is due
            self._played_until = now
            self._marks = deque((now, mark) for _, mark in self._marks)
            self._marks_changed.set()
        self.events.append((now, message["event"], size))

    def played_out(self) -> bool:
        """Every piece of the gateway's audio received so far has played."""
        return time.monotonic() >= self._played_until

    async def _echo_marks(self) -> None:
        """Each mark in order, once the audio before it has played."""
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                self._marks_changed.clear()
                if not self._marks:
                    await self._marks_changed.wait()
                    continue
                due, mark = self._marks[0]
                if (wait := due - time.monotonic()) > 0:
                    with contextlib.suppress(TimeoutError):  # or sooner, on a clear
                        await asyncio.wait_for(self._marks_changed.wait(), wait)
                    continue
                self._marks.popleft()
                await self.send({"event": "mark", "mark": mark})

    async def send(self, message: dict[str, Any]) -> None:
        self._seq += 1
        message.update(sequenceNumber=str(self._seq), streamSid=self.stream_sid)
        await self.ws.send(json.dumps(message))

    async def feed(self, frames: list[bytes]) -> None:
        """Caller audio in real time, one 20 ms frame at a time."""
        for frame in frames:
            await self.send_media(frame)
            await asyncio.sleep(0.02)

    async def send_media(self, frame: bytes, stamp_ms: int | None = None) -> None:
        """One frame sent now, stamped ``stamp_ms`` (default: 20 ms after the last one)."""
        payload = base64.b64encode(frame).decode()
        self._ts = self._ts if stamp_ms is None else stamp_ms
        media = {"track": "inbound", "chunk": "1", "timestamp": str(self._ts)}
        await self.send({"event": "media", "media": {**media, "payload": payload}})
        self._ts += 20

    async def stamped_by_the_clock(self, seconds: float, *, held: float = 0.0) -> None:
        """Silence for ``seconds``, stamped as Twilio stamps it (time since the start); the
        frames of the first ``held`` seconds are held back, then sent at once."""
        if self._clock_start is None:  # one clock for the whole stream, as Twilio's
            self._clock_start = time.monotonic() - self._ts / 1000
        start = self._clock_start
        end, hold_until = time.monotonic() + seconds, time.monotonic() + held
        stamps: list[int] = []
        while (now := time.monotonic()) < end:
            stamps.append(round((now - start) * 50) * 20)
            if now >= hold_until:
                for stamp in stamps:
                    await self.send_media(SILENCE, stamp)
                stamps.clear()
            await asyncio.sleep(0.02)

    async def feed_silence_until(self, done: Callable[[], bool], within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline, f"timed out; gateway sent {self.kinds()}"
            await self.feed([SILENCE])

    @contextlib.asynccontextmanager
    async def silence_meanwhile(self) -> AsyncIterator[None]:
        """Keep the line's inbound audio flowing (as Twilio does) while the test waits."""

        async def forever() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await self.feed([SILENCE])

        task = asyncio.create_task(forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def dtmf(self, digit: str) -> None:
        await self.send({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": digit}})

    def count(self, event: str) -> int:
        return sum(1 for _, kind, _ in self.events if kind == event)

    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.events]

    def media_bytes(self, after: float, until: float = float("inf")) -> int:
        return sum(n for t, kind, n in self.events if kind == "media" and after < t <= until)

    async def drop(self) -> None:
        """The network goes: the socket closes without a `stop`."""
        await self.ws.close()
        await self._reader

    async def feed_silence_until_closed(self, within: float = 10.0) -> int | None:
        """Silence until the gateway ends the stream; its close code."""
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.feed_silence_until(lambda: self.ws.close_code is not None, within)
        return await self.closed_by_gateway(within)

    async def closed_by_gateway(self, within: float = 10.0) -> int | None:
        await asyncio.wait_for(self.ws.wait_closed(), within)
        await self._reader
        return self.ws.close_code


def start_event(call_sid: str, stream_sid: str) -> dict[str, Any]:
    fmt = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
    start = {"accountSid": "AC1", "streamSid": stream_sid, "callSid": call_sid}
    return {
        "event": "start",
        "start": {**start, "tracks": ["inbound"], "customParameters": {}, "mediaFormat": fmt},
    }


# -- helpers ---------------------------------------------------------------------------------


def write_flow(directory: Path, flow: str) -> str:
    """A flows dir whose `default` route answers every number with ``flow`` (named t)."""
    (directory / "routes.yaml").write_text("default: t\n")
    (directory / "t.yaml").write_text(flow)
    return str(directory)


async def record(server: RunningServer, call_sid: str) -> CallRecord:
    found = await server.gateway.store.get(call_sid)
    assert found is not None, call_sid
    return found


async def eventually(
    server: RunningServer, call_sid: str, ok: Callable[[CallRecord], bool], within: float = 5.0
) -> CallRecord:
    deadline = time.monotonic() + within
    while True:
        current = await record(server, call_sid)
        if ok(current):
            return current
        assert time.monotonic() < deadline, f"record never got there: {current!r}"
        await asyncio.sleep(0.05)


def spoken(fake: FakeOpenAIServer) -> list[str]:
    """Every text the gateway asked TTS to say, in order."""
    return [str((r.json or {}).get("input", "")) for r in fake.requests_for("speech")]


GOODBYE = (
    "Thank you for calling, we appreciate your business and hope to hear from you again soon. "
    "Goodbye."
)

MENU_FLOW = f"""
name: t
start: menu1
defaults: {{no_input_timeout: 10, max_retries: 0}}
nodes:
  menu1:
    kind: menu
    prompt: Press one.
    options:
      - {{key: "1", next: second}}
      - {{key: "2", next: bye}}
      - {{key: "3", next: xfer}}
    fallback: bye
  second:
    kind: menu
    prompt: Now press one again.
    options:
      - {{key: "1", next: bye}}
    fallback: bye
  bye:
    kind: hangup
    say: {GOODBYE}
  xfer:
    kind: transfer
    number: "+15550009999"
    say: {GOODBYE}
"""


# -- 1. drop during the last prompt ----------------------------------------------------------


@pytest.mark.parametrize(("key", "verb"), [("2", "<Hangup"), ("3", "<Dial")])
async def test_a_stream_that_drops_during_the_goodbye_prompt_ends_the_call_instead_of_resuming(
    gateway_factory: GatewayFactory, tmp_path: Path, key: str, verb: str
) -> None:
    async with gateway_factory(flows_dir=write_flow(tmp_path, MENU_FLOW)) as server:
        path = stream_path(await voice(server.base_url, "CA1"))
        assert path
        line = await Line.open(server.base_url, path, "CA1", "MZ1")
        await line.feed_silence_until(lambda: line.count("mark") >= 1)
        await line.dtmf(key)
        pressed = time.monotonic()
        # Half a second of the goodbye has reached Twilio: it is playing when the socket goes.
        await line.feed_silence_until(lambda: line.media_bytes(pressed) >= 4000)
        await line.drop()
        await eventually(server, "CA1", lambda r: r.status != CallStatus.ACTIVE)
        twiml = await after_stream(server.base_url, "CA1")
    assert stream_path(twiml) is None, f"resumed a call that had ended: {twiml}"
    assert verb in twiml, twiml
    if verb == "<Dial":
        assert "+15550009999" in twiml


# -- 2. a conversation that fails ------------------------------------------------------------


async def test_a_conversation_that_raises_ends_with_hangup_after_one_stream(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    class Broken:
        async def run(self, io: CallIO, record: CallRecord) -> None:
            await io.say("Hello.")
            raise RuntimeError("flow bug")  # fails again on every resume

    async with gateway_factory(flows_dir=write_flow(tmp_path, MENU_FLOW)) as server:
        # The conversation seam of the per-call services, swapped for a flow that fails.
        gateway = server.gateway
        gateway.services = dataclasses.replace(gateway.services, conversation=Broken())
        twiml = await voice(server.base_url, "CA2")
        streams = 0
        while (path := stream_path(twiml)) is not None and streams < 4:
            streams += 1
            line = await Line.open(server.base_url, path, "CA2", f"MZ{streams}")
            await line.closed_by_gateway()
            twiml = await after_stream(server.base_url, "CA2")
    assert streams == 1, f"the failed call was resumed {streams - 1} times"
    assert "<Hangup" in twiml, twiml


# -- 3. one stream per token, and the newest stream owns the record ---------------------------


async def refusal(base: str, path: str, call_sid: str) -> int | str:
    """How the gateway answers a handshake: an HTTP status, a close code, or 'accepted'."""
    try:
        line = await Line.open(base, path, call_sid, "MZ-dup")
    except websockets.InvalidStatus as exc:
        return exc.response.status_code
    try:
        code = await line.closed_by_gateway(within=2.0)
    except TimeoutError:
        await line.drop()
        return "accepted"
    return code if code is not None else "closed"


async def test_a_second_handshake_with_a_used_stream_token_is_refused(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    async with gateway_factory(flows_dir=write_flow(tmp_path, MENU_FLOW)) as server:
        path = stream_path(await voice(server.base_url, "CA3"))
        assert path
        first = await Line.open(server.base_url, path, "CA3", "MZ-first")
        await first.feed_silence_until(lambda: first.count("media") > 0)
        answer = await refusal(server.base_url, path, "CA3")
        current = await record(server, "CA3")
        await first.drop()
    # Refused before the upgrade (403) or closed as a policy violation (1008).
    assert answer in (403, 1008), answer
    assert current.stream_sid == "MZ-first" and current.stream_count == 1


async def test_an_old_half_open_stream_cannot_overwrite_or_end_the_call_a_newer_stream_carries(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    async with gateway_factory(flows_dir=write_flow(tmp_path, MENU_FLOW)) as server:
        base = server.base_url
        old_path = stream_path(await voice(base, "CA4"))
        assert old_path
        old = await Line.open(base, old_path, "CA4", "MZ-old")
        await old.feed_silence_until(lambda: old.count("mark") >= 1)
        # Twilio gave up on the old stream (it is half-open, not closed) and resumed the call.
        new_path = stream_path(await after_stream(base, "CA4"))
        assert new_path
        new = await Line.open(base, new_path, "CA4", "MZ-new")
        await eventually(server, "CA4", lambda r: r.stream_sid == "MZ-new")
        await new.feed_silence_until(lambda: new.count("mark") >= 1)
        # The old stream still delivers a key press and then a `stop`.
        with contextlib.suppress(websockets.ConnectionClosed):
            await old.dtmf("1")
            await new.feed([SILENCE] * 25)
            await old.send({"event": "stop", "stop": {"callSid": "CA4"}})
        await new.feed([SILENCE] * 25)
        after_old = await record(server, "CA4")
        assert after_old.stream_sid == "MZ-new"
        assert after_old.node == "menu1", "the old stream moved the call on"
        assert not after_old.is_ended, "the old stream's stop ended the live call"
        # The new stream still carries the call: its key press moves the flow on.
        await new.dtmf("1")
        moved = await eventually(server, "CA4", lambda r: r.node == "second")
        await new.drop()
        await old.drop()
    assert moved.stream_sid == "MZ-new"


# -- 4. an answer still in STT at the no-input deadline --------------------------------------


async def test_listen_waits_for_an_answer_that_is_still_being_transcribed_at_the_deadline(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    flow = """
name: t
start: menu1
defaults: {no_input_timeout: 2, max_retries: 0}
nodes:
  menu1:
    kind: menu
    prompt: Say balance.
    options:
      - {key: "1", say: [balance], next: ok}
    fallback: bye
  ok: {kind: hangup, say: Got it.}
  bye: {kind: hangup, say: Bye.}
"""
    fake_openai.transcripts.append("balance")
    # The answer ends ~1.0 s into the 2 s timeout; its transcript arrives ~1.5 s after that.
    fake_openai.faults["transcriptions"] = Fault(delay=1.5)
    async with gateway_factory(flows_dir=write_flow(tmp_path, flow)) as server:
        path = stream_path(await voice(server.base_url, "CA5"))
        assert path
        line = await Line.open(server.base_url, path, "CA5", "MZ5")
        # The prompt has played (its end is when the no-input time starts), not only been sent.
        await line.feed_silence_until(lambda: line.count("mark") >= 1 and line.played_out())
        await line.feed([SILENCE] * 25 + speech("balance"))
        async with line.silence_meanwhile():
            ended = await eventually(server, "CA5", lambda r: r.node in ("ok", "bye"), within=6.0)
        await line.drop()
    # "ok" took the answer; "bye" is where no-input leads.
    assert ended.node == "ok", f"the answer was dropped as no-input (node {ended.node})"


# -- 5. no talking over a caller who barged in -----------------------------------------------


async def test_after_a_barge_in_the_next_prompt_does_not_play_over_the_caller_still_talking(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    flow = """
name: t
start: welcome
defaults: {no_input_timeout: 3, max_retries: 0}
nodes:
  welcome:
    kind: say
    text: Thank you for calling Acme, the company that makes everything you could possibly need.
    next: menu1
  menu1:
    kind: menu
    prompt: For your balance press one or say balance. For an agent press zero or say agent.
    options:
      - {key: "1", say: [balance], next: bye}
    fallback: bye
  bye: {kind: hangup, say: Bye.}
"""
    fake_openai.transcripts.append("balance")
    async with gateway_factory(flows_dir=write_flow(tmp_path, flow)) as server:
        path = stream_path(await voice(server.base_url, "CA6"))
        assert path
        line = await Line.open(server.base_url, path, "CA6", "MZ6")
        await line.feed([SILENCE] * 50)  # a second into the welcome
        await line.feed(speech("balance balance balance balance balance"))  # ~2.5 s
        stopped_talking = time.monotonic()
        await line.feed([SILENCE] * 10)
        await line.drop()
    clears = [t for t, kind, _ in line.events if kind == "clear"]
    assert clears, f"the caller never barged in: {line.kinds()}"
    # Frames already in flight when the clear went out may trail it by a few ms.
    talked_over = line.media_bytes(clears[0] + 0.2, stopped_talking)
    assert talked_over < 800, f"{talked_over / 8000:.2f} s of prompt played over the caller"


# -- 6. what TTS could not say was not heard -------------------------------------------------


AGENT_FLOW = """
name: t
start: assistant
nodes:
  assistant:
    kind: agent
    greeting: Hello, how can I help?
    system: Be brief.
    max_turns: 5
    on_max_turns: bye
    on_no_input: bye
  bye: {kind: hangup, say: Bye.}
"""


async def history_after_a_tts_failure(
    gateway_factory: GatewayFactory, fake: FakeOpenAIServer, tmp_path: Path, *, barge_in: bool
) -> str:
    """The assistant side of the history the LLM gets on turn 2, when TTS failed on the first
    sentence of reply 1 (played out, or cut off by the caller during its second sentence)."""
    fake.transcripts.extend(["what are your hours", "and on sunday"])
    fake.chat = [
        ChatScript(text="Our account number for payments is 12345. We are open nine to five."),
        ChatScript(text="Closed on Sundays."),
    ]
    async with gateway_factory(flows_dir=write_flow(tmp_path, AGENT_FLOW)) as server:
        path = stream_path(await voice(server.base_url, "CA7"))
        assert path
        line = await Line.open(server.base_url, path, "CA7", "MZ7")
        await line.feed_silence_until(lambda: line.count("mark") >= 1)  # greeting played
        fake.faults["speech"] = Fault(status=500, times=1)  # the reply's first sentence
        await line.feed(speech("what are your hours"))
        asked = time.monotonic()
        if barge_in:  # half a second into "We are open nine to five."
            await line.feed_silence_until(lambda: line.media_bytes(asked) >= 4000)
        else:  # the reply played out and the flow listens again
            async with line.silence_meanwhile():
                await eventually(server, "CA7", _listening_after_a_reply)
        await line.feed(speech("and on sunday"))
        await line.feed_silence_until(lambda: len(fake.requests_for("chat")) >= 2)
        await line.drop()
    second = fake.requests_for("chat")[1].json
    assert second is not None
    return " ".join(str(m["content"]) for m in second["messages"] if m["role"] == "assistant")


def _listening_after_a_reply(r: CallRecord) -> bool:
    state = r.flow_state or {}
    return state.get("waiting") == "input" and int(state.get("agent_turns", 0)) >= 1


async def test_a_sentence_tts_failed_on_is_not_in_the_history_the_llm_sees_next(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    assistant = await history_after_a_tts_failure(
        gateway_factory, fake_openai, tmp_path, barge_in=False
    )
    assert "We are open nine to five." in assistant, assistant
    assert "12345" not in assistant, f"history claims the caller heard: {assistant!r}"


async def test_a_sentence_tts_failed_on_is_not_in_the_history_after_a_barge_in_either(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    assistant = await history_after_a_tts_failure(
        gateway_factory, fake_openai, tmp_path, barge_in=True
    )
    assert "12345" not in assistant, f"history claims the caller heard: {assistant!r}"


# -- 7. a click is not a barge-in ------------------------------------------------------------


async def test_a_sound_shorter_than_min_speech_ms_does_not_interrupt_the_bot(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    flow = """
name: t
start: long
nodes:
  long:
    kind: say
    text: >-
      This is a long interruptible announcement that keeps going for quite a while so that
      we can cough over it and see what happens to it, and then talk over it for real.
    next: menu1
  menu1:
    kind: menu
    prompt: Press one.
    options:
      - {key: "1", next: bye}
    fallback: bye
  bye: {kind: hangup, say: Bye.}
"""
    burst = speech("aaaaaaaaaa")[:4]  # 80 ms, below min_speech_ms (100)
    async with gateway_factory(flows_dir=write_flow(tmp_path, flow), min_speech_ms=100) as server:
        path = stream_path(await voice(server.base_url, "CA8"))
        assert path
        line = await Line.open(server.base_url, path, "CA8", "MZ8")
        await line.feed([SILENCE] * 50)  # a second into the announcement
        await line.feed(burst + [SILENCE] * 50)
        clears_after_cough = line.count("clear")
        # Real speech over the same announcement does cut it off (the check can see a clear).
        await line.feed(speech("balance balance") + [SILENCE] * 10)
        clears_after_speech = line.count("clear")
        await line.drop()
    assert clears_after_cough == 0, "an 80 ms sound interrupted the bot"
    assert clears_after_speech >= 1


# -- 8. resuming is bounded ------------------------------------------------------------------


async def test_after_three_resumes_the_action_url_apologises_and_hangs_up(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    async with gateway_factory(flows_dir=write_flow(tmp_path, MENU_FLOW)) as server:
        twiml = await voice(server.base_url, "CA9")
        for n in range(1, 5):  # the first stream and three resumes, each dropping at once
            path = stream_path(twiml)
            assert path, f"stream {n} was not offered: {twiml}"
            line = await Line.open(server.base_url, path, "CA9", f"MZ{n}")
            sid = f"MZ{n}"
            await eventually(server, "CA9", lambda r: r.stream_sid == sid)  # noqa: B023
            await line.drop()
            await eventually(server, "CA9", lambda r: r.status != CallStatus.ACTIVE)
            twiml = await after_stream(server.base_url, "CA9")
        final = await record(server, "CA9")
    assert stream_path(twiml) is None, f"a fifth stream was offered: {twiml}"
    assert "<Say" in twiml and "Sorry" in twiml and "<Hangup" in twiml, twiml
    assert final.is_ended


# -- 9. a transfer number that is not a number -----------------------------------------------


async def test_an_invalid_transfer_number_is_not_dialled_and_the_caller_hears_an_apology(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    flow = """
name: t
start: menu1
variables: {agent_number: ""}
defaults: {no_input_timeout: 10, max_retries: 0}
nodes:
  menu1:
    kind: menu
    prompt: Press one.
    options:
      - {key: "1", next: xfer}
    fallback: bye
  xfer:
    kind: transfer
    number: "{{ agent_number }}"
    say: Transferring you.
  bye: {kind: hangup, say: Bye.}
"""
    async with gateway_factory(flows_dir=write_flow(tmp_path, flow)) as server:
        path = stream_path(await voice(server.base_url, "CA10"))
        assert path
        line = await Line.open(server.base_url, path, "CA10", "MZ10")
        await line.feed_silence_until(lambda: line.count("mark") >= 1)
        await line.dtmf("1")
        pressed = time.monotonic()
        await line.feed_silence_until_closed()
        twiml = await after_stream(server.base_url, "CA10")
    apologies = [
        r
        for r in fake_openai.requests_for("speech")
        if "can't transfer" in str((r.json or {}).get("input")) and r.time > pressed
    ]
    assert apologies, f"no apology was spoken: {spoken(fake_openai)}"
    assert "<Dial" not in twiml and stream_path(twiml) is None, twiml
    assert "<Hangup" in twiml, twiml


# -- the inbound backlog: caller audio taken up late is what an overloaded process shows ------


def backlog_samples(over: float) -> tuple[float, float]:
    """(samples so far, those over ``over`` s) of ivr_inbound_backlog_seconds."""
    name = "ivr_inbound_backlog_seconds"
    count = REGISTRY.get_sample_value(f"{name}_count") or 0.0
    within = REGISTRY.get_sample_value(f"{name}_bucket", {"le": str(over)}) or 0.0
    return count, count - within


async def test_caller_audio_that_reaches_the_gateway_late_is_counted_as_inbound_backlog(
    gateway_factory: GatewayFactory,
) -> None:
    # A process that falls behind takes each call's frames up later than Twilio stamped them
    # (at 100 calls on one core here: 4.4 s, while its event loop lagged only 43 ms). Held up
    # on the way, frames look the same to the gateway: 1.5 s held, then sent at once.
    async with gateway_factory() as server:
        path = stream_path(await voice(server.base_url, "CA-late"))
        assert path
        count0, late0 = backlog_samples(0.5)  # the process's: other tests' calls too
        line = await Line.open(server.base_url, path, "CA-late", "MZ-late")
        await line.feed([SILENCE] * 25)  # on time: the line's own delay, sampled once
        on_time, late = backlog_samples(0.5)
        assert on_time >= count0 + 1 and late == late0
        await asyncio.sleep(1.5)
        for _ in range(50):  # what the line held, then sent in one go
            await line.send_media(SILENCE)
        await line.feed([SILENCE] * 25)
        count, late = backlog_samples(0.5)
        await line.drop()
    assert count - on_time >= 3, count
    assert late >= late0 + 1, "a frame taken up ~1 s after its stamp was not counted as behind"


async def test_an_instance_that_hears_its_callers_late_takes_no_new_call_until_it_catches_up(
    gateway_factory: GatewayFactory,
) -> None:
    # Its event loop keeps time (nothing blocks it), so only the backlog says it is behind:
    # a new call would wait as long for every reply, and hears the overflow instead.
    async with gateway_factory(max_inbound_backlog_ms=200) as server:
        path = stream_path(await voice(server.base_url, "CA-behind"))
        assert path
        line = await Line.open(server.base_url, path, "CA-behind", "MZ-behind")
        await line.stamped_by_the_clock(0.6)
        status, body = await readyz(server)
        assert status == 200 and body["inbound_backlog_ms"] < 200, body
        # 1.5 s of frames held up, then sent at once: they are taken up 1.5-0 s late.
        await line.stamped_by_the_clock(1.55, held=1.5)
        status, body = await readyz(server)
        assert status == 503 and body["overloaded"] is True, body
        assert body["inbound_backlog_ms"] > 200 and body["loop_lag_ms"] < 100, body
        overflow = await voice_webhook(server)
        await line.stamped_by_the_clock(2.5)  # on time again: the late samples age out
        status, body = await readyz(server)
        assert status == 200 and body["overloaded"] is False, f"{body}"
        assert_stream(await voice_webhook(server))
        await line.drop()
    assert_apology(overflow)
