"""``ivr demo``: the newcomer's first call, fully offline.

Starts a real gateway on a free local port (offline STT, TTS and LLM unless providers are
configured), signs requests with a throwaway auth token exactly as Twilio would, and places one
simulated call to Harbor Bikes (``flows/demo.yaml``): a key press at the menu, a spoken answer
to a question, a question the agent answers from the shop's knowledge file, a spoken goodbye.
It prints the transcript with per-turn latency and where each turn's time went.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ivr.audio.resample import resample
from ivr.config import Settings
from ivr.flows.model import Flow
from ivr.flows.nodes import AgentNode
from ivr.gateway import Gateway, build_gateway
from ivr.llm.base import ChatMessage
from ivr.obs.logging import configure_logging
from ivr.server import free_port, running_server
from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import Script, script_from_data, script_from_strings
from ivr.state.base import CallRecord

DEMO_NUMBER = "+15550100100"
"""The number flows/demo.yaml answers."""
DEMO_STEPS: tuple[str | dict[str, str], ...] = (
    {"press": "1"},  # the menu: 1 = book a repair
    "A mountain bike.",  # the question step: which bike
    "Where can I find the shop?",  # answered by the agent from flows/knowledge/harbor_bikes.md
    "Goodbye.",  # the wrap-up menu, by voice
)
DEMO_VOCABULARY = (
    "Harbor Bikes, bike repair: booking, questions, opening hours, prices, the shop, address, "
    "tune-up, road bike, mountain bike, e-bike, goodbye."
)
"""Primes offline whisper with the words this call uses (IVR_STT_PROMPT)."""
OTHER_NUMBER = "+15550002222"
"""Lines given with --say go to the default flow, a general assistant."""
_KNOWLEDGE_HEADING = "\n\n# Reference information\n\n"  # as ivr.flows.agent puts it in context


def demo_settings(
    tts: str | None = None, vocabulary: str | None = DEMO_VOCABULARY, **extra: object
) -> Settings:
    """The gateway settings of the demo; environment variables still win where they are set."""
    overrides: dict[str, object] = {
        # Twilio only dials wss:// URLs; the simulated caller maps this public name to the
        # local port, and every signature is computed over it, exactly as in production.
        "public_url": "https://ivr-demo.example",
        "twilio_auth_token": secrets.token_hex(16),
        **extra,
    }
    if tts:
        overrides["tts_provider"] = tts
    defaults: dict[str, object] = {
        # The 135M offline model rambles; greedy decoding makes its answers repeatable.
        "IVR_LLM_MAX_TOKENS": 48,
        "IVR_LLM_TEMPERATURE": 0.0,
    }
    if vocabulary:
        # The call's words prime whisper: "opening hours" is no longer "work out your ...".
        defaults["IVR_STT_PROMPT"] = vocabulary
    for env, value in defaults.items():
        if not os.environ.get(env):
            overrides[env.removeprefix("IVR_").lower()] = value
    return Settings(**overrides)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class DemoCall:
    report: CallReport
    """The call as the simulated caller lived it (transcript of what it heard, latencies)."""
    record: CallRecord | None
    """The gateway's record of the call: variables, the conversation as heard, turn timings."""


async def run_demo(
    lines: Sequence[str] | None = None,
    record: str | None = "demo-call.wav",
    tts: str | None = None,
) -> int:
    call = await place_demo_call(lines, record, tts)
    print_demo_call(call, record)
    return 1 if call.report.errors or call.report.violations else 0


