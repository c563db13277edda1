"""The simulated Twilio caller, against a small real gateway (FastAPI + uvicorn) defined here.

The test gateway validates every Twilio signature with twilio's RequestValidator, answers with
TwiML built by the twilio library, endpoints the caller's speech on 0.3 s of silent frames, and
replies with a 440 Hz tone in 100 ms chunks, each followed by a mark.
"""

from __future__ import annotations

import asyncio
import audioop
import base64
import contextlib
import json
import math
import socket
import time
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from twilio.request_validator import RequestValidator
from twilio.twiml.voice_response import Connect, Dial, VoiceResponse

from ivr.sim.caller import place_call
from ivr.sim.playout import TwilioPlayout, ulaw_decode, ulaw_encode
from ivr.sim.script import Script, ScriptError, load_script, script_from_data

TOKEN = "test-auth-token"
PUBLIC = "https://gw.example.com"
CHUNK = 800  # 100 ms of mu-law
ENDPOINT_S = 0.3


def tone_ulaw(seconds: float, freq: float = 440.0) -> bytes:
    n = int(seconds * 8000)
    pcm = b"".join(
        int(8000 * math.sin(2 * math.pi * freq * i / 8000)).to_bytes(2, "little", signed=True)
        for i in range(n)
    )
    return audioop.lin2ulaw(pcm, 2)


def tone_wav(path: Path, seconds: float, rate: int = 16000) -> Path:
    pcm = b"".join(
        int(9000 * math.sin(2 * math.pi * 300 * i / rate)).to_bytes(2, "little", signed=True)
        for i in range(int(seconds * rate))
    )
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return path


# -- the test gateway -----------------------------------------------------------------------------


@dataclass
class Gw:
    """Behaviour knobs and everything the gateway saw."""

    greeting_s: float = 0.0
    reply_delay: float = 0.4
    reply_s: float = 1.0
    clear_on_barge_in: bool = False
    close_after_first_utterance: bool = False
    close_after_reply_played: bool = False
    send_bad_messages: bool = False
    stall_at_voiced_frame: int = 0
    """Block this process's event loop (the simulated caller's too) for ``stall_s`` when the
    caller's this-many-th voiced frame arrives: a busy test process, for real."""
    stall_s: float = 0.0
    action_twiml: list[str] = field(default_factory=list)
    bad_signatures: list[str] = field(default_factory=list)
    voice_forms: list[dict[str, str]] = field(default_factory=list)
    action_forms: list[dict[str, str]] = field(default_factory=list)
    streams: list[list[dict[str, Any]]] = field(default_factory=list)
    mark_sent: dict[str, float] = field(default_factory=dict)
    mark_echo: dict[str, float] = field(default_factory=dict)
    utterance_ends: list[float] = field(default_factory=list)
    clears_sent: list[float] = field(default_factory=list)


def stream_twiml(token: str) -> str:
    resp = VoiceResponse()
    conn = Connect(action=f"{PUBLIC}/twilio/after-stream")
    st = conn.stream(url=f"wss://gw.example.com/twilio/stream/{token}")
    st.parameter(name="From", value="+15550001111")
    st.parameter(name="Token", value=token)
    resp.append(conn)
    return str(resp)


def make_app(gw: Gw) -> FastAPI:
    app = FastAPI()
    validator = RequestValidator(TOKEN)

    async def signed_form(request: Request) -> dict[str, str] | None:
        form = {k: str(v) for k, v in (await request.form()).items()}
        url = PUBLIC + request.url.path
        if not validator.validate(url, form, request.headers.get("X-Twilio-Signature", "")):
            gw.bad_signatures.append(url)
            return None
        return form

    @app.post("/twilio/voice")
    async def voice(request: Request) -> Response:
        form = await signed_form(request)
        if form is None:
            return Response(status_code=403)
        gw.voice_forms.append(form)
        return Response(stream_twiml("tok1"), media_type="application/xml")

    @app.post("/twilio/after-stream")
    async def after(request: Request) -> Response:
        form = await signed_form(request)
        if form is None:
            return Response(status_code=403)
        gw.action_forms.append(form)
        twiml = gw.action_twiml.pop(0) if gw.action_twiml else str(VoiceResponse().hangup())
        return Response(twiml, media_type="application/xml")

    @app.websocket("/twilio/stream/{token}")
    async def stream(ws: WebSocket, token: str) -> None:
        url = "wss://gw.example.com" + ws.url.path
        if not validator.validate(url, {}, ws.headers.get("x-twilio-signature", "")):
            gw.bad_signatures.append(url)
            await ws.close(code=1008)
            return
        await ws.accept()
        await _Conversation(gw, ws).run()

    return app


