"""Call recording: what the gateway writes (caller left, bot right as heard, cut at a barge-in),
which calls it records, sinks that fail without the call noticing, S3 over the real wire
protocol (``moto_server``), retention, and the console route that plays a recording."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import soundfile
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory, record_of
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16
from ivr.flows.loader import load_flow_text
from ivr.flows.problems import FlowLoadError
from ivr.flows.spec import RecordingSpec
from ivr.recording.recorder import CallRecorder
from ivr.recording.service import Recordings
from ivr.recording.sinks import LocalDirSink, RecordingError, S3Config, S3Sink
from ivr.server import RunningServer
from ivr.sim.caller import place_call
from ivr.sim.report import CallReport
from ivr.state.memory import MemoryCallStore
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall

RATE = 8000
WINDOW = RATE // 10  # 100 ms
LOUD_RMS = 200.0
"""Above this a 100 ms window has speech in it (the tones and espeak are far louder)."""
LONG_REPLY = (
    "Our opening hours are nine to five on weekdays. On Saturdays we open at ten. "
    "We are closed on Sundays and public holidays. You can also reach us online at any time."
)
CONSENT = "This call is recorded."
ADMIN = "recording-admin-token"
FLOW = """\
name: default
start: assistant
{recording}
nodes:
  assistant:
    kind: agent
    greeting: Hello, you've reached Acme.
    system: You are a helpful phone assistant.
    tools:
      - name: end_call
        description: The caller is done.
        next: goodbye
    on_no_input: goodbye
  goodbye:
    kind: hangup
    say: Goodbye!