async def place_demo_call(
    lines: Sequence[str] | None = None,
    record: str | None = "demo-call.wav",
    tts: str | None = None,
) -> DemoCall:
    """Start the gateway, warm its engines, place the call; the gateway is gone on return."""
    port = free_port()
    settings = demo_settings(tts, None if lines else DEMO_VOCABULARY, port=port)
    configure_logging("console", "warning" if settings.log_level == "info" else settings.log_level)
    print("ivr demo: starting the gateway (loading offline engines can take ~20 s)...", flush=True)
    started = time.monotonic()
    gateway = build_gateway(settings)
    async with running_server(gateway, port=port) as server:
        to = OTHER_NUMBER if lines else DEMO_NUMBER
        await warm_up(gateway, gateway.flows.registry.flow_for_number(to))
        print(
            f"ivr demo: gateway up in {time.monotonic() - started:.1f} s at {server.base_url} "
            f"(stt={gateway.stt.name}, tts={gateway.tts.name}, llm={gateway.llm.model}, "
            f"endpoint silence {settings.endpoint_silence_ms} ms)",
            flush=True,
        )

        async def transcribe(pcm16_16k: bytes) -> str:
            audio = resample(pcm16_16k, 16000, gateway.stt.sample_rate)
            return (await gateway.stt.transcribe(audio)).text.strip()

        report = await place_call(
            server.base_url,
            script=demo_script(lines),
            auth_token=settings.twilio_auth_token,
            public_base_url=settings.public_url,
            to=to,
            record_path=record,
            transcriber=transcribe,
        )
        return DemoCall(report, await gateway.store.get(report.call_sid))


def print_demo_call(call: DemoCall, record: str | None) -> None:
    _print_report(call.report, record)
    if call.record is not None:
        heard = [m.content for m in call.record.history if m.role == "user"]
        if heard:
            print("what the agent heard: " + " | ".join(repr(text) for text in heard))
        if call.record.turns:
            _print_breakdown(call.record.turns)


def demo_script(lines: Sequence[str] | None) -> Script:
    # A slow offline LLM may pause between sentences: wait longer before talking.
    if lines:
        return script_from_strings(list(lines), turn_gap=1.5, max_wait=30)
    return script_from_data(
        {"steps": list(DEMO_STEPS), "turn_gap": 1.5, "max_wait": 30}, source="<demo>"
    )


async def warm_up(gateway: Gateway, flow: Flow) -> None:
    """Pay the engines' first-use costs before the call rather than in its first turns.

    Whisper's first decode allocates its buffers; the LLM evaluates each agent's system
    prompt and knowledge once, which the offline server then keeps in its KV cache (a prompt
    that starts the same way is not evaluated again).
    """
    silence = bytes(gateway.stt.sample_rate)  # 0.5 s of PCM16
    await gateway.stt.transcribe(silence)
    if not gateway.settings.use_local_llm:
        return  # a cloud model keeps no state of ours between requests
    systems = {
        (node.system + _KNOWLEDGE_HEADING + node.knowledge_text if node.knowledge_text
         else node.system, node.greeting or "")
        for node in flow.nodes.values()
        if isinstance(node, AgentNode) and "{{" not in node.system
    }  # fmt: skip
    for system, greeting in sorted(systems):
        messages = [ChatMessage("system", system)]
        if greeting:
            messages.append(ChatMessage("assistant", greeting))
        messages.append(ChatMessage("user", "Hello"))
        async for _event in gateway.llm.stream_chat(messages, max_tokens=1):
            pass


def _print_report(report: CallReport, record: str | None) -> None:
    print()
    print(report.format_transcript())
    latencies = [t.latency_s for t in report.turns if t.latency_s is not None and t.caller_text]
    if latencies:
        print(
            "\nturn latency (end of caller speech -> first bot audio heard): "
            + ", ".join(f"{x:.2f} s" for x in latencies)
        )
    if record:
        print(f"bot audio saved to {record}")
    if report.errors:
        print("errors: " + "; ".join(report.errors), file=sys.stderr)


STAGES = ("endpoint_silence", "stt", "llm_ttft", "llm_first_clause", "tts_ttfb", "gateway", "total")


def _print_breakdown(turns: Sequence[dict[str, float]]) -> None:
    """The gateway's own view of each turn: where the time went, in milliseconds."""
    print("\nper-turn breakdown at the gateway (ms; total = end of speech -> first audio sent):")
    print("  turn  " + "  ".join(f"{stage:>16}" for stage in STAGES))
    for number, turn in enumerate(turns, 1):
        cells = [
            f"{turn[stage] * 1000:16.0f}" if stage in turn else f"{'-':>16}" for stage in STAGES
        ]
        print(f"  {number:>4}  " + "  ".join(cells))