class _Conversation:
    def __init__(self, gw: Gw, ws: WebSocket) -> None:
        self.gw, self.ws = gw, ws
        self.seen: list[dict[str, Any]] = []
        gw.streams.append(self.seen)
        self.sid = ""
        self.lock = asyncio.Lock()
        self.speaking = False
        self.silent_frames = 0
        self.replies = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.echoed = asyncio.Event()
        self.voiced_frames = 0

    async def send(self, msg: dict[str, Any] | bytes) -> None:
        async with self.lock:
            if isinstance(msg, bytes):
                await self.ws.send_bytes(msg)
            else:
                await self.ws.send_text(json.dumps(msg))

    async def run(self) -> None:
        try:
            while True:
                msg = json.loads(await self.ws.receive_text())
                self.seen.append(msg)
                await self.on(msg)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            for t in self.tasks:
                t.cancel()

    async def on(self, msg: dict[str, Any]) -> None:
        event = msg["event"]
        if event == "start":
            self.sid = msg["start"]["streamSid"]
            if self.gw.send_bad_messages:
                await self.bad_messages()
            if self.gw.greeting_s:
                self.tasks.append(asyncio.create_task(self.play("greet", self.gw.greeting_s)))
        elif event == "mark":
            self.gw.mark_echo[msg["mark"]["name"]] = time.monotonic()
            self.echoed.set()
        elif event == "media":
            await self.on_media(base64.b64decode(msg["media"]["payload"]))

    async def on_media(self, frame: bytes) -> None:
        voiced = any(b != 0xFF for b in frame)
        self.voiced_frames += voiced
        if voiced and self.voiced_frames == self.gw.stall_at_voiced_frame:
            time.sleep(self.gw.stall_s)  # noqa: ASYNC251 -- the stall is the point
        if voiced and not self.speaking:
            self.speaking = True
            pending = [n for n in self.gw.mark_sent if n not in self.gw.mark_echo]
            if self.gw.clear_on_barge_in and pending:
                self.gw.clears_sent.append(time.monotonic())
                await self.send({"event": "clear", "streamSid": self.sid})
        self.silent_frames = 0 if voiced else self.silent_frames + 1
        if self.speaking and self.silent_frames * 0.02 >= ENDPOINT_S:
            self.speaking = False
            self.gw.utterance_ends.append(time.monotonic())
            if self.gw.close_after_first_utterance and len(self.gw.streams) == 1:
                await self.ws.close()
                return
            self.replies += 1
            self.tasks.append(asyncio.create_task(self.reply(f"r{self.replies}")))

    async def reply(self, name: str) -> None:
        await asyncio.sleep(self.gw.reply_delay)
        await self.play(name, self.gw.reply_s)
        if self.gw.close_after_reply_played:
            last = f"{name}-{int(self.gw.reply_s * 10) - 1}"
            while last not in self.gw.mark_echo:
                self.echoed.clear()
                await self.echoed.wait()
            await self.ws.close()

    async def play(self, name: str, seconds: float) -> None:
        audio = tone_ulaw(seconds)
        for i in range(0, len(audio), CHUNK):
            payload = base64.b64encode(audio[i : i + CHUNK]).decode()
            await self.send(
                {"event": "media", "streamSid": self.sid, "media": {"payload": payload}}
            )
            mark = f"{name}-{i // CHUNK}"
            self.gw.mark_sent[mark] = time.monotonic()
            await self.send({"event": "mark", "streamSid": self.sid, "mark": {"name": mark}})

    async def bad_messages(self) -> None:
        ok = base64.b64encode(b"\xff" * 160).decode()
        await self.send({"event": "media", "streamSid": "MZwrong", "media": {"payload": ok}})
        short = base64.b64encode(b"\x7f" * 100).decode()
        await self.send({"event": "media", "streamSid": self.sid, "media": {"payload": short}})
        await self.send({"event": "hello", "streamSid": self.sid})
        await self.send(b"\xff" * 160)
        extra = {"payload": ok, "track": "outbound"}
        await self.send({"event": "media", "streamSid": self.sid, "media": extra})


