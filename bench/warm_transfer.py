"""What a warm transfer costs in time and in requests, against the local Twilio REST stand-in.

A real gateway (in-process, uvicorn) with fake OpenAI-compatible providers (real HTTP, instant
answers) and the REST stand-in with its conference rooms and an agent's phone
(``ivr.sim.conference``). Each run places one simulated call that presses 2 at a warm transfer
node; the agent answers (``--answered``) or not, alternately. Printed per phase (median, max):

* prompt end -> caller redirected into the hold (the REST update leaves the gateway);
* redirect -> agent dialled (``Calls.json`` create; template summary, or ``--llm-delay``);
* no-answer callback -> the caller hears the fallback prompt (REST redirect to a new stream,
  stream handshake, flow resume, first audio);
* REST requests and signed callbacks per transfer (Twilio does not bill API requests; they are
  the load a transfer puts on the gateway and on the account's rate limit).

The agent's ringing is compressed (``--ring`` seconds), so totals are the gateway's own work.

    .venv/bin/python bench/warm_transfer.py [--runs 6] [--ring 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_warm_transfer import AGENT, FALLBACK, HOLD, MENU_FLOW, write_flow

from ivr.config import Settings
from ivr.flowtools.audio_test import fast_speak, speech_seconds
from ivr.gateway import build_gateway
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.obs.logging import configure_logging
from ivr.server import running_server
from ivr.sim.caller import place_call
from ivr.sim.conference import AgentPhone, ConferenceDesk
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import script_from_data
from ivr.stt.openai_http import OpenAIHttpStt
from ivr.testing.openai_server import FakeOpenAIServer
from ivr.tts.openai_http import OpenAIHttpTts

AUTH_TOKEN = "bench-auth-token"
PUBLIC_URL = "https://gw.example.com"


async def one_call(
    base_url: str, api: FakeTwilioRestApi, desk: ConferenceDesk, answered: bool, ring: float
) -> dict[str, float]:
    desk.phones[AGENT] = AgentPhone(answers=answered, ring_seconds=ring)
    api.requests.clear()
    desk.calls.clear()
    desk.callbacks.clear()
    steps = [{"press": "2"}, {"silence": 1.5 if answered else 3.0}]
    report = await place_call(
        base_url,
        script=script_from_data({"steps": steps, "max_wait": 20}),
        auth_token=AUTH_TOKEN,
        public_base_url=PUBLIC_URL,
        rest_api=api,
    )
    assert not report.errors, report.errors
    [agent] = desk.calls
    await desk.wait_for_status(agent, "completed" if answered else "no-answer")
    first_update = next(u for u in api.updates if u.call_sid == report.call_sid)
    t0 = first_update.t - report.rest_update_t[0]  # the call's clock -> monotonic
    turn = next(t for t in report.turns if t.caller_text == "[keys 2]")
    assert turn.bot_first_audio_t is not None
    hold_end = turn.bot_first_audio_t + speech_seconds(HOLD)
    redirect = api.requests[0].t
    create = next(r.t for r in api.requests if r.path.endswith("/Calls.json"))
    kind = "answered" if answered else "no-answer"
    out = {
        f"{kind}: rest_requests": float(len(api.requests)),
        f"{kind}: callbacks": float(len(desk.callbacks)),
        "hold_redirect_s": redirect - (t0 + hold_end),
        "agent_dialled_s": create - redirect,
    }
    if not answered:
        no_answer = next(c.t for c in desk.callbacks if c.params.get("CallStatus") == "no-answer")
        new_stream = t0 + report.streams[1].started_t
        fallback_audio = t0 + (turn.bot_audio_end_t or 0.0) - speech_seconds(FALLBACK)
        out["no_answer_to_new_stream_s"] = new_stream - no_answer
        out["no_answer_to_fallback_heard_s"] = fallback_audio - no_answer
    return out


async def main(runs: int, ring: float) -> None:
    configure_logging("console", "warning")
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAIServer(api_key="sk-b") as fake:
        fake.speak = fast_speak
        async with FakeTwilioRestApi(auth_token=AUTH_TOKEN) as api:
            desk = ConferenceDesk(api, phones={}, public_base=PUBLIC_URL)
            settings = Settings(
                public_url=PUBLIC_URL,
                twilio_auth_token=AUTH_TOKEN,
                twilio_account_sid=api.account_sid,
                twilio_api_base_url=api.url,
                llm_api_key="sk-b",
                redis_url="",
                flows_dir=write_flow(Path(tmp), MENU_FLOW),
                vad="webrtc",
            )
            base = fake.base_url
            gateway = build_gateway(
                settings,
                stt=OpenAIHttpStt(base_url=base, api_key="sk-b"),
                tts=OpenAIHttpTts(base_url=base, api_key="sk-b"),
                llm=OpenAICompatLlm(base_url=base, api_key="sk-b", model="m"),
            )
            async with running_server(gateway) as server:
                desk.gateway_base = server.base_url
                for i in range(runs):
                    rows.append(await one_call(server.base_url, api, desk, i % 2 == 0, ring))
            await desk.aclose()
    keys = sorted({k for row in rows for k in row})
    print(f"warm transfers: {runs} calls ({(runs + 1) // 2} answered), ring {ring} s")
    for key in keys:
        values = [row[key] for row in rows if key in row]
        unit = "" if key.endswith(("rest_requests", "callbacks")) else " ms"
        scale = 1.0 if not unit else 1000.0
        med, top = statistics.median(values) * scale, max(values) * scale
        print(f"  {key:28s} median {med:8.1f}{unit}  max {top:8.1f}{unit}  (n={len(values)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--ring", type=float, default=0.3)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.ring))