"""

Pcm = npt.NDArray[np.int16]


def flows_with(tmp_path: Path, recording: str) -> str:
    """A flows directory holding one agent flow whose ``recording:`` block is ``recording``."""
    folder = tmp_path / "flows"
    folder.mkdir()
    (folder / "default.yaml").write_text(FLOW.format(recording=recording))
    return str(folder)


def recordings_total(outcome: str) -> float:
    return REGISTRY.get_sample_value("ivr_recordings_total", {"outcome": outcome}) or 0.0


async def call(server: RunningServer, script: list[Any], **kwargs: Any) -> CallReport:
    report = await place_call(
        server.base_url,
        script=script,
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        **kwargs,
    )
    assert not report.errors and not report.violations, report.format_transcript()
    return report


async def saved(server: RunningServer) -> Recordings:
    recordings = server.gateway.services.recordings
    assert recordings is not None
    # The stream hands its recording over as it tears down, just after the caller hangs up.
    for _ in range(50):
        await recordings.wait_saved()
        await asyncio.sleep(0.05)
    return recordings


def rms(x: Pcm) -> npt.NDArray[np.float64]:
    n = x.size // WINDOW
    frames = x[: n * WINDOW].astype(np.float64).reshape(n, WINDOW)
    return np.sqrt((frames**2).mean(axis=1))


def read_stereo(path: Path) -> tuple[Pcm, Pcm]:
    data, rate = soundfile.read(path, dtype="int16")
    assert rate == RATE and data.ndim == 2 and data.shape[1] == 2
    return data[:, 0], data[:, 1]


# -- the recorder on a controlled clock --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bot_plays_after_what_is_queued_and_a_clear_drops_the_unplayed_tail() -> None:
    clock = Clock()
    recorder = CallRecorder("CA1", "MZ1", max_seconds=60, clock=clock)
    tone = pcm16_to_ulaw((np.full(RATE, 8000, dtype="<i2")).tobytes())  # 1 s
    recorder.caller_audio(tone[:160], 0.0)  # stream time 0 = clock 100.0
    recorder.bot_audio(tone[:4000])  # 0.5 s sent at once: plays 0.0-0.5
    recorder.bot_audio(tone[:4000])  # queued behind it: plays 0.5-1.0
    clock.now = 100.7
    recorder.bot_cleared()  # the caller cut in at 0.7: 0.7-1.0 is never heard
    clock.now = 101.0
    recorder.caller_audio(tone[:160], 1.0)
    recorder.stop()
    rendered = recorder.render()
    caller, bot = rendered.stereo[:, 0], rendered.stereo[:, 1]
    assert rendered.seconds == pytest.approx(1.02)
    assert np.all(bot[: int(0.7 * RATE)] != 0)
    assert np.all(bot[int(0.7 * RATE) :] == 0)
    assert np.all(caller[:160] != 0) and np.all(caller[160:RATE] == 0)
    assert np.all(caller[RATE : RATE + 160] != 0)


def test_audio_still_queued_when_the_stream_ends_is_not_in_the_recording() -> None:
    clock = Clock()
    recorder = CallRecorder("CA1", "MZ1", max_seconds=60, clock=clock)
    recorder.caller_audio(b"\x00" * 160, 0.0)
    recorder.bot_audio(b"\x00" * RATE)  # 1 s sent, the stream ends after 0.25 s
    clock.now = 100.25
    recorder.stop()
    recorder.bot_audio(b"\x00" * RATE)  # ignored: the stream is over
    bot = recorder.render().stereo[:, 1]
    assert np.count_nonzero(bot) == int(0.25 * RATE)


def test_a_call_longer_than_the_limit_is_recorded_up_to_it() -> None:
    recorder = CallRecorder("CA1", "MZ1", max_seconds=1, clock=Clock())
    for i in range(100):  # 2 s of caller audio
        recorder.caller_audio(b"\x00" * 160, i * 0.02)
    rendered = recorder.render()
    assert rendered.truncated and rendered.seconds == pytest.approx(1.0)


def test_a_flow_that_says_never_wins_over_a_call_that_asks() -> None:
    assert RecordingSpec(enabled="never").records(asked=True) is False
    assert RecordingSpec(enabled=True).records(asked=False) is True
    assert RecordingSpec().records(asked=True) is True
    assert RecordingSpec().records(asked=False) is False


def test_a_misspelt_recording_setting_is_refused_with_its_place_and_the_choices() -> None:
    text = FLOW.format(recording="recording: {enabled: nevr}")
    with pytest.raises(FlowLoadError) as refused:
        load_flow_text(text, "flows/default.yaml")
    message = str(refused.value)
    assert "flows/default.yaml:3:" in message
    assert "true, false or never, got 'nevr'" in message


# -- whole calls through the gateway ---------------------------------------------------------


@pytest.mark.slow
async def test_a_barge_in_cuts_the_recorded_bot_channel_where_the_caller_interrupted(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    fake_openai.transcripts.extend(["opening hours", "thanks"])
    fake_openai.chat = [ChatScript(text=LONG_REPLY), ChatScript(text="You're welcome.")]
    script = [
        "When are you open?",
        {"barge_in": {"say": "Thanks, bye.", "after": 1.5}},
        {"silence": 2.0},
        {"hangup": None},
    ]
    store_dir = tmp_path / "recordings"
    flows = flows_with(tmp_path, f"recording: {{enabled: true, consent_prompt: {CONSENT}}}")
    heard = tmp_path / "caller-side.wav"
    async with gateway_factory(recording_dir=str(store_dir), flows_dir=flows) as server:
        report = await call(server, script, record_path=heard)
        await saved(server)
        record = await record_of(server, report)
        consent = server.gateway.services.prompts.get(server.gateway.tts.voice, CONSENT)
    assert consent is not None, "the consent prompt is synthesised ahead, like every prompt"
    assert report.clears, "the caller's barge-in must clear Twilio's buffer"
    assert record.record_call and len(record.recordings) == 1
    location = record.recordings[0]
    assert location.startswith("local:") and location.endswith(".flac")
    path = store_dir / location.removeprefix("local:")
    gw_caller, gw_bot = read_stereo(path)
    sim_caller, sim_bot = read_stereo(heard)
    # The gateway's time 0 is the stream's start; the simulated caller's is the call's.
    offset = round(report.streams[0].started_t * RATE)
    sim_caller, sim_bot = sim_caller[offset:], sim_bot[offset:]
    n = min(gw_caller.size, sim_caller.size) // WINDOW
    for gw, sim, side in ((gw_caller, sim_caller, "caller"), (gw_bot, sim_bot, "bot")):
        gw_loud = rms(gw)[:n] > LOUD_RMS
        sim_loud = rms(sim)[:n] > LOUD_RMS
        agree = float(np.mean(gw_loud == sim_loud))
        assert agree >= 0.95, f"{side}: loud windows agree in only {agree:.0%}"
        assert sim_loud.sum() >= 10, f"{side}: the call should have had {side} speech"
    # The cut: loud until the caller interrupted, digital silence from the clear on, as heard.
    clear = round((report.clears[0] - report.streams[0].started_t) * RATE)
    before = gw_bot[clear - RATE // 2 : clear - RATE // 20]
    after = gw_bot[clear + RATE // 50 : clear + int(0.8 * RATE)]
    assert rms(before).min() > LOUD_RMS, "the reply played until the caller cut in"
    assert np.all(after == 0), f"{np.count_nonzero(after)} samples of the dropped tail recorded"
    assert np.all(sim_bot[clear + RATE // 50 : clear + int(0.8 * RATE)] == 0)
    # The consent prompt came first, sample for sample what was sent (FLAC is lossless).
    expected = np.frombuffer(ulaw_to_pcm16(consent), dtype="<i2")
    start = int(np.flatnonzero(gw_bot)[0]) - int(np.flatnonzero(expected)[0])
    said = gw_bot[start : start + expected.size]
    assert float(np.mean(said == expected)) > 0.99


@pytest.mark.slow
async def test_a_flow_that_says_never_record_leaves_no_file(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    fake_openai.transcripts.append("hello")
    fake_openai.chat = [ChatScript(text="Hi.")]
    store_dir = tmp_path / "recordings"
    flows = flows_with(tmp_path, "recording: {enabled: never, consent_prompt: Never said.}")
    before = recordings_total("saved") + recordings_total("failed")
    async with gateway_factory(recording_dir=str(store_dir), flows_dir=flows) as server:
        report = await call(server, ["Hello."])
        await saved(server)
        record = await record_of(server, report)
    assert not record.record_call and record.recordings == []
    assert not store_dir.exists() or not any(store_dir.rglob("*"))
    assert recordings_total("saved") + recordings_total("failed") == before
    spoken = [r.json.get("input") for r in fake_openai.requests_for("speech") if r.json]
    assert spoken and "Never said." not in spoken


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "reason"),
    [("file", "not_a_directory"), ("/sys/ivr-recordings", "not_writable")],
)
async def test_a_sink_that_fails_never_affects_the_call_and_is_counted(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    where: str,
    reason: str,
) -> None:
    fake_openai.transcripts.extend(["what are your opening hours", "thanks bye"])
    fake_openai.chat = [
        ChatScript(text="Nine to five."),
        ChatScript(tool_calls=[ScriptToolCall("end_call")]),
    ]
    if where == "file":  # a file where the recordings directory should be
        blocker = tmp_path / "blocker"
        blocker.write_text("not a directory")
        where = str(blocker / "recordings")
    flows = flows_with(tmp_path, "recording: {enabled: true}")
    failed = recordings_total("failed")
    async with gateway_factory(recording_dir=where, flows_dir=flows) as server:
        with capture_logs() as logs:
            report = await call(server, ["What are your opening hours?", "Thanks, bye."])
            await saved(server)
        record = await record_of(server, report)
    # The call went as it would have: every caller turn answered, the answer in the record.
    assert [t.bot_audio_seconds > 0 for t in report.turns] == [True, True, True]
    assert [m.content for m in record.history][:3] == [
        "Hello, you've reached Acme.",
        "what are your opening hours",
        "Nine to five.",
    ]
    assert record.recordings == []
    assert recordings_total("failed") == failed + 1
    [failure] = [e for e in logs if e["event"] == "recording.failed"]
    assert failure["reason"] == reason and failure["call_sid"] == report.call_sid


# -- S3 over the wire: moto_server -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "recording-test",
        "AWS_SECRET_ACCESS_KEY": "recording-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_server(s3_credentials: None) -> Iterator[str]:
    """A real S3 wire-protocol server (moto's) in its own process; yields its endpoint URL."""
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    assert moto is not None, "moto_server is missing: pip install 'moto[server]'"
    port = free_port()
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/moto-api/", timeout=1).status_code < 500:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "moto_server died"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def s3_sink(url: str, bucket: str = "calls") -> S3Sink:
    return S3Sink(S3Config(bucket=bucket, endpoint_url=url, attempts=2, connect_timeout=1))


@pytest.mark.slow
async def test_a_call_is_recorded_to_an_s3_bucket_and_the_console_plays_it(
    gateway_factory: GatewayFactory,
    fake_openai: FakeOpenAIServer,
    tmp_path: Path,
    s3_server: str,
) -> None:
    fake_openai.transcripts.append("hello")
    fake_openai.chat = [ChatScript(text="Hi there.")]
    sink = s3_sink(s3_server)
    await asyncio.to_thread(sink._client.create_bucket, Bucket="calls")
    settings = {
        "recording_s3_bucket": "calls",
        "recording_s3_url": s3_server,
        "flows_dir": flows_with(tmp_path, "recording: {enabled: true}"),
        "admin_token": ADMIN,
    }
    async with (
        gateway_factory(**settings) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10) as http,
    ):
        report = await call(server, ["Hello."])
        await saved(server)
        record = await record_of(server, report)
        [location] = record.recordings
        path = f"/console/api/calls/{report.call_sid}/recording"
        refused = await http.get(path)
        wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
        missing = await http.get(f"{path}?part=1", headers={"Authorization": f"Bearer {ADMIN}"})
        played = await http.get(path, headers={"Authorization": f"Bearer {ADMIN}"})
    assert location.startswith("s3://calls/recordings/") and location.endswith(".flac")
    assert refused.status_code == 401 and wrong.status_code == 401
    assert missing.status_code == 404
    assert played.status_code == 200 and played.headers["content-type"] == "audio/flac"
    body = await asyncio.to_thread(sink.open, location)
    stored = b"".join(body.chunks)
    assert played.content == stored and len(stored) == body.size
    local = tmp_path / "from-s3.flac"
    local.write_bytes(stored)
    caller, bot = read_stereo(local)
    assert caller.size == bot.size > 2 * RATE
    assert (rms(caller) > LOUD_RMS).any() and (rms(bot) > LOUD_RMS).any()
    # Retention over the wire: nothing is older than an hour ago; everything is older than soon.
    assert await asyncio.to_thread(sink.delete_older_than, time.time() - 3600) == 0
    assert await asyncio.to_thread(sink.delete_older_than, time.time() + 60) == 1
    listed = await asyncio.to_thread(sink._client.list_objects_v2, Bucket="calls")
    assert listed.get("KeyCount", 0) == 0


