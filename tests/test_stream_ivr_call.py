"""``ivr call`` end to end with each streaming provider: the command a user runs, against a
gateway whose STT and voice are built from the settings (as ``ivr serve`` builds them) and point
at local servers speaking Deepgram's, OpenAI Realtime's, Cartesia's and ElevenLabs' protocols."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from conftest import AUTH_TOKEN, PUBLIC_URL, provider_settings
from stream_calls import KEY, SAID, deepgram, realtime, script, user_said
from streaming_fixtures import VOICE_SERVERS

from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.server import running_server
from ivr.sim.cli import run_cli
from ivr.testing.deepgram_server import FakeDeepgramServer
from ivr.testing.openai_realtime_server import FakeOpenAIRealtimeServer
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer
from ivr.testing.tts_script import TtsScript

REPLY = "We are open nine to five."


@pytest.mark.parametrize(
    ("stt", "voice"),
    [("deepgram", "cartesia"), ("openai-realtime", "elevenlabs"), ("deepgram-flux", "elevenlabs")],
)
async def test_ivr_call_runs_a_call_through_streaming_stt_and_a_streaming_voice(
    fake_openai: FakeOpenAIServer,
    dg: FakeDeepgramServer,
    rt: FakeOpenAIRealtimeServer,
    capsys: pytest.CaptureFixture[str],
    stt: str,
    voice: str,
) -> None:
    fake_openai.chat = [ChatScript(text=REPLY)]
    words: dict[str, Any] = realtime(rt) if stt == "openai-realtime" else deepgram(dg)
    if stt == "deepgram-flux":
        words = deepgram(dg, flux=True)
    (rt if stt == "openai-realtime" else dg).script = script()
    async with VOICE_SERVERS[voice](api_key=KEY) as speaker:
        # The flows' prompts are synthesised one by one at startup: at once here.
        speaker.script = TtsScript(first_audio=0.01, speed=0)
        settings = provider_settings(
            **words,
            tts_provider=voice,
            **{f"{voice}_api_key": KEY, f"{voice}_voice": "voice-1", f"{voice}_url": speaker.url},
        )
        built = build_gateway(
            settings,
            llm=OpenAICompatLlm(base_url=fake_openai.base_url, api_key="sk-test", model="m"),
        )
        async with running_server(built) as server:
            speaker.script = TtsScript(first_audio=0.12, speed=4)
            argv = ["--url", server.base_url, "--public-url", PUBLIC_URL]
            argv += ["--auth-token", AUTH_TOKEN, "--say", "What are your opening hours?", "--json"]
            code = await asyncio.to_thread(run_cli, argv)
            await asyncio.sleep(0.3)  # the stream's teardown: the STT session's end
        out = capsys.readouterr().out  # the gateway's log lines, and the command's report
        report, _ = json.JSONDecoder().raw_decode(out, out.index("\n{\n") + 1)
        sent = [m for c in speaker.connections for m in c.json_received()]
    texts = [str(m.get("transcript") or m.get("text") or "") for m in sent]
    assert code == 0, report
    assert user_said(fake_openai) == [SAID]  # heard by the streaming STT
    replies = [t for t in report["turns"] if t["caller_text"] and t["bot_audio_seconds"] > 0]
    assert replies and replies[0]["latency_s"] < 1.5, report["turns"]
    assert "nine to five" in " ".join(texts), texts  # voiced by the streaming voice