@contextlib.asynccontextmanager
async def serving(gw: Gw) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(gw), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 -- uvicorn offers a flag, not an event
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def script(steps: list[Any], **opts: Any) -> Script:
    return script_from_data({"steps": steps, **opts})


# -- playout model (explicit clock values) --------------------------------------------------------


def media(sid: str, n: int, byte: int = 0x7F) -> str:
    payload = base64.b64encode(bytes([byte]) * n).decode()
    return json.dumps({"event": "media", "streamSid": sid, "media": {"payload": payload}})


def mark(sid: str, name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": sid, "mark": {"name": name}})


def test_a_mark_is_echoed_only_when_the_audio_queued_before_it_has_played() -> None:
    p = TwilioPlayout("MZ1", t0=100.0)
    p.receive(media("MZ1", 8000), now=100.0)
    p.receive(mark("MZ1", "end"), now=100.1)
    assert p.next_mark_time() == pytest.approx(101.0)
    assert p.due_marks(now=100.99) == []
    [echo] = p.due_marks(now=101.0)
    assert (echo.name, echo.cleared) == ("end", False)


def test_a_mark_with_nothing_queued_is_due_at_once() -> None:
    p = TwilioPlayout("MZ1", t0=0.0)
    p.receive(mark("MZ1", "m"), now=5.0)
    assert [e.name for e in p.due_marks(now=5.0)] == ["m"]


def test_clear_drops_unplayed_audio_and_releases_every_pending_mark() -> None:
    p = TwilioPlayout("MZ1", t0=0.0)
    p.receive(media("MZ1", 4000), now=1.0)
    p.receive(mark("MZ1", "a"), now=1.0)
    p.receive(media("MZ1", 4000), now=1.0)
    p.receive(mark("MZ1", "b"), now=1.0)
    p.receive(json.dumps({"event": "clear", "streamSid": "MZ1"}), now=1.25)
    echoes = p.due_marks(now=1.25)
    assert [(e.name, e.cleared) for e in echoes] == [("a", True), ("b", True)]
    played = sum(len(s.audio) for s in p.segments)
    assert played == 2000  # 0.25 s of the 1 s queued
    track = p.render(3 * 8000)
    assert track[8000:10000] == b"\x7f" * 2000 and track[10000:] == b"\xff" * 14000


def test_audio_arriving_faster_than_real_time_plays_back_to_back() -> None:
    p = TwilioPlayout("MZ1", t0=0.0)
    for _ in range(5):
        p.receive(media("MZ1", 800), now=2.0)
    assert [s.start for s in p.segments] == [16000, 16800, 17600, 18400, 19200]
    assert p.queued_until() == pytest.approx(2.5)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (media("MZwrong", 160), "31951"),
        (media("MZ1", 100), "frame-size"),
        ('{"event": "media", "streamSid": "MZ1", "media": {"payload": "%%%"}}', "31951"),
        ('{"event": "clear", "streamSid": "MZ1", "sequenceNumber": "3"}', "31951"),
        ('{"event": "hello", "streamSid": "MZ1"}', "31951"),
        ("not json", "31951"),
        (b"\xff" * 160, "31950"),
    ],
)
def test_invalid_outbound_messages_are_counted_with_twilios_error_codes(
    frame: str | bytes, code: str
) -> None:
    p = TwilioPlayout("MZ1", t0=0.0)
    p.receive(frame, now=0.0)
    assert [v.code for v in p.violations] == [code]


def test_the_mulaw_codec_decodes_like_audioop_and_round_trips_within_one_step() -> None:
    every = bytes(range(256))
    assert ulaw_decode(every) == audioop.ulaw2lin(every, 2)
    pcm = np.arange(-32768, 32768, 7, dtype="<i2").tobytes()
    ours = np.frombuffer(ulaw_encode(pcm), np.uint8).astype(int)
    ref = np.frombuffer(audioop.lin2ulaw(pcm, 2), np.uint8).astype(int)
    # Same quantiser as audioop (which truncates to 14 bits first) up to one code at boundaries.
    assert np.abs(ours - ref).max() == 1 and np.mean(ours != ref) < 0.02
    assert ulaw_encode(b"\x00\x00") == b"\xff"