class _ResettingServer:
    """Accepts TCP connections and resets each one at once (RST): a broken S3 endpoint."""

    def __init__(self) -> None:
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _ResettingServer:
        async def reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            writer.close()

        self._server = await asyncio.start_server(reset, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def resetting_s3() -> AsyncIterator[str]:
    async with _ResettingServer() as server:
        yield server.url


def fed_recorder(seconds: float = 1.0) -> CallRecorder:
    recorder = CallRecorder("CA" + "0" * 32, "MZ" + "1" * 32, max_seconds=60)
    tone = pcm16_to_ulaw(np.full(160, 4000, dtype="<i2").tobytes())
    for i in range(int(seconds * 50)):
        recorder.caller_audio(tone, i * 0.02)
    return recorder


@pytest.mark.parametrize("endpoint", ["refused", "reset"])
async def test_an_s3_endpoint_that_refuses_or_resets_is_counted_as_failed(
    s3_credentials: None, resetting_s3: str, endpoint: str
) -> None:
    url = f"http://127.0.0.1:{free_port()}" if endpoint == "refused" else resetting_s3
    recordings = Recordings(s3_sink(url), MemoryCallStore())
    failed = recordings_total("failed")
    with capture_logs() as logs:
        recordings.finish(fed_recorder())
        await recordings.wait_saved()
    await recordings.aclose()
    assert recordings_total("failed") == failed + 1
    [failure] = [e for e in logs if e["event"] == "recording.failed"]
    assert failure["reason"] == "unreachable" and failure["sink"] == "s3"


# -- retention -------------------------------------------------------------------------------


async def test_retention_deletes_recordings_older_than_the_setting(tmp_path: Path) -> None:
    sink = LocalDirSink(tmp_path / "recordings")
    recordings = Recordings(sink, MemoryCallStore(), retention_days=7)
    source = tmp_path / "call.flac"
    source.write_bytes(b"fLaC")
    old = sink.save(source, "2026/01/01/CAold/MZold.flac")
    new = sink.save(source, "2026/11/23/CAnew/MZnew.flac")
    old_path = sink.root / old.removeprefix("local:")
    ten_days_ago = time.time() - 10 * 86400
    os.utime(old_path, (ten_days_ago, ten_days_ago))
    assert await recordings.expire() == 1
    await recordings.aclose()
    assert not old_path.exists() and not (sink.root / "2026/01").exists()  # folders too
    assert (sink.root / new.removeprefix("local:")).exists()


def test_a_stored_location_cannot_name_a_file_outside_the_sink(tmp_path: Path) -> None:
    sink = LocalDirSink(tmp_path / "recordings")
    (tmp_path / "secret.flac").write_bytes(b"x")
    for location in ("local:../secret.flac", "local:/etc/passwd", "s3://calls/x.flac"):
        with pytest.raises(RecordingError):
            sink.open(location)


# -- the console's player in a real browser --------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium (Playwright drives it; never `playwright install`)."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: run scripts/setup-ops")
    return CHROMIUM


@pytest.mark.slow
async def test_a_browser_plays_an_ended_calls_recording_from_the_console(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path, chromium: str
) -> None:
    from playwright.async_api import async_playwright, expect

    fake_openai.transcripts.append("hello")
    fake_openai.chat = [ChatScript(text="Hi there.")]
    store_dir = tmp_path / "recordings"
    settings = {
        "admin_token": ADMIN,
        "recording_dir": str(store_dir),
        "flows_dir": flows_with(tmp_path, "recording: {enabled: true}"),
    }
    ARTIFACTS.mkdir(exist_ok=True)
    async with gateway_factory(**settings) as server, async_playwright() as pw:
        report = await call(server, ["Hello."])
        await saved(server)
        [location] = (await record_of(server, report)).recordings
        seconds = soundfile.info(store_dir / location.removeprefix("local:")).duration
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{server.base_url}/console")
        await page.fill("#token", ADMIN)
        await page.click("#login-form button")
        await expect(page.locator("#link-state")).to_have_text("live", timeout=5000)
        await page.fill("#sid", report.call_sid)
        await page.click("#open-sid")
        audio = page.locator("#recording audio")
        await expect(audio).to_have_count(1, timeout=10_000)
        await expect(audio).to_have_attribute("src", re.compile(r"^blob:"), timeout=10_000)
        duration = await audio.evaluate(
            """a => new Promise((ok, fail) => {
                if (a.readyState >= 1) return ok(a.duration);
                a.addEventListener("loadedmetadata", () => ok(a.duration));
                a.addEventListener("error", () => fail(new Error(`media error ${a.error.code}`)));
            })"""
        )
        await page.screenshot(path=str(ARTIFACTS / "console-recording.png"), full_page=True)
        await browser.close()
    assert duration == pytest.approx(seconds, abs=0.05), "the browser decoded the whole file"
    assert not errors, errors