# -- scripts --------------------------------------------------------------------------------------


def test_a_yaml_script_loads_every_step_kind_relative_to_its_file(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "turn_gap: 0.5\nsteps:\n  - hello\n  - press: '12#'\n  - wav: a.wav\n"
        "  - silence: 1\n  - barge_in: {say: stop, after: 0.2}\n  - hangup:\n"
    )
    s = load_script(tmp_path / "s.yaml")
    assert [st.kind for st in s.steps] == ["say", "press", "wav", "silence", "barge_in", "hangup"]
    assert s.steps[2].wav == tmp_path / "a.wav"  # type: ignore[union-attr]
    assert s.turn_gap == 0.5


def test_a_bad_script_step_is_reported_with_its_position() -> None:
    with pytest.raises(ScriptError, match=r"steps\.1.*press"):
        script_from_data(["hi", {"press": "12x"}])


# -- whole calls against the test gateway ---------------------------------------------------------


async def test_a_call_measures_latency_echoes_marks_after_playout_and_follows_the_action(
    tmp_path: Path,
) -> None:
    dial = VoiceResponse()
    dial.append(Dial("+15550009999"))
    gw = Gw(greeting_s=0.3, close_after_reply_played=True, action_twiml=[str(dial)])
    wav = tone_wav(tmp_path / "hi.wav", 0.5)
    async with serving(gw) as base:
        report = await place_call(
            base,
            script=script([{"wav": str(wav)}]),
            auth_token=TOKEN,
            public_base_url=PUBLIC,
            record_path=tmp_path / "call.wav",
        )
    assert report.errors == [] and report.violations == [] and gw.bad_signatures == []
    form = gw.voice_forms[0]
    assert (form["CallStatus"], form["Direction"], form["ApiVersion"]) == (
        "ringing",
        "inbound",
        "2010-04-01",
    )
    seen = gw.streams[0]
    assert seen[0] == {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    start = seen[1]["start"]
    assert start["customParameters"] == {"From": "+15550001111", "Token": "tok1"}
    assert start["callSid"] == form["CallSid"] and start["tracks"] == ["inbound"]
    assert start["mediaFormat"] == {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
    assert [m["sequenceNumber"] for m in seen[1:]] == [str(i) for i in range(1, len(seen))]
    chunks = [m["media"] for m in seen if m["event"] == "media"]
    assert [c["chunk"] for c in chunks] == [str(i) for i in range(1, len(chunks) + 1)]
    assert all(len(base64.b64decode(c["payload"])) == 160 for c in chunks)
    # Each reply mark echoes once the audio queued before it has played: (i+1) * 100 ms after
    # the first chunk was sent, not when it arrived.
    t_first = gw.mark_sent["r1-0"]
    for i in range(10):
        waited = gw.mark_echo[f"r1-{i}"] - t_first
        assert waited == pytest.approx((i + 1) * 0.1, abs=0.06)
    greet, turn = report.turns
    assert greet.caller_text is None and greet.bot_audio_seconds == pytest.approx(0.3)
    assert turn.latency_s == pytest.approx(ENDPOINT_S + gw.reply_delay, abs=0.1)
    assert turn.bot_audio_seconds == pytest.approx(1.0)
    assert report.marks_echoed == 13 and report.marks_cleared == 0
    assert gw.action_forms[0]["CallSid"] == form["CallSid"]
    assert report.closing_twiml is not None and "<Dial>+15550009999</Dial>" in report.closing_twiml
    assert report.streams[0].ended_by == "gateway"
    with wave.open(str(tmp_path / "call.wav")) as w:
        assert (w.getnchannels(), w.getframerate()) == (2, 8000)
        assert w.getnframes() == pytest.approx(report.duration_s * 8000, abs=8)


async def test_a_caller_whose_frames_go_out_late_reports_latency_from_the_frame_clock(
    tmp_path: Path,
) -> None:
    """The caller's last words are sent ~0.26 s late (the process stalls 0.3 s two frames
    before they are due), as a busy test process sends them. The gateway counts its silence
    in frames, as ours counts Twilio's timestamps, so it answers 0.3 + 0.4 s after the words
    ended on the frame clock; measured from their late send, the reply read ~0.26 s short."""
    gw = Gw(stall_at_voiced_frame=23, stall_s=0.3)
    wav = tone_wav(tmp_path / "hi.wav", 0.5)  # 25 voiced frames
    async with serving(gw) as base:
        report = await place_call(
            base, script=script([{"wav": str(wav)}]), auth_token=TOKEN, public_base_url=PUBLIC
        )
    assert report.errors == [] and gw.utterance_ends
    (turn,) = report.turns
    assert turn.latency_s == pytest.approx(ENDPOINT_S + gw.reply_delay, abs=0.1)


async def test_barge_in_speech_gets_a_clear_that_drops_queued_audio_and_echoes_marks_at_once() -> (
    None
):
    gw = Gw(clear_on_barge_in=True, reply_delay=0.1)
    steps = ["hello there", {"barge_in": {"say": "stop please", "after": 0.3}}]
    async with serving(gw) as base:
        report = await place_call(
            base,
            script=script(steps, wait_for_greeting=False),
            auth_token=TOKEN,
            public_base_url=PUBLIC,
        )
    assert report.errors == [] and report.violations == []
    assert len(gw.clears_sent) == 1 and len(report.clears) == 1
    cleared = [n for n, t in gw.mark_echo.items() if n.startswith("r1-") and t >= gw.clears_sent[0]]
    assert len(cleared) >= 4  # at most ~0.45 s of the 1 s reply can have played
    for name in cleared:
        assert gw.mark_echo[name] - gw.clears_sent[0] < 0.06
    first, barge = report.turns
    assert first.interrupted and first.bot_audio_seconds < 0.6
    assert barge.caller_text == "stop please" and barge.bot_audio_seconds == pytest.approx(1.0)
    assert report.streams[0].ended_by == "caller"
    stop = gw.streams[0][-1]
    assert stop["event"] == "stop" and stop["stop"]["callSid"] == report.call_sid
    assert gw.action_forms == []  # the caller hung up: nothing left to ask for


async def test_dtmf_goes_out_as_twilio_json_and_bad_gateway_messages_are_counted() -> None:
    gw = Gw(send_bad_messages=True)
    steps = [{"press": "12#", "gap": 0.1}, {"silence": 0.2}, {"hangup": None}]
    async with serving(gw) as base:
        report = await place_call(
            base,
            script=script(steps, wait_for_greeting=False),
            auth_token=TOKEN,
            public_base_url=PUBLIC,
        )
    dtmf = [m for m in gw.streams[0] if m["event"] == "dtmf"]
    assert [m["dtmf"] for m in dtmf] == [{"track": "inbound_track", "digit": d} for d in "12#"]
    assert all(set(m) == {"event", "sequenceNumber", "streamSid", "dtmf"} for m in dtmf)
    assert [v.code for v in report.violations] == ["31951", "frame-size", "31951", "31950", "31951"]


async def test_a_new_connect_stream_from_the_action_resumes_the_script_on_a_new_stream(
    tmp_path: Path,
) -> None:
    gw = Gw(close_after_first_utterance=True, greeting_s=0.2, action_twiml=[stream_twiml("tok2")])
    wav = str(tone_wav(tmp_path / "a.wav", 0.4))
    async with serving(gw) as base:
        report = await place_call(
            base,
            script=script([{"wav": wav}, {"wav": wav}]),
            auth_token=TOKEN,
            public_base_url=PUBLIC,
        )
    assert report.errors == [] and gw.bad_signatures == []
    first, second = report.streams
    assert first.ended_by == "gateway" and second.ended_by == "caller"
    assert first.stream_sid != second.stream_sid
    assert second.custom_parameters["Token"] == "tok2"
    assert gw.streams[1][1]["sequenceNumber"] == "1"
    assert len(report.resume_gaps_s) == 1 and 0 < report.resume_gaps_s[0] < 0.5
    assert report.turns[-1].latency_s == pytest.approx(ENDPOINT_S + gw.reply_delay, abs=0.1)


async def test_a_wrong_auth_token_is_rejected_by_the_gateway_and_reported() -> None:
    gw = Gw()
    async with serving(gw) as base:
        report = await place_call(
            base, script=script(["hi"]), auth_token="wrong", public_base_url=PUBLIC
        )
    assert gw.bad_signatures == [f"{PUBLIC}/twilio/voice"]
    assert report.streams == [] and "HTTP 403" in report.errors[0]
